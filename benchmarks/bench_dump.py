"""Throughput and bytes of the dump stage: the tiny test target, the demo target's shape, and an
untrained Llama-3.2-1B shape (GPU).

    .venv/bin/python -m benchmarks.bench_dump --threads 1                     # CPU: tiny + demo
    .venv/bin/python -m benchmarks.bench_dump --target-path .cache/demo-target   # an existing target
    python3 -m benchmarks.bench_dump --targets demo llama-1b --devices auto \\
        --conversations convs.json --max-length 2048 --tokens-per-batch 32768      # every visible GPU

What it answers: end-to-end tokens/s of the dump stage (`drafter.stages.dump.run`) (tokenise + forward + shard write + verified
upload to a file:// store, model loads included), the forward pass alone on the first device, and
bytes per stored token against the payload formula (headers and offsets are the difference).
Targets are built in a temp dir with a short training budget (llama-1b: random weights):
throughput depends on the shape, not on how well the model is trained.
Recorded results are at the bottom of this file.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from drafter import capture
from drafter.config import DemoTargetConfig, TargetConfig, parse_config
from drafter.demo_target import build_demo_target, build_tokenizer
from drafter.stages import dump
from drafter.shards import project_corpus
from drafter.stage_output import StageOutput, to_jsonl
from drafter.store import FileStore
from drafter.tokenize import tokenize_conversation

SHAPES = {
    # tests/fixtures/targets.py::tiny_target_config
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=512, seq_len=64, tokenizer_texts=200),
    # the demo profile's target (DemoTargetConfig defaults)
    "demo": {},
}
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, max_position_embeddings=8192, rope_theta=500000.0)


def build_target(shape: str, out: Path, conversations: list[dict]) -> Path:
    if shape == "llama-1b":
        return build_random_llama(out, conversations)
    cfg = DemoTargetConfig(**SHAPES[shape], max_steps=5, train_seconds=60, train_conversations=400,
                           eval_conversations=10, batch_size=2, threads=torch.get_num_threads())
    build_demo_target(cfg, out, conversations=conversations[:410])
    return out


def build_random_llama(out: Path, conversations: list[dict]) -> Path:
    """Llama-3.2-1B layout with random bf16 weights and a 4096-token BPE (small embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer((m["content"] for c in conversations[:1000] for m in c["messages"]), 4096)
    cfg = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **LLAMA_1B)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def aux_ids(num_layers: int) -> list[int]:
    """SpecForge's default where the target is deep enough, else three distinct non-final layers."""
    return [1, num_layers // 2 - 1, num_layers - 4] if num_layers >= 8 else [0, 1, num_layers - 2]


def bench_target(path: Path, conversations: list[dict], args) -> list[tuple[str, str]]:
    num_layers = TargetConfig(path=str(path)).resolved_shape()["num_hidden_layers"]
    cfg = parse_config({
        "target": {"path": str(path)}, "train": {"draft_vocab_size": 2},
        "dump": {"upstream": "prepare", "aux_layer_ids": aux_ids(num_layers), "max_length": args.max_length,
                 "tokens_per_batch": args.tokens_per_batch, "samples_per_shard": args.samples_per_shard,
                 "devices": args.devices}})
    samples = conversations[:args.samples]
    with tempfile.TemporaryDirectory() as tmp:
        store = FileStore(tmp)
        up = StageOutput(store, "prepare", "bench000")
        up.write_shard("train.jsonl", to_jsonl(samples))
        up.write_shard("eval.jsonl", to_jsonl([]))
        up.commit({})
        t = time.perf_counter()
        meta = dump.run(cfg, store, upstream={"prepare": "bench000"}).manifest.meta
        total = time.perf_counter() - t

    # The parts, with the model already loaded, on the first device.
    plan = dump.plan_dump(cfg, {"prepare": "bench000"})
    t = time.perf_counter()
    seqs = [tokenize_conversation(plan.tokenizer, c["messages"], args.max_length)[0] for c in samples]
    t_tok = time.perf_counter() - t
    cm = capture.load_capture_model(str(path), plan.devices[0], plan.dtype, plan.aux_layer_ids)
    tokens = sum(map(len, seqs))
    shards = [seqs[i:i + args.samples_per_shard] for i in range(0, len(seqs), args.samples_per_shard)]
    runs = [(shard, batch) for shard in shards for batch in capture.plan_batches(list(map(len, shard)),
                                                                                    args.tokens_per_batch)]
    capture.capture_batch(cm, [runs[0][0][j] for j in runs[0][1]])  # warm-up (kernels, allocator)
    _sync(cm.device)
    t = time.perf_counter()
    for shard, batch in runs:
        capture.capture_batch(cm, [shard[j] for j in batch])
    _sync(cm.device)
    t_fwd = time.perf_counter() - t
    devices = ", ".join(str(d) for d in plan.devices)
    return [
        ("shape", f"hidden {meta['hidden_size']}, {meta['num_hidden_layers']} layers, {meta['dtype']}"),
        ("samples / tokens / loss tokens", f"{meta['num_samples']} / {meta['num_tokens']} / {meta['num_loss_tokens']}"),
        (f"run_dump end to end [{devices}]",
         f"{meta['num_tokens'] / total:10.0f} tokens/s  ({total:.1f} s, incl. model load)"),
        ("  tokenise only (1 thread)", f"{tokens / t_tok:10.0f} tokens/s"),
        (f"  capture forward only [{cm.device}]", f"{tokens / t_fwd:10.0f} tokens/s"),
        ("bytes/token measured", f"{meta['bytes_per_token']:10.1f}  (payload {meta['payload_bytes_per_token']})"),
        ("this corpus", meta["storage_projection"]),
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="*", default=["tiny", "demo"], choices=[*SHAPES, "llama-1b"])
    parser.add_argument("--target-path", type=Path, help="benchmark this existing target instead")
    parser.add_argument("--conversations", type=Path, help="JSON list of {id, messages} (default: ShareGPT)")
    parser.add_argument("--devices", nargs="*", default=["cpu"])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.conversations:
        conversations = json.loads(args.conversations.read_text())
    else:
        from drafter.data import load_sharegpt

        conversations = load_sharegpt(max(args.samples, 1000) + 10)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, devices {args.devices}, "
          f"{args.samples} conversations, max_length {args.max_length}, tokens_per_batch {args.tokens_per_batch}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["given"] if args.target_path else args.targets:
            t = time.perf_counter()
            path = args.target_path or build_target(name, Path(tmp) / name, conversations)
            print(f"\n## {name}: {path} (ready in {time.perf_counter() - t:.0f} s)", flush=True)
            for key, value in bench_target(path, conversations, args):
                print(f"  {key:40s} {value}", flush=True)
    print("\n## projections (bf16, 3 aux + final)")
    for label, tokens, hidden in (("seed run, Kimi-K2.5", 87_800_000, 7168),
                                  ("Llama-3.1-8B, same corpus", 87_800_000, 4096),
                                  ("1.4M samples x 2353 tokens, hidden 7168", 1_400_000 * 2353, 7168)):
        print(f"  {label:40s} {project_corpus(tokens, hidden)}")


if __name__ == "__main__":
    main()

# Recorded results
# ----------------
# CPU, this dev box (2 cores shared with other jobs, load average 1-2), torch 2.13 CPU, 256 ShareGPT
# conversations, max_length 512, tokens_per_batch 4096, samples_per_shard 64, file:// store:
#   .venv/bin/python -m benchmarks.bench_dump --threads 1
#   tiny (hidden 64, 4 layers, fp32):  run_dump 24.9k tok/s end to end (3.7 s incl. model load);
#                                      forward alone 53.9k tok/s; tokenise 105k tok/s; 1033.1 B/token
#   demo (hidden 256, 6 layers, fp32): run_dump 4.7k tok/s end to end; forward alone 5.7k tok/s;
#                                      tokenise 89k tok/s; 4105.1 B/token (payload 4105)
#   With 2 torch threads on the same busy box the forward ran 13x SLOWER (2.7k vs 35k tok/s for
#   tiny): OpenMP pools spinning against other processes. Use --threads 1 on shared machines.
#
# GPU, 2 x H200 (device machine), torch 2.11 + cu130, transformers 5.17, bf16 (dtype auto), 256
# conversations, max_length 2048, tokens_per_batch 32768, samples_per_shard 32, file:// store on the
# machine's local disk:
#   python3 -m benchmarks.bench_dump --targets demo llama-1b --devices auto --conversations convs.json \
#       --samples 256 --max-length 2048 --tokens-per-batch 32768 --samples-per-shard 32
#   demo (hidden 256):      103k tok/s end to end on 2 GPUs; forward alone 563k tok/s on one GPU
#   llama-1b (hidden 2048): 37.8k tok/s end to end on 2 GPUs, 29.7k on 1 GPU; forward alone
#                           144-149k tok/s on one GPU; 16393.0 B/token (payload 16393)
#   The GPU is not the bottleneck: a verified upload (hash, put, read-back hash = 2 reads + 1 write
#   of every byte) runs at ~450-700 MB/s there. upload_threads 1 -> 2 took llama-1b on one GPU from
#   19.4k to 29.7k tok/s; 4 threads gained nothing more (disk-bound: 1.27 GB/s write, 0.76 GB/s
#   read+sha256 measured on that machine).
#   Also checked there (one-off script): 'auto' -> one worker per GPU; shards byte-identical between
#   1 GPU, the other GPU, both GPUs, and a crash + resume on both (8/8 each); stored bf16 states equal
#   an unpadded HF bf16 forward; vs fp32 max relative error 0.9%.
