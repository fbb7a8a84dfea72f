"""The `bench` stage: baseline vs every `bench.speculative` setting x `bench.batch_sizes`, measured
in interleaved rounds on servers started through ServerSession, reported with intervals.

Upstream: `prepare` (the held-out eval split: the first `bench.num_prompts` conversations' first
user turn, through the target's chat template when it has one, less those that leave no room for
`bench.max_tokens` in the target's context: counted in the report, refused when none is left)
and `export` (its SGLang-format drafter, shards `sglang/config.json` + `sglang/model.safetensors`,
downloaded into a directory named after the export fingerprint) unless `serve.draft_path` names a
drafter directory.

With `retrain.bench` the sweep is a head-to-head: every setting is served twice, with this run's
export (the challenger) and with the registry's champion it faces (Registry.opponent), and the
report adds challenger / champion throughput over paired rounds (`head_to_head`), which the
`champion` stage reads before its verdict. Without a champion yet, only the challenger is benched.

Output (`bench/<fingerprint>/`): one shard per measurement, launch and failure (see
drafter.bench.sweep), then `report.md`, `report.json` and `report.png`, committed last. Measurements
are not bitwise reproducible; the fingerprint names what the sweep IS (bench section, the serve
settings that change the server, target, drafter identities, prompts), so a re-run resumes it and a
changed sweep lands in a new output.
"""
from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from drafter.bench import BenchError
from drafter.bench.plan import BASELINE, SweepPlan, plan_sweep
from drafter.bench.report import head_to_head_rows, markdown, plot_png, table_rows
from drafter.bench.stats import head_to_head, summarize
from drafter.bench.sweep import FIXES, Sweep, failure_name, hardware
from drafter.config import LifecycleConfig, fingerprint_fields
from drafter.formats import EXPORT, PREPARE, load_prepared
from drafter.retrain.registry import CHAMPION, Registry
from drafter.stages import serve as serve_stage
from drafter.stage_output import Progress, StageOutput, StageResult
from drafter.stage_output import fingerprint as stage_fingerprint
from drafter.store import ObjectStore, open_store
from drafter.target_identity import target_fingerprint, target_identity

log = logging.getLogger(__name__)

STAGE = "bench"
REPORT_SHARDS = ("report.md", "report.json", "report.png")
# serve settings the bench sets per server itself, or that never change what a server does
_SERVE_NOT_IDENTITY = {"speculative", "draft_path"}


def head_to_head_exports(cfg: LifecycleConfig, upstream: Mapping[str, str]) -> dict[str, str]:
    """`retrain.bench`: the challenger (this run's export) and the champion it faces
    (Registry.opponent, the same one the champion stage judges it against), when there is one."""
    challenger = upstream.get(EXPORT)
    if not challenger:
        raise BenchError("retrain.bench benches this run's export against the champion: no export upstream")
    opponent = Registry.for_config(cfg, open_store(cfg.storage)).opponent(challenger)
    return {"challenger": challenger, **({"champion": opponent} if opponent else {})}


def _drafter_identity(cfg: LifecycleConfig, upstream: Mapping[str, str]) -> dict | None:
    if not cfg.bench.speculative:
        return None  # a baseline-only sweep needs no drafter
    if cfg.retrain.bench:
        return head_to_head_exports(cfg, upstream)
    if cfg.serve.draft_path == CHAMPION:  # the export that is champion now
        return {"export": Registry.for_config(cfg, open_store(cfg.storage)).require_champion()}
    if cfg.serve.draft_path:
        try:
            return {"draft_dir": target_fingerprint(cfg.serve.draft_path)}
        except FileNotFoundError as err:
            raise BenchError(f"serve.draft_path: {err}") from None
    fp = upstream.get(EXPORT)
    if not fp:
        raise BenchError("bench.speculative is set but there is no drafter: no export upstream and no "
                         "serve.draft_path")
    return {"export": fp}


def fingerprint(cfg: LifecycleConfig, upstream: Mapping[str, str]) -> str:
    serve = {k: v for k, v in fingerprint_fields(cfg.serve).items() if k not in _SERVE_NOT_IDENTITY}
    target = {"served_name": cfg.target.served_name, "dtype": cfg.target.dtype, **target_identity(cfg.target)}
    return stage_fingerprint(STAGE, {"bench": fingerprint_fields(cfg.bench), "serve": serve, "target": target,
                                     "drafter": _drafter_identity(cfg, upstream)}, [upstream[PREPARE]])


def output(cfg: LifecycleConfig, store: ObjectStore, upstream: Mapping[str, str]) -> StageOutput:
    return StageOutput(store, STAGE, fingerprint(cfg, upstream))


def drafter_paths(cfg: LifecycleConfig, store: ObjectStore, upstream: Mapping[str, str],
                  identity: dict | None) -> dict[str, str]:
    """The drafters the sweep's speculative servers load, by role: `{"": dir}` for one drafter,
    `{"challenger": dir, "champion": dir}` with `retrain.bench`, `{}` for a baseline-only sweep.
    `identity`: `_drafter_identity` (which names what is missing)."""
    if identity is None:
        return {}
    if cfg.retrain.bench:
        return {role: serve_stage.export_dir(cfg, store, fp) for role, fp in identity.items()}
    return {"": serve_stage.draft_path(cfg, store, upstream)}


def target_context(cfg: LifecycleConfig) -> int | None:
    """The target's context length: `max_position_embeddings` of its config.json (the text model's);
    None when there is no config.json here or it does not say."""
    if not (Path(cfg.target.path) / "config.json").is_file():
        return None
    from drafter.model import read_target_config

    return read_target_config(cfg.target.path).get("max_position_embeddings")


@dataclass(frozen=True)
class BenchPrompts:
    prompts: list
    format: str
    dropped: int = 0              # too long for the target's context with bench.max_tokens new tokens
    context: int | None = None    # the target's context length; None: not checked


def _tokenizer(cfg: LifecycleConfig):
    path = Path(cfg.target.path)
    if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.target.trust_remote_code)
    return None


def build_prompts(cfg: LifecycleConfig, conversations: list[dict]) -> BenchPrompts:
    """Token ids through the target's chat template when it has one (what a chat request sends),
    without the prompts that leave no room for `bench.max_tokens` new tokens in the target's context
    (every configuration would fail on them); the rule and the rendering are the export judge's
    (`prompts_from_conversations`). Else the first user turn's text, unchecked (the server
    tokenizes it)."""
    tok = _tokenizer(cfg)
    if tok is not None and tok.chat_template:
        from drafter.export.judge import prompts_from_conversations

        context = target_context(cfg)
        room = context - cfg.bench.max_tokens if context is not None else sys.maxsize
        prompts, skipped = prompts_from_conversations(tok, conversations, len(conversations), room)
        if not prompts and skipped["too_long"]:
            every, _ = prompts_from_conversations(tok, conversations, len(conversations), sys.maxsize)
            shortest = min(len(p) for p in every)
            raise BenchError(
                f"no held-out prompt fits the target's context: all {skipped['too_long']} need more than "
                f"max_position_embeddings {context} ({cfg.target.path}/config.json) with bench.max_tokens "
                f"{cfg.bench.max_tokens} new tokens (the shortest has {shortest} tokens); set bench.max_tokens "
                f"to at most {context - shortest}, or bench on prompts that fit")
        return BenchPrompts(prompts, "chat template token ids", skipped["too_long"], context)
    firsts = []
    for conv in conversations:
        msgs = conv["messages"]
        upto = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        if upto is not None:
            firsts.append(msgs[:upto + 1])
    return BenchPrompts([m[-1]["content"] for m in firsts],
                        "first user turn, raw text (the target has no chat template)")


def _settings(cfg: LifecycleConfig) -> dict:
    return cfg.bench.model_dump(mode="json")


def _result(out: StageOutput, report: dict, skipped: bool) -> StageResult:
    rows = report["table"]
    summary = [f"{r['config']} @ batch {r['batch']}: {r['output tok/s']} tok/s, {r['speedup [CI]']}, "
               f"{r['verdict']}, accept {r['accept length']} (break-even {r['break-even accept']})" for r in rows]
    summary += [f"batch {bs}: {rec['text']}" for bs, rec in report["summary"]["recommendation"].items()]
    summary += [f"challenger vs champion, {r['setting']} @ batch {r['batch']}: {r['challenger / champion tok/s [CI]']}, "
                f"{r['verdict']}" for r in head_to_head_rows(report.get("head_to_head") or [])]
    summary.append(f"report: {out.store.uri(out.key('report.md'))}")
    return StageResult.committed(out.manifest, out.uri, skipped=skipped, summary=summary, table=rows)


def run(cfg: LifecycleConfig, store: ObjectStore, *, upstream: Mapping[str, str],
        progress: Progress | None = None, on_line=None, session_options: dict | None = None) -> StageResult:
    """`session_options`: extra ServerSession arguments (tests: shorter poll intervals)."""
    out = output(cfg, store, upstream)
    if out.is_complete():
        return _result(out, json.loads(out.read_shard("report.json")), skipped=True)
    conversations = load_prepared(store, upstream[PREPARE], "eval")[:cfg.bench.num_prompts]
    built = build_prompts(cfg, conversations)
    prompts = built.prompts
    if not prompts:
        raise BenchError(f"the prepared eval split {upstream[PREPARE]} has no conversation with a user turn")
    if built.dropped:
        log.warning("bench: %d of %d held-out prompts dropped: prompt tokens + bench.max_tokens %d exceed the "
                    "target's context %d", built.dropped, len(conversations), cfg.bench.max_tokens, built.context)
    identity = _drafter_identity(cfg, upstream)
    drafters = drafter_paths(cfg, store, upstream, identity)
    plan: SweepPlan = plan_sweep(cfg, drafters)
    log.info("bench: %d server configurations (%s), batch sizes %s, %d rounds, interleave %s; %d skipped",
             len(plan.servers), ", ".join(s.label for s in plan.servers), plan.batch_sizes, plan.rounds,
             plan.interleave, len(plan.skipped))
    sweep = Sweep(cfg, out, plan, prompts, on_line=on_line, progress=progress, session_options=session_options)
    sweep.run()
    outcome = sweep.outcome()
    if BASELINE in outcome.failures:
        f = outcome.failures[BASELINE]
        raise BenchError(f"the baseline server failed ({f['kind']}): {f['message'].splitlines()[0]}; nothing can be "
                         f"compared: {f['fix']}. Finished measurements stay committed in {out.uri}; the failure "
                         f"and its evidence: {out.store.uri(out.key(failure_name(BASELINE)))}",
                         retryable=f["retryable"])
    held = [f for f in outcome.failures.values() if f["kind"] == "port_taken"]
    if held:
        # another process's port says nothing about the configuration: no report without it
        raise BenchError("port taken: " + "; ".join(f"{f['config']}: {f['message'].splitlines()[0]}" for f in held)
                         + f"; {FIXES['port_taken'][1]}. Finished measurements stay committed in {out.uri}",
                         retryable=True)
    servers = [(s.key, s.label) for s in plan.servers]
    b = cfg.bench
    summary = summarize(outcome.measurements, servers, plan.batch_sizes, confidence=b.confidence,
                        samples=b.bootstrap_samples, seed=b.seed, drift_tolerance=b.drift_tolerance)
    rows = table_rows(summary, outcome.failures)
    versus = head_to_head(outcome.measurements, plan.head_to_head_pairs(), plan.batch_sizes, confidence=b.confidence,
                          samples=b.bootstrap_samples, seed=b.seed)
    hw = hardware()
    notes = [f"prompts: {len(prompts)} ({built.format})"
             + (f"; {built.dropped} of the first {len(conversations)} dropped: prompt tokens + bench.max_tokens "
                f"{b.max_tokens} > the target's context {built.context}" if built.dropped else "")]
    notes += [f"{f['config']} failed in an earlier run ({f['kind']}): re-checked, measured in this one"
              for f in outcome.cleared.values()]
    if cfg.serve.engine == "reference":
        notes.append("the reference engine does not stream: TTFT and inter-token latency are not measured")
    if cfg.serve.engine == "command":
        notes.append("engine command: TTFT and inter-token latency are not measured (no known streaming API)")
    plan_d = plan.to_dict()
    md = markdown(summary, rows, plan=plan_d, failures=outcome.failures, launches=outcome.launches,
                  hardware=hw, settings=_settings(cfg), notes=notes, head_to_head=versus)
    report = {"summary": summary, "table": rows, "plan": plan_d, "failures": outcome.failures,
              "launches": outcome.launches, "hardware": hw, "settings": _settings(cfg), "notes": notes,
              "drafters": identity, "drafter_paths": drafters, "head_to_head": versus,
              "measurements": len(outcome.measurements),
              "prompts": {"used": len(prompts), "dropped_too_long": built.dropped, "context": built.context}}
    out.write_shard("report.json", json.dumps(report, indent=1, sort_keys=True, default=str))
    out.write_shard("report.md", md)
    out.write_shard("report.png", plot_png(summary, f"bench {out.fingerprint}"))
    verdicts = {f"{r['key']}@{r['batch_size']}": (r.get("speedup") or {}).get("verdict")
                for r in summary["rows"] if r["key"] != BASELINE}
    meta = {"engine": cfg.serve.engine, "interleave": plan.interleave, "rounds": plan.rounds,
            "batch_sizes": plan.batch_sizes, "configs": [s.label for s in plan.servers],
            "skipped": [s.to_dict() for s in plan.skipped],
            "failed": {k: f["kind"] for k, f in outcome.failures.items()},
            "measurements": len(outcome.measurements), "launches": len(outcome.launches),
            "verdicts": verdicts, "recommendation": {str(k): v for k, v in summary["recommendation"].items()},
            "drift_unstable": {str(k): d["unstable"] for k, d in summary["drift"].items()},
            "engine_versions": sorted({str(x.get("engine_version")) for x in outcome.launches}),
            "hardware": hw, "prompts": len(prompts), "prompts_dropped": built.dropped, "report": "report.md"}
    out.commit(meta=meta)
    return _result(out, report, skipped=False)
