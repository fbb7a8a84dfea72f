"""A fan-out stage's shards as data (datagen, dump): the plan the skeleton (drafter.stages.base), a
fan-out child and the one-worker path all read, the one rule for which shards are pending, and the
one place that takes shards from earlier outputs.

A stage that plans shards returns a `ShardPlan` (or a subclass adding what only its own `compute`
and `finish` read):
- `units`: the shards this output computes, in plan order (fan-out ranges cut this list), and
  `inputs`: the digest of what each is computed from (its marker records it as `input_digest`);
  `digest` names the plan (a child refuses a plan other than its parent's);
- `reused`: shards taken whole from `earlier` outputs with the same `reuse_key` that the reuse index
  (drafter.contracts.reuse) found computed from the same inputs, each with where it comes from; once
  committed, the output is registered under `reuse_key` for later outputs;
- `local`: units the run that commits computes itself before any fan-out, needing no worker
  (datagen's shards whose answers are all copied from earlier outputs);
- `companions`: a shard written beside another and valid only with it (datagen's `errors-i` beside
  `gen-i`); `also`: the other shards the output holds (written by `finish`).

The rule (`is_pending`): a shard is pending when it has no verified marker recording the digest it
is computed from. The reuse steps (`take_reused`, by the run that commits, before computing): drop
the shards of a killed attempt that this plan does not name, drop the companions of pending shards,
and reference every pending reused shard (`StageOutput.link_shard`).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from drafter.contracts import reuse
from drafter.fanout import plan_digest
from drafter.stage_output import ShardInfo, StageOutput


@dataclass(frozen=True)
class Reused:
    """Shard `name` of this output is `source`'s shard `source_name`, computed from `digest`;
    `meta` its marker's meta here (None: the source's, which records the same digest)."""

    name: str
    digest: str
    source: StageOutput
    source_name: str
    meta: Mapping | None = None


@dataclass(frozen=True, kw_only=True)
class ShardPlan:
    """One output's shards: what is computed from what, what is taken from where (module doc)."""

    units: tuple[str, ...]
    inputs: tuple[str, ...]
    reused: tuple[Reused, ...] = ()
    earlier: tuple[StageOutput, ...] = ()
    reuse_key: str | None = None
    local: frozenset[str] = frozenset()
    companions: Mapping[str, str] = field(default_factory=dict)
    also: frozenset[str] = frozenset()

    @property
    def digest(self) -> str:
        return plan_digest(self.units, self.inputs)

    def pending(self, done: Mapping[str, ShardInfo]) -> list[str]:
        """The units without a verified marker of their input (`done`: out.completed_shards()), in plan order."""
        return [u for u, d in zip(self.units, self.inputs) if is_pending(done, u, d)]


def is_pending(done: Mapping[str, ShardInfo], name: str, digest: str) -> bool:
    """THE rule: shard `name` is to be computed (or referenced) unless it has a verified marker
    recording `digest`, what it is computed from now (a shard of a killed attempt planned from
    other inputs counts as not done)."""
    info = done.get(name)
    return info is None or info.meta.get("input_digest") != digest


def take_reused(out: StageOutput, plan: ShardPlan, done: Mapping[str, ShardInfo],
                pending: Sequence[str]) -> list[str]:
    """The reuse steps, by the run that commits before anything is computed: drop what a killed
    attempt wrote that this plan does not name (it planned with another reusable history), drop the
    companions of the `pending` units, and reference each reused shard not done yet. Returns the
    names referenced now (they are not computed)."""
    named = {*plan.units, *(r.name for r in plan.reused)}
    keep = named | {plan.companions[n] for n in named if n in plan.companions} | plan.also
    for name in done:
        if name not in keep:
            out.drop_shard(name)
    todo = [r for r in plan.reused if is_pending(done, r.name, r.digest)]
    drop_stale_companions(out, plan, done, [*pending, *(r.name for r in todo)])
    for r in todo:
        out.link_shard(r.name, r.source, r.source_name, meta=None if r.meta is None else dict(r.meta))
    return [r.name for r in todo]


def drop_stale_companions(out: StageOutput, plan: ShardPlan, done: Mapping[str, ShardInfo],
                          names: Collection[str]) -> None:
    """A companion of a shard about to be computed or referenced was written by an attempt killed
    before the shard landed (datagen writes `errors-i` before `gen-i`): it would be committed with
    the new shard and name conversations that are now fine. Removing its object is enough: a marker
    only counts while its shard exists."""
    for name in names:
        companion = plan.companions.get(name)
        if companion is not None and companion in done:
            out.store.delete(out.key(companion))


def register(out: StageOutput, plan: ShardPlan) -> None:
    """Once committed: findable by later outputs with the same reuse key."""
    if plan.reuse_key is not None:
        reuse.register(out, plan.reuse_key)
