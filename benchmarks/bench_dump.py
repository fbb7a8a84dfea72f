"""Throughput and bytes of the dump stage, end to end against the forward pass alone, in one run.

    .venv/bin/python -m benchmarks.bench_dump --threads 1 --out /tmp/dump-bench          # CPU: tiny + demo
    python3 -m benchmarks.bench_dump --targets llama-1b llama-8b --devices cuda:0 \\
        --conversations sharegpt.jsonl --samples 2048 --max-length 2048 --tokens-per-batch 32768 \\
        --samples-per-shard 128 --storage-dtypes model float8_e4m3 --store-dir /dev/shm/dump-bench --out $OUT

What it answers, per target shape and storage dtype (dump.storage_dtype), in the same process:
- end to end: the dump stage (`TABLE.run("dump", ...)`: tokenise, forward, device-to-host, shard write, verified
  upload to the store, commit), tokens/s over the whole call (model load included) and in the steady
  state (from the first shard's verified marker to the last: the pipeline's rate, load excluded);
- forward only: the same samples and batches through the capture forward on the first device, the
  model already loaded (the ceiling the dump should reach);
- bytes per stored token; the store's own raw write speed (write + fsync of 1 GiB, by one writer and
  by as many parallel writers as each run uses: its ceiling) and one core's sha256 speed, to tell a
  disk-bound run from a pipeline-bound one;
- that every shard reads back verified (sha256), outside the timings.
Targets: `tiny`/`demo` are built in a temp dir with a short training budget; `llama-1b` (Llama-3.2-1B
layout) and `llama-8b` (Llama-3.1-8B layout) get random bf16 weights: throughput depends on the
shape, not on how well the model is trained. `--s3-endpoint URL` dumps to an S3 server instead of
`--store-dir` (bucket `--s3-bucket`, created if missing). Results: `$OUT/bench_dump.json`, and the
rows printed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.corpus import read_conversations
from drafter.capture import backends, base, hf
from drafter.config import DemoTargetConfig, DumpConfig, TargetConfig, parse_config
from drafter.demo_target import build_demo_target, build_tokenizer
from drafter.contracts.shards import project_corpus
from drafter.stage_output import StageOutput, to_jsonl
from drafter.capture.plan import plan_dump
from drafter.store import FileStore, ObjectStore, S3Store
from drafter.tokenize import tokenize_conversation
from drafter.stages import TABLE

SHAPES = {
    # tests/fixtures/targets.py::tiny_target_config
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=512, seq_len=64, tokenizer_texts=200),
    # the demo profile's target (DemoTargetConfig defaults)
    "demo": {},
}
LLAMA = {
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, max_position_embeddings=8192, rope_theta=500000.0),
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, max_position_embeddings=8192, rope_theta=500000.0),
}
GiB = 1 << 30


def build_target(shape: str, out: Path, conversations: list[dict]) -> Path:
    if shape in LLAMA:
        return build_random_llama(out, conversations, LLAMA[shape])
    cfg = DemoTargetConfig(**SHAPES[shape], max_steps=5, train_seconds=60, train_conversations=400,
                           eval_conversations=10, batch_size=2, threads=torch.get_num_threads())
    build_demo_target(cfg, out, conversations=conversations[:410])
    return out


def build_random_llama(out: Path, conversations: list[dict], shape: dict) -> Path:
    """A Llama layout with random bf16 weights and a 4096-token BPE (small embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer((m["content"] for c in conversations[:1000] for m in c["messages"]), 4096)
    cfg = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **shape)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # never materialise an fp32 copy of 8B weights
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    return out


def aux_ids(num_layers: int) -> list[int]:
    """SpecForge's default where the target is deep enough, else three distinct non-final layers."""
    return [1, num_layers // 2 - 1, num_layers - 4] if num_layers >= 8 else [0, 1, num_layers - 2]


class MarkerClock:
    """Wraps a store: records when each shard's verified marker lands and the shard's tokens."""

    def __init__(self, store: ObjectStore):
        self.store, self.marks = store, []
        real = store.put_bytes

        def put_bytes(key: str, data: bytes) -> None:
            real(key, data)
            if "/_parts/" in key:
                self.marks.append((time.perf_counter(), int(json.loads(data)["meta"].get("tokens", 0))))

        store.put_bytes = put_bytes

    def steady_tokens_per_s(self) -> float | None:
        if len(self.marks) < 2:
            return None
        (t0, _), (t1, _) = self.marks[0], self.marks[-1]
        return sum(n for _, n in self.marks[1:]) / max(t1 - t0, 1e-9)


def open_bench_store(args, tag: str) -> tuple[ObjectStore, callable]:
    """A fresh store for one run and the function that removes it."""
    if args.s3_endpoint:
        import boto3

        client = boto3.session.Session().client("s3", endpoint_url=args.s3_endpoint, region_name="us-east-1")
        try:
            client.create_bucket(Bucket=args.s3_bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        store = S3Store(args.s3_bucket, f"bench-dump-{tag}-{os.getpid()}", endpoint_url=args.s3_endpoint,
                        region="us-east-1", multipart_threshold_mb=64, multipart_chunk_mb=64)
        return store, lambda: store.delete_prefix("")
    root = Path(tempfile.mkdtemp(prefix=f"bench-dump-{tag}-", dir=args.store_dir))
    return FileStore(root), lambda: shutil.rmtree(root, ignore_errors=True)


def bench_run(path: Path, conversations: list[dict], args, storage: str) -> dict:
    num_layers = TargetConfig(path=str(path)).resolved_shape()["num_hidden_layers"]
    cfg = parse_config({
        "target": {"path": str(path)}, "train": {"draft_vocab_size": 2},
        "dump": {"upstream": "prepare", "aux_layer_ids": aux_ids(num_layers), "max_length": args.max_length,
                 "tokens_per_batch": args.tokens_per_batch, "samples_per_shard": args.samples_per_shard,
                 "devices": args.devices, "storage_dtype": storage, "upload_threads": args.upload_threads,
                 "upload_queue": args.upload_queue, "tokenize_processes": args.tokenize_processes}})
    samples = conversations[:args.samples]
    store, remove = open_bench_store(args, storage)
    try:
        up = StageOutput(store, "prepare", "bench000")
        up.write_shard("train.jsonl", to_jsonl(samples))
        up.write_shard("eval.jsonl", to_jsonl([]))
        up.commit({})
        clock = MarkerClock(store)
        t = time.perf_counter()
        result = TABLE.run("dump", cfg, store, upstream={"prepare": "bench000"})
        total = time.perf_counter() - t
        meta = result.manifest.meta
        t = time.perf_counter()
        out = StageOutput(store, "dump", result.fingerprint)
        if not args.skip_verify:  # outside the timings above
            with tempfile.TemporaryDirectory(dir=args.store_dir) as dl:
                for s in result.manifest.shards:  # every shard reads back with its recorded sha256
                    out.download_shard(s.name, Path(dl) / "x").unlink()
        verify_s = time.perf_counter() - t
    finally:
        remove()
    forward = forward_only(path, cfg, samples, args)
    steady = clock.steady_tokens_per_s()
    return {
        "storage_dtype": meta["storage_dtype"], "dtype": meta["dtype"], "hidden_size": meta["hidden_size"],
        "layers": meta["num_hidden_layers"], "devices": args.devices, "samples": meta["num_samples"],
        "tokens": meta["num_tokens"], "shards": meta["num_shards"],
        "end_to_end_tokens_per_s": round(meta["num_tokens"] / total, 1), "end_to_end_s": round(total, 2),
        "steady_tokens_per_s": round(steady, 1) if steady else None,
        **forward,
        "steady_vs_forward": round(steady / forward["forward_tokens_per_s"], 4) if steady else None,
        "end_to_end_vs_forward": round(meta["num_tokens"] / total / forward["forward_tokens_per_s"], 4),
        "bytes_per_token": meta["bytes_per_token"], "payload_bytes_per_token": meta["payload_bytes_per_token"],
        "store_gb_per_s_steady": round(steady * meta["bytes_per_token"] / 1e9, 3) if steady else None,
        "all_shards_verified_on_read": not args.skip_verify,
        "verify_read_s": None if args.skip_verify else round(verify_s, 2),
        "projection": meta["storage_projection"],
    }


def forward_only(path: Path, cfg, samples: list[dict], args) -> dict:
    """The capture forward over the same samples and batches on the first device, model loaded."""
    plan = plan_dump(cfg, {"prepare": "bench000"})
    t = time.perf_counter()
    seqs = [tokenize_conversation(plan.tokenizer, c["messages"], args.max_length)[0] for c in samples]
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    cm = hf.load_capture_model(str(path), plan.devices[0], plan.dtype, plan.aux_layer_ids)
    _sync(cm.device)
    t_load = time.perf_counter() - t
    tokens = sum(map(len, seqs))
    shards = [seqs[i:i + args.samples_per_shard] for i in range(0, len(seqs), args.samples_per_shard)]
    runs = [(shard, batch) for shard in shards for batch in base.plan_batches(list(map(len, shard)),
                                                                                    args.tokens_per_batch)]
    backends.capture_batch(cm, [runs[0][0][j] for j in runs[0][1]])  # warm-up (kernels, allocator)
    _sync(cm.device)
    t = time.perf_counter()
    for shard, batch in runs:
        backends.capture_batch(cm, [shard[j] for j in batch])
    _sync(cm.device)
    t_fwd = time.perf_counter() - t
    del cm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"forward_tokens_per_s": round(tokens / t_fwd, 1), "forward_device": str(plan.devices[0]),
            "model_load_s": round(t_load, 2),
            "tokenise_tokens_per_s_1_thread": round(tokens / t_tok, 1)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_speed(store_dir: str | None, writers: int, total: int = GiB, block: bytes | None = None) -> float:
    """GB/s of `writers` threads each writing its share of `total` bytes to its own new file in
    `store_dir`, write + fsync, as the dump's writers do (a disk or tmpfs may take parallel writers
    faster than one)."""
    block = block or os.urandom(64 << 20)
    share = max(len(block), total // writers)

    def one(_i: int) -> None:
        with tempfile.NamedTemporaryFile(dir=store_dir) as f:
            for _ in range(share // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    t = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(one, range(writers)))
    return writers * (share // len(block)) * len(block) / (time.perf_counter() - t) / 1e9


def machine_baseline(store_dir: str | None, writers: list[int] = (), total: int = GiB) -> dict:
    """The store directory's raw write + fsync speed with one writer and with each count in
    `writers`, and one core's sha256 speed."""
    block = os.urandom(min(64 << 20, total))
    write_speed(store_dir, 1, len(block), block)  # warm-up: the first write to a fresh store pays for it
    by_writers = {n: round(write_speed(store_dir, n, total, block), 3) for n in sorted({1, *writers})}
    h = hashlib.sha256()
    t = time.perf_counter()
    for _ in range(8):
        h.update(block)
    sha = 8 * len(block) / (time.perf_counter() - t) / 1e9
    return {"store_dir": store_dir or tempfile.gettempdir(), "write_fsync_gb_per_s": by_writers[1],
            "write_fsync_gb_per_s_by_writers": by_writers,
            "sha256_gb_per_s_one_core": round(sha, 3), "cpu_count": os.cpu_count()}


def ceiling(row: dict, machine: dict) -> dict:
    """What the dump could reach: min(forward only, the store's raw write speed with the run's
    writer count / bytes per token), both measured in this run, and the share of it reached end to
    end and in the steady state. A run of this size also pays the model load once (measured by the
    forward-only pass): the end-to-end ceiling is the tokens over (load + tokens at the ceiling), so
    a short benchmark is not judged against a rate no dump of its size could reach; both shares
    are printed."""
    speeds = machine.get("write_fsync_gb_per_s_by_writers") or {}
    write = speeds.get(row.get("upload_threads"), machine["write_fsync_gb_per_s"])
    by_store = write * 1e9 / row["bytes_per_token"]
    top = min(row["forward_tokens_per_s"], by_store)
    with_load = row["tokens"] / (row["model_load_s"] + row["tokens"] / top)
    steady = row.get("steady_tokens_per_s")
    return {"ceiling_tokens_per_s": round(top, 1), "ceiling_bound_by": "forward" if top < by_store else "store write",
            "store_write_tokens_per_s": round(by_store, 1),
            "end_to_end_share_of_ceiling": round(row["end_to_end_tokens_per_s"] / top, 4),
            "end_to_end_ceiling_with_load_tokens_per_s": round(with_load, 1),
            "end_to_end_share_of_ceiling_with_load": round(row["end_to_end_tokens_per_s"] / with_load, 4),
            "steady_share_of_ceiling": round(steady / top, 4) if steady else None}


def load_conversations(path: Path | None, n: int) -> list[dict]:
    if path is None:
        from drafter.contracts.sharegpt import load_sharegpt

        return load_sharegpt(max(n, 1000) + 10)
    return list(read_conversations(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="*", default=["tiny", "demo"], choices=[*SHAPES, *LLAMA])
    parser.add_argument("--target-path", type=Path, help="benchmark this existing target instead")
    parser.add_argument("--conversations", type=Path, help="JSON list or JSONL of {id, messages} (default: ShareGPT)")
    parser.add_argument("--devices", nargs="*", default=["cpu"])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--storage-dtypes", nargs="+", default=["model", "float8_e4m3"],
                        choices=["model", "float8_e4m3"])
    parser.add_argument("--upload-threads", type=int, nargs="+", default=[DumpConfig.model_fields["upload_threads"].default],
                        help="dump.upload_threads; several values: one run each, same target")
    parser.add_argument("--upload-queue", type=int, default=1)
    parser.add_argument("--tokenize-processes", type=int, default=0, help="dump.tokenize_processes")
    parser.add_argument("--store-dir", help="directory of the file:// store (default: system temp dir)")
    parser.add_argument("--s3-endpoint", help="dump to this S3 server instead (e.g. a local MinIO or moto)")
    parser.add_argument("--s3-bucket", default="bench-dump")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--skip-verify", action="store_true",
                        help="skip reading every shard back (sha256) after the timed dump")
    parser.add_argument("--out", type=Path, required=True, help="directory for bench_dump.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.store_dir:
        Path(args.store_dir).mkdir(parents=True, exist_ok=True)  # a fresh machine has none
    conversations = load_conversations(args.conversations, args.samples)
    results = {"torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "cpu_threads": torch.get_num_threads(), "args": {k: str(v) for k, v in vars(args).items()},
               "machine": machine_baseline(args.store_dir, args.upload_threads), "runs": []}
    emit = lambda: (args.out / "bench_dump.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["machine"]), flush=True)
    emit()
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["given"] if args.target_path else args.targets:
            t = time.perf_counter()
            path = args.target_path or build_target(name, Path(tmp) / name, conversations)
            built_s = round(time.perf_counter() - t, 1)
            for storage, threads in [(s, n) for s in args.storage_dtypes for n in args.upload_threads]:
                run_args = argparse.Namespace(**{**vars(args), "upload_threads": threads})
                row = {"target": name, "target_ready_s": built_s, "upload_threads": threads,
                       **bench_run(path, conversations, run_args, storage)}
                row.update(ceiling(row, results["machine"]))
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
                emit()
            if not args.target_path:
                shutil.rmtree(path, ignore_errors=True)
    results["projections"] = {label: project_corpus(tokens, hidden, storage_dtype=storage)
                              for label, tokens, hidden in (("seed run, Kimi-K2.5", 87_800_000, 7168),
                                                            ("Llama-3.1-8B, same corpus", 87_800_000, 4096))
                              for storage in ("model", "float8_e4m3") for label in [f"{label} ({storage})"]}
    emit()


if __name__ == "__main__":
    main()

# Recorded results (before the pipelined data plane; see benchmarks/RESULTS.md for the current ones)
# ----------------
# CPU, this dev box (2 cores shared with other jobs, load average 1-2), torch 2.13 CPU, 256 ShareGPT
# conversations, max_length 512, tokens_per_batch 4096, samples_per_shard 64, file:// store:
#   tiny (hidden 64, 4 layers, fp32):  24.9k tok/s end to end; forward alone 53.9k tok/s; 1033.1 B/token
#   demo (hidden 256, 6 layers, fp32): 4.7k tok/s end to end; forward alone 5.7k tok/s; 4105.1 B/token
# GPU, 2 x H200, torch 2.11 + cu130, bf16, 256 conversations, max_length 2048, tokens_per_batch 32768,
# samples_per_shard 32, file:// store on local disk:
#   llama-1b (hidden 2048): 37.8k tok/s end to end on 2 GPUs, 29.7k on 1 GPU; forward alone
#                           144-149k tok/s on one GPU; 16393.0 B/token. Bound by the verified upload
#                           (hash, put, read-back hash: ~450-700 MB/s there; disk 1.27 GB/s write).
