"""The one skeleton every stage runs in, and the four parts a stage module provides.

A stage module (one per row of the table in drafter.stages) defines:

    needs(cfg) -> tuple[str, ...]          the upstream stages it reads, for this configuration
    inputs(ctx) -> Inputs                   resolve what it reads (the drafter, the champion, the
                                            dump plan) ONCE, with the store; Inputs carries `ctx`
    fingerprint(inputs) -> str | None       pure: where its output lives (None: no stored output)
    build(inputs, out) -> Built             do the work into `out` (a StageOutput); what to commit
    summarize(inputs, out) -> Summary       its lines and table, from the committed output

A stage whose work is independent shards (datagen, dump; `fans_out` in its row) defines three
parts instead of `build`:

    plan(inputs, out) -> ShardPlan          its shards as data (drafter.shard_plan): the units in
                                            plan order, what each is computed from, what is reused
                                            from where
    compute(inputs, out, plan, names, pending) -> dict
                                            compute these pending units (with their markers);
                                            `pending`: the units pending when this run planned;
                                            returns this run's figures
    finish(inputs, out, plan, figures, pending) -> Built
                                            what to commit once none is pending

The skeleton decides what is pending (drafter.shard_plan's one rule), takes the reused shards, then
computes the rest here, or, with `<stage>.workers` > 1 and a fan-out runner in the context (the
Prefect task gives one), in child runs of contiguous ranges (drafter.fanout); a child runs
`run_range`, which computes the pending units of its range and never commits.

and optionally `exclusive(inputs, out)` (a context manager held from the second completeness check
to the commit: train's one-run-per-output lock, which refuses a second run) and `verdict(result,
error)` (a gate's verdict as markdown, drafter.stages.verdicts). `run_stage` does the rest once for all:
skip a complete output, commit, summarise. A stage without stored output (fingerprint None: serve)
returns its StageResult from `build(inputs, None)`.

One run per output: a stage that plans shards (datagen, dump) and defines no `exclusive` holds the
output's lock on this host (drafter.workdirs.output_lock) from before it plans to its commit; a
second run of the same output waits for it, saying whose run it waits for, then finds the output
committed and skips it (or resumes after the shards of a run that failed). A run that finds its
output committed under it anyway (another host's run, sharing the store, committed first) reports
it complete (skipped), never an error.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

from drafter.config import LifecycleConfig
from drafter.errors import DrafterError
from drafter.fanout import FanOut, Lease, PlanChanged, RangeTask, lease_key, split_ranges
from drafter.shard_plan import ShardPlan, drop_stale_companions, register, take_reused
from drafter.stage_output import AlreadyCommitted, Progress, StageOutput
from drafter.stage_result import StageResult
from drafter.store import ObjectStore
from drafter.workdirs import describe_holder, output_lock

log = logging.getLogger(__name__)


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
    fan_out: Callable[[FanOut], dict] | None = None   # runs the ranges' children, waits (tasks/fanout.py)

    def say(self, line: str) -> None:
        if self.on_line is not None:
            self.on_line(line)

    def tell(self, line: str) -> None:
        """A line the person running the stage must see: through `on_line` when the caller gave one
        (`drafter run`'s stderr, the Prefect run log), else as a warning of the skeleton's logger
        (which Python prints on stderr when nothing configured logging: the named CLI commands)."""
        if self.on_line is not None:
            self.on_line(line)
        else:
            log.warning("%s", line)


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
    meta in the result when a stage keeps a bulky part of it out of task results; `headline` the
    one line a person asks the stage for (the bench's answer), printed last."""

    lines: Sequence[str]
    table: Sequence[dict] = ()
    meta: dict | None = None
    headline: str = ""


class RangesIncomplete(DrafterError):
    """Every child reported done, yet shards of the plan have no verified marker (a child wrote
    elsewhere, or its shards were removed meanwhile): nothing is committed."""

    retryable = True


def run_stage(name: str, code: ModuleType, ctx: StageContext) -> StageResult:
    """Resolve the inputs, then skip a complete output or build and commit it."""
    inputs = code.inputs(ctx)
    fp = code.fingerprint(inputs)
    if fp is None:
        return code.build(inputs, None)
    out = StageOutput(ctx.store, name, fp)
    if out.is_complete():
        return _committed(code, inputs, out, skipped=True)
    exclusive = getattr(code, "exclusive", None) or (_one_run_per_output(name, ctx) if hasattr(code, "plan")
                                                     else _shared)
    try:
        with exclusive(inputs, out):
            if out.is_complete():  # committed by the run that held the stage before us
                return _committed(code, inputs, out, skipped=True)
            built = code.build(inputs, out) if not hasattr(code, "plan") else _build_planned(name, code, inputs, out, ctx)
            out.commit(built.meta, expect=built.expect)
            if built.after_commit is not None:
                built.after_commit()
    except AlreadyCommitted:
        if not out.is_complete():
            raise
        ctx.tell(f"{name}: {out.uri} was committed by another run of the same output while this one worked: "
                 f"complete, nothing more to do")
        return _committed(code, inputs, out, skipped=True)
    return _committed(code, inputs, out, skipped=False)


def _one_run_per_output(name: str, ctx: StageContext):
    """The skeleton's `exclusive` for a stage that plans shards: hold the output's lock on this
    host, waiting (and saying so) while another run holds it."""

    @contextlib.contextmanager
    def hold(inputs, out: StageOutput):
        def waiting(holder: dict, path, waited_s: float) -> None:
            ctx.tell(f"{name}: output {out.fingerprint} is being computed by {describe_holder(holder)} (lock {path}); "
                     f"waiting for that run to end" + (f" ({waited_s / 60:.0f} min so far)" if waited_s >= 60 else "")
                     + ": then this run finds the output committed and skips it, or resumes after its shards")

        with output_lock(name, out.fingerprint, wait=True, on_wait=waiting):
            yield

    return hold


def _build_planned(name: str, code: ModuleType, inputs, out: StageOutput, ctx: StageContext) -> Built:
    """Take the reused shards, compute the pending ones here or fan them out in ranges; then what
    to commit."""
    plan: ShardPlan = code.plan(inputs, out)
    done = out.completed_shards()
    pending = plan.pending(done)
    linked = set(take_reused(out, plan, done, pending))
    local = [u for u in pending if u in plan.local and u not in linked]
    if local:  # computed by this run whatever the workers (no worker needed)
        code.compute(inputs, out, plan, local, pending)
    todo = [u for u in pending if u not in linked and u not in plan.local]
    workers = getattr(ctx.cfg, name).workers
    if todo and workers > 1 and ctx.fan_out is not None:
        ranges = split_ranges(plan.units, workers)
        launch = [r for r in ranges if set(todo) & set(plan.units[r.start:r.stop])]
        fanned = ctx.fan_out(FanOut(name, out.fingerprint, dict(ctx.upstream), plan.digest, launch, len(ranges)))
        left = plan.pending(out.completed_shards())  # what the children wrote, as the store's markers say
        if left:
            raise RangesIncomplete(f"{name}: the children reported done but {len(left)} shards have no "
                                   f"verified marker (first: {left[0]}); nothing committed")
        built = code.finish(inputs, out, plan, {}, pending)  # this run computed nothing itself
        built = replace(built, meta=_with_fan_out(built.meta, fanned))
    else:
        if todo and workers > 1:
            ctx.tell(f"{name}: {name}.workers = {workers} fans out only in the Prefect flow; computing all "
                     f"{len(todo)} pending shards here")
        built = code.finish(inputs, out, plan, code.compute(inputs, out, plan, todo, pending) if todo else {}, pending)
    return replace(built, after_commit=_then(built.after_commit, lambda: register(out, plan)))


def _then(first: Callable[[], None] | None, then: Callable[[], None]) -> Callable[[], None]:
    if first is None:
        return then
    return lambda: (first(), then())


def _with_fan_out(meta: dict | Callable[[dict], dict], fanned: dict) -> dict | Callable[[dict], dict]:
    """The fan-out's figures (ranges, attempts, wall time) in the manifest meta, under `fan_out`."""
    if callable(meta):
        return lambda shards: {**meta(shards), "fan_out": fanned}
    return {**meta, "fan_out": fanned}


def run_range(name: str, code: ModuleType, ctx: StageContext, task: RangeTask) -> StageResult:
    """A fan-out child: compute the pending shards of `task.part` (with their markers), beating its
    lease meanwhile; never commit. Refuses a plan or an output other than its parent's."""
    with Lease(ctx.store, lease_key(name, task.fingerprint, task.part, task.attempt), task.lease_interval_s):
        inputs = code.inputs(ctx)
        fp = code.fingerprint(inputs)
        if fp != task.fingerprint:
            raise PlanChanged(f"{name}: this child's output is {fp}, its parent's {task.fingerprint}: the "
                              f"configuration or an upstream output differs between them")
        out = StageOutput(ctx.store, name, fp)
        committed = StageResult(stage=name, status="skipped", uri=out.uri, fingerprint=fp,
                                summary=(f"{task.part.label}: output already committed",))
        if out.is_complete():
            return committed
        plan: ShardPlan = code.plan(inputs, out)
        if plan.digest != task.plan:
            raise PlanChanged(f"{name}: {task.part.label}: the plan changed since the parent made it "
                              f"({plan.digest} != {task.plan}); the parent's next run plans again")
        mine = set(plan.units[task.part.start:task.part.stop])
        done = out.completed_shards()
        pending = plan.pending(done)
        names = [n for n in pending if n in mine and n not in plan.local]  # the parent computed the local ones
        try:
            drop_stale_companions(out, plan, done, names)
            figures = code.compute(inputs, out, plan, names, pending) if names else {}
        except AlreadyCommitted:
            if not out.is_complete():
                raise
            return committed
    line = (f"{task.part.label} ({task.part.first}..{task.part.last}): computed {len(names)} of "
            f"{len(mine)} shards" + (", the others were already done" if len(names) < len(mine) else ""))
    return StageResult(stage=name, status="range done", uri=out.uri, fingerprint=fp,
                       meta={"range": task.part.to_dict(), "computed": names, "figures": figures}, summary=(line,))


@contextlib.contextmanager
def _shared(inputs, out):
    yield


def _committed(code: ModuleType, inputs, out: StageOutput, skipped: bool) -> StageResult:
    summary = code.summarize(inputs, out)
    return StageResult.committed(out.manifest, out.uri, skipped, summary.lines, summary.table, summary.meta,
                                 summary.headline)
