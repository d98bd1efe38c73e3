"""petl-serve: trained runs over HTTP, many tasks over one backbone, batches formed across tasks.

    petl-serve runs/cars runs/pets runs/dtd                  # http://127.0.0.1:8000/ (docs: /docs)
    petl-serve runs/sweep/ port=9000 max_batch=64            # every run folder under a folder
    petl-serve task.cars=runs/cars/lora/seed0 runs/dtd host=0.0.0.0
    PETL_SERVE_TOKEN=secret petl-serve runs/cars             # /v1/... and /metrics need the bearer token

A RUN is a run folder (``model.json`` beside ``trainable.safetensors``) or a folder holding run folders
(searched recursively).  A task is named by its folder (by its path below the folders the runs share when two
folders have one name); ``task.NAME=RUN`` names it.  Every run must have trained on one backbone and with a
method that shares it (``petl.MultiTask``); a run that fails ``petl.load_run``'s checks is refused at start,
naming it.  See :mod:`petl.deploy.serve` for the routes.

Options (key=value, anywhere, listed below; the batching ones default to :class:`petl.deploy.serve.ServeOptions`'s:
max_batch=32 max_wait_ms=5 max_queue=256 max_upload_mb=20).  Exit status: 2 bad input (an option, a run folder),
1 the server could not run (FastAPI missing, the port taken), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from petl.cli.args import Key, exit_statuses, parse, parser, split_items
from petl.utils.errors import UsageError

PROG = "petl-serve"
TASK_PREFIX = "task."
KEYS = (
    Key("host", "the address to listen on (0.0.0.0: every interface; set PETL_SERVE_TOKEN then)", str, "127.0.0.1"),
    Key("port", "the port to listen on", int, 8000),
    Key("max_batch", "the most images in one mixed batch", int),
    Key("max_wait_ms", "how long the oldest queued image waits for others before its batch runs", float),
    Key("max_queue", "the most images waiting at once (and in one request); beyond it requests get 503", int),
    Key("max_upload_mb", "the largest request body, in MB; larger ones get 413", float),
)
USAGE = f"{PROG} RUN [RUN ...] [{TASK_PREFIX}NAME=RUN ...] [key=value ...] [--quiet]"
TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
PIP_HINT = "pip install 'petl[serve]' (FastAPI, uvicorn, python-multipart)"


def _is_run(path: Path) -> bool:
    return path.is_dir() and (path / "model.json").is_file()


def find_runs(items: Sequence[str]) -> dict[str, Path]:
    """Task name -> run folder for every RUN and ``task.NAME=RUN`` argument, in the order given.

    Raises:
        UsageError: a path that is not there or holds no run folder, a task named twice, a name a URL cannot hold.

    """
    from petl.deploy.predict import run_labels

    named: dict[str, Path] = {}
    unnamed: list[Path] = []
    for item in items:
        key, eq, value = item.partition("=")
        path = Path(value if eq else item).expanduser()
        if not path.is_dir():
            raise UsageError(f"{item}: no such run folder")
        found = [path] if _is_run(path) else sorted({p.parent for p in path.rglob("model.json") if _is_run(p.parent)})
        if not found:
            raise UsageError(f"{path} holds no run folder (no model.json): give petl-run output folders")
        if not eq:
            unnamed += found
        elif len(found) > 1:
            raise UsageError(f"{item}: {path} holds {len(found)} runs; task.NAME= names one run folder")
        else:
            named[key.removeprefix(TASK_PREFIX)] = found[0]
    runs = dict(named)
    for folder, name in run_labels(unnamed).items():
        if name in runs:
            raise UsageError(f"two runs are named {name!r} ({runs[name]}, {folder}): name one with task.NAME=RUN")
        runs[name] = folder
    for name in runs:
        if not TASK_NAME.fullmatch(name):
            raise UsageError(
                f"task name {name!r} cannot be part of a URL: name it with task.NAME=RUN (A-Z a-z 0-9 _ . -)"
            )
    return runs


def build_parser():  # noqa: ANN201  (argparse is imported by petl.cli.args)
    """The command's parser: its flag; ``--help`` lists it and :data:`KEYS`."""
    made = parser(PROG, __doc__, USAGE, KEYS)
    made.add_argument("--quiet", action="store_true", help="no request log")
    return made


def read_command_line(argv: Sequence[str]) -> tuple[dict[str, Path], dict, argparse.Namespace]:
    """The runs, the ``key=value`` options (typed, checked) and the flags of a command line."""
    args = parse(build_parser(), argv)
    runs, given = split_items(args.words, KEYS, PROG, prefixes=(TASK_PREFIX,))
    options = {key.name: key.default for key in KEYS if key.default is not None} | given
    for key in ("max_batch", "max_queue"):
        if key in options and options[key] < 1:
            raise UsageError(f"{key}={options[key]}: must be at least 1")
    for key in ("max_wait_ms", "max_upload_mb"):
        if key in options and not options[key] >= 0:
            raise UsageError(f"{key}={options[key]}: must be 0 or more")
    if not 0 <= options["port"] <= 65535:
        raise UsageError(f"port={options['port']}: must be 0 to 65535")
    if not runs:
        raise UsageError("no run folder given: petl-serve RUN [RUN ...]")
    return find_runs(runs), options, args


def run_cli(argv: Sequence[str]) -> int:
    """Load the runs and serve them until interrupted; returns the exit status."""
    runs, options, args = read_command_line(argv)
    try:
        import uvicorn

        from petl.deploy import serve
    except ImportError as error:
        raise RuntimeError(f"petl-serve needs {error.name}: {PIP_HINT}") from None
    try:
        served, tasks = serve.load_tasks(runs)
    except ValueError as error:  # RunFolderError, TaskRefused, disagreeing backbones: each names the run
        raise UsageError(str(error).splitlines()[0]) from None
    batching = {k: options[k] for k in ("max_batch", "max_wait_ms", "max_queue", "max_upload_mb") if k in options}
    app = serve.create_app(served, tasks, serve.ServeOptions(**batching, token=serve.token_from_environment()))
    names = ", ".join(f"{t.name} ({t.method})" for t in tasks)
    print(f"{PROG}: {len(tasks)} task(s) over {tasks[0].backbone}: {names}", file=sys.stderr)
    print(f"{PROG}: http://{options['host']}:{options['port']}/ (API docs at /docs)", file=sys.stderr)
    if options["host"] not in ("127.0.0.1", "localhost", "::1") and serve.token_from_environment() is None:
        print(
            f"{PROG}: note: host={options['host']} takes requests from other machines and {serve.TOKEN_VARIABLE} "
            "is not set: anyone who reaches this port can use the tasks",
            file=sys.stderr,
        )
    config = uvicorn.Config(
        app, host=options["host"], port=options["port"], access_log=not args.quiet, log_level="info"
    )
    server = uvicorn.Server(config)
    server.run()
    if not server.started:  # uvicorn logged why (the port is taken...)
        raise RuntimeError(f"could not serve on {options['host']}:{options['port']}")
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``petl-serve``."""
    with exit_statuses(PROG):
        status = run_cli(sys.argv[1:] if argv is None else argv)
    raise SystemExit(status)


if __name__ == "__main__":
    main()
