"""What every stage run hands back (StageResult): where its output is, what it holds, what to show.
It sits above the committed outputs (drafter.stage_output, whose manifest a result carries, and
where a stage's progress callback, Progress, is defined)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from drafter.stage_output import Manifest


@dataclass(frozen=True)
class StageResult:
    """What every stage's `run` returns, the one shape the CLI, the tasks and the flow read.

    `status`: "done" (this run produced the output), "skipped" (it was already complete) or a
    stage's own word ("ready" for a server that passed its gate). `uri`: where the output is (a
    store URI, or a server's base URL). `summary`: human-readable lines (CLI output, run log);
    `table`: {"metric", "value"} rows for a report (a Prefect table artifact). `headline`: the one
    line a person asks the stage for (the bench: faster or not, by how much, on which engine), or
    empty. `manifest`: the committed manifest, for stages that write to the store."""

    stage: str
    status: str
    uri: str
    fingerprint: str | None = None
    meta: dict = field(default_factory=dict)
    manifest: Manifest | None = None
    summary: tuple[str, ...] = ()
    table: tuple[dict, ...] = ()
    headline: str = ""

    @property
    def skipped(self) -> bool:
        return self.status == "skipped"

    @classmethod
    def committed(cls, manifest: Manifest, uri: str, skipped: bool, summary: Iterable[str] = (),
                  table: Iterable[dict] = (), meta: dict | None = None, headline: str = "") -> "StageResult":
        """The result of a stage whose output is `manifest` at `uri`; `meta` replaces the manifest's
        when a stage keeps a bulky part of it out of task results."""
        return cls(stage=manifest.stage, status="skipped" if skipped else "done", uri=uri,
                   fingerprint=manifest.fingerprint, meta=manifest.meta if meta is None else meta,
                   manifest=manifest, summary=tuple(summary), table=tuple(table), headline=headline)

    def outcome(self) -> str:
        """One line: did it run, or find its output complete (what `make demo` prints)."""
        state = {"skipped": "skipped (output already complete)"}.get(self.status, self.status)
        return f"stage {self.stage}: {state} {self.uri}"

    def to_dict(self) -> dict:
        """JSON-able (what a Prefect task returns; never data, only where it is and what it holds)."""
        return {"stage": self.stage, "status": self.status, "skipped": self.skipped, "uri": self.uri,
                "fingerprint": self.fingerprint, "meta": self.meta, "summary": list(self.summary),
                "headline": self.headline}
