"""The ``petl-*`` commands' thin shells: argument parsing and exit statuses, the work done elsewhere."""
