"""The project's error base: whether a retry can help is part of the error's type.

Every expected failure of a stage derives from `DrafterError`. `retryable` says whether a later
attempt of the same work can succeed (transient storage or network trouble, a server that crashed,
stalled or never turned healthy, a server that went down mid-run) or never will (configuration,
integrity, a missing upstream output). The Prefect tasks ask exactly this, in one predicate
(`tasks/common.py`), and the CLI prints any `DrafterError` as one clean line (`describe`) with
the exit code `exit_code` gives (documented in docs/operations.md, Exit codes):

    2  configuration or usage error (fix the profile or the command line)
    3  expected failure that a retry may fix (storage, network, a server start)
    4  expected failure that a retry will not fix (missing upstream, corrupt object, bad data, a
       full disk: ENOSPC / EDQUOT, whatever error wraps it)
    130 / 143  interrupted by Ctrl-C / SIGTERM (servers were torn down)
    1  anything else: a bug, shown with its traceback
"""
from __future__ import annotations

import errno

EXIT_CONFIG = 2
EXIT_RETRYABLE = 3
EXIT_FAILED = 4
EXIT_PATHS_MISSING = 5  # `config validate`: the profiles are valid, but local paths they name are not here
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class DrafterError(Exception):
    """An expected failure. Subclasses set `retryable` (class default; an instance may override)
    and may set `exit_code` (default: 3 if retryable, else 4)."""

    retryable: bool = False
    exit_code: int | None = None

    def summary(self) -> str:
        """The message without attachments (log tails): what the CLI prints after `error:`."""
        return str(self)


# A full disk (ENOSPC) or an exhausted quota (EDQUOT): a retry would only repeat the work and fail
# at the same place, so it is never retried, whatever error wraps it (a store write, a download).
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
DISK_FULL_HINT = ("the disk is full (or a quota is exhausted): free space or raise the quota, then run again "
                  "(not retried: a retry would repeat the work and fail at the same place)")


def disk_full(exc: BaseException | None) -> bool:
    """True when `exc` is, or was raised from (its cause / context chain), an OSError whose errno
    says the disk is full or a quota is exhausted."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def is_retryable(exc: BaseException) -> bool:
    """True when a later attempt can succeed. Unknown exceptions: only OS-level I/O trouble
    (connection resets, timeouts) is worth another attempt; a bug is not. A full disk never is,
    even inside an error that is otherwise retryable (a store write)."""
    if disk_full(exc):
        return False
    if isinstance(exc, DrafterError):
        return bool(exc.retryable)
    return isinstance(exc, (ConnectionError, TimeoutError))


def exit_code(exc: BaseException) -> int:
    """The documented exit code of an expected failure (a DrafterError, or an OSError of a full disk)."""
    if isinstance(exc, DrafterError) and exc.exit_code is not None:
        return exc.exit_code
    return EXIT_RETRYABLE if is_retryable(exc) else EXIT_FAILED


def describe(exc: BaseException) -> str:
    """One line for a person (the CLI's stderr, the Prefect run log): the error's type and its
    summary, with the notes added on the way up (e.g. the server log's path) on the same line."""
    text = exc.summary() if isinstance(exc, DrafterError) else str(exc)
    notes = [n for n in getattr(exc, "__notes__", ()) if n]
    if disk_full(exc) and DISK_FULL_HINT not in text:
        notes.append(DISK_FULL_HINT)
    if notes:
        text += " (" + "; ".join(notes) + ")"
    return f"error ({type(exc).__name__}): {text}"
