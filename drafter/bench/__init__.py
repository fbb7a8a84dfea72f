"""The bench sweep: plan (what to launch), measure (the client), sweep (the driver that commits
each measurement), stats (intervals, verdicts, drift, break-even) and report (markdown, table rows,
PNG). The `bench` stage (drafter.stages.bench) wires them to the store."""
from __future__ import annotations

from drafter.errors import DrafterError


class BenchError(DrafterError):
    """The bench cannot produce a report (no prompts, no drafter, the baseline did not start)."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable

    def __reduce__(self):
        return (BenchError, (str(self), self.retryable))
