"""What every stage task shares: retry policy, progress artifacts, run logging."""
from __future__ import annotations

import time

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger

from drafter.config import ConfigError
from drafter.store import CorruptObject, ObjectNotFound, StoreError

# Errors that a retry cannot fix: bad configuration, corrupted data that needs a human, an upstream
# stage that was never committed (run it first; waiting will not make it appear).
NEVER_RETRY = (ConfigError, CorruptObject, ObjectNotFound)


def failure_of(state) -> BaseException | None:
    try:
        result = state.result(raise_on_failure=False)
    except Exception as exc:  # the result itself could not be loaded
        return exc
    return result if isinstance(result, BaseException) else None


def retry_transient(task, task_run, state) -> bool:
    """Retry storage and network trouble; never configuration or integrity errors."""
    exc = failure_of(state)
    if exc is None or isinstance(exc, NEVER_RETRY):
        return False
    return isinstance(exc, (StoreError, OSError, TimeoutError, ConnectionError))


class ProgressArtifact:
    """A Prefect progress artifact fed by library callbacks, throttled (each update is an API call)."""

    def __init__(self, key: str, description: str, min_interval_s: float = 2.0):
        self.key = key
        self.description = description
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._id = None  # created on the first report, so a skipped stage makes no API calls

    def __call__(self, done: int, total: int | None = None, *info) -> None:
        now = time.monotonic()
        finished = total is not None and done >= total
        if not total or (now - self._last < self.min_interval_s and not finished):
            return
        self._last = now
        if self._id is None:
            self._id = create_progress_artifact(progress=0.0, key=self.key, description=self.description)
        update_progress_artifact(self._id, progress=min(100.0, 100.0 * done / total))


def log():
    return get_run_logger()
