"""Small utilities every layer shares: the cache folder and file hashes, outside text, errors and exit
statuses, option checks.
"""
