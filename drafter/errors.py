"""The project's error base: whether a retry can help is part of the error's type.

Every expected failure of a stage derives from `DrafterError`. `retryable` says whether a later
attempt of the same work can succeed (transient storage or network trouble, a server that crashed,
stalled or never turned healthy, a server that went down mid-run) or never will (configuration,
integrity, a missing upstream output). The Prefect tasks ask exactly this, in one predicate
(`tasks/common.py`), and the CLI prints any `DrafterError` as one clean line.
"""
from __future__ import annotations


class DrafterError(Exception):
    """An expected failure. Subclasses set `retryable` (class default; an instance may override)."""

    retryable: bool = False


def is_retryable(exc: BaseException) -> bool:
    """True when a later attempt can succeed. Unknown exceptions: only OS-level I/O trouble
    (connection resets, timeouts) is worth another attempt; a bug is not."""
    if isinstance(exc, DrafterError):
        return bool(exc.retryable)
    return isinstance(exc, (ConnectionError, TimeoutError))
