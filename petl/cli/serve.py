"""petl-serve: trained runs over HTTP, many tasks over one backbone, batches formed across tasks.

    petl-serve runs/cars runs/pets runs/dtd                  # http://127.0.0.1:8000/ (API: /openapi.json)
    petl-serve runs/sweep/ port=9000 max_batch=64            # every run folder under a folder
    petl-serve task.cars=runs/cars/lora/seed0 runs/dtd host=0.0.0.0
    PETL_SERVE_TOKEN=secret petl-serve runs/cars             # /v1/... and /metrics need the bearer token

A RUN is a run folder (``model.json`` beside ``trainable.safetensors``) or a folder holding run folders (searched
recursively, linked sub-folders followed; there, earlier runs that ``resume=false`` set aside,
``<run>.replaced-<time>/``, and unfinished runs, ``checkpoint.pt`` without ``result.json`` or a run's ``config.yaml``
alone, and runs without weights, as petl-bench leaves its selection trials, are not served, a note naming them). A
task is named by its folder (by its path below the folders the runs share when two folders have one name;
characters other than A-Z a-z 0-9 _ . - become _); ``task.NAME=RUN`` names it (only a ``task.`` word is read as
NAME=RUN: a run folder named lr=0.001 is a RUN). Every run must have trained on one backbone and with a method that
shares it (``petl.MultiTask``); a run that fails ``petl.load_run``'s checks, or an unfinished run given as a RUN, is
refused at start, naming it.
The routes, the token, bad input and the limits: docs/serving.md (GET /openapi.json on the server).

Options (key=value, anywhere, listed below with their defaults, which are those of the Python API's
petl.deploy.serve.ServeOptions; a value that is not a finite number in its range, or a precision not listed, is
refused, and so is a cuda_graphs other than its default or precision=tf32 where torch sees no GPU, and a max_batch
given above max_queue or a max_image_mp given above max_request_mp, as the outer limit caps the inner one).
``precision`` means what petl-run's ``train.precision`` does: the forward runs under it (bf16 autocast, TF32) on a
GPU, the weights stay fp32, and a CPU under ``auto`` answers exactly as strict fp32. Exit status: 2 bad input (an
option, a run folder, a task named twice, a host that does not resolve or is not this machine's, a PETL_SERVE_TOKEN
no client can send in a header), 1 the server could not run (FastAPI missing, the port taken), 130 Ctrl-C; the host
and the port are checked before the runs load; SIGTERM shuts the server down as Ctrl-C does, and then ends it as
SIGTERM ends a process.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import re
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from petl.cli.args import Key, entry_point, exit_statuses, parse, parser, split_items
from petl.utils.errors import UsageError
from petl.utils.text import plural, shown

PROG = "petl-serve"
TASK_PREFIX = "task."
KEYS = (
    Key(
        "host",
        "the address to listen on: an IP address or a host name, the port apart (0.0.0.0: every interface; set "
        "PETL_SERVE_TOKEN then)",
        str,
        "127.0.0.1",
    ),
    Key("port", "the port to listen on", int, 8000),
    Key("max_batch", "the most images in one mixed batch", int, 32),
    Key("max_wait_ms", "how long the oldest queued image waits for others before its batch runs", float, 5.0),
    Key(
        "max_queue",
        "the most images waiting at once (beyond it requests get 503) and in one request (more get 413)",
        int,
        256,
    ),
    Key("max_upload_mb", "the largest request body, in MB; larger ones get 413", float, 20.0),
    Key("max_image_mp", "the most pixels in one image, in millions (read before decoding); more get 413", float, 16.0),
    Key("max_request_mp", "the most pixels in one request's images, in millions; more get 413", float, 64.0),
    Key("header_timeout_s", "a connection whose request headers take longer is closed", float, 10.0),
    Key("body_timeout_s", "a request whose body takes longer after its headers gets 408", float, 60.0),
    Key("max_connections", "the most connections and requests at once; beyond it requests get 503", int, 128),
    Key("shutdown_timeout_s", "how long SIGTERM or Ctrl-C waits for requests in flight", float, 10.0),
    Key(
        "cuda_graphs",
        "on a GPU, the most CUDA graphs kept, one per mix of tasks in a batch that comes again (one per padded "
        "batch size where every task's modules batch), replayed with one launch; 0: every batch eager",
        int,
        8,
    ),
    Key(
        "precision",
        "auto (bf16 autocast and TF32 on a CUDA GPU with native bf16, fp32 elsewhere), no (strict fp32), tf32, bf16",
        str,
        "auto",
    ),
)
SERVE_OPTIONS = tuple(key.name for key in KEYS if key.name not in ("host", "port"))
# (inner, outer, why): a limit the other one caps, so that a value given above it could not act.
CAPPED = (
    ("max_batch", "max_queue", "a batch is formed from the images waiting, at most max_queue"),
    ("max_image_mp", "max_request_mp", "an image is all of a request at most, which max_request_mp bounds"),
)
USAGE = f"{PROG} RUN [RUN ...] [{TASK_PREFIX}NAME=RUN ...] [key=value ...] [--quiet]"
TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
NOT_IN_TASK_NAME = re.compile(r"[^A-Za-z0-9_.-]+")
# A host name: dot-separated labels of letters, digits and inner hyphens (RFC 1123), and underscores, which
# container networks' names have and resolvers take.
HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")
PIP_HINT = 'pip install -e ".[serve]" in petl\'s checkout (FastAPI, uvicorn, python-multipart)'


def _is_run(path: Path) -> bool:
    return path.is_dir() and (path / "model.json").is_file()


def runs_under(folder: Path) -> list[Path]:
    """The finished run folders under ``folder`` (linked sub-folders followed), less runs set aside by ``resume=false``;
    the others, in notes.

    A folder set aside by ``resume=false`` (``<run>.replaced-<time>/``) is an earlier run of a task, not a task: the
    reports skip it too.  An unfinished run (``checkpoint.pt`` without ``result.json``, or one stopped before its first
    checkpoint: :func:`petl.store.files.unfinished_run`) has no weights to serve yet, and a run without
    ``trainable.safetensors`` none at all (petl-bench removes its selection trials' weights once they are scored).
    Each kind skipped is said in one line on stderr, naming the folders.
    """
    from petl.store.files import (
        CHECKPOINT_FILE,
        CONFIG_FILE,
        MODEL_FILE,
        REPLACED_MARK,
        WEIGHTS_FILE,
        unfinished_run,
    )
    from petl.utils.paths import walk_linked

    # Linked sub-folders followed (rglob does not), as petl-run reads a data folder: a folder of links to the runs to
    # serve (cars -> sweep/lora/seed0) held "no finished run folder".
    carded, started = set(), set()
    for top, _dirs, files in walk_linked(folder):
        carded |= {Path(top)} if MODEL_FILE in files else set()
        # A run stopped before its first checkpoint has its config.yaml alone: unfinished too, and said so.
        started |= {Path(top)} if CHECKPOINT_FILE in files or CONFIG_FILE in files else set()
    replaced = sorted(p for p in carded | started if REPLACED_MARK in str(p.relative_to(folder)))
    unfinished = {p: line for p in started - set(replaced) if (line := unfinished_run(p)) is not None}
    if replaced:
        print(
            f"{PROG}: note: not served: {plural(len(replaced), 'run')} set aside by resume=false (earlier runs, "
            f"not tasks): {', '.join(shown(p) for p in replaced)}",
            file=sys.stderr,
        )
    for path in sorted(unfinished):
        print(f"{PROG}: note: not served: {unfinished[path]}", file=sys.stderr)
    # petl-bench removes a selection trial's weights once it is scored (its final runs retrain the chosen point), and
    # keeps its model.json: such a trial stopped the start of a whole bench folder, "restore it from the run".
    weightless = sorted(p for p in carded - set(replaced) - set(unfinished) if not (p / WEIGHTS_FILE).is_file())
    if weightless:
        print(
            f"{PROG}: note: not served: {plural(len(weightless), 'run')} without {WEIGHTS_FILE} (petl-bench keeps "
            f"none for its selection trials; their final runs, seed*/, hold the weights): "
            f"{', '.join(shown(p) for p in weightless)}",
            file=sys.stderr,
        )
    skipped = {*replaced, *unfinished, *weightless}
    return sorted(p for p in carded if _is_run(p) and p not in skipped)


def loopback(host: str) -> bool:
    """Whether ``host`` takes requests from this machine alone: ``localhost`` or a loopback address (127.0.0.0/8,
    ``::1``).
    """
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: it may resolve to any interface
        return False


def find_runs(items: Sequence[str]) -> dict[str, Path]:
    """Task name -> run folder for every RUN and ``task.NAME=RUN`` argument, in the order given.

    A folder holding runs gives each run found by :func:`runs_under`.

    Raises:
        UsageError: a path that is not there, holds no finished run folder or is an unfinished run, a task named
            twice, a name a URL cannot hold.

    """
    from petl.deploy.predict import run_labels
    from petl.deploy.tasks import given_once
    from petl.store.files import exported_not_run, file_not_run, unfinished_run

    named: dict[str, Path] = {}
    unnamed: list[Path] = []
    # Every task in the order given, its name None where it is made from the path: named ones came first, and
    # GET /v1/tasks, the page and the start-up line listed `petl-serve runs/a task.b=runs/b` as b, a.
    given: list[tuple[str | None, Path]] = []
    for item in items:
        # Only task.NAME=RUN names a task: any other word is a path whole, '=' and all (a run folder named by its
        # options, runs/lr=0.001, was read as task 'runs/lr' of a folder '0.001': "no such run folder").
        key, eq, value = item.partition("=") if item.startswith(TASK_PREFIX) else ("", "", item)
        if eq and not value:  # Path("") is the current folder: task.x= served whatever run was there
            raise UsageError(f"{item}: no run folder after '=': give one, as {item}runs/cars")
        path = Path(value if eq else item).expanduser()
        if path.is_file():
            raise UsageError(file_not_run(path, item))
        if not path.is_dir():
            raise UsageError(f"{item}: no such run folder")
        unfinished = unfinished_run(path)
        if unfinished is not None:
            raise UsageError(unfinished)
        found = [path] if _is_run(path) else runs_under(path)
        if not found:
            raise UsageError(
                exported_not_run(path)
                or f"{path} holds no finished run folder (no model.json): give petl-run output folders"
            )
        name = key.removeprefix(TASK_PREFIX)
        if not eq:
            unnamed += found
            given += [(None, folder) for folder in found]
        elif len(found) > 1:
            raise UsageError(f"{item}: {path} holds {len(found)} runs; task.NAME= names one run folder")
        elif name in named:
            raise UsageError(f"task {name!r} is named twice ({named[name]}, {found[0]}): give each task one name")
        else:
            named[name] = found[0]
            given.append((name, found[0]))
    # Given more than once, however spelt (runs/a and its absolute path were two tasks named alike: refused):
    # served once, where it came first.
    unnamed, again = given_once(unnamed)
    for folder in again:
        print(f"{PROG}: note: {folder} was given more than once: served once", file=sys.stderr)
    served_once = {id(folder) for folder in unnamed}  # by identity: a later giving may be an equal Path
    labels = run_labels(unnamed)
    runs: dict[str, Path] = {}
    for name, folder in given:
        if name is None:
            if id(folder) not in served_once:
                continue
            # A name petl made from a path takes no character a URL part cannot hold: folders named by their options
            # (lr=0.001) are common, and refusing them would have each of a folder's runs named by hand.
            label = labels.pop(folder)
            name = NOT_IN_TASK_NAME.sub("_", label).lstrip("_.-") or label
            if name in runs or name in named:
                other = runs.get(name, named.get(name))
                raise UsageError(f"two runs are named {name!r} ({other}, {folder}): name one with task.NAME=RUN")
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
    # paths_first: a run folder named by its options (lr=0.001), given from the folder above it, is a run, not an
    # unknown option 'lr'.
    runs, given = split_items(args.words, KEYS, PROG, paths_first=True, prefixes=(TASK_PREFIX,))
    options = {key.name: key.default for key in KEYS if key.default is not None} | given
    if not 0 <= options["port"] <= 65535:
        raise UsageError(f"port={options['port']}: must be 0 to 65535")
    check_host(options["host"])
    for inner, outer, why in CAPPED:
        if inner in given and options[inner] > options[outer]:
            raise UsageError(
                f"{inner}={options[inner]:g} is above {outer}={options[outer]:g} and could not act ({why}): "
                f"raise {outer} or lower {inner}"
            )
    if not runs:
        raise UsageError("no run folder given: petl-serve RUN [RUN ...]")
    return find_runs(runs), options, args


def check_host(host: str) -> None:
    """Refuse a ``host`` that is neither an IP address nor a host name, before any run is loaded.

    Without this, ``host=`` (empty) or ``host=0.0.0.0:9000`` loaded every run and then failed to bind, exit 1.

    Raises:
        UsageError: one line naming the value and what to give (exit 2).

    """
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    # An all-digit last label is a malformed IPv4 address (1.2.3.4.5), not a name.
    if len(host) <= 253 and HOST_NAME.fullmatch(host) and not host.rstrip(".").rpartition(".")[2].isdigit():
        return
    address, colon, port = host.rpartition(":")
    if colon and port.isdigit():
        raise UsageError(f"host={host}: give the port apart, as host={address} port={port}")
    raise UsageError(
        f"host={host!r} is not an IP address or a host name: give one such as host=127.0.0.1 (this machine only, "
        "the default), host=0.0.0.0 (every interface) or host=localhost"
    )


def run_cli(argv: Sequence[str]) -> int:
    """Load the runs and serve them until interrupted; returns the exit status."""
    runs, options, args = read_command_line(argv)
    try:
        import uvicorn  # noqa: F401  (the serve extra, said missing below)

        from petl.deploy import serve
        from petl.deploy.multitask import TaskRefused
    except ImportError as error:
        raise RuntimeError(f"petl-serve needs {error.name}: {PIP_HINT}") from None
    import torch

    try:
        serve_options = serve.ServeOptions(
            **{k: options[k] for k in SERVE_OPTIONS if k in options}, token=serve.token_from_environment()
        )
        # Before the runs load (minutes), as create_app checks them: they are served on the GPU where torch sees one
        # (serve.load_tasks), else on the CPU, which keeps no graph and has no TF32.
        if not torch.cuda.is_available():
            serve.refuse_graphs_off_gpu(serve_options, "cpu", "torch sees none here")
            serve.inference_precision(serve_options.precision, "cpu")
    except ValueError as error:
        raise UsageError(str(error)) from None
    # Bound before the runs load, which can take minutes: a host that is not this machine's or a port in use is
    # said at once.  It listens only once they have: until then a client is refused instead of kept waiting.
    with bind(options["host"], options["port"]) as listening:
        port = listening.getsockname()[1]
        try:
            served, tasks = serve.load_tasks(runs)
        except TaskRefused as refused:
            if refused.mismatch:  # the run fails load_run's own check: petl-predict would refuse it as well
                raise UsageError(str(refused).splitlines()[0]) from None
            # A method that cannot share the backbone is refused alone too: petl-serve has no way to serve it.
            raise UsageError(
                f"{str(refused).splitlines()[0]} (petl-serve shares one frozen backbone among its tasks: leave "
                f"{runs[refused.task]} out, and use it with petl-predict, or petl-export where its method folds into "
                "the backbone)"
            ) from None
        except ValueError as error:  # RunFolderError, disagreeing backbones: each names the run
            raise UsageError(str(error).splitlines()[0]) from None
        app = serve.create_app(served, tasks, serve_options)
        listen(listening, options["host"], port)
        names = ", ".join(f"{t.name} ({t.method})" for t in tasks)
        print(f"{PROG}: {plural(len(tasks), 'task')} over {tasks[0].backbone}: {names}", file=sys.stderr)
        precision = serve.describe(app.state.precision, app.state.device)
        print(
            f"{PROG}: serving on {app.state.device} in {precision} (precision={options['precision']})", file=sys.stderr
        )
        print(f"{PROG}: http://{address(options['host'], port)}/ (the API: /openapi.json)", file=sys.stderr)
        if not loopback(options["host"]) and serve.token_from_environment() is None:
            print(
                f"{PROG}: note: host={options['host']} takes requests from other machines and "
                f"{serve.TOKEN_VARIABLE} is not set: anyone who reaches this port can use the tasks",
                file=sys.stderr,
            )
        server = serve.make_server(app, options["host"], port, serve_options, not args.quiet)
        try:
            server.run(sockets=[listening])
        except SystemExit as stop:  # uvicorn exits 3 when it cannot start: petl's status for that is 1
            if stop.code:
                raise RuntimeError(
                    f"could not serve on {address(options['host'], port)} (uvicorn said why above)"
                ) from None
            raise
    if not server.started:
        raise RuntimeError(f"could not serve on {address(options['host'], port)} (uvicorn said why above)")
    return 0


def address(host: str, port: int) -> str:
    """``host:port`` as a URL holds it: an IPv6 address in brackets (``[::1]:8000``; ``::1:8000`` is no address)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: one the system picks), not listening yet (:func:`listen`).

    Raises:
        UsageError: ``host`` does not resolve or is not an address of this machine (one line naming it; exit 2).
        RuntimeError: the port is taken, or the system refused it (one line naming host and port; exit 1).

    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        if error.errno == socket.EAI_AGAIN:  # the resolver did not answer: not the name's fault
            raise RuntimeError(f"host={host}: {error.strerror}: try again, or give an IP address") from None
        raise UsageError(
            f"host={host} does not resolve ({error.strerror}): give this machine's address or name, as "
            "host=127.0.0.1 (the default), host=0.0.0.0 (every interface) or host=localhost"
        ) from None
    try:
        listening = socket.socket(family, kind, proto)
    except OSError as error:
        raise RuntimeError(f"host={host}: {error.strerror or error}") from None
    try:
        # As uvicorn does: a port whose last connections are in TIME_WAIT is taken, one another socket listens on
        # is refused (EADDRINUSE, here or, where two starts raced, at listen).
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(address)
    except OSError as error:
        listening.close()
        raise cannot_listen(host, port, error) from None
    listening.set_inheritable(True)
    return listening


def listen(listening: socket.socket, host: str, port: int) -> None:
    """Start ``listening`` (bound by :func:`bind`); an error as :func:`bind` words it."""
    try:
        listening.listen()
    except OSError as error:
        raise cannot_listen(host, port, error) from None


def cannot_listen(host: str, port: int, error: OSError) -> Exception:
    """What :func:`bind` or :func:`listen` raises for ``error``: the one line, bad input or not."""
    if error.errno == errno.EADDRNOTAVAIL:
        return UsageError(
            f"host={host} is not an address of this machine ({error.strerror}): give one of its own, as "
            "host=127.0.0.1 (the default) or host=0.0.0.0 (every interface)"
        )
    if error.errno == errno.EADDRINUSE:
        return RuntimeError(
            f"cannot listen on {address(host, port)}: the port is in use: stop what holds it, or choose another port="
        )
    if error.errno == errno.EACCES and 0 < port < 1024:  # privileged ports: root's (or CAP_NET_BIND_SERVICE's)
        return RuntimeError(
            f"cannot listen on {address(host, port)}: {error.strerror}: ports below 1024 need root; choose "
            "port=8000 (the default) or another of 1024 and above"
        )
    return RuntimeError(f"cannot listen on {address(host, port)}: {error.strerror or error}")


# uvicorn handles SIGTERM itself, as Ctrl-C: the requests in flight finish (shutdown_timeout_s), then the signal is
# raised again and ends the process as SIGTERM does, the status a service manager expects of a server it stopped.
@entry_point(PROG, sigterm=False)
def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``petl-serve``."""
    with exit_statuses(PROG):
        status = run_cli(sys.argv[1:] if argv is None else argv)
    raise SystemExit(status)


if __name__ == "__main__":
    main()
