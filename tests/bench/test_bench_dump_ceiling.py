"""bench_dump's ceiling: the store's write speed probed with as many parallel writers as each run
uses (a store that takes parallel writers is not judged against one writer's speed)."""
from __future__ import annotations

import json

from benchmarks import bench_dump as bd


def test_the_probe_writes_with_each_writer_count_and_leaves_nothing(tmp_path):
    machine = bd.machine_baseline(str(tmp_path), [2, 4], total=8 << 20)
    assert set(machine["write_fsync_gb_per_s_by_writers"]) == {1, 2, 4}
    assert all(v > 0 for v in machine["write_fsync_gb_per_s_by_writers"].values())
    assert machine["write_fsync_gb_per_s"] == machine["write_fsync_gb_per_s_by_writers"][1]
    assert list(tmp_path.iterdir()) == []  # the probe's files are gone
    json.dumps(machine)  # it goes into bench_dump.json as it is


def test_the_ceiling_uses_the_run_s_writer_count():
    machine = {"write_fsync_gb_per_s": 1.0, "write_fsync_gb_per_s_by_writers": {1: 1.0, 4: 2.0}}
    row = {"bytes_per_token": 10_000, "forward_tokens_per_s": 500_000.0, "end_to_end_tokens_per_s": 180_000.0,
           "steady_tokens_per_s": 190_000.0, "tokens": 1_000_000, "model_load_s": 0.0, "upload_threads": 4}
    got = bd.ceiling(row, machine)
    assert got["ceiling_tokens_per_s"] == 200_000.0 and got["ceiling_bound_by"] == "store write"
    assert got["end_to_end_share_of_ceiling"] == 0.9
    # a run whose writer count was not probed (or an older machine record) falls back to one writer
    assert bd.ceiling({**row, "upload_threads": 3}, machine)["ceiling_tokens_per_s"] == 100_000.0
    assert bd.ceiling(row, {"write_fsync_gb_per_s": 1.0})["ceiling_tokens_per_s"] == 100_000.0
    # the forward pass bounds it where the store is faster
    assert bd.ceiling({**row, "forward_tokens_per_s": 150_000.0}, machine)["ceiling_bound_by"] == "forward"
