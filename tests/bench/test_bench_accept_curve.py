"""The accept-length curve on a small demo: prepare -> datagen -> dump -> train -> export -> bench on
a small trained target (reference engine, CPU), as `make demo` chains them, without Prefect.

The target learns one passage by heart (its answer to every prompt, confidently: the same tokens on
any machine). The drafter is trained on the target's first 48 answer tokens and the bench asks for
64: it is accepted on every draft of the first 48 and on next to none past them, ~2.25 tokens per
verify at 3/1/4 (the offline judge's figure too): inside the curve, not at its end, by construction.
A target barely trained on ShareGPT (200 steps, loss ~5.3: next-token probabilities within a few
thousandths of each other) answers whatever its near-ties give on that machine's floats: here one
token over and over ("eeee..."), which any drafter predicts after two optimizer steps (4.0, the
curve's end); the fixture refuses a degenerate target.

The export prints that no curve is stored yet; the bench serves the trained drafter and, in the same
interleaved sweep, the same setting with acceptance forced at 1.0 .. 3.0 tokens per verify; the
drafter's measured speedup and the speedup the curve predicts at its measured accept length agree
within their intervals; the export, asked again, prints the speedup its offline accept length
predicts from the stored curve.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafter.bench.predict import predict
from drafter.config import parse_config
from drafter.stage_output import StageOutput
from drafter.stages import TABLE
from drafter.store import FileStore
from tests.fixtures.bench import FAST, no_servers_left
from tests.fixtures.net import free_port_block
from tests.fixtures.targets import tiny_target_config

pytestmark = pytest.mark.slow

S314 = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
CURVE = [1.0, 1.5, 2.0, 2.5, 3.0, 4.0]


# What the target learns to answer to every prompt: ~170 tokens of its own tokenizer, past what
# the bench generates (64), so every answer the drafter is judged on is this passage.
PASSAGE = (
    "Numbers are ideas before they are symbols. A shepherd who counts sheep with pebbles keeps one pebble "
    "for each animal, and the pile grows or shrinks with the flock. Later people carved marks on bones and "
    "pressed wedges into clay, so that a count could travel to a market far away. The digits we write today "
    "came from India through Baghdad to Europe, where merchants learned that ten signs and a place for each "
    "power of ten were enough to write any number at all. Zero was the hardest idea of the set: a sign for "
    "nothing that still holds a place. With it, adding long columns became a skill that a child could learn "
    "in school, and the abacus slowly left the counting house.")
TRAINED_TOKENS = 48  # datagen.max_tokens: the drafter learns the passage's first 48 tokens
BENCH_TOKENS = 64  # bench.max_tokens and the judge's: 16 tokens past them


@pytest.fixture(scope="module")
def small_target(tmp_path_factory) -> Path:
    """A tiny Llama that answers PASSAGE to "Tell me about number <i>." (200 steps, ~10 s; 128-token
    windows, so the positions the judge and the bench reach, prompt + 64, are ones it trained at)."""
    from drafter.demo_target import build_demo_target

    conversations = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me about number {i}."},
                                                  {"role": "assistant", "content": PASSAGE}]} for i in range(210)]
    out = tmp_path_factory.mktemp("targets") / "small"
    report = build_demo_target(tiny_target_config(max_steps=200, seq_len=128, fail_on_degenerate=True), out,
                               conversations=conversations)
    assert report["answers"]["mean_distinct_tokens"] > 40, report["answers"]  # the passage, not a loop
    return out


def test_predicted_and_measured_speedup_agree_on_a_trained_drafter(tmp_path, small_target):
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": f"Tell me about number {i}."}]}) + "\n" for i in range(40)))
    store_dir = tmp_path / "store"
    cfg = parse_config({
        "name": "curve-demo",
        "target": {"path": str(small_target)},
        "data": {"sources": [{"kind": "jsonl", "path": str(corpus)}], "eval_fraction": 0.2},
        "datagen": {"max_tokens": TRAINED_TOKENS, "shard_size": 16},
        "dump": {"aux_layer_ids": [0, 1, 2], "max_length": 96, "samples_per_shard": 8, "devices": ["cpu"]},
        "train": {"draft_vocab_size": 64, "epochs": 30, "learning_rate": 0.005, "ttt_length": 2},
        "export": {"eval_prompts": 8, "judge_max_new_tokens": BENCH_TOKENS, "judge_num_steps": 3,
                   "min_accept_ratio": 0.01, "min_accept_length": 1.0, "device": "cpu"},
        "serve": {"engine": "reference", "device": "cpu", "port": free_port_block(len(CURVE) + 2),
                  "log_dir": str(tmp_path / "logs"), "extra_args": ["--cpu-threads", "1"], "speculative": S314,
                  "startup_timeout_s": 180, "stall_timeout_s": 90},
        # measurements of ~1 s (8 prompts x 64 tokens): shorter ones jitter by tens of percent here
        "bench": {"speculative": [S314], "num_prompts": 8, "max_tokens": BENCH_TOKENS, "repeats": 4,
                  "warmup_requests": 1, "accept_curve": CURVE},
        "storage": {"root": f"file://{store_dir}"}})
    store = FileStore(store_dir)
    fps = TABLE.fingerprints(cfg, store=store)
    said: list[str] = []
    for stage in ("prepare", "datagen", "dump", "train", "export"):
        TABLE.run(stage, cfg, store, fingerprints=fps, on_line=said.append, session_options=FAST)
    offline = StageOutput.committed(store, "export", fps["export"]).manifest.meta["judge"]["accept_length"]
    assert [line for line in said if "predicted speedup" in line] == [
        f"export: predicted speedup: none yet, no accept-length curve is stored for engine reference and this target "
        f"at 3 draft steps (run the bench with bench.accept_curve); offline accept length {offline:.3f}"]

    result = TABLE.run("bench", cfg, store, fingerprints=fps, session_options=FAST)
    assert result.meta["failed"] == {} and result.meta["measurements"] == (2 + len(CURVE)) * 4
    out = StageOutput.committed(store, "bench", result.fingerprint)
    report = json.loads(out.read_shard("report.json"))
    assert [r["key"] for r in report["summary"]["rows"]] == ["baseline", "eagle3-s3-k1-d4"]  # forced: no rows
    (curve,) = report["accept_curves"]
    assert (curve["setting"], curve["batch_size"]) == ("EAGLE3 3/1/4", 1)
    points = curve["points"]
    assert [p["requested"] for p in points] == CURVE
    for p in points:  # the forced knob gives what it was asked, measured by the client as any server
        assert p["accept_length"] == pytest.approx(p["requested"], abs=0.1), p
    assert points[-1]["speedup"] > 2.5 * points[0]["speedup"]  # 4 tokens per cycle instead of 1, similar cost
    (drafter,) = curve["measured"]
    assert 1.5 < drafter["accept_length"] < 3.0, drafter  # inside the curve
    # the bench measured the drafter the export judged (the same passage: the same accept length)
    assert drafter["accept_length"] == pytest.approx(offline, abs=0.05), (drafter, offline)
    pred = drafter["predicted"]
    assert pred["speedup"] == pytest.approx(predict(points, drafter["accept_length"],
                                                    drafter["accept_interval"])["speedup"])
    assert not pred["extrapolated"]
    # the claim: the curve predicts the drafter's speedup from its accept length alone
    assert drafter["agree"] is True, (drafter, points)
    assert pred["low"] <= drafter["high"] and drafter["low"] <= pred["high"]
    md = out.read_shard("report.md").decode()
    assert "## Speedup against accept length" in md and "agree (intervals overlap)" in md
    stored = out.manifest.meta["accept_curve"]
    assert stored["engine"] == "reference" and stored["curves"][0]["points"] == points

    again = TABLE.run("export", cfg, store, fingerprints=fps)
    assert again.status == "skipped"
    want = predict(points, offline)
    (line,) = [line for line in again.summary if line.startswith("predicted speedup at")]
    assert line.startswith(f"predicted speedup at EAGLE3 3/1/4, batch 1: {want['speedup']:.2f}x "
                           f"[{want['low']:.2f}, {want['high']:.2f}] from offline accept length {offline:.3f}")
    assert f"curve: bench {result.fingerprint}" in line
    no_servers_left(tmp_path / "logs")
