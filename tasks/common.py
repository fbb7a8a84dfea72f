"""What every stage task shares: retry policy, progress artifacts, run logging."""
from __future__ import annotations

import time
from collections.abc import Callable

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger

from drafter.config import ConfigError
from drafter.stage_output import ManifestError
from drafter.store import CorruptObject, ObjectNotFound, StoreError

# Errors that a retry cannot fix: bad configuration, corrupted data or an unusable manifest that
# needs a human, an upstream stage that was never committed (run it first; waiting will not help).
NEVER_RETRY = (ConfigError, CorruptObject, ManifestError, ObjectNotFound)


def failure_of(state) -> BaseException | None:
    try:
        result = state.result(raise_on_failure=False)
    except Exception as exc:  # the result itself could not be loaded
        return exc
    return result if isinstance(result, BaseException) else None


def is_transient(exc: BaseException) -> bool:
    """Storage and network trouble; never configuration or integrity errors."""
    return not isinstance(exc, NEVER_RETRY) and isinstance(exc, (StoreError, OSError, TimeoutError, ConnectionError))


def retry_if(predicate: Callable[[BaseException], bool]) -> Callable[..., bool]:
    """A Prefect `retry_condition_fn`: retry when the task failed with an exception `predicate` accepts."""
    def condition(task, task_run, state) -> bool:
        exc = failure_of(state)
        return exc is not None and predicate(exc)
    return condition


retry_transient = retry_if(is_transient)


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
