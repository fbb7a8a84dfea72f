"""Adding an engine is one module plus one registry line: a test-only engine
(tests/fixtures/fake_engine.py) is registered by that line and the config accepts it, the serve
stage serves with it and the bench stage sweeps with it, every engine fact coming from its class."""
from __future__ import annotations

import json
import sys

import pytest

from drafter import engine_registry
from drafter.config import ConfigError, parse_config
from drafter.engine_registry import ENGINES, make_engine
from drafter.server_errors import ServerConfigError
from drafter.stage_output import StageOutput
from drafter.stages import TABLE
from tests.fixtures import fake_engine
from tests.fixtures.bench import FAST, S314, UPSTREAM, free_ports, make_drafter, make_store, no_servers_left


@pytest.fixture
def toy(monkeypatch):
    """The one line that adds an engine, as the registry documents it."""
    monkeypatch.setitem(ENGINES, fake_engine.NAME, fake_engine.REGISTRY_LINE)
    monkeypatch.setattr(fake_engine.ToyEngine, "asked", [])
    return fake_engine.ToyEngine


def toy_config(tmp_path, speculative=(), **bench):
    port = free_ports(3)
    (tmp_path / "target").mkdir(exist_ok=True)  # preflight checks a local model path
    return parse_config({
        "target": {"path": str(tmp_path / "target"), "name": "fake-model", "num_hidden_layers": 32,
                   "vocab_size": 64000},
        "serve": {"engine": "toy", "port": port, "log_dir": str(tmp_path / "logs"),
                  "draft_path": str(make_drafter(tmp_path)), "speculative": S314,
                  "extra_args": ["--token-delay-s", "0.004", "--accept-length", "3", "--draft-cost", "0.1"],
                  "stall_timeout_s": 10.0, "startup_timeout_s": 30.0},
        "bench": {"speculative": list(speculative), "batch_sizes": [1], "num_prompts": 3, "max_tokens": 12,
                  "repeats": 2, "warmup_requests": 1, "drift_tolerance": 0.9, **bench},
        "storage": {"root": f"file://{tmp_path / 'store'}"}})


def test_an_unregistered_engine_is_one_line_for_the_user(tmp_path):
    with pytest.raises(ConfigError) as err:
        toy_config(tmp_path)
    assert "serve.engine: Input should be 'reference', 'sglang', 'vllm' or 'command'" in str(err.value)
    with pytest.raises(ServerConfigError, match=r"^unknown engine 'toy' \(known: command, reference, sglang, vllm\)$"):
        make_engine("toy")


def test_the_registry_names_every_engine_and_imports_none():
    """The config's choices are the registry's; each name is its engine's `name`."""
    import subprocess

    code = ("import sys, drafter.config, drafter.engine_registry as r; "
            "print(sorted(m for m in sys.modules if m.startswith('drafter.engines')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    for name in engine_registry.ENGINES:
        assert make_engine(name).name == name


def test_the_serve_stage_serves_with_a_registered_engine(tmp_path, toy):
    cfg = toy_config(tmp_path)
    assert cfg.serve.engine == "toy"
    result = TABLE.run("serve", cfg, make_store(tmp_path), upstream={})
    report = result.meta
    assert result.status == "ready" and report["engine"] == "toy", report["message"]
    assert report["settings"]["num_steps"] == 3 and report["settings_mismatch"] == []
    assert report["layer_ids"] == {"checked": False, "why": "toy reads our ids as they are"}
    assert report["sglang_rules"] == {"source": "toy rules"} and "toy rules: toy rules" in report["notes"]
    assert toy.asked == ["check_layer_ids", "launch_rules"]
    launch = json.loads(open(report["launch_path"]).read())
    assert launch["engine"] == "toy" and launch["argv"][1] == str(fake_engine.FAKE)
    no_servers_left(tmp_path / "logs")


def test_the_bench_stage_sweeps_with_a_registered_engine(tmp_path, toy):
    cfg = toy_config(tmp_path, [S314, {**S314, "eagle_topk": 2, "num_draft_tokens": 4}])
    store = make_store(tmp_path)
    result = TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    assert result.status == "done"
    meta = result.meta
    assert meta["engine"] == "toy" and meta["interleave"] == "concurrent"  # runs_without_gpu
    assert meta["failed"] == {} and meta["launches"] == 2
    assert [s["reason"] for s in meta["skipped"]] == ["not valid for engine 'toy': toy drafts a chain, not eagle_topk=2"]
    out = StageOutput.committed(store, "bench", result.fingerprint)
    report = json.loads(out.read_shard("report.json"))
    launches = {l["key"]: l for l in report["launches"]}
    assert launches["eagle3-s3-k1-d4"]["settings"]["num_steps"] == 3
    # the facts the sweep asked the engine: SGLang's API, streaming, cache flush, no counters
    assert launches["eagle3-s3-k1-d4"]["client_api"] == {**launches["eagle3-s3-k1-d4"]["client_api"],
                                                         "style": "sglang", "stream": True, "flush_cache": True,
                                                         "counters": False}
    assert launches["eagle3-s3-k1-d4"]["engine_version"]
    assert not any("not measured" in n for n in report["notes"])  # it streams: no note
    rows = {(r["key"], r["batch_size"]): r for r in report["summary"]["rows"]}
    assert rows[("eagle3-s3-k1-d4", 1)]["rounds"] == 2
    ms = [json.loads(out.read_shard(n)) for n in (s.name for s in out.manifest.shards) if n.startswith("m/")]
    assert ms and all(m["ttft_s"] is not None for m in ms)
    no_servers_left(tmp_path / "logs")
