"""What a bench sweep launches and measures, decided before anything starts.

- The baseline (no speculation) is always the first server configuration.
- Every `bench.speculative` entry is a server configuration; one that the engine cannot run
  (SGLang's rules are enforced by SpeculativeConfig itself; engine-specific ones here and by a dry
  `Engine.build_launch`, which starts nothing) is listed as skipped with the reason, and so is a
  duplicate (it would be a second launch of the same server).
- ONE server per distinct configuration (field note 8: restarts are the main cost of a sweep);
  every batch size is measured on the same server.
- With `bench.accept_curve`, every runnable setting is also served at each of those accept lengths
  with acceptance forced (`Engine.forced_acceptance`): one more server per (setting, length), in
  the same sweep, never recommended (drafter.bench.predict makes the curve of them). A length the
  setting cannot reach, or an engine without a knob, is listed as skipped with the reason.
- Interleaving (field note 6): rounds go round-robin across configurations. With one server per
  configuration that needs either every server alive at once (`concurrent`: one launch each,
  consecutive ports, one measured at a time) or a launch per (configuration, round) (`relaunch`).
  `auto` picks `concurrent` where servers share no GPU (reference engine on CPU, command engine),
  `relaunch` otherwise: two servers on one GPU fail preflight's "GPUs in use" check and would
  share memory and compute.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from drafter.config import LifecycleConfig, SpeculativeConfig
# The server names and the interleave rule live with the configuration: the profile's port check asks them too.
from drafter.config.lifecycle import Interleave, resolve_interleave
from drafter.config.sections import BASELINE, server_key
from drafter.engine_registry import make_engine
from drafter.server_errors import ServerConfigError

# What each engine offers the bench (SGLang's /flush_cache, its /generate API, streaming, counters)
# is asked of the engine: drafter.engines.base.Engine (flush_cache, client_style, streams,
# reports_counters).


@dataclass(frozen=True)
class ServerPlan:
    """One server configuration: the baseline (`speculative` None) or one speculative setting with
    one drafter. `drafter` names the drafter's role in a head-to-head sweep (`challenger`,
    `champion`); it is empty in a sweep of one drafter."""

    key: str
    speculative: SpeculativeConfig | None
    drafter: str = ""
    draft_path: str | None = None
    forced_accept_length: float | None = None  # a point of the accept-length curve (timing only)

    @property
    def is_baseline(self) -> bool:
        return self.speculative is None

    @property
    def label(self) -> str:
        if self.forced_accept_length is not None:
            return f"{describe(self.speculative)} forced accept {self.forced_accept_length:g}"
        return f"{self.drafter} {describe(self.speculative)}" if self.drafter else describe(self.speculative)


@dataclass(frozen=True)
class Skipped:
    label: str
    reason: str

    def to_dict(self) -> dict:
        return {"config": self.label, "reason": self.reason}


@dataclass
class SweepPlan:
    engine: str
    servers: list[ServerPlan]
    batch_sizes: list[int]
    rounds: int
    interleave: Interleave
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def baseline(self) -> ServerPlan:
        return self.servers[0]

    def order(self, round_index: int) -> list[ServerPlan]:
        """Round r visits the servers rotated by r (B S1 S2, S1 S2 B, S2 B S1, ...): every
        configuration takes every position equally often, so slow drift hits all alike."""
        n = len(self.servers)
        k = round_index % n
        return self.servers[k:] + self.servers[:k]

    def head_to_head_pairs(self) -> list[tuple[str, str, str]]:
        """(setting, challenger key, champion key) for every setting both drafters are served at."""
        by = {(s.drafter, server_key(s.speculative)): s.key for s in self.servers if s.drafter}
        return [(describe(s.speculative), s.key, by[("champion", server_key(s.speculative))])
                for s in self.servers if s.drafter == "challenger" and ("champion", server_key(s.speculative)) in by]

    def curve_servers(self) -> list[dict]:
        """Every speculative server as drafter.bench.predict.build_curves reads it."""
        return [{"key": s.key, "setting_key": server_key(s.speculative), "setting": describe(s.speculative),
                 "num_steps": s.speculative.num_steps, "drafter": s.drafter,
                 "forced_accept_length": s.forced_accept_length} for s in self.servers if not s.is_baseline]

    def to_dict(self) -> dict:
        return {"engine": self.engine, "interleave": self.interleave, "rounds": self.rounds,
                "batch_sizes": list(self.batch_sizes),
                "servers": [{"key": s.key, "config": s.label, "drafter": s.drafter or None,
                             "speculative": s.speculative.model_dump(mode="json") if s.speculative else None,
                             **({"forced_accept_length": s.forced_accept_length}
                                if s.forced_accept_length is not None else {})}
                            for s in self.servers],
                "skipped": [s.to_dict() for s in self.skipped]}


def describe(spec: SpeculativeConfig | None) -> str:
    if spec is None:
        return "baseline (no speculation)"
    if not spec.is_set:
        return f"{spec.algorithm} (engine's default steps/topk/draft tokens)"
    return f"{spec.algorithm} {spec.num_steps}/{spec.eagle_topk}/{spec.num_draft_tokens}"


def engine_problem(cfg: LifecycleConfig, spec: SpeculativeConfig, draft_path: str,
                   forced_accept_length: float | None = None) -> str | None:
    """Why the configured engine cannot run `spec` (with acceptance forced at that length), or
    None. Rules beyond SGLang's own (which SpeculativeConfig enforced already)."""
    engine = make_engine(cfg.serve.engine)
    if (problem := engine.speculative_problem(spec)) is not None:
        return problem
    try:  # a dry build of the command line: the engine's own refusals (vLLM has no topk > 1)
        engine.build_launch(server_config(cfg, ServerPlan(server_key(spec), spec, draft_path=draft_path)),
                                         draft_path, forced_accept_length=forced_accept_length)
    except ServerConfigError as err:
        return err.message
    return None


def forced_key(spec: SpeculativeConfig, accept_length: float) -> str:
    """eagle3-s3-k1-d4-forced2.5: a point of the accept-length curve."""
    return f"{server_key(spec)}-forced{accept_length:g}"


def plan_sweep(cfg: LifecycleConfig, drafters: Mapping[str, str]) -> SweepPlan:
    """The baseline plus every runnable, distinct `bench.speculative` setting, once per drafter.

    `drafters`: role -> drafter directory; `{"": path}` for a sweep of one drafter, `{"challenger":
    ..., "champion": ...}` for a head-to-head (keys `challenger-eagle3-s3-k1-d4`, ...), `{}` for none."""
    servers = [ServerPlan(BASELINE, None)]
    skipped: list[Skipped] = []
    seen: dict[str, int] = {}
    for i, spec in enumerate(cfg.bench.speculative):
        key, label = server_key(spec), f"bench.speculative.{i} ({describe(spec)})"
        if key in seen:
            skipped.append(Skipped(label, f"duplicate of bench.speculative.{seen[key]}: one server serves both"))
            continue
        if not drafters:
            skipped.append(Skipped(label, "no drafter (no export and no serve.draft_path)"))
            continue
        problem = engine_problem(cfg, spec, next(iter(drafters.values())))
        if problem is not None:
            skipped.append(Skipped(label, f"not valid for engine {cfg.serve.engine!r}: {problem}"))
            continue
        seen[key] = i
        servers += [ServerPlan(f"{role}-{key}" if role else key, spec, role, path) for role, path in drafters.items()]
    # the accept-length curve: each setting served with acceptance forced (one drafter is enough:
    # a forced cycle's cost does not depend on how good the drafter is)
    runnable = [s.speculative for s in servers[1:] if s.drafter in ("", next(iter(drafters), ""))]
    for spec in runnable:
        for a in cfg.bench.accept_curve:
            label = f"bench.accept_curve {a:g} at {describe(spec)}"
            problem = engine_problem(cfg, spec, next(iter(drafters.values())), a)
            if problem is not None:
                skipped.append(Skipped(label, problem))
                continue
            servers.append(ServerPlan(forced_key(spec, a), spec, draft_path=next(iter(drafters.values())),
                                      forced_accept_length=a))
    return SweepPlan(engine=cfg.serve.engine, servers=servers, batch_sizes=list(cfg.bench.batch_sizes),
                     rounds=cfg.bench.repeats, interleave=resolve_interleave(cfg), skipped=skipped)


def server_config(cfg: LifecycleConfig, server: ServerPlan, port: int | None = None) -> LifecycleConfig:
    """The configuration one server of the sweep is launched with: `serve.speculative` and
    `serve.draft_path` set for a speculative server (cleared for the baseline), on `port`.

    The engine adds what else it needs (`Engine.bench_serve_update`): engine `command` has no
    placeholder for the speculative settings, so SGLang's speculative flags (`--speculative-algorithm
    ... --speculative-num-steps ...`, as the reference engine takes them) are appended to
    `serve.command`, and the command must accept them."""
    s = cfg.serve if port is None else cfg.serve.on_port(port)
    draft_path = None if server.is_baseline else server.draft_path
    update: dict = {"speculative": server.speculative, "draft_path": draft_path}
    if not server.is_baseline:
        update.update(make_engine(s.engine).bench_serve_update(s, server.speculative, draft_path))
    return cfg.model_copy(update={"serve": s.model_copy(update=update)})
