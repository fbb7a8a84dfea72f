"""Accept length by context position on a small trained chain: prepare -> datagen -> dump -> train
-> export on a small trained target (reference engine, CPU), as `make demo` chains them. The
training samples are short (a one-line prompt and a 16-token answer), the judge generates 128
tokens: the curve runs past every trained length, and the export says so bucket by bucket from
the dump's recorded sample lengths. Prints the export's lines (pytest -s), the README's figure."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafter.config import parse_config
from drafter.stage_output import StageOutput
from drafter.stages import TABLE
from drafter.store import FileStore
from tests.fixtures.bench import FAST
from tests.fixtures.net import free_port_block
from tests.fixtures.targets import tiny_target_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_cpu_thread")]


@pytest.fixture(scope="module")
def small_target(tmp_path_factory, tiny_conversations) -> Path:
    from drafter.demo_target import build_demo_target

    out = tmp_path_factory.mktemp("targets") / "small"
    build_demo_target(tiny_target_config(max_steps=200), out, conversations=tiny_conversations)
    return out


def test_a_drafter_trained_on_short_samples_is_judged_past_them_and_told_so(tmp_path, small_target):
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": f"Tell me about number {i}."}]}) + "\n" for i in range(40)))
    store_dir = tmp_path / "store"
    cfg = parse_config({
        "name": "context-curve",
        "target": {"path": str(small_target)},
        "data": {"sources": [{"kind": "jsonl", "path": str(corpus)}], "eval_fraction": 0.2},
        "datagen": {"max_tokens": 16, "shard_size": 16},
        "dump": {"aux_layer_ids": [0, 1, 2], "max_length": 64, "samples_per_shard": 8, "devices": ["cpu"]},
        "train": {"draft_vocab_size": 64, "epochs": 30, "learning_rate": 0.005, "ttt_length": 2},
        "export": {"eval_prompts": 8, "judge_max_new_tokens": 128, "judge_num_steps": 3, "min_accept_ratio": 0.01,
                   "min_accept_length": 1.0, "device": "cpu"},
        "serve": {"engine": "reference", "device": "cpu", "port": free_port_block(2),
                  "log_dir": str(tmp_path / "logs"), "extra_args": ["--cpu-threads", "1"],
                  "startup_timeout_s": 180, "stall_timeout_s": 90},
        "storage": {"root": f"file://{store_dir}"}})
    store = FileStore(store_dir)
    fps = TABLE.fingerprints(cfg, store=store)
    for stage in ("prepare", "datagen", "dump", "train"):
        TABLE.run(stage, cfg, store, fingerprints=fps, session_options=FAST)
    dump = StageOutput.committed(store, "dump", fps["dump"]).manifest
    lengths = [n for s in dump.shards if s.meta.get("split") == "train" for n in s.meta["sample_tokens"]]
    assert len(lengths) == dump.meta["num_samples"] and sum(lengths) == dump.meta["num_tokens"]
    longest = max(lengths)
    assert longest <= 64

    result = TABLE.run("export", cfg, store, fingerprints=fps)
    print("\n".join(result.summary))
    judge = result.meta["judge"]
    curve = judge["by_context"]
    assert judge["training_lengths"]["recorded_samples"] == len(lengths)
    assert sum(b["blocks"] for b in curve) == judge["verifies"]
    for b in curve:
        assert b["trained_samples_reaching"] == sum(n > b["lo"] for n in lengths)
    past = [b for b in curve if b["lo"] >= longest]
    assert past and all(b["trained_samples_reaching"] == 0 for b in past)
    assert any(b["blocks"] for b in past)  # the judge ran there
    lines = [s for s in result.summary if s.startswith("  [")]
    assert len(lines) == len(curve)
    assert all(line.endswith("— untrained at these lengths") for line, b in zip(lines, curve) if b in past)
