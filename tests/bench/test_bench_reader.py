"""bench_reader at a tiny shape on the CPU (file:// store): each row has the consumer's own wait,
for the sleeping and the interpreter-holding step stand-ins."""
from __future__ import annotations

import json
import sys

import pytest

from benchmarks import bench_reader


@pytest.mark.parametrize("consumer", ["sleep", "busy"])
def test_rows_report_the_consumers_wait(consumer, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [
        "bench_reader.py", "--hidden", "64", "--tokens", "6000", "--shard-tokens", "2000", "--sample-len", "200",
        "--storage-dtypes", "model", "float8_e4m3", "--backends", "file", "--micro-batch", "512",
        "--tokens-per-s", "200000", "--consumer", consumer, "--store-dir", str(tmp_path / "store"),
        "--out", str(tmp_path / "out")])
    bench_reader.main()
    runs = json.loads((tmp_path / "out" / "bench_reader.json").read_text())["runs"]
    assert len(runs) == 4  # two dtypes, each throttled and unthrottled
    for r in runs:
        assert r["consumer"] == consumer and r["tokens"] == 6000 and 0 <= r["consumer_wait_share"] < 1
