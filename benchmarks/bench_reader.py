"""The training reader's data wait: can the dump's shards reach the trainer as fast as it trains?

    .venv/bin/python -m benchmarks.bench_reader --hidden 256 --tokens 200000 --out /tmp/reader-bench  # CPU check
    python3 -m benchmarks.bench_reader --hidden 2048 4096 --tokens 1500000 --backends file s3 \\
        --store-dir /tmp/reader-store --tokens-per-s 35600 --out $OUT

A synthetic committed dump (random states, real shard format, `--storage-dtypes`) is written to each
backend: `file` (a file:// store under --store-dir) and `s3` (a moto S3 server started here as its own
process on loopback, or --s3-endpoint URL, e.g. MinIO). Then the real reader (DumpReader: parallel
verified fetches, prefetch, bounded cache; Packer: packing and fp8 decoding on its thread) feeds a
consumer that stands in for the training step: each micro-batch of --micro-batch tokens takes
micro_batch / --tokens-per-s seconds (a sleep, like a step waiting on the GPU; default 35.6k tok/s:
2048 tokens per 57.6 ms step, the CUDA-graph step of benchmarks/RESULTS.md at the 8B shape). It
reports the data-wait share (time the consumer waited for a micro-batch / time it ran), delivered
tokens/s and GB/s, and the same unthrottled (--tokens-per-s 0 row: the reader's ceiling). Results:
`$OUT/bench_reader.json`.

moto keeps objects in a Python process and reads an object's whole value for every ranged GET, so
the s3 rows use one range per shard (multipart_chunk_mb above the shard size): they bound the client
path through a slow server, not S3's bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.contracts import fp8  # noqa: E402
from drafter.layers import LAYER_ID_CONVENTION  # noqa: E402
from drafter.contracts.shards import ShardWriter  # noqa: E402
from drafter.stage_output import StageOutput  # noqa: E402
from drafter.store import FileStore, ObjectStore, S3Store  # noqa: E402
from drafter.training.data import Cursor, DumpExpectation, DumpReader, Packer, dump_splits  # noqa: E402

AUX = [1, 2, 3]


def write_dump(store: ObjectStore, hidden: int, tokens: int, per_shard_tokens: int, sample_len: int,
               storage: str, fp: str) -> dict:
    """A committed dump of random bf16 states (a pool of random rows, tiled: content does not
    matter for I/O, every byte is still written, hashed and read)."""
    g = torch.Generator().manual_seed(0)
    pool = 4 * sample_len
    aux_pool = torch.randn(pool, 3, hidden, generator=g).to(torch.bfloat16)
    fin_pool = torch.randn(pool, hidden, generator=g).to(torch.bfloat16)
    if storage == "float8_e4m3":
        (aq, asc), (fq, fsc) = fp8.encode(aux_pool), fp8.encode(fin_pool)
    out = StageOutput(store, "dump", fp)
    shards, k, written = 0, 0, 0
    t = time.perf_counter()
    while written < tokens:
        meta = {"aux_layer_ids": AUX, "layer_id_convention": LAYER_ID_CONVENTION}
        if storage == "float8_e4m3":
            meta["dtype"] = "bfloat16"
        w = ShardWriter(metadata=meta)
        n = 0
        while n < per_shard_tokens and written + n < tokens:
            a = (k * 977) % (pool - sample_len)
            ids = torch.randint(0, 32000, (sample_len,), generator=g)
            mask = torch.ones(sample_len, dtype=torch.uint8)
            if storage == "float8_e4m3":
                w.add(f"s{k}", ids, mask, aq[a:a + sample_len], fq[a:a + sample_len],
                      aux_scales=asc[a:a + sample_len], hidden_scales=fsc[a:a + sample_len])
            else:
                w.add(f"s{k}", ids, mask, aux_pool[a:a + sample_len], fin_pool[a:a + sample_len])
            n += sample_len
            k += 1
        out.write_shard(f"hs-{shards:05d}.safetensors", w.chunks(), meta={"samples": len(w), "tokens": n})
        w.discard()
        written += n
        shards += 1
    write_s = time.perf_counter() - t
    manifest = out.commit({"aux_layer_ids": AUX, "layer_id_convention": LAYER_ID_CONVENTION, "hidden_size": hidden,
                           "target_fingerprint": "bench", "dtype": "bfloat16", "storage_dtype": storage})
    return {"fingerprint": fp, "shards": shards, "tokens": written, "bytes": manifest.total_bytes,
            "bytes_per_token": round(manifest.total_bytes / written, 1), "write_s": round(write_s, 2),
            "write_gb_per_s": round(manifest.total_bytes / write_s / 1e9, 3)}


def read(store: ObjectStore, fp: str, hidden: int, args, tokens_per_s: float) -> dict:
    expect = DumpExpectation(aux_layer_ids=AUX, hidden_size=hidden)
    reader = DumpReader(store, dump_splits(store, fp)[0], expect, seed=0, cache_shards=args.cache_shards,
                        prefetch_shards=args.prefetch_shards, cache_dir=args.cache_dir)
    tokens = batches = 0
    waited = 0.0  # the consumer's own wait for its next micro-batch (first one excluded: start-up)
    t = time.perf_counter()
    try:
        packer = Packer(args.micro_batch, args.micro_batch, prefetch=args.prefetch_batches)
        stream = iter(packer.batches(reader.samples(Cursor(), 1), Cursor(1, 0, 0)))
        while True:
            t0 = time.perf_counter()
            item = next(stream, None)
            if item is None:
                break
            waited += (time.perf_counter() - t0) if batches else 0.0
            mb = item[1]
            if tokens_per_s:
                step(mb.num_tokens / tokens_per_s, args.consumer)
            tokens += mb.num_tokens
            batches += 1
    finally:
        reader.close()
    wall = time.perf_counter() - t
    stats = reader.stats()
    return {"consumer_tokens_per_s": tokens_per_s, "consumer": args.consumer, "micro_batches": batches,
            "tokens": tokens, "wall_s": round(wall, 2), "delivered_tokens_per_s": round(tokens / wall, 1),
            "delivered_gb_per_s": round(stats["fetched_bytes"] / wall / 1e9, 3),
            "consumer_wait_share": round(waited / wall, 4), **stats}


def step(seconds: float, consumer: str) -> None:
    """The training step's time: `sleep` gives the packer's thread the interpreter (a step waiting on
    the GPU); `busy` keeps it (an eager step launching kernels from Python), giving it up only at
    the interpreter's switch interval."""
    if consumer == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def start_moto() -> tuple[str, subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return url, proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[2048], help="target hidden sizes (2048: 1B, 4096: 8B)")
    ap.add_argument("--tokens", type=int, default=400_000, help="tokens in each synthetic dump")
    ap.add_argument("--shard-tokens", type=int, default=65536, help="tokens per shard")
    ap.add_argument("--sample-len", type=int, default=1024)
    ap.add_argument("--storage-dtypes", nargs="+", default=["model", "float8_e4m3"], choices=["model", "float8_e4m3"])
    ap.add_argument("--backends", nargs="+", default=["file", "s3"], choices=["file", "s3"])
    ap.add_argument("--store-dir", default=None, help="where the file:// store lives (default: temp dir)")
    ap.add_argument("--cache-dir", default=None, help="the reader's local cache (s3)")
    ap.add_argument("--s3-endpoint", default=None, help="an S3 server to use instead of starting moto")
    ap.add_argument("--tokens-per-s", type=float, default=35600.0, help="the consumer's training speed")
    ap.add_argument("--consumer", choices=["sleep", "busy"], default="sleep",
                    help="the step stand-in: sleep (waits on the GPU) or busy (holds the interpreter)")
    ap.add_argument("--micro-batch", type=int, default=2048)
    ap.add_argument("--cache-shards", type=int, default=3)
    ap.add_argument("--prefetch-shards", type=int, default=2)
    ap.add_argument("--prefetch-batches", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for var, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(var, value)
    results = {"torch": torch.__version__, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    emit = lambda: (args.out / "bench_reader.json").write_text(json.dumps(results, indent=2))
    if args.store_dir:
        Path(args.store_dir).mkdir(parents=True, exist_ok=True)  # a fresh machine has none
    moto = None
    try:
        for backend in args.backends:
            with tempfile.TemporaryDirectory(prefix="bench-reader-", dir=args.store_dir) as tmp:
                if backend == "file":
                    store = FileStore(tmp)
                else:
                    url = args.s3_endpoint
                    if url is None:
                        url, moto = start_moto()
                    import boto3

                    client = boto3.session.Session().client("s3", endpoint_url=url, region_name="us-east-1")
                    try:
                        client.create_bucket(Bucket="bench-reader")
                    except client.exceptions.BucketAlreadyOwnedByYou:
                        pass
                    shard_mb = 1 + args.shard_tokens * (4 * 4096 * 2 + 9) // (1 << 20)
                    chunk = shard_mb if args.s3_endpoint is None else 64  # moto: one range per shard
                    store = S3Store("bench-reader", f"run-{os.getpid()}", endpoint_url=url, region="us-east-1",
                                    multipart_threshold_mb=64, multipart_chunk_mb=chunk)
                for hidden in args.hidden:
                    for storage in args.storage_dtypes:
                        fp = f"h{hidden}-{storage.replace('_', '')}"
                        dumped = write_dump(store, hidden, args.tokens, args.shard_tokens, args.sample_len, storage, fp)
                        for rate in (args.tokens_per_s, 0.0):
                            row = {"backend": backend, "hidden": hidden, "storage_dtype": storage,
                                   "dump": dumped, **read(store, fp, hidden, args, rate)}
                            results["runs"].append(row)
                            print(json.dumps(row), flush=True)
                            emit()
                        StageOutput(store, "dump", fp).reset()
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(timeout=30)
    emit()


if __name__ == "__main__":
    main()
