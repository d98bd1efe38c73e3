"""``python -m petl.run`` (and ``accelerate launch -m petl.run``) is ``petl-run``."""

from petl.cli.run import main

main()
