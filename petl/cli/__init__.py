"""The ``petl-*`` commands: each a thin shell over an API function, parsed by one grammar (:mod:`petl.cli.args`)."""
