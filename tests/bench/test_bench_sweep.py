"""The bench stage end to end against real servers on loopback: the fake server (command engine,
tests/fixtures/fake_server.py --decode) through the real ServerSession, and a short sweep on the
reference engine with the tiny successor target and its crafted drafter."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drafter.stages import TABLE
from drafter.store import ObjectNotFound

from drafter.config import parse_config
from drafter.stage_output import StageOutput
from drafter.stages import bench
from tests.fixtures.bench import (FAKE, FAST, PREPARE_FP, S213, S314, S516, UPSTREAM, fake_config, free_ports,
                                  make_store, no_servers_left)
from tests.fixtures.speculative import successor_pair  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[2]


def _markers(store_root: Path, fp: str) -> dict[str, str]:
    parts = store_root / "bench" / fp / "_parts"
    out = {}
    for p in parts.rglob("*.json"):
        info = json.loads(p.read_text())
        out[info["name"]] = info["sha256"]
    return out


# ----------------------------------------------------------------------------- fake servers

def test_sweep_records_a_failed_config_and_keeps_the_others(tmp_path):
    """Baseline, 3/1/4 (accept 3 -> a real speedup), 5/1/6 (fails to start), 2/1/3; a duplicate
    is skipped. Every measurement of the healthy configs is committed and analysed."""
    store = make_store(tmp_path)
    cfg = fake_config(tmp_path, [S314, S516, S213, S314],
                      fake_args=["--token-delay-s", "0.012", "--accept-length", "3", "--draft-cost", "0.1",
                                 "--fail-if-num-steps", "5"],
                      # 64 ms measurements on a shared machine jitter by several percent; the drift
                      # check itself is tested in test_bench_units
                      bench_extra={"drift_tolerance": 0.4})
    assert cfg.bench.interleave == "auto"
    seen = []
    result = TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST,
                       progress=lambda done, total, *info: seen.append((done, total)))
    assert result.status == "done"
    meta = result.meta
    assert meta["interleave"] == "concurrent" and meta["failed"] == {"eagle3-s5-k1-d6": "crashed"}
    assert [s["config"] for s in meta["skipped"]] == ["bench.speculative.3 (EAGLE3 3/1/4)"]
    assert meta["measurements"] == 3 * 2 * 3 and meta["launches"] == 3
    assert seen[-1] == (18, 24)
    out = StageOutput.committed(store, "bench", result.fingerprint)
    names = {s.name for s in out.manifest.shards}
    assert {"report.md", "report.json", "report.png", "failed/eagle3-s5-k1-d6.json"} <= names
    assert not any(n.startswith("m/eagle3-s5") for n in names)
    failure = json.loads(out.read_shard("failed/eagle3-s5-k1-d6.json"))
    assert failure["kind"] == "crashed" and "OutOfMemoryError" in json.dumps(failure["detail"]["log_tail"])
    report = json.loads(out.read_shard("report.json"))
    rows = {(r["key"], r["batch_size"]): r for r in report["summary"]["rows"]}
    fast = rows[("eagle3-s3-k1-d4", 1)]
    assert fast["rounds"] == 3 and fast["speedup"]["verdict"] == "faster" and fast["speedup"]["low"] > 1.3
    assert fast["accept_length"]["mean"] == pytest.approx(16 / 6)  # 16 tokens in 6 cycles of 3
    # break-even = cycle time / baseline step time ~ 1.3 (draft cost 0.1 x 3 steps), plus HTTP overhead
    assert 1.15 < fast["break_even_accept_length"] < 1.7
    assert rows[(bench.BASELINE, 2)]["accept_length"] is None
    # the recommendation is the significantly faster configuration with the highest speedup
    # (2/1/3 accepts as much as 3/1/4 with a cheaper cycle; on a busy machine one slow round can
    # leave it without a significant verdict, and then it must not be recommended)
    faster = {k: r["speedup"]["speedup"] for (k, bs), r in rows.items()
              if bs == 1 and r.get("speedup") and r["speedup"]["verdict"] == "faster"}
    assert report["summary"]["recommendation"]["1"]["key"] == max(faster, key=faster.get), report["summary"]
    assert rows[("eagle3-s5-k1-d6", 1)]["rounds"] == 0
    # what the servers said they run, read back, and the saved launch environment
    launches = {l["key"]: l for l in report["launches"]}
    assert launches["eagle3-s3-k1-d4"]["settings"]["num_steps"] == 3
    assert launches["eagle3-s3-k1-d4"]["engine_version"] == "fake"
    assert launches[bench.BASELINE]["settings"]["algorithm"] is None
    assert launches[bench.BASELINE]["launch_environment"]["argv"][1] == str(FAKE)
    assert len({l["port"] for l in launches.values()}) == 3
    md = out.read_shard("report.md").decode()
    assert "failed EAGLE3 5/1/6: crashed" in md and "the 4 planned servers were launched once each" in md
    # the answer first, the table's speedup and verdict right after the configuration, the deployable
    # settings per batch size (batch sizes 1 and 2) last, as the command engine takes them
    assert re.search(r"\| EAGLE3 3/1/4 \| 1 \| \d+\.\d\dx \[[\d.]+, [\d.]+\] \| faster \|", md), md
    titles = [line for line in md.splitlines() if line.startswith("## ")]
    assert titles[0] == "## Answer" and titles[-1] == "## Deployable settings per batch size"
    assert "Engine `command`, one server per batch size" in md and "- batch 1: `--speculative-algorithm EAGLE3" in md
    assert result.headline.startswith("on engine command (speedup over no speculation, 95% interval): batch 1 faster: ")
    assert list(result.table[0])[:4] == ["config", "batch", "speedup [CI]", "verdict"]
    assert any(line.startswith("EAGLE3 3/1/4 @ batch 1: ") and " faster, accept length 2.67 vs break-even 1."
               in line for line in result.summary), result.summary
    assert result.table and result.summary[-1].startswith("report: file://")
    # interleaved: within each round every live server was measured before the next round began
    ms = sorted((json.loads(out.read_shard(n)) for n in names if n.startswith("m/")), key=lambda m: m["started_at"])
    assert [m["round"] for m in ms] == sorted(m["round"] for m in ms)
    assert [m["key"] for m in ms if m["round"] == 1][0] == "eagle3-s3-k1-d4"  # rotated start
    no_servers_left(tmp_path / "logs")
    # a second run finds the output complete and launches nothing
    logs = len(list((tmp_path / "logs").glob("*.log")))
    assert logs == 4  # three servers and the failed start
    again = TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    assert again.status == "skipped" and again.table == result.table
    assert len(list((tmp_path / "logs").glob("*.log"))) == logs


def test_relaunch_mode_starts_one_server_per_round_in_rotating_order(tmp_path):
    store = make_store(tmp_path)
    cfg = fake_config(tmp_path, [S314], fake_args=["--token-delay-s", "0.002"],
                      bench_extra={"interleave": "relaunch", "repeats": 2, "batch_sizes": [2], "num_prompts": 2})
    result = TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    report = json.loads(StageOutput.committed(store, "bench", result.fingerprint).read_shard("report.json"))
    launches = sorted(report["launches"], key=lambda l: l["started_at"])
    assert [l["key"] for l in launches] == [bench.BASELINE, "eagle3-s3-k1-d4", "eagle3-s3-k1-d4", bench.BASELINE]
    assert {l["port"] for l in launches} == {cfg.serve.port}
    assert result.meta["interleave"] == "relaunch" and result.meta["measurements"] == 4
    assert "own launch" in StageOutput.committed(store, "bench", result.fingerprint).read_shard("report.md").decode()


def test_baseline_that_fails_to_start_fails_the_stage_keeping_nothing_committed(tmp_path):
    store = make_store(tmp_path)
    cfg = fake_config(tmp_path, [S314], fake_args=["--crash-in", "kv_cache"], bench_extra={"repeats": 1})
    with pytest.raises(bench.BenchError, match="baseline server failed \\(crashed\\)") as err:
        TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    assert err.value.retryable
    assert not TABLE.output("bench", cfg, store, UPSTREAM).is_complete()


_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from drafter.config import parse_config
from drafter.stages import TABLE
from drafter.store import FileStore
from tests.fixtures.speculative import successor_pair  # noqa: F401  (fixture)
cfg = parse_config(json.load(open({cfg!r})))
TABLE.run("bench", cfg, FileStore({store!r}), upstream={upstream!r}, session_options={fast!r})
"""


def test_killed_sweep_resumes_without_repeating_finished_measurements(tmp_path):
    store = make_store(tmp_path)
    cfg = fake_config(tmp_path, [S314, S213], fake_args=["--token-delay-s", "0.008"])
    fp = TABLE.fingerprint("bench", cfg, UPSTREAM)
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(cfg.model_dump(mode="json")))
    script = _CHILD.format(root=str(ROOT), cfg=str(cfg_file), store=str(tmp_path / "store"),
                           upstream=UPSTREAM, fast=FAST)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    deadline = time.monotonic() + 120
    try:
        while True:
            measured = [n for n in _markers(tmp_path / "store", fp) if n.startswith("m/")]
            if len(measured) >= 5:
                break
            assert child.poll() is None, "the sweep ended before it could be killed"
            assert time.monotonic() < deadline, "no measurements appeared"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    before = _markers(tmp_path / "store", fp)
    finished = {n: sha for n, sha in before.items() if n.startswith("m/")}
    assert 5 <= len(finished) < 18
    # the killed driver's servers (own process groups) are stopped by their watchdogs, which
    # remove the pid files once nothing is left
    deadline = time.monotonic() + 60
    while list((tmp_path / "logs").glob("*.pid.json")):
        assert time.monotonic() < deadline, "the killed sweep's servers were not stopped"
        time.sleep(0.1)
    result = TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    assert result.status == "done" and result.meta["measurements"] == 18
    after = _markers(tmp_path / "store", fp)
    for name, sha in finished.items():
        assert after[name] == sha, f"{name} was measured again"
    report = json.loads(StageOutput.committed(store, "bench", fp).read_shard("report.json"))
    # six launches in all: three before the kill, three for what was left
    assert len(report["launches"]) == 6 and sorted({l["launch"] for l in report["launches"]}) == [0, 1]
    no_servers_left(tmp_path / "logs")


# ----------------------------------------------------------------------------- reference engine

def test_reference_engine_sweep_with_the_crafted_drafter(tmp_path, successor_pair):
    target, draft = successor_pair
    store = make_store(tmp_path, n_eval=3)
    port = free_ports(2)
    cfg = parse_config({
        "target": {"path": str(target), "name": "tiny"},
        "train": {"draft_vocab_size": 256}, "dump": {"aux_layer_ids": [0, 1, 2]},
        "serve": {"engine": "reference", "device": "cpu", "port": port, "log_dir": str(tmp_path / "logs"),
                  "draft_path": str(draft), "startup_timeout_s": 120.0, "stall_timeout_s": 60.0},
        "bench": {"speculative": [S314, {"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 4}],
                  "batch_sizes": [1], "num_prompts": 2, "max_tokens": 24, "repeats": 2, "warmup_requests": 1},
        "storage": {"root": f"file://{tmp_path / 'store'}"}})
    result = TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    meta = result.meta
    assert meta["interleave"] == "concurrent" and meta["failed"] == {} and meta["measurements"] == 4
    assert "eagle_topk must be 1" in meta["skipped"][0]["reason"]
    report = json.loads(StageOutput.committed(store, "bench", result.fingerprint).read_shard("report.json"))
    rows = {r["key"]: r for r in report["summary"]["rows"]}
    spec = rows["eagle3-s3-k1-d4"]
    assert spec["accept_length"]["mean"] > 1.5  # the crafted drafter is accepted
    assert spec["speedup"]["verdict"] in ("faster", "slower", "no measurable difference")
    assert spec["break_even_accept_length"] > 0 and rows[bench.BASELINE]["accept_length"] is None
    assert spec["ttft_s"] is None and "does not stream" in " ".join(report["notes"])
    assert "chat template token ids" in report["notes"][0]
    launches = {l["key"]: l for l in report["launches"]}
    s = launches["eagle3-s3-k1-d4"]["settings"]
    assert (s["num_steps"], s["eagle_topk"], s["num_draft_tokens"]) == (3, 1, 4)
    assert s["draft_path"] == str(draft) and launches[bench.BASELINE]["settings"]["algorithm"] is None
    assert launches[bench.BASELINE]["engine_version"]
    for m in (json.loads(StageOutput.committed(store, "bench", result.fingerprint).read_shard(n))
              for n in (x.name for x in StageOutput.committed(store, "bench", result.fingerprint).manifest.shards)
              if n.startswith("m/")):
        assert m["completion_tokens"] == 2 * 24 and m["flush_cache"] == "ok"
    no_servers_left(tmp_path / "logs")


def test_streaming_client_measures_ttft_and_inter_token_latency(tmp_path):
    """SGLang /generate and OpenAI /v1/completions SSE streams (the paths sglang and vLLM use),
    against a fake server started through the real ServerSession."""
    from drafter.bench.measure import ClientApi, measure
    from drafter.bench.plan import ServerPlan, server_config
    from drafter.config import SpeculativeConfig
    from drafter.serving.session import ServerSession

    cfg = fake_config(tmp_path, [S314], fake_args=["--token-delay-s", "0.005", "--accept-length", "2"])
    spec = server_config(cfg, ServerPlan("s", SpeculativeConfig(**S314), draft_path=cfg.serve.draft_path))
    with ServerSession(spec, strict_settings=True, **FAST) as served:
        for style in ("sglang", "openai"):
            api = ClientApi(style, stream=True, flush_cache=True, served_model_name="fake-model")
            m = measure(served.base_url, api, ["a", "b", "c"], batch_size=3, max_tokens=12, warmup_requests=1)
            assert m["completion_tokens"] == 36 and m["flush_cache"] == "ok"
            # 6 cycles of 2 tokens, 6.5 ms each: first chunk after one cycle, then 5 more for 11 tokens
            assert 0.005 < m["ttft_s"] < m["latency_s"]
            assert 0.0065 * 5 / 11 * 0.8 < m["itl_s"] < 0.05
            if style == "sglang":
                assert m["accept_length"] == pytest.approx(2.0) and m["verify_ct"] == 18
            else:
                assert m["accept_length"] is None  # OpenAI answers carry no speculative counters
    no_servers_left(tmp_path / "logs")


def test_drafter_from_the_export_output_and_what_the_fingerprint_covers(tmp_path):
    store = make_store(tmp_path)
    export = StageOutput(store, "export", "feedfacefeedface")
    export.write_shard("sglang/config.json", b'{"architectures": ["LlamaForCausalLMEagle3"]}')
    export.write_shard("sglang/model.safetensors", b"weights")
    export.commit()
    from drafter.stages.drafters import export_dir

    cfg = fake_config(tmp_path, [S314])
    got = Path(export_dir(cfg, store, "feedfacefeedface"))
    assert got.name == "export-feedfacefeedface" and got.parent == (Path(cfg.serve.log_dir).parent / "drafters").resolve()
    assert sorted(p.name for p in got.iterdir()) == ["config.json", "model.safetensors"]
    stamp = (got / "model.safetensors").stat().st_mtime_ns
    assert Path(export_dir(cfg, store, "feedfacefeedface")) == got
    assert (got / "model.safetensors").stat().st_mtime_ns == stamp  # verified copy kept, not re-fetched
    with pytest.raises(ObjectNotFound, match="export is not committed"):
        export_dir(cfg, store, "0000000000000000")

    no_dir = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"draft_path": None})})
    up = {"prepare": PREPARE_FP, "export": "feedfacefeedface"}
    fp = TABLE.fingerprint("bench", no_dir, up)
    assert TABLE.fingerprint("bench", no_dir, {**up, "export": "1111111111111111"}) != fp
    assert TABLE.fingerprint("bench", no_dir, {**up, "prepare": "2222222222222222"}) != fp
    # operational settings do not change what the sweep is; bench output fields do
    moved = no_dir.model_copy(update={"serve": no_dir.serve.model_copy(update={"port": 1234}),
                                      "bench": no_dir.bench.model_copy(update={"request_timeout_s": 5.0})})
    assert TABLE.fingerprint("bench", moved, up) == fp
    more = no_dir.model_copy(update={"bench": no_dir.bench.model_copy(update={"repeats": 5})})
    assert TABLE.fingerprint("bench", more, up) != fp
    # bench.accept_curve: off (the default) leaves the fingerprint as it was before the option existed
    from drafter.config import fingerprint_fields
    from drafter.stage_output import fingerprint as stage_fingerprint

    inputs = bench.inputs(bench.StageContext(no_dir, store, up))
    section = {k: v for k, v in fingerprint_fields(no_dir.bench).items() if k != "accept_curve"}
    assert bench.fingerprint(inputs) == stage_fingerprint("bench", {
        "bench": section, "serve": {k: v for k, v in fingerprint_fields(no_dir.serve).items()
                                    if k not in ("speculative", "draft_path")},
        "target": {"served_name": no_dir.target.served_name, "dtype": no_dir.target.dtype,
                   **bench.target_identity(no_dir.target)}, "drafter": inputs.drafters.identity}, [PREPARE_FP])
    curve = no_dir.model_copy(update={"bench": no_dir.bench.model_copy(update={"accept_curve": [2.0]})})
    assert TABLE.fingerprint("bench", curve, up) != fp
    # serve.draft_path set: its content is the identity, the export is not needed
    with_dir = TABLE.fingerprint("bench", cfg, {"prepare": PREPARE_FP})
    (Path(cfg.serve.draft_path) / "model.safetensors").write_bytes(b"other weights")
    assert TABLE.fingerprint("bench", cfg, {"prepare": PREPARE_FP}) != with_dir
    with pytest.raises(bench.BenchError, match="no drafter"):
        TABLE.fingerprint("bench", no_dir, {"prepare": PREPARE_FP})
