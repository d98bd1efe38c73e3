"""Small utilities every layer shares: the cache folder, file hashes and whether a folder can be written, outside
text, errors and exit statuses, option checks, precision; and what a run records of the process that ran it (rank,
random generators, versions and commit, peak memory).
"""
