"""Throughput of the object store and of verified shard writes, file:// vs s3:// (moto on loopback).

    .venv/bin/python -m benchmarks.bench_store [--mb 256] [--small 200]

What it answers: how much does the commit protocol cost on top of raw puts (write_shard = one pass:
hash while uploading, the committed object checked (file: inode + size; s3: the server's SHA256
checksums) + marker), and does streaming keep memory flat for big files. Moto is an
in-process Python S3 server, so its numbers bound our client overhead, not real S3/MinIO bandwidth.
Recorded results are at the bottom of this file.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from drafter.stage_output import StageOutput
from drafter.store import FileStore, ObjectStore, S3Store

MiB = 1024 * 1024


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench(store: ObjectStore, work: Path, big_mb: int, small_n: int) -> list[tuple[str, str]]:
    big = work / "big.bin"
    with open(big, "wb") as f:
        for _ in range(big_mb):
            f.write(os.urandom(MiB))
    rows = []
    t = _timed(lambda: store.put_file("bench/big.bin", big))
    rows.append((f"put_file {big_mb} MB", f"{big_mb / t:8.1f} MB/s"))
    t = _timed(lambda: store.get_file("bench/big.bin", work / "big.out"))
    rows.append((f"get_file {big_mb} MB", f"{big_mb / t:8.1f} MB/s"))
    out = StageOutput(store, "bench", "0000000000000000")
    t = _timed(lambda: out.write_shard("big.bin", big))
    rows.append((f"write_shard {big_mb} MB (hashed while written, commit checked)", f"{big_mb / t:8.1f} MB/s"))
    t = _timed(lambda: out.download_shard("big.bin", work / "big.dl"))
    rows.append((f"download_shard {big_mb} MB (get+verify)", f"{big_mb / t:8.1f} MB/s"))
    blob = os.urandom(64 * 1024)
    t = _timed(lambda: [store.put_bytes(f"bench/small/{i:05d}", blob) for i in range(small_n)])
    rows.append((f"put_bytes 64 KB x {small_n}", f"{small_n / t:8.1f} obj/s"))
    t = _timed(lambda: [out.write_shard(f"small/{i:05d}", blob) for i in range(small_n)])
    rows.append((f"write_shard 64 KB x {small_n}", f"{small_n / t:8.1f} obj/s"))
    t = _timed(lambda: store.list("bench/"))
    rows.append((f"list {small_n} keys", f"{t * 1000:8.1f} ms"))
    t = _timed(out.completed_shards)
    rows.append((f"completed_shards ({small_n + 1} markers)", f"{t * 1000:8.1f} ms"))
    t = _timed(lambda: out.commit({}))
    rows.append(("commit", f"{t * 1000:8.1f} ms"))
    t = _timed(out.is_complete)
    rows.append(("is_complete", f"{t * 1000:8.1f} ms"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="size of the big object")
    ap.add_argument("--small", type=int, default=200, help="number of small objects")
    args = ap.parse_args()

    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request otherwise

    for var, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
                       "AWS_SHARED_CREDENTIALS_FILE": os.devnull}.items():
        os.environ[var] = value
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.session.Session().client("s3", endpoint_url=url).create_bucket(Bucket="bench")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            backends = {"file": FileStore(tmp / "store"),
                        "s3 (moto)": S3Store("bench", "run", endpoint_url=url, region="us-east-1")}
            results = {}
            for name, store in backends.items():
                work = tmp / f"work-{name[:2]}"
                work.mkdir()
                results[name] = bench(store, work, args.mb, args.small)
            names = list(results)
            print(f"{'operation':<50}" + "".join(f"{n:>16}" for n in names))
            for i, (op, _) in enumerate(results[names[0]]):
                print(f"{op:<50}" + "".join(f"{results[n][i][1]:>16}" for n in names))
    finally:
        server.stop()


if __name__ == "__main__":
    main()

# Recorded 2026-11-29, `--mb 256 --small 200`, 2-core CI container, local disk, moto 5.2.5 in-process.
# File numbers include fsync per object (and per directory); they vary +-50% run to run here.
# Moto is GIL-bound Python: its S3 column shows our client overhead is not the bottleneck, and that
# per-object latency (not bandwidth) dominates small shards: prefer shards of tens of MB or more.
RESULTS = """
operation                                             file       s3 (moto)
put_file 256 MB                                 382.2 MB/s       56.6 MB/s
get_file 256 MB                                 321.9 MB/s      238.2 MB/s
write_shard 256 MB (hash+put+verify)            215.4 MB/s       43.8 MB/s
download_shard 256 MB (get+verify)              269.4 MB/s      143.8 MB/s
put_bytes 64 KB x 200                         1155.6 obj/s     100.6 obj/s
write_shard 64 KB x 200                        562.0 obj/s      29.6 obj/s
list 200 keys                                       3.2 ms        122.0 ms
completed_shards (201 markers)                     15.0 ms        888.0 ms
commit                                             14.3 ms        977.9 ms
is_complete                                         2.5 ms        204.4 ms
"""
