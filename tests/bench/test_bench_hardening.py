"""Issue 21, second round, against real servers on loopback: a bench failure is never repeated
from its record (a transient one is retried, a refusal keeps its evidence, says what to change
and is re-checked), and the held-out prompts that cannot fit the target's context are dropped
before any server starts."""
from __future__ import annotations

import json
import os
import pickle
import socket
from pathlib import Path

import pytest

from drafter.stages import TABLE
from drafter.bench.measure import MeasurementError
from drafter.config import parse_config
from drafter.errors import exit_code
from drafter.stage_output import StageOutput, to_jsonl
from drafter.stages import bench
from drafter.store import FileStore
from tests.fixtures.bench import (FAST, PREPARE_FP, S314, UPSTREAM, fake_config, free_ports, make_store,
                                  no_servers_left)
from tests.fixtures.speculative import successor_pair  # noqa: F401  (fixture)

FAKE_FAST = ["--token-delay-s", "0.002"]
ONE_ROUND = {"repeats": 1, "batch_sizes": [1], "num_prompts": 2}
# a first user turn far longer than the tiny target's 512 positions
LONG = "Question: " + " ".join(f"w{i}" for i in range(600))


def shards(store, fp: str) -> set[str]:
    return {s.name for s in StageOutput.committed(store, "bench", fp).manifest.shards}


# ----------------------------------------------------------------------------- 1. failures

def test_measurement_error_is_retryable_unless_the_server_refused_the_request():
    assert not MeasurementError("HTTP 400", 400).retryable
    assert not MeasurementError("HTTP 404", 404).retryable
    assert all(MeasurementError("x", s).retryable for s in (None, 408, 429, 500, 503))
    again = pickle.loads(pickle.dumps(MeasurementError("HTTP 400", 400)))  # crosses process boundaries
    assert again.status == 400 and not again.retryable


def test_baseline_port_taken_is_retryable_and_the_next_run_retries_it(tmp_path):
    store = make_store(tmp_path)
    cfg = fake_config(tmp_path, [S314], fake_args=FAKE_FAST, bench_extra=ONE_ROUND)
    holder = socket.create_server(("127.0.0.1", cfg.serve.port))  # another process's server, in effect
    try:
        with pytest.raises(bench.BenchError) as err:
            TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    finally:
        holder.close()
    msg = str(err.value)
    assert err.value.retryable and exit_code(err.value) == 3
    assert "baseline server failed (port_taken)" in msg and f"pid {os.getpid()}" in msg
    assert "set serve.port" in msg and "delete" not in msg
    record = json.loads(TABLE.output("bench", cfg, store, UPSTREAM).read_shard("failed/baseline.json"))
    assert record["kind"] == "port_taken" and record["retryable"] and record["attempts"] == 1
    # the port is free again: the re-run retries the baseline instead of repeating the record
    result = TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    assert result.status == "done" and result.meta["failed"] == {} and result.meta["measurements"] == 2
    assert "failed/baseline.json" not in shards(store, result.fingerprint)
    report = json.loads(StageOutput.committed(store, "bench", result.fingerprint).read_shard("report.json"))
    assert "baseline (no speculation) failed in an earlier run (port_taken): re-checked" in " ".join(report["notes"])
    no_servers_left(tmp_path / "logs")


def test_a_speculative_server_whose_port_is_taken_holds_the_report_back(tmp_path):
    """Another process's port says nothing about the configuration: no report is committed with it
    missing (a head-to-head would veto the challenger for good); the re-run measures only it."""
    store = make_store(tmp_path)
    cfg = fake_config(tmp_path, [S314], fake_args=FAKE_FAST, bench_extra=ONE_ROUND)
    holder = socket.create_server(("127.0.0.1", cfg.serve.port + 1))  # concurrent: the second server's
    try:
        with pytest.raises(bench.BenchError, match=r"port taken: EAGLE3 3/1/4: .*already in use") as err:
            TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    finally:
        holder.close()
    assert err.value.retryable and not TABLE.output("bench", cfg, store, UPSTREAM).is_complete()
    result = TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    assert result.status == "done" and result.meta["failed"] == {}
    assert result.meta["launches"] == 2  # the baseline was measured once, in the first run
    no_servers_left(tmp_path / "logs")


# ----------------------------------------------------------------------------- reference engine

def store_with(tmp_path: Path, questions: list[str]) -> FileStore:
    store = FileStore(tmp_path / "store")
    out = StageOutput(store, "prepare", PREPARE_FP)
    rows = [{"id": f"e{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}]}
            for i, q in enumerate(questions)]
    out.write_shard("train.jsonl", to_jsonl([]))
    out.write_shard("eval.jsonl", to_jsonl(rows))
    out.write_shard("quarantine.jsonl", to_jsonl([]))
    out.commit()
    return store


def reference_config(tmp_path: Path, target: Path, **bench_extra):
    return parse_config({
        "target": {"path": str(target), "name": "tiny"}, "dump": {"aux_layer_ids": [0, 1, 2]},
        "serve": {"engine": "reference", "device": "cpu", "port": free_ports(1), "log_dir": str(tmp_path / "logs"),
                  "startup_timeout_s": 120.0, "stall_timeout_s": 60.0},
        "bench": {"speculative": [], "batch_sizes": [1], "num_prompts": 3, "max_tokens": 16, "repeats": 1,
                  "warmup_requests": 0, **bench_extra},
        "storage": {"root": f"file://{tmp_path / 'store'}"}})


def test_a_refused_request_keeps_its_evidence_says_what_to_change_and_is_rechecked(
        tmp_path, successor_pair, monkeypatch):
    """The issue's case: a prompt longer than the target's 512 positions, answered 400 by the real
    reference server. The first run sends it (the context check switched off, as before it
    existed); the re-run drops it, re-measures the baseline and clears the record."""
    target, _ = successor_pair
    store = store_with(tmp_path, ["Question 1: tell me about 1", LONG, "Question 3: tell me about 3"])
    cfg = reference_config(tmp_path, target)
    with monkeypatch.context() as m:
        m.setattr("drafter.bench.prompts.target_context", lambda cfg: None)
        with pytest.raises(bench.BenchError) as err:
            TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    msg = str(err.value)
    assert not err.value.retryable and exit_code(err.value) == 4  # the same request would be refused again
    assert "baseline server failed (request_refused)" in msg and "HTTP 400" in msg
    assert "does not fit the context length 512" in msg and "bench.max_tokens" in msg and "delete" not in msg
    record = json.loads(TABLE.output("bench", cfg, store, UPSTREAM).read_shard("failed/baseline.json"))
    assert record["kind"] == "request_refused" and record["detail"]["http_status"] == 400
    assert Path(record["detail"]["log_path"]).is_file()

    result = TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    assert result.status == "done" and result.meta["failed"] == {} and result.meta["measurements"] == 1
    assert result.meta["prompts"] == 2 and result.meta["prompts_dropped"] == 1
    assert "failed/baseline.json" not in shards(store, result.fingerprint)
    report = json.loads(StageOutput.committed(store, "bench", result.fingerprint).read_shard("report.json"))
    assert report["prompts"] == {"used": 2, "dropped_too_long": 1, "context": 512}
    notes = " ".join(report["notes"])
    assert "1 of the first 3 dropped: prompt tokens + bench.max_tokens 16 > the target's context 512" in notes
    assert "failed in an earlier run (request_refused): re-checked" in notes
    no_servers_left(tmp_path / "logs")


# ----------------------------------------------------------------------------- 2. preflight

def test_no_prompt_that_fits_the_context_is_refused_by_name_before_any_server_starts(tmp_path, successor_pair):
    target, _ = successor_pair
    store = store_with(tmp_path, ["Question 1: tell me about 1", LONG])
    cfg = reference_config(tmp_path, target, max_tokens=510)  # no room left even for a short question
    with pytest.raises(bench.BenchError, match=r"no held-out prompt fits the target's context: all 2 need more "
                                               r"than max_position_embeddings 512 .*bench.max_tokens 510") as err:
        TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    shortest = int(str(err.value).split("the shortest has ")[1].split()[0])
    assert f"set bench.max_tokens to at most {512 - shortest}" in str(err.value)
    assert not list((tmp_path / "logs").glob("*.log"))  # refused before launching anything
