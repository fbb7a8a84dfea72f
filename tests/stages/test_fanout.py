"""The fan-out rule in the library (drafter.fanout, drafter.stages.base): contiguous ranges, children
that compute and never commit, the parent that relaunches a lost child, fails naming a failed
range, and commits once; the output byte-identical to `workers: 1`. Children here are threads of
this process running the real stage code (the Prefect children: tests/core/test_fanout_prefect.py)."""
from __future__ import annotations

import hashlib
import threading

import pytest

from drafter.fanout import (ChildState, PlanChanged, RangesFailed, RangeTask, child_config, done_line, lease_key,
                            run_ranges, split_ranges)
from drafter.stage_output import StageOutput
from drafter.stages import TABLE
from drafter.store import open_store
from tests.fixtures.datagen_fakes import fakes, make_cfg, prepared, sharegpt, with_datagen  # noqa: F401
from tests.fixtures.dump_stage import convs, make_cfg as dump_cfg, put_prepared  # noqa: F401


def test_ranges_are_contiguous_near_equal_and_cover_the_plan():
    units = [f"s{i}" for i in range(10)]
    ranges = split_ranges(units, 3)
    assert [(r.start, r.stop) for r in ranges] == [(0, 4), (4, 7), (7, 10)]
    assert [(r.first, r.last, r.label) for r in ranges][1] == ("s4", "s6", "shards 4-6")
    assert len(split_ranges(units[:2], 5)) == 2 and split_ranges(units[:1], 3)[0].label == "shard 0"


def test_a_childs_own_server_moves_with_its_health_url(tmp_path):
    cfg = make_cfg(tmp_path, _storage(tmp_path), [sharegpt(0)])
    cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={
        "engine": "command", "command": ["serve", "--port", "{port}"], "port": 30000,
        "health_url": "http://127.0.0.1:30000/health"})})
    [first, third] = [split_ranges(["s0", "s1", "s2"], 3)[i] for i in (0, 2)]
    assert child_config(cfg, first).serve == cfg.serve
    moved = child_config(cfg, third).serve
    assert (moved.port, moved.health_url) == (30002, "http://127.0.0.1:30002/health")
    elsewhere = cfg.serve.model_copy(update={"health_url": "http://10.0.0.5:9000/ready"})  # another port: kept
    assert elsewhere.on_port(30002).health_url == "http://10.0.0.5:9000/ready"


class ThreadLauncher:
    """Each child a thread running `TABLE.run(..., range_task=...)`. `silent` attempts run but never
    beat their lease (a machine that died); `stuck` attempts stay taken by a worker and never start
    (the worker died before starting them); `failing` ranges raise in the child."""

    def __init__(self, cfg, store, silent=(), stuck=(), failing=()):
        self.cfg, self.store, self.silent, self.stuck, self.failing = cfg, store, set(silent), set(stuck), set(failing)
        self.job = None
        self.launched, self.lost, self.cancelled = [], [], []

    def launch(self, part, attempt):
        self.launched.append((part.label, attempt))
        child = {"state": ChildState("running"), "key": (part.index, attempt)}
        if (part.index, attempt) in self.silent:
            return child
        if (part.index, attempt) in self.stuck:
            child["state"] = ChildState("starting")
            return child
        spec = RangeTask(part, self.job.fingerprint, self.job.plan, attempt, lease_interval_s=0.05)

        def run():
            try:
                if part.index in self.failing:
                    raise RuntimeError(f"planted failure in {part.label}")
                TABLE.run(self.job.stage, child_config(self.cfg, part), self.store, upstream=self.job.upstream,
                          range_task=spec)
                child["state"] = ChildState("done")
            except Exception as err:
                child["state"] = ChildState("failed", str(err))

        child["thread"] = threading.Thread(target=run, daemon=True)
        child["thread"].start()
        return child

    def state(self, child):
        return child["state"]

    def mark_lost(self, child, why):
        self.lost.append((child["key"], why))

    def cancel(self, children):
        self.cancelled += [c["key"] for c in children]

    def fan_out(self, job, lease_timeout_s=2.0, start_timeout_s=60.0):
        self.job = job
        return run_ranges(job, self, self.store, attempts=2, lease_timeout_s=lease_timeout_s,
                          start_timeout_s=start_timeout_s, poll_s=0.02)


def shard_digests(store, stage, manifest):
    out = StageOutput(store, stage, manifest.fingerprint)
    return {s.name: hashlib.sha256(out.read_shard(s.name)).hexdigest() for s in manifest.shards}


def test_datagen_fanned_out_is_byte_identical_to_one_worker(tmp_path, fakes):
    fake = fakes(delay_s=0.01)
    rows = [sharegpt(i, turns=1 + i % 2) for i in range(14)]
    results = {}
    for workers in (1, 3):
        cfg = with_datagen(make_cfg(tmp_path, _storage(tmp_path / f"w{workers}"), rows,
                                    shard_size=2), workers=workers, server_urls=[fake.url])
        store = open_store(cfg.storage)
        launcher = ThreadLauncher(cfg, store)
        results[workers] = (store, TABLE.run("datagen", cfg, store, upstream={"prepare": prepared(cfg, store)},
                                             fan_out=launcher.fan_out), launcher)
    (store1, one, _), (store3, three, launcher) = results[1], results[3]
    assert one.fingerprint == three.fingerprint  # workers is operational: the same output
    assert sorted(launcher.launched) == [("shards 0-2", 1), ("shards 3-4", 1), ("shards 5-6", 1)]
    assert shard_digests(store1, "datagen", one.manifest) == shard_digests(store3, "datagen", three.manifest)
    assert three.manifest.meta["fan_out"]["ranges"] == 3
    assert not store3.list("_fanout/")  # each child removed its lease


def test_dump_relaunches_a_lost_child_and_equals_one_worker(tmp_path, tiny_target, convs):
    digests = {}
    for workers in (1, 3):
        cfg = dump_cfg(tiny_target, f"file://{tmp_path}/w{workers}", workers=workers)
        store = open_store(cfg.storage)
        fp = put_prepared(store, convs)
        launcher = ThreadLauncher(cfg, store, silent={(1, 1)})  # range 1's first machine dies at once
        result = TABLE.run("dump", cfg, store, upstream={"prepare": fp}, fan_out=launcher.fan_out)
        digests[workers] = shard_digests(store, "dump", result.manifest)
    assert launcher.launched == [("shards 0-1", 1), ("shard 2", 1), ("shard 3", 1), ("shard 2", 2)]
    assert [key for key, _ in launcher.lost] == [(1, 1)] and "no lease beat" in launcher.lost[0][1]
    assert result.manifest.meta["fan_out"]["relaunched"][0].startswith("shard 2: attempt 1 lost")
    assert digests[1] == digests[3] and len(digests[3]) == 4


def test_a_child_taken_but_never_started_is_relaunched(tmp_path, fakes):
    fake = fakes()
    cfg = with_datagen(make_cfg(tmp_path, _storage(tmp_path), [sharegpt(i) for i in range(6)], shard_size=2),
                       workers=3, server_urls=[fake.url])
    store = open_store(cfg.storage)
    launcher = ThreadLauncher(cfg, store, stuck={(0, 1)})  # range 0's worker took it, then died
    result = TABLE.run("datagen", cfg, store, upstream={"prepare": prepared(cfg, store)},
                       fan_out=lambda job: launcher.fan_out(job, start_timeout_s=0.5))
    assert sorted(launcher.launched) == [("shard 0", 1), ("shard 0", 2), ("shard 1", 1), ("shard 2", 1)]
    assert [key for key, _ in launcher.lost] == [(0, 1)] and "not started after" in launcher.lost[0][1]
    assert result.manifest.meta["generated"] == 6


def test_a_child_queued_for_a_worker_is_never_lost(tmp_path):
    """Queued (no worker free, or none on the pool) is the pool's business: the status line says so."""
    from drafter.fanout import FanOut

    class Queued:
        polls, lost = 0, []

        def launch(self, part, attempt):
            return attempt

        def state(self, handle):
            self.polls += 1
            return ChildState("waiting") if self.polls < 30 else ChildState("done")

        def mark_lost(self, handle, why):
            self.lost.append(why)

        def cancel(self, handles):
            pass

    launcher, lines = Queued(), []
    job = FanOut("datagen", "fp", {}, "plan", split_ranges(["s0", "s1"], 1), 1)
    figures = run_ranges(job, launcher, open_store(_storage(tmp_path)), attempts=2, lease_timeout_s=0.01,
                         start_timeout_s=0.01, poll_s=0.01, on_status=lines.append)
    assert launcher.lost == [] and figures["attempts"] == 1
    assert lines == ["datagen: 0 of 1 ranges done, 0 failed (1 waiting)", "datagen: 1 of 1 ranges done, 0 failed"]
    assert done_line("datagen", figures) == "datagen: 1 of 1 ranges done, 0 failed (1 launched here)"


def test_a_failed_range_fails_the_stage_naming_it_and_a_rerun_launches_only_it(tmp_path, fakes):
    fake = fakes()
    cfg = with_datagen(make_cfg(tmp_path, _storage(tmp_path), [sharegpt(i) for i in range(12)], shard_size=2),
                       workers=3, server_urls=[fake.url])
    store = open_store(cfg.storage)
    fp = prepared(cfg, store)
    failing = ThreadLauncher(cfg, store, failing={2})
    with pytest.raises(RangesFailed, match=r"datagen: 1 of 3 ranges failed: shards 4-5 \(failed: planted failure "
                                           r"in shards 4-5\); 2 launched ranges done"):
        TABLE.run("datagen", cfg, store, upstream={"prepare": fp}, fan_out=failing.fan_out)
    out = TABLE.output("datagen", cfg, store, {"prepare": fp})
    assert not out.is_complete() and sorted(out.completed_shards()) == [f"gen-{i:05d}.jsonl" for i in range(4)]
    again = ThreadLauncher(cfg, store)
    result = TABLE.run("datagen", cfg, store, upstream={"prepare": fp}, fan_out=again.fan_out)
    assert again.launched == [("shards 4-5", 1)]  # the finished ranges are the store's, not relaunched
    assert result.manifest.meta["generated"] == 12


def test_a_child_refuses_a_plan_other_than_its_parents(tmp_path, fakes):
    fake = fakes()
    cfg = with_datagen(make_cfg(tmp_path, _storage(tmp_path), [sharegpt(i) for i in range(4)]),
                       server_urls=[fake.url])
    store = open_store(cfg.storage)
    fp = prepared(cfg, store)
    out = TABLE.output("datagen", cfg, store, {"prepare": fp})
    part = split_ranges(["gen-00000.jsonl", "gen-00001.jsonl"], 2)[1]
    with pytest.raises(PlanChanged, match="the plan changed since the parent made it"):
        TABLE.run("datagen", cfg, store, upstream={"prepare": fp},
                  range_task=RangeTask(part, out.fingerprint, "0" * 16))
    with pytest.raises(PlanChanged, match="its parent's ffff"):
        TABLE.run("datagen", cfg, store, upstream={"prepare": fp}, range_task=RangeTask(part, "ffff" * 4, "0" * 16))
    assert not fake.received and not store.list(lease_key("datagen", out.fingerprint, part, 1))


def _storage(path):
    from drafter.config import StorageConfig

    return StorageConfig(root=f"file://{path}/store")
