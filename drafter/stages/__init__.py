"""The stage table: the one place that says which stages exist, in which order, what each one
reads, and where its code is. The CLI, the Prefect tasks and the flow all read it; none of them
wires stages together on its own.

Every stage is a module with the same two functions:

    fingerprint(cfg, upstream) -> str | None      # where its output lives (None: no stored output)
    run(cfg, store, *, upstream, progress=None, on_line=None) -> StageResult

`upstream` maps each upstream stage's name to its fingerprint. Fingerprints are pure functions of
the configuration, so a stage started alone finds the outputs its upstream stages committed (and
fails naming them when they were never committed). Adding a stage = one module + one row here.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType

from drafter.config import LifecycleConfig
from drafter.outputs import bench_verdict, champion_verdict, export_verdict
from drafter.stage_output import Progress, StageResult
from drafter.store import ObjectStore


@dataclass(frozen=True)
class Stage:
    name: str
    module: str                       # imported on first use: `drafter config validate` needs no torch
    description: str
    upstream: tuple[str, ...] | Callable[[LifecycleConfig], tuple[str, ...]] = ()
    starts_servers: bool = False      # the flow reaps what a cancelled run of it left behind
    retries: int = 3                  # attempts after the first, for errors that are `retryable`
    # A gate's verdict as markdown, (result, error) -> str | None (drafter.outputs); the Prefect
    # task publishes it. None for an error that is not the gate's refusal (then the stage failed).
    verdict: Callable[..., str | None] | None = None

    def refuses(self, error: BaseException) -> bool:
        """Whether `error` is this gate's refusal (a decision), not a failure of the stage."""
        return self.verdict is not None and self.verdict(None, error) is not None

    def upstream_of(self, cfg: LifecycleConfig) -> tuple[str, ...]:
        return self.upstream(cfg) if callable(self.upstream) else self.upstream

    @property
    def code(self) -> ModuleType:
        return importlib.import_module(self.module)


STAGES: tuple[Stage, ...] = (
    Stage("prepare", "drafter.stages.prepare", "normalise, dedupe, filter and split the prompt corpus"),
    Stage("datagen", "drafter.stages.datagen", "regenerate the answers with the target", upstream=("prepare",),
          starts_servers=True, retries=2),
    Stage("dump", "drafter.stages.dump", "capture the target's aux + final hidden states",
          upstream=lambda cfg: (cfg.dump.upstream,)),
    Stage("train", "drafter.stages.train", "train the EAGLE-3 drafter on the hidden states",
          upstream=("dump",)),
    Stage("export", "drafter.stages.export", "write the SGLang and vLLM formats, check them, judge the "
                                             "accept length offline", upstream=("train", "prepare"),
          verdict=export_verdict),
    # With `retrain.bench` a head-to-head of this run's export and the champion, read by `champion`;
    # otherwise this run's export unless the profile names a drafter directory (or `champion`).
    Stage("bench", "drafter.stages.bench", "sweep speculative settings against the baseline, interleaved, "
                                           "with confidence intervals", starts_servers=True, retries=2,
          verdict=bench_verdict,
          upstream=lambda cfg: ("prepare", "export") if cfg.retrain.bench or (cfg.bench.speculative and
                                                                             not cfg.serve.draft_path)
          else ("prepare",)),
    Stage("champion", "drafter.stages.champion", "judge this run's export against the registry's champion on "
                                                 "the same held-out prompts; promote it only when better",
          upstream=lambda cfg: ("export", "prepare", "bench") if cfg.retrain.bench else ("export", "prepare"),
          verdict=champion_verdict),
    # This run's export, unless the profile names a drafter directory (or `champion`) or serves the target alone.
    Stage("serve", "drafter.stages.serve", "start the server, gate it on a real generation, read its "
                                           "settings back, stop it", starts_servers=True, retries=2,
          upstream=lambda cfg: ("export",) if cfg.serve.speculative is not None and not cfg.serve.draft_path else ()),
)


class StageTable:
    """Stages in lifecycle order, and the fingerprint wiring between them."""

    def __init__(self, stages: Iterable[Stage]):
        self.stages = tuple(stages)
        self.by_name = {s.name: s for s in self.stages}
        for stage in self.stages:
            unknown = [u for u in (stage.upstream if not callable(stage.upstream) else ()) if u not in self.by_name]
            if unknown:
                raise ValueError(f"stage {stage.name!r}: unknown upstream {unknown}")

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

    def fingerprints(self, cfg: LifecycleConfig, known: Mapping[str, str | None] | None = None) -> "Fingerprints":
        return Fingerprints(self, cfg, known)

    def run(self, name: str, cfg: LifecycleConfig, store: ObjectStore, *, fingerprints: "Fingerprints | None" = None,
            progress: Progress | None = None, on_line: Callable[[str], None] | None = None) -> StageResult:
        """Run one stage with its upstream fingerprints resolved from the table."""
        fps = fingerprints or self.fingerprints(cfg)
        try:
            result = self[name].code.run(cfg, store, upstream=fps.upstream(name), progress=progress, on_line=on_line)
        finally:
            _release_gpu_cache()
        fps.record(result)
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

    def __init__(self, table: StageTable, cfg: LifecycleConfig, known: Mapping[str, str | None] | None = None):
        self.table, self.cfg = table, cfg
        self._known: dict[str, str | None] = dict(known or {})

    def __getitem__(self, name: str) -> str | None:
        if name not in self._known:
            self._known[name] = self.table[name].code.fingerprint(self.cfg, self.upstream(name))
        return self._known[name]

    def upstream(self, name: str) -> dict[str, str]:
        return {u: self[u] for u in self.table[name].upstream_of(self.cfg)}

    def record(self, result: StageResult | Mapping) -> None:
        """What a stage run produced (a StageResult, or its to_dict() as a Prefect task returns it)."""
        if isinstance(result, StageResult):
            self._known[result.stage] = result.fingerprint
        else:
            self._known[result["stage"]] = result["fingerprint"]


TABLE = StageTable(STAGES)
