"""The `export` stage: the train stage's drafter -> SGLang and vLLM (speculators) formats, judged
offline before anything is committed.

Upstream: {"train": fp, "prepare": fp}. `prepare` (the held-out prompts) may be left out: it is
then found through the chain train -> dump -> (datagen ->) prepare; given, it must agree with it.

Output (`export/<fingerprint>/`):
    sglang/config.json, sglang/model.safetensors   LlamaForCausalLMEagle3, target embedding included
    vllm/config.json,   vllm/model.safetensors     speculators eagle3 (with export.formats: vllm)
    export.json                                     the export manifest (drafter.export.manifest)
    judge.json                                      the offline judgement and its verdict; with
                                                    export.vllm_judge also real vLLM's (`vllm`, `agreement`)
Manifest meta: {"export": <export.json>, "judge": <judge.json>}.

After the offline judgement (and in the summary) the stage prints the speedup that accept length
predicts, from the newest accept-length curve the bench stored for this engine and target
(drafter.bench.forecast), or that there is none yet.

Refusals (ExportError and subclasses, never retried), each naming its cause: a drafter trained
for another target or on other layers; any key / shape / value of the files read back that differs
from what the engine loads or from the trained drafter; an offline accept length below
`export.min_accept_length` or below `export.min_accept_ratio` x training's prediction.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from drafter.bench.forecast import predicted_speedup_lines
from drafter.config import LifecycleConfig, fingerprint_fields
from drafter.contracts.context_curve import curve_lines, trained_by_context
from drafter.export.judge import check as judge_check
from drafter.export.manifest import EXPORT_FORMAT_VERSION, export_manifest
from drafter.export.sglang import ExportError, TargetInfo, check_sglang_export, require_good, write_sglang
from drafter.formats import DATAGEN, DUMP, PREPARE, TRAIN, download_trained_drafter
from drafter.layers import LAYER_ID_CONVENTION
from drafter.model import CONFIG_FILE, WEIGHTS_FILE
from drafter.stages.verdicts import export_verdict as verdict  # noqa: F401  (the gate's verdict, published by the task)
from drafter.stage_output import Progress, StageOutput, guarded_progress
from drafter.stage_output import fingerprint as stage_fingerprint
from drafter.stages.base import Built, StageContext, Summary
from drafter.store import ObjectStore
from drafter.target_identity import target_fingerprint, target_identity
from drafter.workdirs import scratch_dir

STAGE = "export"
SGLANG_DIR, VLLM_DIR = "sglang", "vllm"
EXPORT_JSON, JUDGE_JSON = "export.json", "judge.json"


def needs(cfg: LifecycleConfig) -> tuple[str, ...]:
    return (TRAIN, PREPARE)


@dataclass(frozen=True)
class Inputs:
    ctx: StageContext  # the trained drafter is read by `build` (a complete export skips without it)


def inputs(ctx: StageContext) -> Inputs:
    return Inputs(ctx)


def fingerprint(inputs: Inputs) -> str:
    """The export section's output fields, the target (content and local path: the vLLM config
    names it as its verifier; dtype: the judge runs in it), the aux layer ids and the trained
    drafter. The prepare output is implied by the train fingerprint (train -> dump -> prepare)."""
    cfg, upstream = inputs.ctx.cfg, inputs.ctx.upstream
    export = fingerprint_fields(cfg.export)
    if cfg.export.vllm_judge is not None:  # its port, timeouts, interpreter do not change the judgement
        export["vllm_judge"] = fingerprint_fields(cfg.export.vllm_judge)
    config = {"export": export, "target": target_identity(cfg.target),
              "target_path": str(Path(cfg.target.path).resolve()), "target_dtype": cfg.target.dtype,
              "aux_layer_ids": cfg.aux_layer_ids(), "layer_id_convention": LAYER_ID_CONVENTION,
              "export_format": EXPORT_FORMAT_VERSION}
    return stage_fingerprint(STAGE, config, [upstream[TRAIN]])


def _prepare_of_chain(store: ObjectStore, dump: StageOutput) -> str | None:
    up = dump.manifest.meta.get("upstream") or {}
    if up.get("stage") == PREPARE:
        return up.get("fingerprint")
    if up.get("stage") == DATAGEN and up.get("fingerprint"):
        return StageOutput.committed(store, DATAGEN, up["fingerprint"]).manifest.meta.get("prepare_fingerprint")
    return None


def _inputs(cfg: LifecycleConfig, store: ObjectStore, upstream: Mapping[str, str]) -> dict:
    """The committed train output, its dump and the prepare output, checked against this
    configuration's target and layer ids before any work."""
    train = StageOutput.committed(store, TRAIN, upstream[TRAIN])
    meta = train.manifest.meta
    dump_fp = meta.get("dump_fingerprint") or meta.get("train_dump")
    if not dump_fp:
        raise ExportError(f"train/{upstream[TRAIN]}: its manifest names no dump (dump_fingerprint)")
    dump = StageOutput.committed(store, DUMP, dump_fp)
    problems = []
    want_target = target_fingerprint(cfg.target.path, cfg.target.revision)
    got_target = dump.manifest.meta.get("target_fingerprint")
    if got_target != want_target:
        problems.append(f"the drafter was trained for another target: its hidden states ({DUMP}/{dump_fp}) come "
                        f"from target {got_target}, this configuration's target {cfg.target.path} is {want_target}")
    ours = cfg.aux_layer_ids()
    for who, ids in (("train manifest", meta.get("aux_layer_ids")), (f"{DUMP}/{dump_fp}", dump.manifest.meta.get("aux_layer_ids"))):
        if ids is not None and [int(i) for i in ids] != ours:
            problems.append(f"aux layer ids: {who} has {list(ids)}, this configuration {ours} ({LAYER_ID_CONVENTION})")
    conv = dump.manifest.meta.get("layer_id_convention")
    if conv not in (None, LAYER_ID_CONVENTION):
        problems.append(f"layer_id_convention: {DUMP}/{dump_fp} has {conv!r}, expected {LAYER_ID_CONVENTION!r}")
    chain = _prepare_of_chain(store, dump)
    given = upstream.get(PREPARE)
    if given and chain and given != chain:
        problems.append(f"upstream prepare {given} is not the corpus the dump {dump_fp} was made from ({chain})")
    if problems:
        raise ExportError(f"refusing to export train/{upstream[TRAIN]}:\n  " + "\n  ".join(problems))
    prepare_fp = given or chain
    if not prepare_fp:
        raise ExportError(f"no held-out prompts for the judgement: pass upstream 'prepare' (the dump {dump_fp} "
                          "does not name its corpus)")
    return {"train": train, "dump_fp": dump_fp, "prepare_fp": prepare_fp, "target_fp": want_target}


def build(inputs: Inputs, out: StageOutput) -> Built:
    """Export, check the files read back, judge them offline (the gate), then commit."""
    ctx = inputs.ctx
    cfg, store, upstream, fp, on_line = ctx.cfg, ctx.store, ctx.upstream, out.fingerprint, ctx.on_line
    progress = guarded_progress(ctx.progress, STAGE)
    say = ctx.say
    inputs = _inputs(cfg, store, upstream)
    train_meta = inputs["train"].manifest.meta
    ours = cfg.aux_layer_ids()
    target = TargetInfo.read(cfg.target.path)
    with scratch_dir(STAGE, fp) as work:  # a killed run's folder is removed by the next run
        from drafter.model import load_drafter

        source = load_drafter(download_trained_drafter(store, inputs["train"].manifest, work / "trained"))
        problems = []
        if source.config.vocab_size != target.vocab_size or source.config.target_hidden_size != target.hidden_size:
            problems.append(f"the drafter was trained for another target: vocab_size={source.config.vocab_size}, "
                            f"target_hidden_size={source.config.target_hidden_size}; target {cfg.target.path} has "
                            f"vocab_size={target.vocab_size}, hidden_size={target.hidden_size}")
        trained_ids = source.config.aux_layer_ids
        if trained_ids is not None and list(trained_ids) != ours:
            problems.append(f"the trained drafter's config has aux layer ids {trained_ids}, the configuration {ours}")
        require_good(problems, f"train/{upstream[TRAIN]}")
        sglang_dir, vllm_dir = work / SGLANG_DIR, work / VLLM_DIR
        ec = cfg.export
        sglang = write_sglang(source, target, sglang_dir, ours, ec.sglang_version)
        require_good(check_sglang_export(sglang_dir, source, target, ours, ec.sglang_version),
                     "SGLang export (read back)")
        say(f"export: SGLang files checked key by key (ids {sglang['eagle_aux_hidden_state_layer_ids']})")
        vllm = None
        if "vllm" in cfg.export.formats:
            from drafter.export.vllm import check_vllm_export, write_vllm

            vllm = write_vllm(sglang_dir, target, vllm_dir, ours, ec.vllm_speculative_tokens, ec.vllm_version)
            require_good(check_vllm_export(vllm_dir, sglang_dir, target, ours, ec.vllm_version),
                         "vLLM export (read back)")
            say(f"export: vLLM files checked (ids {vllm['eagle_aux_hidden_state_layer_ids']}: {vllm['rule']})")
        manifest = export_manifest(
            target=target, target_fingerprint=inputs["target_fp"], train_fingerprint=upstream[TRAIN],
            train_meta=train_meta, dump_fingerprint=inputs["dump_fp"], prepare_fingerprint=inputs["prepare_fp"],
            our_aux_ids=ours, sglang=sglang, vllm=vllm, d2t=source.d2t, vocab_size=target.vocab_size)
        judge, prompts = _judge(cfg, store, inputs["prepare_fp"], sglang_dir, train_meta, progress, say,
                                inputs["dump_fp"])
        for line in predicted_speedup_lines(cfg, store, judge["accept_length"], judge["num_steps"]):
            say(f"export: {line}")  # before any server runs this drafter (the vLLM judge's below)
        if ec.vllm_judge is not None:
            if vllm is None:
                raise ExportError("export.vllm_judge judges the vLLM export: add 'vllm' to export.formats")
            judge["vllm"], judge["agreement"] = _judge_vllm(cfg, vllm_dir, prompts, judge, progress, on_line, say)
        manifest["judge"] = {k: judge[k] for k in ("accept_length", "num_steps", "prompts")}
        if "vllm" in judge:
            manifest["judge"]["vllm_accept_length"] = judge["vllm"]["accept_length"]
        shards = [(f"{SGLANG_DIR}/{n}", sglang_dir / n) for n in (CONFIG_FILE, WEIGHTS_FILE)]
        if vllm is not None:
            shards += [(f"{VLLM_DIR}/{n}", vllm_dir / n) for n in (CONFIG_FILE, WEIGHTS_FILE)]
        for name, path in shards:
            out.write_shard(name, path)
        out.write_shard(EXPORT_JSON, json.dumps(manifest, indent=2) + "\n")
        out.write_shard(JUDGE_JSON, json.dumps(judge, indent=2) + "\n")
    return Built({"export": manifest, "judge": judge})


def training_lengths(store: ObjectStore, dump_fp: str, train_max_length: int) -> dict:
    """What the drafter trained on, by length: the train split's tokens per sample from the dump's
    shard markers (`sample_tokens`), and the longest sample the trainer can have seen (the dump's
    and train's max_length). Shards dumped before the lengths were recorded count as unrecorded."""
    dump = StageOutput.committed(store, DUMP, dump_fp)
    lengths, unrecorded = [], 0
    for shard in dump.manifest.shards:
        if shard.meta.get("split", "train") != "train":
            continue
        if "sample_tokens" in shard.meta:
            lengths += [int(n) for n in shard.meta["sample_tokens"]]
        else:
            unrecorded += int(shard.meta.get("samples", 0))
    longest = min(train_max_length, dump.manifest.meta.get("max_length") or train_max_length)
    return {"dump": dump_fp, "lengths": lengths, "unrecorded_samples": unrecorded, "max_trained_length": longest}


def add_training_lengths(report: dict, trained: dict) -> None:
    """Each context bucket of the judgement gets the training samples reaching it and ending in it."""
    report["training_lengths"] = {k: v for k, v in trained.items() if k != "lengths"}
    report["training_lengths"]["recorded_samples"] = len(trained["lengths"])
    if trained["lengths"]:
        for bucket, t in zip(report["by_context"], trained_by_context(trained["lengths"], report["by_context"],
                                                                      trained["max_trained_length"])):
            bucket.update(trained_samples_reaching=t["samples_reaching"], trained_samples_ending=t["samples_ending"])


def context_lines(judge: dict) -> list[str]:
    """The judgement's accept length by context position, the training samples beside each bucket."""
    curve, tl = judge.get("by_context"), judge.get("training_lengths") or {}
    if not curve:
        return []
    trained = ([{"samples_reaching": b["trained_samples_reaching"], "samples_ending": b["trained_samples_ending"]}
                for b in curve] if "trained_samples_reaching" in curve[0] else None)
    head = (f"accept length by context position (prompt + generated tokens where each draft block starts; "
            f"target context {judge.get('context_length')}):")
    if trained is None:
        head += (" no per-sample lengths in dump/" + str(tl.get("dump")) + " (dumped before they were recorded);"
                 f" no training sample is longer than {tl.get('max_trained_length')} tokens") if tl else ""
    elif tl.get("unrecorded_samples"):
        head += (f" training samples counted for {tl['recorded_samples']}, {tl['unrecorded_samples']} more dumped "
                 "before lengths were recorded")
    return [head, *("  " + line for line in curve_lines(
        curve, trained, untrained_from=tl.get("max_trained_length") if trained is None else None))]


def _judge(cfg: LifecycleConfig, store: ObjectStore, prepare_fp: str, sglang_dir: Path, train_meta: dict,
           progress: Progress | None, say, dump_fp: str | None = None) -> dict:
    from drafter.export.judge import check_last_bucket, held_out_judging, judge_as_configured

    ec = cfg.export
    target, prompts, skipped, conversations = held_out_judging(cfg, store, prepare_fp)
    if not prompts:
        raise ExportError(f"no held-out prompt to judge with: {PREPARE}/{prepare_fp} eval split has "
                          f"{conversations} conversations, skipped {skipped}")
    row = train_meta.get("final_eval") or train_meta.get("final_train") or {}
    report = judge_as_configured(ec, sglang_dir, target, prompts, prediction=row,
                                 on_prompt=(lambda done, total: progress(done, total, "prompts judged"))
                                 if progress else None)
    report["prediction_split"] = "eval" if train_meta.get("final_eval") else ("train" if row else None)
    report["train_max_length"] = cfg.train.max_length
    # Positions past the trained length are positions the drafter never learned (measured: 3 of the
    # demo's 16 prompts past 256 tokens cost a fifth of its offline accept length): say so.
    report["prompts_past_train_max_length"] = sum(len(p) + ec.judge_max_new_tokens > cfg.train.max_length
                                                  for p in prompts)
    report["skipped_prompts"] = skipped
    if dump_fp is not None:
        add_training_lengths(report, training_lengths(store, dump_fp, cfg.train.max_length))
    report["verdict"] = judge_check(report, ec.min_accept_length, ec.min_accept_ratio)
    say(f"export: offline accept length {report['accept_length']:.3f} "
        f"(predicted {(report.get('predicted') or {}).get('accept_length', float('nan')):.3f})")
    for line in context_lines(report):  # before the gate below, so a refusal shows its curve
        say(f"export: {line}")
    report["verdict"]["last_bucket"] = check_last_bucket(report, ec.min_last_bucket_accept_length,
                                                         ec.last_bucket_min_blocks)
    return report, prompts


def _judge_vllm(cfg: LifecycleConfig, vllm_dir: Path, prompts: list[list[int]], reference: dict,
                progress: Progress | None, on_line, say) -> tuple[dict, dict]:
    """The vLLM export served by real vLLM on the reference judge's prompts: its own verdict (the
    same thresholds) and its agreement with the reference judge."""
    from drafter.export.judge import JudgedTooLow
    from drafter.export.vllm_judge import agreement, judge_with_vllm

    ec = cfg.export
    say(f"export: judging the vLLM export with vLLM ({len(prompts)} prompts)")
    report = judge_with_vllm(cfg, vllm_dir, prompts, num_steps=ec.judge_num_steps,
                             max_new_tokens=ec.judge_max_new_tokens, on_line=on_line,
                             on_prompt=(lambda done, total: progress(done, total, "prompts judged by vLLM"))
                             if progress else None)
    if reference.get("predicted"):
        report["predicted"] = reference["predicted"]
    try:
        report["verdict"] = judge_check(report, ec.min_accept_length, ec.min_accept_ratio)
    except JudgedTooLow as err:
        raise JudgedTooLow(f"vLLM judge (vllm {report['engine_version']}): {err}") from None
    agree = agreement(reference, report, ec.judge_agreement_tolerance)
    say(f"export: vLLM accept length {report['accept_length']:.3f} (reference {reference['accept_length']:.3f}, "
        f"agree within {ec.judge_agreement_tolerance})")
    return report, agree


def summarize(inputs: Inputs, out: StageOutput) -> Summary:
    meta = out.manifest.meta
    judge, export = meta.get("judge") or {}, meta.get("export") or {}
    pred = (judge.get("predicted") or {}).get("accept_length")
    fmt = lambda values: "[" + ", ".join(f"{v:.3f}" for v in values) + "]"
    s = judge.get("num_steps")
    summary = [
        f"offline accept length {judge['accept_length']:.3f} at {s}/1/{s + 1} on {judge['prompts']} held-out prompts"
        + (f" (training predicted {pred:.3f}, ratio {judge['accept_length'] / pred:.2f})" if pred else ""),
        f"accepted at position k / verifies {fmt(judge['per_position'])}"
        + (f", predicted {fmt(judge['predicted']['per_position'])}" if pred else ""),
        "by output length: " + ", ".join(f"{b['output_tokens']} {b['accept_length']:.2f} ({b['verifies']})"
                                         for b in judge["by_output_length"] if b["verifies"]),
        *context_lines(judge),
        *([f"WARNING: {judge['prompts_past_train_max_length']} of {judge['prompts']} judged prompts run past "
           f"train.max_length {judge['train_max_length']} (prompt + {judge['max_new_tokens']} new tokens): the "
           "drafter never trained at those positions; raise dump.max_length and train.max_length to the serving "
           "context"] if judge.get("prompts_past_train_max_length") else []),
        *([f"vLLM judge (vllm {judge['vllm']['engine_version']}): accept length {judge['vllm']['accept_length']:.3f}, "
           f"per position {fmt(judge['vllm']['per_position'])}; reference {judge['accept_length']:.3f}: agree within "
           f"{judge['agreement']['tolerance']} (difference {judge['agreement']['accept_length_difference']:.3f}); "
           "no vLLM curve by context position (its /metrics counters are aggregate)"]
          if "vllm" in judge else []),
        *predicted_speedup_lines(inputs.ctx.cfg, inputs.ctx.store, judge["accept_length"], s),
        f"layer ids {export['layer_ids']['trained']['ids']} (ours) -> SGLang "
        f"{export['layer_ids']['sglang']['eagle_aux_hidden_state_layer_ids']}"
        + (f", vLLM {export['layer_ids']['vllm']['eagle_aux_hidden_state_layer_ids']}" if "vllm" in export["layer_ids"]
           else ""),
    ]
    table = [{"metric": "offline accept length", "value": f"{judge['accept_length']:.3f}"},
             {"metric": "predicted accept length", "value": f"{pred:.3f}" if pred else "-"},
             {"metric": "sglang accept length (completion / verifies)", "value": f"{judge['sglang_accept_length']:.3f}"},
             {"metric": "vLLM accept length (real vLLM, /metrics deltas)",
              "value": f"{judge['vllm']['accept_length']:.3f}" if "vllm" in judge else "-"},
             {"metric": "per position", "value": fmt(judge["per_position"])},
             {"metric": "accept length, farthest context judged", "value": next(
                 (f"{b['accept_length']:.3f} at {b['positions']} ({b['blocks']} draft blocks)"
                  for b in reversed(judge.get("by_context") or []) if b["blocks"]), "-")},
             {"metric": "draft vocab", "value": f"{export['draft_vocab']['size']} ({export['draft_vocab']['hash']})"},
             {"metric": "target", "value": export["target"]["fingerprint"]},
             {"metric": "dump", "value": export["dump_fingerprint"]}]
    return Summary(summary, table)


def write_local(store: ObjectStore, export_fp: str, out_dir: str | Path) -> dict[str, Path]:
    """A committed export as local directories a server loads (`drafter export --out DIR`):
    DIR/sglang/, DIR/vllm/ (when exported), DIR/export.json, DIR/judge.json; every file verified."""
    out = StageOutput.committed(store, STAGE, export_fp)
    out_dir = Path(out_dir)
    paths: dict[str, Path] = {}
    for shard in out.manifest.shards:
        path = out_dir / shard.name
        path.parent.mkdir(parents=True, exist_ok=True)
        out.download_shard(shard.name, path)
    for name in (SGLANG_DIR, VLLM_DIR):
        if (out_dir / name / CONFIG_FILE).is_file():
            paths[name] = out_dir / name
    paths["manifest"] = out_dir / EXPORT_JSON
    paths["judge"] = out_dir / JUDGE_JSON
    return paths
