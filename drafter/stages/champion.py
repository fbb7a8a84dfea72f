"""The `champion` stage: this run's export (the challenger) against the registry's champion.

Upstream: {"export": fp, "prepare": fp} (+ "bench": fp with `retrain.bench`). The champion is
the one the challenger faces (Registry.opponent: the current champion, or the one the challenger
replaced when it already is the champion, so a re-run skips). Both drafters are judged offline on the same held-out
prompts of this run's corpus (the eval split, `export.eval_prompts`, `export.judge_num_steps`,
`export.judge_max_new_tokens`, greedy), in this run; the verdict (drafter.retrain.verdict.compare) promotes
the challenger only when it is better by `retrain.min_improvement` with the interval of the
difference above zero. Without a champion the challenger is promoted: it passed the export gate
(the export stage commits only a drafter whose judgement passed). A challenger that already is the
champion leaves everything unchanged.

Output (`champion/<fingerprint>/`): `decision.json` (the verdict and its figures),
`judge-champion.json` / `judge-challenger.json` (the two judgements, per prompt) and
`accept-length.png` (accept length across every retrain of this drafter). It prints the speedup
each offline accept length predicts, from the newest accept-length curve the bench stored for this
engine and target (drafter.bench.forecast), or that there is none yet. The registry
(drafter.retrain.registry) is updated BEFORE the commit: a crash in between re-runs as "unchanged".
The fingerprint names the pair (challenger, the champion it faces) and the bench, so a re-run of
the same retrain skips, and so does one after a rollback (the rolled-back challenger is not
promoted again by re-running; the summary reads the registry's champion now).
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from drafter.bench.forecast import predicted_speedup_lines
from drafter.config import LifecycleConfig, fingerprint_fields
from drafter.formats import BENCH, BENCH_REPORT, EXPORT, PREPARE, download_export
from drafter.formats import CHAMPION as STAGE
from drafter.formats import CHAMPION_DECISION as DECISION
from drafter.formats import CHAMPION_PLOT as PLOT
from drafter.retrain.registry import Registry
from drafter.retrain.verdict import bench_verdict, compare, plot_decisions
from drafter.stages.verdicts import champion_verdict as verdict  # noqa: F401  (the gate's verdict, published by the task)
from drafter.stage_output import Progress, StageOutput, guarded_progress
from drafter.stage_output import fingerprint as stage_fingerprint
from drafter.stages.base import Built, StageContext, Summary
from drafter.stages.drafters import Drafters, resolve_drafter
from drafter.store import ObjectStore
from drafter.target_identity import target_identity

JUDGE_FIELDS = ("eval_prompts", "judge_num_steps", "judge_max_new_tokens", "judge_bucket_edges")


def needs(cfg: LifecycleConfig) -> tuple[str, ...]:
    """With `retrain.bench` the head-to-head bench is read before the verdict."""
    return (EXPORT, PREPARE, BENCH) if cfg.retrain.bench else (EXPORT, PREPARE)


@dataclass(frozen=True)
class Inputs:
    ctx: StageContext
    registry: Registry
    drafters: Drafters  # the challenger and the champion it faces (Registry.opponent)


def inputs(ctx: StageContext) -> Inputs:
    drafters = resolve_drafter(ctx.cfg, ctx.store, ctx.upstream, source=None, source_field="retrain",
                               head_to_head=True)
    return Inputs(ctx, Registry.for_config(ctx.cfg, ctx.store), drafters)


def fingerprint(inputs: Inputs) -> str:
    """The retrain section, the judge settings, the target, the registry entry and its champion
    now, the challenger export and the corpus whose held-out prompts judge them."""
    cfg, upstream, registry = inputs.ctx.cfg, inputs.ctx.upstream, inputs.registry
    config = {"retrain": fingerprint_fields(cfg.retrain), "judge": {k: getattr(cfg.export, k) for k in JUDGE_FIELDS},
              "target": target_identity(cfg.target), "target_dtype": cfg.target.dtype,
              "registry": [registry.target, registry.name], "champion": inputs.drafters.exports.get("champion")}
    return stage_fingerprint(STAGE, config, [upstream[k] for k in (EXPORT, PREPARE, BENCH) if k in upstream])


def build(inputs: Inputs, out: StageOutput) -> Built:
    """Judge both, decide, update the registry, then hand the decision to be committed."""
    ctx = inputs.ctx
    cfg, store, upstream, progress, say, registry = ctx.cfg, ctx.store, ctx.upstream, ctx.progress, ctx.say, inputs.registry
    challenger = upstream[EXPORT]
    challenger_judge = registry.check_export(challenger).manifest.meta["judge"]
    champion = inputs.drafters.exports.get("champion")
    bench = bench_figures(store, upstream[BENCH], challenger, champion) if BENCH in upstream else None
    reports: dict[str, dict] = {}
    if registry.champion_export() == challenger:  # promoted by hand, or a crash after the registry update
        decision = {"verdict": "unchanged", "champion_accept_length": challenger_judge["accept_length"],
                    "challenger_accept_length": challenger_judge["accept_length"],
                    "reason": f"export {challenger} already is the champion"}
    elif champion is None:
        al = challenger_judge["accept_length"]
        decision = {"verdict": "promoted", "champion_accept_length": None, "challenger_accept_length": al,
                    "reason": f"first drafter {registry.name!r} for this target: no champion yet; it passed the "
                              f"export gate (offline accept length {al:.3f} on {challenger_judge['prompts']} "
                              f"held-out prompts)"}
    else:
        reports = _judge_both(cfg, store, upstream[PREPARE], {"champion": champion, "challenger": challenger},
                              guarded_progress(progress, STAGE), say)
        r = cfg.retrain
        judged = compare(reports["champion"], reports["challenger"], min_improvement=r.min_improvement,
                         confidence=r.confidence, samples=r.bootstrap_samples, seed=r.seed)
        decision = {**judged, "verdict": "promoted" if judged.pop("promoted") else "rejected"}
    if bench is not None:
        decision["bench"] = bench
        if decision["verdict"] == "promoted" and bench["problems"]:
            decision.update(verdict="rejected", reason=decision["reason"] + "; but the bench: " +
                            "; ".join(bench["problems"]))
    decision.update(challenger=challenger, champion=champion, drafter=registry.name, target=registry.target,
                    registry=registry.uri, corpus=upstream[PREPARE])
    for line in _predictions(cfg, store, decision):
        say(f"champion: {line}")
    say(f"champion: {decision['verdict']}: {decision['reason']}")
    if decision["verdict"] == "promoted":
        registry.promote(challenger, decision["reason"], _figures(decision), decision=_figures(decision))
    elif decision["verdict"] == "rejected":
        registry.record_decision(_figures(decision))
    decision["champion_after"] = registry.champion_export()
    for who, report in reports.items():
        out.write_shard(f"judge-{who}.json", json.dumps(report, indent=1) + "\n")
    out.write_shard(PLOT, plot_decisions(registry.decisions()))
    out.write_shard(DECISION, json.dumps(decision, indent=1) + "\n")
    return Built(decision)


def bench_figures(store: ObjectStore, bench_fp: str, challenger: str, champion: str | None) -> dict:
    """The head-to-head bench (upstream with `retrain.bench`): its figures and vetoes, and where its report is."""
    out = StageOutput.committed(store, BENCH, bench_fp)
    report = json.loads(out.read_shard(BENCH_REPORT))
    return {**bench_verdict(report, challenger, champion), "fingerprint": bench_fp,
            "report": store.uri(out.key("report.md"))}


def _predictions(cfg: LifecycleConfig, store: ObjectStore, decision: dict) -> list[str]:
    """The speedup each drafter's offline accept length predicts (judged at export.judge_num_steps;
    "unchanged" judged no champion: its figure is the challenger's)."""
    who = ("challenger",) if decision["verdict"] == "unchanged" else ("challenger", "champion")
    return [line for w in who if decision.get(f"{w}_accept_length") is not None
            for line in predicted_speedup_lines(cfg, store, decision[f"{w}_accept_length"],
                                                cfg.export.judge_num_steps, w)]


def _figures(decision: dict) -> dict:
    """What the registry and the events carry: the verdict and its numbers."""
    keys = ("verdict", "reason", "challenger", "champion", "champion_accept_length", "challenger_accept_length",
            "difference", "relative", "interval", "confidence", "prompts", "min_improvement", "corpus", "bench")
    return {k: decision[k] for k in keys if k in decision}


def _judge_both(cfg: LifecycleConfig, store: ObjectStore, prepare_fp: str, exports: dict[str, str],
                progress: Progress | None, say) -> dict[str, dict]:
    """Each export's SGLang files judged on the same prompts with the same target and settings."""
    from drafter.export.judge import held_out_judging, judge_as_configured

    target, prompts, _, _ = held_out_judging(cfg, store, prepare_fp)
    reports = {}
    with tempfile.TemporaryDirectory(prefix="drafter-champion-") as work:
        for k, (who, export_fp) in enumerate(exports.items()):
            sglang_dir = download_export(store, export_fp, Path(work) / who, "sglang")
            report = judge_as_configured(cfg.export, sglang_dir, target, prompts,
                                         on_prompt=(lambda done, total, k=k: progress(k * total + done, 2 * total,
                                                                                      "prompts judged"))
                                         if progress else None)
            reports[who] = {**report, "export": export_fp}
            say(f"champion: {who} {export_fp}: offline accept length {report['accept_length']:.3f}")
    return reports


def summarize(inputs: Inputs, out: StageOutput) -> Summary:
    d = out.manifest.meta
    registry = inputs.registry
    fmt = lambda v, f="{:.3f}": f.format(v) if isinstance(v, (int, float)) else "-"
    now = registry.champion_export()  # the registry's word now (a rollback may have followed the verdict)
    summary = [f"{d['verdict']}: {d['reason']}",
               f"champion now: export {now} (registry {d['registry']})"
               + ("" if now == d["champion_after"] else f"; after this verdict it was {d['champion_after']}")]
    table = [{"figure": "export", "champion": d.get("champion") or "-", "challenger": d["challenger"]},
             {"figure": "offline accept length", "champion": fmt(d.get("champion_accept_length")),
              "challenger": fmt(d.get("challenger_accept_length"))}]
    bench = d.get("bench")
    for row in (bench or {}).get("rows", []):
        at = f"bench {row['setting']} @ batch {row['batch_size']}"
        table.append({"figure": f"{at}: speedup vs baseline", "champion": fmt(row.get("champion_speedup"), "{:.2f}x"),
                      "challenger": fmt(row.get("challenger_speedup"), "{:.2f}x")})
        table.append({"figure": f"{at}: accept length (server)", "champion": fmt(row.get("champion_accept_length")),
                      "challenger": fmt(row.get("challenger_accept_length"))})
        if row.get("interval"):
            lo, hi = row["interval"]
            table.append({"figure": f"{at}: challenger / champion throughput", "champion": "",
                          "challenger": f"{row['challenger_over_champion']:.2f}x [{fmt(lo, '{:.2f}')}, "
                                        f"{fmt(hi, '{:.2f}')}] ({row['verdict']})"})
    summary += _predictions(inputs.ctx.cfg, inputs.ctx.store, d)
    if bench:
        summary.append(f"bench: {bench['report']}")
        summary += [f"bench note: {n}" for n in bench["notes"]]
    table += [{"figure": "verdict", "champion": "kept" if d["verdict"] != "promoted" else "replaced",
               "challenger": d["verdict"]},
              {"figure": "why", "champion": "", "challenger": d["reason"]}]
    return Summary(summary, table)
