"""The stage table: the one place that says which stages exist, in which order, and where each
one's code is. The CLI (`drafter run STAGE`), the Prefect tasks, the flow and the deployments all
read it; none of them wires stages together on its own.

A row is plain data. What a stage reads (`needs`), how it resolves and fingerprints its inputs and
what it builds is its module's (the four parts in drafter.stages.base); the skip / commit skeleton
is drafter.stages.base.run_stage, once for all. Fingerprints are pure functions of the resolved
inputs, so a stage started alone finds the outputs its upstream stages committed (and fails naming
them when they were never committed). Adding a stage = one module + one row here (+ its config
section when it has settings of its own).
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType

from drafter.config import LifecycleConfig
from drafter.stage_output import Progress, StageOutput
from drafter.stage_result import StageResult
from drafter.fanout import FanOut, RangeTask
from drafter.stages.base import StageContext, run_range, run_stage
from drafter.store import ObjectStore, open_store


@dataclass(frozen=True)
class Stage:
    name: str
    module: str                       # imported on first use: `drafter config validate` needs no torch
    description: str
    starts_servers: bool = False      # the flow reaps what a cancelled run of it left behind
    retries: int = 3                  # attempts after the first, for errors that are `retryable`
    gate: bool = False                # its module's verdict(result, error) is published (drafter.stages.verdicts)
    unit: str = "item"                # what its progress counts (`drafter run`'s progress bar)
    fans_out: bool = False            # its module plans shards (`plan`): `<stage>.workers` > 1 fans them out

    @property
    def code(self) -> ModuleType:
        return importlib.import_module(self.module)

    @property
    def verdict(self) -> Callable[..., str | None] | None:
        """A gate's verdict as markdown, (result, error) -> str | None; None for an error that is
        not the gate's refusal (then the stage failed)."""
        return self.code.verdict if self.gate else None

    def refuses(self, error: BaseException) -> bool:
        """Whether `error` is this gate's refusal (a decision), not a failure of the stage."""
        return self.gate and self.verdict(None, error) is not None

    def upstream_of(self, cfg: LifecycleConfig) -> tuple[str, ...]:
        return tuple(self.code.needs(cfg))


STAGES: tuple[Stage, ...] = (
    Stage("prepare", "drafter.stages.prepare", "normalise, dedupe, filter and split the prompt corpus", unit="row"),
    Stage("datagen", "drafter.stages.datagen", "regenerate the answers with the target",
          starts_servers=True, retries=2, unit="conv", fans_out=True),
    Stage("dump", "drafter.stages.dump", "capture the target's aux + final hidden states", unit="shard",
          fans_out=True),
    Stage("train", "drafter.stages.train", "train the EAGLE-3 drafter on the hidden states", unit="step"),
    Stage("export", "drafter.stages.export", "write the SGLang and vLLM formats, check them, judge the "
                                             "accept length offline", gate=True, unit="prompt"),
    Stage("bench", "drafter.stages.bench", "sweep speculative settings against the baseline, interleaved, "
                                           "with confidence intervals", starts_servers=True, retries=2, gate=True,
          unit="measurement"),
    Stage("champion", "drafter.stages.champion", "judge this run's export against the registry's champion on "
                                                 "the same held-out prompts; promote it only when better", gate=True,
          unit="prompt"),
    Stage("serve", "drafter.stages.serve", "start the server, gate it on a real generation, read its "
                                           "settings back, stop it", starts_servers=True, retries=2),
)


class StageTable:
    """Stages in lifecycle order, and the fingerprint wiring between them."""

    def __init__(self, stages: Iterable[Stage]):
        self.stages = tuple(stages)
        self.by_name = {s.name: s for s in self.stages}
        if len(self.by_name) != len(self.stages):
            raise ValueError(f"two rows share a name: {[s.name for s in self.stages]}")

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def __getitem__(self, name: str) -> Stage:
        try:
            return self.by_name[name]
        except KeyError:
            raise KeyError(f"no stage {name!r}; stages: {', '.join(self.names)}") from None

    def in_order(self, names: Iterable[str]) -> list[Stage]:
        wanted = set(names)
        unknown = wanted - set(self.by_name)
        if unknown:
            raise KeyError(f"no stage {sorted(unknown)}; stages: {', '.join(self.names)}")
        return [s for s in self.stages if s.name in wanted]

    def fingerprints(self, cfg: LifecycleConfig, known: Mapping[str, str | None] | None = None,
                     store: ObjectStore | None = None) -> "Fingerprints":
        return Fingerprints(self, cfg, known, store)

    def context(self, name: str, cfg: LifecycleConfig, store: ObjectStore | None = None, *,
                upstream: Mapping[str, str] | None = None, fingerprints: "Fingerprints | None" = None,
                progress: Progress | None = None, on_line: Callable[[str], None] | None = None,
                fan_out: Callable[[FanOut], dict] | None = None, **options) -> StageContext:
        """The context of one run of `name`: its upstream fingerprints given, or resolved from the table."""
        store = store if store is not None else open_store(cfg.storage)
        if upstream is None:
            upstream = (fingerprints or self.fingerprints(cfg, store=store)).upstream(name)
        unknown = sorted(set(self.upstream_names(name, cfg)) - set(self.by_name))
        if unknown:
            raise KeyError(f"stage {name!r} needs unknown stages {unknown}; stages: {', '.join(self.names)}")
        return StageContext(cfg=cfg, store=store, upstream=dict(upstream), progress=progress, on_line=on_line,
                            options=options, fan_out=fan_out)

    def upstream_names(self, name: str, cfg: LifecycleConfig) -> tuple[str, ...]:
        return self[name].upstream_of(cfg)

    def fingerprint(self, name: str, cfg: LifecycleConfig, upstream: Mapping[str, str] | None = None,
                    store: ObjectStore | None = None) -> str | None:
        """Where `name`'s output for `cfg` lives (its inputs resolved with the store, then hashed)."""
        code = self[name].code
        return code.fingerprint(code.inputs(self.context(name, cfg, store, upstream=upstream)))

    def output(self, name: str, cfg: LifecycleConfig, store: ObjectStore,
               upstream: Mapping[str, str] | None = None) -> StageOutput:
        return StageOutput(store, name, self.fingerprint(name, cfg, upstream, store))

    def run(self, name: str, cfg: LifecycleConfig, store: ObjectStore | None = None, *,
            upstream: Mapping[str, str] | None = None, fingerprints: "Fingerprints | None" = None,
            progress: Progress | None = None, on_line: Callable[[str], None] | None = None,
            fan_out: Callable[[FanOut], dict] | None = None, range_task: RangeTask | None = None,
            **options) -> StageResult:
        """Run one stage (drafter.stages.base.run_stage) with its upstream fingerprints given or
        resolved from the table; a flow's `fingerprints` records what it produced. `fan_out` runs
        the ranges of a stage that fans out; `range_task` makes this run one such range's child."""
        if range_task is not None and not self[name].fans_out:
            raise KeyError(f"stage {name!r} does not fan out; stages that do: "
                           f"{', '.join(s.name for s in self.stages if s.fans_out)}")
        ctx = self.context(name, cfg, store, upstream=upstream, fingerprints=fingerprints, progress=progress,
                           on_line=on_line, fan_out=fan_out if self[name].fans_out else None, **options)
        try:
            if range_task is not None:
                return run_range(name, self[name].code, ctx, range_task)
            result = run_stage(name, self[name].code, ctx)
        finally:
            _release_gpu_cache()
        if fingerprints is not None:
            fingerprints.record(result)
        return result


def _release_gpu_cache() -> None:
    """Hand the GPU memory a stage cached in this process back to the device, so a server that a
    later stage of the same flow run starts finds it free (torch only if a stage loaded it)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class Fingerprints:
    """Each stage's fingerprint for one configuration, computed at most once; a stage that ran
    records what it produced, so downstream stages read exactly that output."""

    def __init__(self, table: StageTable, cfg: LifecycleConfig, known: Mapping[str, str | None] | None = None,
                 store: ObjectStore | None = None):
        self.table, self.cfg = table, cfg
        self._store = store
        self._known: dict[str, str | None] = dict(known or {})

    @property
    def store(self) -> ObjectStore:
        if self._store is None:  # opened on first need: fingerprints of prepare alone read no store
            self._store = open_store(self.cfg.storage)
        return self._store

    def __getitem__(self, name: str) -> str | None:
        if name not in self._known:
            self._known[name] = self.table.fingerprint(name, self.cfg, self.upstream(name), self.store)
        return self._known[name]

    def upstream(self, name: str) -> dict[str, str]:
        return {u: self[u] for u in self.table.upstream_names(name, self.cfg)}

    def record(self, result: StageResult | Mapping) -> None:
        """What a stage run produced (a StageResult, or its to_dict() as a Prefect task returns it)."""
        if isinstance(result, StageResult):
            self._known[result.stage] = result.fingerprint
        else:
            self._known[result["stage"]] = result["fingerprint"]


TABLE = StageTable(STAGES)
