"""Typed server start-up failures.

A 20-minute server start can fail in ways that deserve a retry (crash, hang, health check
never passing) and in ways that never will succeed (bad flags, port taken, missing model).
The type says which (`retryable`, from drafter.errors.DrafterError), so the one retry policy
asks the error instead of parsing text.
"""
from __future__ import annotations

from typing import Any, Sequence

from drafter.errors import DrafterError


class ServerStartError(DrafterError):
    """A server did not become ready. `status` is the short word reports use."""

    status = "error"

    def __init__(self, message: str, *, engine: str | None = None, phase: str | None = None,
                 seconds: float | None = None, log_tail: Sequence[str] = (), **extra: Any):
        super().__init__(message)
        self.message = message
        self.engine = engine
        self.phase = phase
        self.seconds = seconds
        self.log_tail = list(log_tail)
        for key, value in extra.items():
            setattr(self, key, value)
        self._extra = extra

    def summary(self) -> str:
        return self.message

    def __str__(self) -> str:
        if not self.log_tail:
            return self.message
        tail = "\n    ".join(self.log_tail[-20:])
        return f"{self.message}\n  last log lines:\n    {tail}"

    # Exceptions cross process boundaries (Prefect results, multiprocessing): keyword-only
    # fields would be lost by the default pickling, which replays only `args`.
    def __reduce__(self):
        fields = dict(engine=self.engine, phase=self.phase, seconds=self.seconds,
                      log_tail=self.log_tail, **self._extra)
        return (_rebuild, (type(self), self.message, fields))

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "message": self.message, "engine": self.engine,
                "phase": self.phase, "seconds": self.seconds, "log_tail": self.log_tail,
                **self._extra}


def _rebuild(cls: type, message: str, fields: dict[str, Any]) -> ServerStartError:
    return cls(message, **fields)


class ServerCrashed(ServerStartError):
    """The process exited (or logged a fatal line) before it was ready."""

    status = "crashed"
    retryable = True

    def __init__(self, message: str, *, exit_code: int | None = None, **kw: Any):
        super().__init__(message, exit_code=exit_code, **kw)


class ServerStalled(ServerStartError):
    """No log progress for longer than the current phase's budget (field note 1: the 8-hour
    CUDA graph capture hang). `seconds` is the time since the last progress."""

    status = "stalled"
    retryable = True


class HealthCheckTimeout(ServerStartError):
    """Still alive and logging, but the HTTP gate did not pass before the deadline.
    `failing` names the checks that still failed (health / model listing / generation)."""

    status = "health_timeout"
    retryable = True

    def __init__(self, message: str, *, failing: Sequence[str] = (), **kw: Any):
        super().__init__(message, failing=list(failing), **kw)


class ServerConfigError(ServerStartError):
    """Bad settings, port taken, missing model path, busy GPUs, or a configuration this host cannot run
    (the engine's log says so, e.g. no attention backend with EAGLE support on this CPU: the gate,
    `Engine.config_error_patterns`). Retrying cannot help. A start that failed this way carries the
    crash's fields too (`exit_code`, `log_tail`)."""

    status = "config_error"


class TeardownError(DrafterError):
    """The server could not be fully stopped: processes left, port held, GPU memory kept.
    Not a start failure: the next launch on this host would fail, so a person must look."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("teardown incomplete: " + "; ".join(self.problems))

    def __reduce__(self):
        return (TeardownError, (self.problems,))
