"""bench_train's real-data mode at a tiny shape on the CPU: ShareGPT-like lengths written as a
file:// dump (bf16 and fp8), read back through the training reader into the trainer's step; its
JSON; the same micro-batches for every consumer of a dump (what the SpecForge job relies on); a
job that times out or cannot run is an entry of the JSON."""
from __future__ import annotations

import gzip
import json
from contextlib import closing

import pytest

from benchmarks import bench_train as bt
from benchmarks import real_batches as rb

TINY = ["--device", "cpu", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--vocab", "256",
        "--draft-vocab", "64", "--tokens-per-micro-batch", "96", "--max-length", "160", "--steps", "4",
        "--warmup", "1", "--ttt", "3"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 conversations of varied length (user / assistant turns), as ShareGPT JSONL.gz."""
    path = tmp_path_factory.mktemp("corpus") / "sharegpt.jsonl.gz"
    convs = [{"id": f"c{i}", "messages": [{"role": "user", "content": "q" * (40 + 37 * (i % 5))},
                                          {"role": "assistant", "content": "a" * (60 + 91 * (i % 7))}]}
             for i in range(40)]
    path.write_bytes(gzip.compress("".join(json.dumps(c) + "\n" for c in convs).encode(), mtime=0))
    return path


def test_sharegpt_masks_follow_the_chat_template():
    conv = {"messages": [{"role": "user", "content": "x" * 8}, {"role": "assistant", "content": "y" * 10}]}
    (m,) = rb.sharegpt_masks([conv], max_length=100, chars_per_token=4)
    # BOS, 4 header + 2 user + eot, 4 header + 3 answer + eot: loss on the answer and its eot only
    assert m.tolist() == [0] + [0] * 4 + [0, 0, 0] + [0] * 4 + [1, 1, 1, 1]
    assert rb.sharegpt_masks([conv], max_length=6)[0].numel() == 6


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3"])
def test_real_data_job_reads_the_dump_through_the_reader(storage, corpus, tmp_path):
    a = bt.parse_args(TINY + ["--sharegpt-lengths", str(corpus), "--store-dir", str(tmp_path / "store")])
    where, fp, facts = bt.real_dump(a, storage)
    assert where == f"file://{(tmp_path / 'store').resolve()}" and facts["storage_dtype"] == bt.STORAGE[storage]
    assert facts["tokens"] >= 1.6 * 5 * 96 and 0 < facts["loss_share"] < 1
    assert bt.real_dump(a, storage)[2]["reused"]  # committed once, reused by the next job
    a.shards, a.dump = where, fp
    out = bt.run_real(a)
    for key in ("tokens_per_s", "steady_tokens_per_s", "data_wait_share", "graph_captures_per_100_steps",
                "capture_step_s", "graph_captures_total", "distinct_shape_keys", "reader", "batch_digests", "stopped_by"):
        assert key in out, key
    assert out["stopped_by"] == "steps" and out["steps_timed"] == 4 and out["tokens_per_s"] > 0
    assert 0 <= out["data_wait_share"] < 1 and out["graph_captures_per_100_steps"] == 0 and out["capture_step_s"] == []
    waits = out["data_wait_s_by_quarter"]  # 4 timed steps: one per quarter, adding up to the share
    assert len(waits) == 4 and sum(waits) == pytest.approx(out["data_wait_share"] * out["window_s"], abs=4e-3)
    assert out["storage_dtype"] == bt.STORAGE[storage] and len(out["batch_digests"]) == 5
    # Any other consumer of the dump (the SpecForge job, in its own process) gets the same batches;
    # another seed, other batches.
    for seed, same in ((0, True), (1, False)):
        store, _ = rb.open_dump(where, fp)
        reader = rb.open_reader(store, fp, a.max_length, seed=seed)
        digests = rb.BatchDigests()
        try:
            with closing(rb.batches(reader, 96, 160, epochs=1000)) as stream:
                for _ in range(5):
                    digests.add(next(stream)[1])
        finally:
            reader.close()
        assert rb.same_batches(digests.digests, out["batch_digests"]) == {"compared_micro_batches": 5, "same": same}


def test_all_writes_json_with_skips_and_timeouts(corpus, tmp_path):
    """--all: one entry per job, each in its own process (SpecForge skipped with its reason where it
    cannot run), a summary per dtype, the file rewritten after each job; a job past --job-timeout
    is an entry too."""
    base = TINY + ["--all", "--sharegpt-lengths", str(corpus), "--store-dir", str(tmp_path / "store"),
                   "--storage-dtypes", "float8_e4m3"]
    res = bt.run_all_real(bt.parse_args(base + ["--jobs", "specforge", "--out", str(tmp_path / "out")]))
    saved = json.loads((tmp_path / "out" / "bench_train_real.json").read_text())
    assert saved["jobs"] == res["jobs"] and saved["data"][0]["storage_dtype"] == "float8_e4m3"
    (sf,) = res["jobs"]
    assert sf["job"] == "specforge-float8_e4m3" and sf["impl"] == "specforge"
    assert sf.get("skipped") or "tokens_per_s" in sf  # skipped on a CPU-only machine, saying why
    if "skipped" in sf:
        assert res["summary"] == [{"storage_dtype": "float8_e4m3", "specforge_tokens_per_s": None,
                                   "note": sf["skipped"]}]
    late = bt.run_all_real(bt.parse_args(base + ["--jobs", "ours", "--job-timeout", "0.05", "--out",
                                                 str(tmp_path / "late")]))
    (entry,) = late["jobs"]
    assert entry["timed_out"] and entry["error"] == "timed out after 0.05 s" and entry["job"] == "ours-float8_e4m3"
    assert json.loads((tmp_path / "late" / "bench_train_real.json").read_text())["jobs"] == [entry]


def test_summary_compares_with_specforge_on_the_same_batches():
    ours = {"impl": "ours", "job": "ours-graphs-model", "tokens_per_s": 300.0, "data_wait_share": 0.01,
            "batch_digests": ["a", "b", "c"]}
    sf = {"impl": "specforge", "job": "specforge-model", "tokens_per_s": 200.0, "batch_digests": ["a", "b"]}
    row = bt.summarize_real([sf, ours], {"storage_dtype": "model"})["ours-graphs-model"]
    assert row["vs_specforge"] == 1.5 and row["batches"] == {"compared_micro_batches": 2, "same": True}
    sf["batch_digests"] = ["a", "x"]
    assert not bt.summarize_real([sf, ours], {})["ours-graphs-model"]["batches"]["same"]


def test_job_names():
    assert bt.job_flags("ours-graphs-b4") == ["--compile", "--graphs", "--graph-buckets", "4"]
    assert bt.job_flags("specforge") == ["--impl", "specforge"]
    with pytest.raises(SystemExit):
        bt.job_flags("ours-fast")


def test_a_missing_store_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench_train.py", "--shards", str(tmp_path / "none"), "--device", "cpu"])
    with pytest.raises(SystemExit) as e:
        bt.main()
    assert str(e.value) == f"bench_train: no store at file://{tmp_path / 'none'}: the directory does not exist"


def test_the_time_budget_bounds_the_timed_window_not_the_warm_up(corpus, tmp_path):
    # a budget shorter than any step: the warm-up (where compilation happens) still runs in full,
    # then one timed step, then the budget stops the job
    a = bt.parse_args(TINY + ["--sharegpt-lengths", str(corpus), "--store-dir", str(tmp_path / "store"),
                              "--warmup", "2", "--max-seconds", "1e-9"])
    a.shards, a.dump, _ = bt.real_dump(a, "bfloat16")
    out = bt.run_real(a)
    assert out["steps_warmup"] == 2 and len(out["warmup_step_s"]) == 2
    assert out["steps_timed"] == 1 and out["stopped_by"] == "time budget (1e-09 s)"


def test_quarters_keep_every_row_in_order():
    assert bt.quarters(list(range(10))) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert bt.quarters([1]) == [[1], [], [], []] and bt.quarters([]) == []


def test_a_capped_dump_is_read_again_epoch_after_epoch(corpus, tmp_path):
    """--dump-tokens: a long window over a small dump (the whole dump of an 8B-shape run would not
    fit the disk): the job reads it more than once, every step timed."""
    a = bt.parse_args(TINY + ["--sharegpt-lengths", str(corpus), "--store-dir", str(tmp_path / "store"),
                              "--dump-tokens", "300", "--steps", "8"])
    a.shards, a.dump, facts = bt.real_dump(a, "bfloat16")
    assert facts["tokens"] < 1.6 * 9 * 96  # fewer than the steps read
    out = bt.run_real(a)
    assert out["steps_timed"] == 8 and out["data_epochs_begun"] > 1


def test_the_trainer_check_needs_cuda_and_says_so(monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench_train.py", "--trainer-check"])
    monkeypatch.setattr(bt.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bt.main()
    assert str(e.value) == "bench_train: --trainer-check needs a CUDA device (train.cuda_graphs)"
