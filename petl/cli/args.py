"""The one command-line grammar of the ``petl-*`` commands: ``key=value`` overrides as Hydra has them, flags anywhere.

Every command parses with :func:`parse` (argparse's ``parse_intermixed_args``, so ``RUN IMAGES --quiet out=p.csv``
and ``--quiet RUN out=p.csv IMAGES`` mean the same) on a :class:`Parser`, whose errors are one line, then splits its
words into positionals and ``key=value`` pairs with :func:`split_items`.  A command declares its keys once
(:class:`Key`), and :func:`keys_epilog` prints them under ``--help``, so the help lists exactly what the command
accepts.  :func:`exit_statuses` turns what the command's body raises into one line and the exit status every command
documents; :func:`entry_point` wraps each command's ``main``, so that Ctrl-C while it starts (its imports take
seconds) is one line too, SIGTERM (a job scheduler's time limit) interrupts the command as Ctrl-C does, and a reader
that closes the output early (``petl-run --help | head``) ends the command quietly.  Nothing here imports torch or
timm: ``--help`` answers before anything heavy loads.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from petl.utils.distributed import is_main_process
from petl.utils.errors import INTERRUPTED, RUN_ERROR, TERMINATED, USAGE_ERROR, RunError, Terminated, UsageError
from petl.utils.text import shown

Main = TypeVar("Main", bound=Callable[..., Any])

# What an override key may look like (Hydra's grammar: +key, ++key, ~key, dotted paths).
_KEY_PREFIXES = ("++", "+", "~")


class CommandLineError(UsageError):
    """A word of the command line the command does not take: one line naming it (exit status 2)."""


class Parser(argparse.ArgumentParser):
    """The parser of every petl-* command: argparse, its errors one line that :func:`exit_statuses` prints.

    argparse prints the command's usage (1 to 8 lines) before its error and exits itself; here its error is a
    :class:`CommandLineError` instead, so that it reads ``PROG: error: MESSAGE`` (exit status 2) as every other
    bad input does, the message ending with where to look (``(see PROG --help)``) unless it lists the choices
    already.  ``--help`` is argparse's own, unchanged.
    """

    def error(self, message: str) -> NoReturn:
        """Raise argparse's message (an unknown flag, a missing value, a bad choice) as a :class:`CommandLineError`."""
        if "(choose from " not in message:
            message = f"{message} (see {self.prog} --help)"
        raise CommandLineError(message)


@dataclass(frozen=True)
class Key:
    """One ``key=value`` option a command accepts: its name, its type and a one-line help."""

    name: str
    help: str
    type: type = str
    default: Any = None


def boolean(value: str) -> bool:
    """A ``key=value`` option's truth value, as Hydra reads one (``true``/``false``, any case).

    Raises:
        ValueError: anything else (``overwrite=yes``): :func:`split_items` names the option.

    """
    lowered = value.lower()
    if lowered not in ("true", "false"):
        raise ValueError(value)
    return lowered == "true"


def is_override(word: str) -> bool:
    """Whether ``word`` is a ``key=value`` override (a path such as ``a=b.jpg`` only if its key looks like a key)."""
    key, sep, _ = word.partition("=")
    key = key.removeprefix("++").removeprefix("+").removeprefix("~")
    return bool(sep) and bool(key) and all(part.isidentifier() for part in key.split("."))


# Docstring markup a terminal would show raw: Sphinx roles (:mod:`x`, :class:`~a.B`), ``literals``, `code`, **bold**.
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``|`([^`]+)`")
_BOLD = re.compile(r"\*\*([^*]+)\*\*")


def plain(text: str) -> str:
    """Help text as plain text: docstring markup (RST roles, double backquotes, Markdown code and bold) taken off.

    Every ``--help`` of the petl-* commands goes through here (:func:`parser`, ``petl-bench``'s and ``petl-run``'s
    own help), so a module docstring can keep its markup for the API docs.  ``Usage::`` loses its second colon.
    """
    text = _ROLE.sub(r"\1", text)
    text = _LITERAL.sub(lambda m: m.group(1) or m.group(2), text)
    return _BOLD.sub(r"\1", text).replace("::\n", ":\n")


def parser(prog: str, description: str, usage: str | None = None, keys: Sequence[Key] = ()) -> Parser:
    """A command's parser (:class:`Parser`): flags are added by the caller, ``words`` takes the rest."""
    made = Parser(
        prog=prog,
        description=plain(description),
        usage=usage,
        epilog=keys_epilog(keys) if keys else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return made


def keys_epilog(keys: Sequence[Key]) -> str:
    """The ``key=value`` options of a command as the help's last section."""
    width = max(len(key.name) for key in keys) + len("=VALUE")
    lines = ["key=value options (anywhere on the line):"]
    for key in keys:
        default = f" (default: {key.default})" if key.default is not None else ""
        lines.append(f"  {key.name + '=VALUE':<{width}}  {key.help}{default}")
    return "\n".join(lines)


def parse(made: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv`` with flags anywhere among the words (``words``: every positional and ``key=value``)."""
    made.add_argument("words", nargs="*", help=argparse.SUPPRESS)
    return made.parse_intermixed_args(list(argv))


def split_items(
    words: Sequence[str],
    keys: Sequence[Key],
    prog: str,
    paths_first: bool = False,
    prefixes: Sequence[str] = (),
) -> tuple[list[str], dict[str, Any]]:
    """Split words into positionals and the command's own ``key=value`` options (typed, unknown keys refused).

    Args:
        words: the command line's words but its flags (:func:`parse`'s ``words``).
        keys: the options the command takes.
        prog: the command's name, for the message of an unknown key.
        paths_first: a word naming an existing file (``a=b.jpg``) is a positional, not an option.
        prefixes: key prefixes whose rest is free-form (``task.`` of ``task.NAME=RUN``): such words are positionals,
            left whole for the command to read.

    Raises:
        CommandLineError: an unknown key or a value of the wrong type, in one line naming it.

    """
    known = {key.name: key for key in keys}
    positional, options = [], {}
    for word in words:
        if not is_override(word) or (paths_first and Path(word).exists()) or word.startswith(tuple(prefixes)):
            positional.append(word)
            continue
        name, _, value = word.partition("=")
        if name not in known:
            choices = ", ".join([*sorted(known), *(f"{prefix}NAME" for prefix in prefixes)]) or "none"
            raise CommandLineError(f"unknown option {name!r}; valid: {choices} (see {prog} --help)")
        try:
            options[name] = known[name].type(value)
        except ValueError:
            raise CommandLineError(f"{name}={value!r}: expected {known[name].type.__name__}") from None
    return positional, options


@contextlib.contextmanager
def exit_statuses(
    prog: str,
    usage: tuple[type[Exception], ...] = (),
    failure: tuple[type[Exception], ...] = (RuntimeError, OSError),
    interrupted: str | Callable[[], str] = "interrupted",
    debug: bool | None = None,
    quiet: bool = False,
) -> Iterator[None]:
    """Turn what a command's body raises into one line on stderr and the exit status of :mod:`petl.utils.errors`.

    Bad input (:class:`petl.utils.errors.UsageError`, so :class:`CommandLineError`, and the ``usage`` types) exits with
    2, the ``failure`` types with 1, both printing ``PROG: error: MESSAGE``; Ctrl-C exits with 130, printing
    ``PROG: INTERRUPTED``, and SIGTERM (under :func:`entry_point`) with 143, printing the same line as
    :func:`interruption` words it.  Bad input is tried first: a ``usage`` type may subclass a ``failure`` one.

    Args:
        prog: the command's name, the first word of each line.
        usage: more exception types that are bad input.
        failure: the exception types of a run that could not complete.
        interrupted: what follows ``PROG: `` on Ctrl-C (the word ``interrupted``, then what is kept and how to go
            on), or a function that words it once Ctrl-C came (what was kept depends on when).
        debug: ``None`` for a command without ``--debug``; ``False``: a failure's line names its type and says
            that ``--debug`` shows the traceback (not a :class:`~petl.utils.errors.RunError`'s, whose message says
            why); ``True``: every exception goes on, traceback and all.
        quiet: print nothing (every process of a multi-GPU launch but the first).

    """

    def stop(status: int, line: str) -> SystemExit:
        if not quiet:
            print(f"{prog}: {line}", file=sys.stderr)
        return SystemExit(status)

    try:
        yield
    except KeyboardInterrupt as error:
        if debug:
            raise
        line = interrupted() if callable(interrupted) else interrupted
        raise stop(*interruption(error, line)) from None
    except BrokenPipeError:  # the reader closed stdout: entry_point ends the command, not as a failure
        raise
    except (UsageError, *usage) as error:
        if debug:
            raise
        raise stop(USAGE_ERROR, f"error: {shown(error)}") from None
    except failure as error:
        if debug:
            raise
        message = shown(error)
        # A fault nobody foresaw: its type, and where the traceback is (a RunError's message says why itself).
        if debug is not None and not isinstance(error, RunError):
            message = f"{type(error).__name__}: {message} (--debug shows the traceback)"
        raise stop(RUN_ERROR, f"error: {message}") from None


def interruption(error: KeyboardInterrupt, line: str) -> tuple[int, str]:
    """The exit status and the line (what follows ``PROG: ``) of a command that ``error`` interrupted.

    Ctrl-C: 130 and ``line``.  SIGTERM (:class:`petl.utils.errors.Terminated`): 143, and ``line`` with its word
    ``interrupted`` as ``terminated (SIGTERM)``, so that a job's log says a time limit or ``kill`` ended it,
    followed by what the command keeps and how to go on, as for Ctrl-C.
    """
    if isinstance(error, Terminated):
        return TERMINATED, line.replace("interrupted", "terminated (SIGTERM)", 1)
    return INTERRUPTED, line


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`petl.utils.errors.Terminated` (a KeyboardInterrupt).

    A job scheduler ends a job with SIGTERM (SLURM at its time limit, then SIGKILL after a grace period), as a
    user does with ``kill``: the command then stops as on Ctrl-C, its lock released, its finished work kept and
    one line saying so, where the default action of SIGTERM would end it without a word.  Used by
    :func:`entry_point` only, so importing or calling petl's Python API never changes a signal handler.  Left as it
    is: SIGTERM outside the main thread (only it may set handlers), and one whose handler was already set (ignored,
    or a program that runs the command in-process with a handler of its own); the handler found is put back after.
    """
    main_thread = threading.current_thread() is threading.main_thread()
    if not main_thread or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise Terminated

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def entry_point(prog: str, debug_flag: str = "--debug", sigterm: bool = True) -> Callable[[Main], Main]:
    """Wrap a command's ``main(argv=None)``: Ctrl-C and SIGTERM anywhere in it, imports included, and a closed stdout.

    Ctrl-C before the command's own :func:`exit_statuses` takes over (while torch, timm and Hydra import, which
    takes seconds) prints ``PROG: interrupted`` and exits with 130, as later; with ``debug_flag`` on the command
    line it goes on, traceback and all.  With ``sigterm``, SIGTERM interrupts the command as Ctrl-C does
    (:func:`sigterm_interrupts`), its line saying so and its status 143; ``petl-serve`` passes False: uvicorn
    handles SIGTERM itself (a graceful shutdown).  A reader that stops reading (``petl-run --help | head -3``) ends the
    command quietly, as Python's documentation advises for SIGPIPE: stdout is pointed at ``os.devnull``, so that
    the interpreter's last flush does not fail again, and the status is the command's own (0 when the pipe closed
    while it was still writing: what the reader wanted it got).
    """

    def wrap(main: Main) -> Main:
        @functools.wraps(main)
        def command(argv: Sequence[str] | None = None) -> Any:
            status: Any = 0  # the command's own, kept when only its last flush meets a closed pipe
            try:
                with sigterm_interrupts() if sigterm else contextlib.nullcontext():
                    try:
                        return main(argv)
                    except SystemExit as stop:
                        status = stop.code
                        raise
                    finally:
                        if sys.stdout is not None:  # None where the command started with stdout closed (>&-)
                            sys.stdout.flush()  # here, where a closed pipe is caught, rather than at exit
            except KeyboardInterrupt as error:
                if debug_flag in (sys.argv[1:] if argv is None else argv):
                    raise
                code, line = interruption(error, "interrupted")
                if is_main_process():  # one line for a multi-GPU launch, not one per process
                    print(f"{prog}: {line}", file=sys.stderr)
                raise SystemExit(code) from None
            except BrokenPipeError:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                raise SystemExit(status) from None

        return command  # type: ignore[return-value]

    return wrap


# What Hydra's --info prints (hydra._internal.utils.get_args_parser's choices; the grammar test checks them).
INFO_TOPICS = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def info_topic(value: str) -> str:
    """``--info``'s value, one of :data:`INFO_TOPICS`; an override after ``--info`` (its value is optional, so argparse
    takes the next word) is said to be one.

    Raises:
        argparse.ArgumentTypeError: anything else, in one line.

    """
    if value in INFO_TOPICS:
        return value
    hint = ", an override that --info took as its topic: write the overrides first" if "=" in value else ""
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r}{hint} (choose from {', '.join(INFO_TOPICS)})")


def hydra_parser(prog: str) -> Parser:
    """``petl-run``'s flags: the ones Hydra's app runner reads (``hydra.main``), on a public argparse parser.

    Hydra has no public API for its own command-line parser; these are its flags, so that a command line is
    known (and every job of a sweep checked) before Hydra starts.  ``tests/cli/test_petl_run_cli.py`` checks them
    against the help Hydra prints.  A :class:`Parser`: an unknown flag is one line, not Hydra's 7 lines of usage.
    """
    made = Parser(prog=prog, add_help=False)
    made.add_argument("--help", "-h", action="store_true", help="this help (with overrides: Hydra's, composed)")
    made.add_argument("--hydra-help", action="store_true", help="Hydra's own help (launchers, sweepers, plugins)")
    made.add_argument("--version", action="store_true", help="Hydra's version")
    made.add_argument(
        "--cfg", "-c", choices=["job", "hydra", "all"], help="print the config (job, hydra or all) instead of running"
    )
    made.add_argument("--resolve", action="store_true", help="with --cfg: resolve interpolations (${...})")
    made.add_argument("--package", "-p", help="with --cfg: print this package of the config only")
    made.add_argument("--run", "-r", action="store_true", help="run one job (the default)")
    made.add_argument("--multirun", "-m", action="store_true", help="a sweep: one job per combination (a=1,2 b=x,y)")
    made.add_argument("--shell-completion", "-sc", action="store_true", help="install shell completion (Hydra's)")
    made.add_argument("--config-path", "-cp", help="another primary config folder")
    made.add_argument("--config-name", "-cn", help="another primary config file name")
    made.add_argument("--config-dir", "-cd", help="one more folder to search for configs")
    made.add_argument("--experimental-rerun", help="rerun a job from its config pickle (Hydra's)")
    made.add_argument(
        "--info",
        "-i",
        const="all",
        nargs="?",
        type=info_topic,
        help=f"Hydra's information: {', '.join(INFO_TOPICS)} (after the overrides: --info takes the next word)",
    )
    made.add_argument("overrides", nargs="*", help="key=value overrides (method=lora train.lr=0.01)")
    return made
