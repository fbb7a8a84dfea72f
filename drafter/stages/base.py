"""The one skeleton every stage runs in, and the four parts a stage module provides.

A stage module (one per row of the table in drafter.stages) defines:

    needs(cfg) -> tuple[str, ...]          the upstream stages it reads, for this configuration
    inputs(ctx) -> Inputs                   resolve what it reads (the drafter, the champion, the
                                            dump plan) ONCE, with the store; Inputs carries `ctx`
    fingerprint(inputs) -> str | None       pure: where its output lives (None: no stored output)
    build(inputs, out) -> Built             do the work into `out` (a StageOutput); what to commit
    summarize(inputs, out) -> Summary       its lines and table, from the committed output

and optionally `exclusive(inputs, out)` (a context manager held from the second completeness check
to the commit: train's one-run-per-output lock) and `verdict(result, error)` (a gate's verdict as
markdown, drafter.outputs). `run_stage` does the rest once for all: skip a complete output,
commit, summarise. A stage without stored output (fingerprint None: serve) returns its StageResult
from `build(inputs, None)`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from drafter.config import LifecycleConfig
from drafter.stage_output import Progress, StageOutput, StageResult
from drafter.store import ObjectStore


@dataclass(frozen=True)
class StageContext:
    """What one stage run gets: the configuration, the store, its upstream fingerprints, where
    progress and log lines go, and stage-specific options (bench: `session_options`)."""

    cfg: LifecycleConfig
    store: ObjectStore
    upstream: Mapping[str, str] = field(default_factory=dict)
    progress: Progress | None = None
    on_line: Callable[[str], None] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def say(self, line: str) -> None:
        if self.on_line is not None:
            self.on_line(line)


@dataclass(frozen=True)
class Built:
    """What `build` hands back to be committed: the manifest meta (or a function of the committed
    shards that returns it), the shards the commit must find, and what to do once committed."""

    meta: dict | Callable[[dict], dict]
    expect: Sequence[str] | None = None
    after_commit: Callable[[], None] | None = None


@dataclass(frozen=True)
class Summary:
    """A committed output's lines (CLI, run log) and table (report); `meta` replaces the manifest
    meta in the result when a stage keeps a bulky part of it out of task results."""

    lines: Sequence[str]
    table: Sequence[dict] = ()
    meta: dict | None = None


def run_stage(name: str, code: ModuleType, ctx: StageContext) -> StageResult:
    """Resolve the inputs, then skip a complete output or build and commit it."""
    inputs = code.inputs(ctx)
    fp = code.fingerprint(inputs)
    if fp is None:
        return code.build(inputs, None)
    out = StageOutput(ctx.store, name, fp)
    if out.is_complete():
        return _committed(code, inputs, out, skipped=True)
    with getattr(code, "exclusive", _shared)(inputs, out):
        if out.is_complete():  # committed by the run that held the stage before us
            return _committed(code, inputs, out, skipped=True)
        built = code.build(inputs, out)
        out.commit(built.meta, expect=built.expect)
        if built.after_commit is not None:
            built.after_commit()
    return _committed(code, inputs, out, skipped=False)


@contextlib.contextmanager
def _shared(inputs, out):
    yield


def _committed(code: ModuleType, inputs, out: StageOutput, skipped: bool) -> StageResult:
    summary = code.summarize(inputs, out)
    return StageResult.committed(out.manifest, out.uri, skipped, summary.lines, summary.table, summary.meta)
