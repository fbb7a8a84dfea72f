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

With `bench.accept_curve`, every setting is also served at those accept lengths with acceptance
forced, in the same sweep (drafter.bench.plan); their rows are kept out of the table and the
recommendation and make the accept-length curves (drafter.bench.predict), stored in report.json
and in the manifest meta (`accept_curve`: engine, target, curves) where the export and champion
stages find the newest one for their engine and target (drafter.formats.stored_accept_curves).

The report leads with the answer (faster or not, by how much, with the interval, on which engine:
the stage's headline), gives each setting's speedup with its accept length next to its break-even,
and, over several batch sizes, ends with the best setting per batch size as the engine's own
configuration (drafter.bench.answer, Engine.per_batch_size).

Output (`bench/<fingerprint>/`): one shard per measurement, launch and failure (see
drafter.bench.sweep), then `report.md`, `report.json` and `report.png`, committed last. Measurements
are not bitwise reproducible; the fingerprint names what the sweep IS (bench section, the serve
settings that change the server, target, drafter identities, prompts), so a re-run resumes it and a
changed sweep lands in a new output.
"""
from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass

from drafter.bench import BenchError
from drafter.bench.answer import answer, deploy, deploy_section, ordered, setting_lines, with_answer
from drafter.bench.plan import BASELINE, SweepPlan, plan_sweep
from drafter.bench.predict import build_curves, fmt_speedup
from drafter.bench.prompts import build_prompts
from drafter.bench.report import (
    accept_by_context_position, context_lines, head_to_head_rows, markdown, plot_png, table_rows)
from drafter.bench.stats import head_to_head
from drafter.bench.stats import summarize as summarize_measurements
from drafter.bench.sweep import FIXES, Sweep, failure_name, hardware
from drafter.config import LifecycleConfig, fingerprint_fields
from drafter.engine_registry import make_engine
from drafter.formats import EXPORT, PREPARE, load_prepared
from drafter.stages.verdicts import bench_verdict as verdict  # noqa: F401  (the gate's verdict, published by the task)
from drafter.stage_output import StageOutput
from drafter.stage_output import fingerprint as stage_fingerprint
from drafter.stages.base import Built, StageContext, Summary
from drafter.stages.drafters import Drafters, needs_export, resolve_drafter
from drafter.target_identity import target_identity

log = logging.getLogger(__name__)

STAGE = "bench"
REPORT_SHARDS = ("report.md", "report.json", "report.png")
# serve settings the bench sets per server itself, or that never change what a server does
_SERVE_NOT_IDENTITY = {"speculative", "draft_path"}


def needs(cfg: LifecycleConfig) -> tuple[str, ...]:
    """With `retrain.bench` a head-to-head of this run's export and the champion; otherwise this
    run's export unless the profile names a drafter directory (or `champion`)."""
    return (PREPARE, EXPORT) if needs_export(cfg, STAGE) else (PREPARE,)


@dataclass(frozen=True)
class Inputs:
    ctx: StageContext
    drafters: Drafters


def inputs(ctx: StageContext) -> Inputs:
    cfg = ctx.cfg
    if not cfg.bench.speculative:
        return Inputs(ctx, Drafters())  # a baseline-only sweep needs no drafter
    drafters = resolve_drafter(cfg, ctx.store, ctx.upstream, source=cfg.serve.draft_path,
                               source_field="serve.draft_path", head_to_head=cfg.retrain.bench)
    if drafters.identity is None:
        raise BenchError("bench.speculative is set but there is no drafter: no export upstream and no "
                         "serve.draft_path")
    return Inputs(ctx, drafters)


def fingerprint(inputs: Inputs) -> str:
    cfg = inputs.ctx.cfg
    serve = {k: v for k, v in fingerprint_fields(cfg.serve).items() if k not in _SERVE_NOT_IDENTITY}
    target = {"served_name": cfg.target.served_name, "dtype": cfg.target.dtype, **target_identity(cfg.target)}
    section = fingerprint_fields(cfg.bench)
    if not section["accept_curve"]:
        del section["accept_curve"]  # off: the same sweep as before the option existed, the same output
    return stage_fingerprint(STAGE, {"bench": section, "serve": serve, "target": target,
                                     "drafter": inputs.drafters.identity}, [inputs.ctx.upstream[PREPARE]])


def _settings(cfg: LifecycleConfig) -> dict:
    return cfg.bench.model_dump(mode="json")


def summarize(inputs: Inputs, out: StageOutput) -> Summary:
    report = json.loads(out.read_shard("report.json"))
    rows = ordered(report["table"])  # report.json's keys are sorted: the table's reading order again
    summary = setting_lines(report["summary"], report["plan"], report["failures"])
    summary += [f"batch {bs}: {rec['text']}" for bs, rec in report["summary"]["recommendation"].items()]
    summary += [f"challenger vs champion, {r['setting']} @ batch {r['batch']}: {r['challenger / champion tok/s [CI]']}, "
                f"{r['verdict']}" for r in head_to_head_rows(report.get("head_to_head") or [])]
    summary += curve_lines(report.get("accept_curves") or [])
    summary += context_lines(report.get("by_context") or [])
    summary += deploy_lines(report.get("deploy"))
    summary.append(f"report: {out.store.uri(out.key('report.md'))}")
    headline = answer(report["summary"], report["plan"], report["settings"]["confidence"])
    return Summary(summary, rows, headline=headline)


def deploy_lines(deployed: dict | None) -> list[str]:
    """The engine's configuration for the best setting per batch size (several batch sizes only)."""
    if not deployed:
        return []
    conf, engine = deployed["config"], deployed["engine"]
    if conf["one_server"] is not None:
        return [f"deploy: one {engine} server for every batch size: "
                + (shlex.join(conf["one_server"]) or "no speculative arguments")]
    return [f"deploy: batch {bs} on {engine}: " + (shlex.join(args) or "no speculative arguments (no speculation)")
            for bs, args in conf["per_batch"].items()]


def curve_lines(curves: list[dict]) -> list[str]:
    """Per curve: its points, and each drafter's measured speedup next to the predicted one."""
    lines = []
    for c in curves:
        points = ", ".join(f"{p['accept_length']:.2f} -> {fmt_speedup(p)}" for p in c["points"])
        lines.append(f"accept-length curve at {c['setting']} @ batch {c['batch_size']}: {points}")
        for m in c["measured"]:
            if m.get("predicted"):
                word = {True: "agree", False: "DISAGREE", None: "not compared"}[m["agree"]]
                lines.append(f"  {m['drafter'] or 'drafter'} at accept length {m['accept_length']:.2f}: measured "
                             f"{fmt_speedup(m)}, predicted {fmt_speedup(m['predicted'])}: {word}")
    return lines


def build(inputs: Inputs, out: StageOutput) -> Built:
    """The sweep, its report and its verdicts. The context's option `session_options`: extra
    ServerSession arguments (tests: shorter poll intervals)."""
    ctx = inputs.ctx
    cfg, store, upstream, progress, on_line = ctx.cfg, ctx.store, ctx.upstream, ctx.progress, ctx.on_line
    session_options = ctx.options.get("session_options")
    conversations = load_prepared(store, upstream[PREPARE], "eval")[:cfg.bench.num_prompts]
    built = build_prompts(cfg, conversations)
    prompts = built.prompts
    if not prompts:
        raise BenchError(f"the prepared eval split {upstream[PREPARE]} has no conversation with a user turn")
    if built.dropped:
        log.warning("bench: %d of %d held-out prompts dropped: prompt tokens + bench.max_tokens %d exceed the "
                    "target's context %d", built.dropped, len(conversations), cfg.bench.max_tokens, built.context)
    identity = inputs.drafters.identity
    drafters = inputs.drafters.local_paths(cfg, store)
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
                         + f"; {FIXES['port_taken']}. Finished measurements stay committed in {out.uri}",
                         retryable=True)
    servers = [(s.key, s.label) for s in plan.servers if s.forced_accept_length is None]
    forced = [(s.key, s.label) for s in plan.servers if s.forced_accept_length is not None]
    b = cfg.bench
    summary = summarize_measurements(outcome.measurements, servers, plan.batch_sizes, confidence=b.confidence,
                        samples=b.bootstrap_samples, seed=b.seed, drift_tolerance=b.drift_tolerance)
    # the forced servers against the same baseline rounds; never in the table or the recommendation
    curves = build_curves(summarize_measurements(outcome.measurements, forced, plan.batch_sizes,
                                                 confidence=b.confidence, samples=b.bootstrap_samples, seed=b.seed,
                                                 drift_tolerance=b.drift_tolerance)["rows"],
                          summary["rows"], plan.curve_servers()) if forced else []
    rows = ordered(table_rows(summary, outcome.failures))
    versus = head_to_head(outcome.measurements, plan.head_to_head_pairs(), plan.batch_sizes, confidence=b.confidence,
                          samples=b.bootstrap_samples, seed=b.seed)
    hw = hardware()
    notes = [f"prompts: {len(prompts)} ({built.format})"
             + (f"; {built.dropped} of the first {len(conversations)} dropped: prompt tokens + bench.max_tokens "
                f"{b.max_tokens} > the target's context {built.context}" if built.dropped else "")]
    notes += [f"{f['config']} failed in an earlier run ({f['kind']}): re-checked, measured in this one"
              for f in outcome.cleared.values()]
    engine = make_engine(cfg.serve.engine)
    if not engine.streams:
        notes.append(engine.not_streaming_note)
    plan_d = plan.to_dict()
    deployed = deploy(summary, plan) if len(plan.batch_sizes) > 1 else None
    # the export judge's buckets, each request at its context (engines with per-request counters only)
    by_context = accept_by_context_position(outcome.measurements, cfg.serve.engine, built.context,
                                            cfg.export.context_bucket_edges)
    md = markdown(summary, rows, plan=plan_d, failures=outcome.failures, launches=outcome.launches,
                  hardware=hw, settings=_settings(cfg), notes=notes, head_to_head=versus, accept_curves=curves,
                  by_context=by_context)
    md = with_answer(md, answer(summary, plan_d, b.confidence), setting_lines(summary, plan_d, outcome.failures),
                     deploy_section(deployed["choices"], plan.engine, deployed["config"]) if deployed else ())
    report = {"summary": summary, "table": rows, "plan": plan_d, "failures": outcome.failures, "deploy": deployed,
              "launches": outcome.launches, "hardware": hw, "settings": _settings(cfg), "notes": notes,
              "drafters": identity, "drafter_paths": drafters, "head_to_head": versus, "accept_curves": curves,
              "by_context": by_context,
              "measurements": len(outcome.measurements),
              "prompts": {"used": len(prompts), "dropped_too_long": built.dropped, "context": built.context}}
    out.write_shard("report.json", json.dumps(report, indent=1, sort_keys=True, default=str))
    out.write_shard("report.md", md)
    out.write_shard("report.png", plot_png(summary, f"bench {out.fingerprint}", accept_curves=curves))
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
    if curves:  # what later stages and runs look up (drafter.formats.stored_accept_curves)
        meta["accept_curve"] = {"engine": cfg.serve.engine, "target": target_identity(cfg.target),
                                "max_tokens": b.max_tokens, "curves": curves}
    return Built(meta)
