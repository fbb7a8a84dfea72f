"""Drafter quality on a GPU target: the whole chain in one run, through the stage table.

What it answers: for a Llama-architecture target of ~100M parameters trained here on ShareGPT (no
model hub), how well does the drafter this project trains predict it, and does the exported drafter
accept what training predicted? It records the target's held-out loss, the drafter's training
prediction (simulated accept length on the held-out dump) and the offline accept length of the
EXPORTED files at draft steps 1, 3 and 5 (topk 1), judged by the reference engine's speculative
decoder on held-out prompts.

Chain: demo-target builder (GPU preset, bf16) -> prepare -> dump (upstream: prepare, i.e. the
corpus's own answers; regenerating 3k conversations with the one-request-at-a-time reference
engine does not fit a device session) -> train -> export with judgement, re-judged at 1, 3, 5 steps.

    python3 benchmarks/bench_drafter_quality.py --corpus sharegpt.jsonl --work /tmp/q --out $OUT

`--small` runs the same chain at toy sizes on the CPU (to check the script before a GPU run).

fp8 storage against bf16 (dump.storage_dtype), one command: the same prepared data dumped both
ways, each trained with the same seed and budget and judged the same way; `comparison` in
quality.json holds both offline accept lengths per draft step and their ratio:

    python3 benchmarks/bench_drafter_quality.py --corpus sharegpt.jsonl --work /tmp/q --out $OUT \
        --storage-dtypes model float8_e4m3
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from drafter.config import DemoTargetConfig, parse_config
from drafter.demo_target import ensure_demo_target
from drafter.stages import TABLE
from drafter.store import open_store


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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


def profile(args, target_dir: Path, corpus: Path) -> dict:
    gpu = not args.small
    return {
        "name": "quality",
        "target": {"path": str(target_dir), "dtype": "bfloat16" if gpu else "float32"},
        "data": {"sources": [{"kind": "jsonl", "path": str(corpus)}], "max_chars": 6000, "max_turns": 2,
                 "eval_fraction": 0.05, "max_eval": 64, "limit": args.conversations},
        "dump": {"upstream": "prepare", "aux_layer_ids": [1, 5, 8] if gpu else [0, 1, 2],
                 "max_length": 512 if gpu else 128, "samples_per_shard": 256, "tokens_per_batch": 32768,
                 "devices": ["cuda:0"] if gpu else ["cpu"], "dtype": "bfloat16" if gpu else "float32"},
        "train": {"draft_vocab_size": 4096 if gpu else 512, "ttt_length": 7 if gpu else 3,
                  "epochs": args.epochs, "learning_rate": 3e-4 if gpu else 3e-3, "max_length": 512 if gpu else 128,
                  "tokens_per_micro_batch": 16384 if gpu else 1024, "eval_every_steps": 200,
                  "save_every_steps": 1000, "device": "cuda" if gpu else "cpu",
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, required=True, help="JSONL of {id, messages} conversations")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--conversations", type=int, default=3000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--steps", default="1,3,5", help="draft steps to judge at (topk 1)")
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
    args.bench_steps = [int(s) for s in args.bench_steps.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    emit = lambda: (args.out / "quality.json").write_text(json.dumps(results, indent=2, default=str))

    t0 = time.monotonic()
    conversations = read_jsonl(args.corpus)
    preset = target_preset(args.small)
    target_dir = args.work / "target"
    report = ensure_demo_target(preset, target_dir, conversations=conversations[-(preset.train_conversations
                                                                                  + preset.eval_conversations):])
    results["target"] = {k: report.get(k) for k in ("parameters", "steps", "eval_loss_initial", "eval_loss",
                                                     "train_loss", "train_seconds", "stopped_by")}
    print("target:", results["target"], flush=True)
    emit()

    # The chain's corpus: the conversations the target did not train on come first.
    corpus = args.work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    base = parse_config(profile(args, target_dir, corpus))
    store = open_store(base.storage)
    for storage in args.storage_dtypes:
        cfg = base.model_copy(update={"dump": base.dump.model_copy(update={"storage_dtype": storage})})
        if len(args.storage_dtypes) == 1:
            run_chain(args, cfg, store, results, emit)
        else:
            run_chain(args, cfg, store, results.setdefault("storage", {}).setdefault(storage, {}), emit)
    if len(args.storage_dtypes) > 1:
        results["comparison"] = compare(results["storage"], args.storage_dtypes)
        print("comparison", results["comparison"], flush=True)
    results["total_seconds"] = round(time.monotonic() - t0, 1)
    emit()


def run_chain(args, cfg, store, results: dict, emit) -> None:
    """prepare -> dump -> train -> export judged at --steps (-> bench), figures into `results`."""
    fps = TABLE.fingerprints(cfg)
    for stage in ("prepare", "dump", "train"):
        t = time.monotonic()
        result = TABLE.run(stage, cfg, store, fingerprints=fps)
        results[stage] = {"seconds": round(time.monotonic() - t, 1), "summary": list(result.summary)}
        if stage == "dump":
            results["dump"].update({k: result.meta[k] for k in ("storage_dtype", "bytes_per_token", "num_tokens")})
        print(stage, results[stage], flush=True)
        emit()
    results["predicted"] = result.meta.get("final_eval")  # the train stage's held-out metrics
    results["train"]["steps"] = result.meta.get("steps")

    results["judged"] = {}
    for steps in [int(s) for s in args.steps.split(",")]:
        judged_cfg = cfg.model_copy(update={"export": cfg.export.model_copy(update={"judge_num_steps": steps})})
        t = time.monotonic()
        export = TABLE.run("export", judged_cfg, store)
        judge = export.meta["judge"]
        results["judged"][steps] = {"seconds": round(time.monotonic() - t, 1), "accept_length": judge["accept_length"],
                                    "per_position": judge["per_position"], "predicted": judge["predicted"],
                                    "by_output_length": judge["by_output_length"], "summary": list(export.summary)}
        print("judged", steps, results["judged"][steps], flush=True)
        emit()
    if args.bench:  # the export it benches is the one judged at the profile's own judge_num_steps
        t = time.monotonic()
        bench = TABLE.run("bench", cfg, store, fingerprints=TABLE.fingerprints(cfg))
        results["bench"] = {"seconds": round(time.monotonic() - t, 1), "summary": list(bench.summary),
                            "table": bench.table, "meta": bench.meta}
        print("bench", results["bench"]["summary"], flush=True)
        emit()


def compare(runs: dict, storages: list[str]) -> dict:
    """Offline accept length of each storage per draft step, and each one's ratio to the first's."""
    ref = storages[0]
    out = {"reference": ref, "bytes_per_token": {s: runs[s]["dump"]["bytes_per_token"] for s in storages},
           "train_steps": {s: runs[s]["train"].get("steps") for s in storages}, "by_steps": {}}
    for steps, judged in runs[ref]["judged"].items():
        row = {s: runs[s]["judged"][steps]["accept_length"] for s in storages}
        row["ratio"] = {s: round(row[s] / row[ref], 4) for s in storages[1:]}
        row["within_2pct"] = {s: abs(row[s] / row[ref] - 1) <= 0.02 for s in storages[1:]}
        out["by_steps"][steps] = row
    return out


if __name__ == "__main__":
    main()
