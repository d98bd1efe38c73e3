"""The ways a run fails: bad input (:class:`ConfigError`) and runs that cannot complete; each message says why."""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input to a command (a file, a folder, an option): the message is one line naming it and what to do."""


class ConfigError(ValueError):
    """Bad user input: an unknown choice or key, a value of the wrong type or out of range."""


class RunError(RuntimeError):
    """A run could not complete (non-finite loss, unreachable data or weights); the message says why."""


class UnreachableError(RunError):
    """Data or weights this machine cannot reach (not cached, offline, a package missing).

    Every process of a multi-process launch on the machine meets it alike, so the first of them says it (as bad
    input is said by the first process of the launch), not one line per GPU.
    """


class DivergedError(RunError):
    """The loss or the trained weights became NaN or infinite: this configuration diverged.

    In an lr search that is an outcome, not a breakdown: the selection protocol scores such a trial last
    (it checks ``diverged`` rather than the class, so the sweep need not import the engine).
    """

    diverged = True


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler's time limit, ``kill``) in a petl-* command: an interruption, as Ctrl-C is.

    Only the commands' entry points (:func:`petl.cli.args.entry_point`) turn the signal into this exception; the
    Python API leaves signal handlers alone.  A subclass of KeyboardInterrupt, so that every path that lets Ctrl-C
    through (a sweep goes on after a failed run, never after Ctrl-C) and cleans up after it (the run folder's lock,
    the temporary file of an atomic write) does the same for it; the command's line says which it was.
    """


# Exit statuses, the same in every petl-* command (docs/reliability.md, "Bad input and failures"): bad input (a
# value, a file, an image the user gave), a run or prediction that could not complete (a full disk, a failed job),
# Ctrl-C, SIGTERM (128 + its number 15, the status a shell reports for a process SIGTERM ended; a job script can
# tell a time limit from Ctrl-C).
USAGE_ERROR = 2
RUN_ERROR = 1
INTERRUPTED = 130
TERMINATED = 143


def exit_status(error: BaseException) -> int:
    """The exit status of a command that ``error`` ended: bad input (:class:`ConfigError`, :class:`UsageError`) is
    :data:`USAGE_ERROR`, anything else (a :class:`RunError`, a fault nobody foresaw: out of memory) :data:`RUN_ERROR`.

    petl-run's own rule, shared with what reports a run's failure for it (petl-bench's estimate of a tiny run).
    """
    return USAGE_ERROR if isinstance(error, ConfigError | UsageError) else RUN_ERROR
