"""Bench statistics, planning and report rendering: pure functions on synthetic numbers."""
from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest

from drafter.bench.plan import BASELINE, plan_sweep, server_config, server_key
from drafter.bench.report import markdown, plot_png, table_rows
from drafter.bench.stats import (
    FASTER, NO_DIFFERENCE, SLOWER, baseline_drift, break_even_accept_length, mean_ci, paired_speedup,
    summarize, t_quantile)
from drafter.config import SpeculativeConfig, parse_config


# ----------------------------------------------------------------------------- stats

def test_t_quantiles_match_tables():
    # two-sided 95% critical values from any t table
    for df, want in [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042)]:
        assert t_quantile(0.975, df) == pytest.approx(want, abs=1e-3)
    assert t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-6)
    assert t_quantile(0.05, 3) == pytest.approx(-t_quantile(0.95, 3), abs=1e-6)


def test_mean_ci():
    ci = mean_ci([10.0, 12.0, 14.0], 0.95)
    assert ci.mean == 12.0 and ci.n == 3
    assert (ci.high - ci.low) / 2 == pytest.approx(4.303 * 2.0 / math.sqrt(3), rel=1e-3)
    one = mean_ci([5.0, None], 0.95)
    assert one.mean == 5.0 and one.low is None and mean_ci([None], 0.95) is None


def test_noisy_fake_gives_no_measurable_difference():
    """Same true speed, 10% round-to-round noise (speculation's spread): never a false speedup,
    although the point estimates differ from 1.0 by several percent."""
    rng = np.random.default_rng(123)
    estimates = []
    for trial in range(20):
        base = 80.0 * (1 + rng.normal(0, 0.03, 5))
        spec = 80.0 * (1 + rng.normal(0, 0.10, 5))
        sp = paired_speedup(base, spec, 0.95, samples=2000, seed=0)
        estimates.append(sp.speedup)
        assert sp.verdict == NO_DIFFERENCE, (trial, sp)
        assert sp.low < 1.0 < sp.high
    assert max(abs(e - 1) for e in estimates) > 0.03  # the noise was real


def test_real_speedup_gives_faster_with_an_interval_excluding_one():
    rng = np.random.default_rng(7)
    base = 60.0 * (1 + rng.normal(0, 0.03, 5))
    spec = 1.5 * base * (1 + rng.normal(0, 0.05, 5))
    sp = paired_speedup(base, spec, 0.95, samples=5000, seed=0)
    assert sp.verdict == FASTER and sp.low > 1.0 and sp.low <= 1.5 <= sp.high
    assert sp.speedup == pytest.approx(1.5, rel=0.05)
    slow = paired_speedup(base, 0.6 * base * (1 + rng.normal(0, 0.02, 5)), 0.95)
    assert slow.verdict == SLOWER and slow.high < 1.0


def test_pairing_cancels_shared_drift():
    """The machine slows down 30% over the sweep; config and baseline of each round move together.
    Unpaired, the spread would hide a real 1.2x; paired it does not."""
    drift = np.linspace(1.0, 0.7, 6)
    base = 100.0 * drift
    spec = 120.0 * drift * np.array([1.01, 0.99, 1.0, 1.01, 0.99, 1.0])
    sp = paired_speedup(base, spec, 0.95)
    assert sp.verdict == FASTER and sp.low > 1.1
    unpaired = mean_ci(spec, 0.95).low / mean_ci(base, 0.95).high
    assert unpaired < 1.0


def test_bootstrap_is_deterministic_and_widened_for_few_rounds():
    base, spec = [100.0, 104.0, 98.0], [110.0, 101.0, 112.0]
    a, b = paired_speedup(base, spec, 0.95, seed=3), paired_speedup(base, spec, 0.95, seed=3)
    assert a == b
    # 3 rounds: the bootstrap percentile interval is narrower than the t interval; we report the hull
    assert a.t_low <= a.bootstrap_low and a.low == min(a.t_low, a.bootstrap_low)
    assert a.high == max(a.t_high, a.bootstrap_high)
    single = paired_speedup([100.0], [150.0], 0.95)
    assert single.verdict == NO_DIFFERENCE and single.low is None and single.speedup == 1.5
    with pytest.raises(ValueError):
        paired_speedup([1.0, 2.0], [1.0], 0.95)


def test_baseline_drift_flags_a_machine_moving_faster_than_a_pair_carries():
    steady = baseline_drift([82.0, 83.0, 82.5, 82.8, 83.1, 82.6], 0.05)
    assert steady.unstable is False and abs(steady.per_round) < 0.005
    # field note 6's fresh boot over two rounds: 90 -> 82 tok/s, -9% within the span of one pair
    fresh_boot = baseline_drift([90.0, 82.0], 0.05)
    assert fresh_boot.unstable and fresh_boot.per_round == pytest.approx(-8.0 / 86.0)
    # the same 8% spread over six rounds moves each pair ~2%: reported over the sweep, not judged
    slow = baseline_drift([90.0, 88.8, 84.0, 83.0, 82.5, 82.0], 0.05)
    assert slow.relative_change == pytest.approx((82.25 - 89.4) / 89.4) and slow.rounds_compared == 2
    assert slow.per_round == pytest.approx(-0.0201, abs=1e-3) and slow.unstable is False
    # 6% per round, every round: unstable however many rounds there are
    assert baseline_drift([100.0 * 0.94 ** r for r in range(9)], 0.05).unstable
    assert baseline_drift([80.0], 0.05).unstable is False


def test_break_even_from_measured_costs():
    # the field notes: ~29.5 ms verify cycle vs 12 ms decode step -> ~2.46
    assert break_even_accept_length(0.0295, 0.012) == pytest.approx(2.46, abs=0.01)
    assert break_even_accept_length(None, 0.012) is None


def _measurement(key, bs, r, tps, accept=None, cycle=None, step=0.01):
    return {"key": key, "batch_size": bs, "round": r, "output_tok_s": tps, "latency_s": 1.0,
            "ttft_s": None, "itl_s": None, "accept_length": accept, "draft_acceptance": None,
            "step_time_s": step, "cycle_time_s": cycle}


def test_summarize_recommends_only_significant_and_stable():
    servers = [(BASELINE, "baseline"), ("fast", "fast"), ("noisy", "noisy")]
    ms = []
    for r, (b, noisy) in enumerate([(100.0, 80.0), (101.0, 125.0), (99.0, 95.0)]):
        ms += [_measurement(BASELINE, 1, r, b), _measurement("fast", 1, r, 1.5 * b, 2.5, 0.016),
               _measurement("noisy", 1, r, noisy, 1.6, 0.015)]
    s = summarize(ms, servers, [1], confidence=0.95)
    rows = {r["key"]: r for r in s["rows"]}
    assert rows["fast"]["speedup"]["verdict"] == FASTER
    assert rows["noisy"]["speedup"]["verdict"] == NO_DIFFERENCE
    assert rows["fast"]["break_even_accept_length"] == pytest.approx(1.6)
    assert s["recommendation"][1]["key"] == "fast"
    # the same numbers on a drifting machine: no recommendation
    drifting = [dict(m, output_tok_s=m["output_tok_s"] * (1 - 0.2 * m["round"])) for m in ms]
    s2 = summarize(drifting, servers, [1], confidence=0.95)
    assert s2["drift"][1]["unstable"] and s2["recommendation"][1]["key"] is None
    assert "not stable" in s2["recommendation"][1]["text"]
    # nothing significant: keep the baseline
    s3 = summarize([m for m in ms if m["key"] != "fast"], servers, [1], confidence=0.95)
    assert s3["recommendation"][1]["text"].startswith("keep the baseline")


def test_report_renders_table_markdown_and_png():
    servers = [(BASELINE, "baseline (no speculation)"), ("s", "EAGLE3 3/1/4")]
    ms = [_measurement(BASELINE, bs, r, 100.0 + r, step=0.01) for bs in (1, 4) for r in range(3)]
    ms += [_measurement("s", bs, r, 150.0 + r, 2.5, 0.016) for bs in (1, 4) for r in range(3)]
    s = summarize(ms, servers, [1, 4], confidence=0.95)
    rows = table_rows(s, {})
    assert len(rows) == 4 and rows[1]["verdict"] == FASTER and rows[0]["verdict"] == "baseline"
    assert rows[1]["break-even accept"] == "1.60" and rows[1]["accept length"].startswith("2.50")
    plan = {"engine": "reference", "interleave": "concurrent", "rounds": 3, "servers": [{}, {}],
            "skipped": [{"config": "bench.speculative.1", "reason": "not valid"}]}
    md = markdown(s, rows, plan=plan, failures={"x": {"config": "X", "kind": "crashed", "message": "boom"}},
                  launches=[], hardware={"cpu_model": "cpu", "cpu_count": 2, "gpus": None, "platform": "linux"},
                  settings={"num_prompts": 4, "max_tokens": 8, "ignore_eos": True, "warmup_requests": 1,
                            "confidence": 0.95})
    assert "| config | batch |" in md and "EAGLE3 3/1/4 (1.50x" in md and "failed X: crashed: boom" in md
    assert "the 2 planned servers were launched once each" in md and "skipped bench.speculative.1: not valid" in md
    png = plot_png(s)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1200, 450)
    assert zlib.crc32(png[12:29]) == struct.unpack(">I", png[29:33])[0]


# ----------------------------------------------------------------------------- plan

def _cfg(engine="reference", speculative=(), **serve):
    base = {"target": {"path": "/nonexistent/tiny", "num_hidden_layers": 8, "vocab_size": 64000},
            "serve": {"engine": engine, "port": 31000, **serve},
            "bench": {"speculative": list(speculative), "batch_sizes": [1, 4], "repeats": 3}}
    if engine == "command":
        base["serve"].update(command=["srv", "--port", "{port}"], health_url="http://127.0.0.1:31000/health")
    return parse_config(base)


S314 = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
S224 = {"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 4}


def test_plan_one_server_per_distinct_config_baseline_first():
    cfg = _cfg("sglang", [S314, S224, S314, {}])
    plan = plan_sweep(cfg, {"": "/d"})
    assert [s.key for s in plan.servers] == [BASELINE, "eagle3-s3-k1-d4", "eagle3-s2-k2-d4", "eagle3-auto"]
    assert plan.batch_sizes == [1, 4] and plan.rounds == 3
    assert [(s.label, "duplicate" in s.reason) for s in plan.skipped] == [
        ("bench.speculative.2 (EAGLE3 3/1/4)", True)]
    # rotation: every configuration takes every position once every len(servers) rounds
    orders = [[s.key for s in plan.order(r)] for r in range(4)]
    assert orders[0][0] == BASELINE and orders[1][-1] == BASELINE
    assert all(sorted(o) == sorted(orders[0]) for o in orders)
    assert {o[0] for o in orders} == set(orders[0])
    assert plan.interleave == "relaunch"  # sglang shares the GPU: one server at a time


def test_plan_skips_combinations_the_engine_cannot_run():
    ref = plan_sweep(_cfg("reference", [S314, S224], device="cpu"), {"": "/d"})
    assert [s.key for s in ref.servers] == [BASELINE, "eagle3-s3-k1-d4"]
    assert "eagle_topk must be 1" in ref.skipped[0].reason and "reference" in ref.skipped[0].reason
    assert ref.interleave == "concurrent"
    vllm = plan_sweep(_cfg("vllm", [S224, S314]), {"": "/d"})
    assert [s.key for s in vllm.servers] == [BASELINE, "eagle3-s3-k1-d4"]
    assert "vllm" in vllm.skipped[0].reason and "chain" in vllm.skipped[0].reason
    none = plan_sweep(_cfg("reference", [S314]), {})
    assert [s.key for s in none.servers] == [BASELINE] and "no drafter" in none.skipped[0].reason


def test_head_to_head_plan_serves_every_setting_with_both_drafters():
    cfg = _cfg("reference", [S314, {"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 2}], device="cpu")
    plan = plan_sweep(cfg, {"challenger": "/new", "champion": "/old"})
    assert [(s.key, s.drafter, s.draft_path) for s in plan.servers] == [
        (BASELINE, "", None), ("challenger-eagle3-s3-k1-d4", "challenger", "/new"),
        ("champion-eagle3-s3-k1-d4", "champion", "/old"), ("challenger-eagle3-s1-k1-d2", "challenger", "/new"),
        ("champion-eagle3-s1-k1-d2", "champion", "/old")]
    assert plan.servers[2].label == "champion EAGLE3 3/1/4"
    assert plan.head_to_head_pairs() == [("EAGLE3 3/1/4", "challenger-eagle3-s3-k1-d4", "champion-eagle3-s3-k1-d4"),
                                         ("EAGLE3 1/1/2", "challenger-eagle3-s1-k1-d2", "champion-eagle3-s1-k1-d2")]
    assert server_config(cfg, plan.servers[2], port=31002).serve.draft_path == "/old"
    assert server_config(cfg, plan.servers[0]).serve.draft_path is None
    alone = plan_sweep(cfg, {"challenger": "/new"})  # the first retrain: no champion yet
    assert [s.key for s in alone.servers][1:] == ["challenger-eagle3-s3-k1-d4", "challenger-eagle3-s1-k1-d2"]
    assert alone.head_to_head_pairs() == []


def test_head_to_head_ratio_pairs_rounds_and_a_slower_challenger_is_a_veto():
    from drafter.bench.stats import head_to_head
    from drafter.retrain.verdict import RetrainError, bench_verdict

    def m(key, r, tp, al):
        return {"key": key, "batch_size": 1, "round": r, "output_tok_s": tp, "accept_length": al}

    ch, cp = "challenger-eagle3-s3-k1-d4", "champion-eagle3-s3-k1-d4"
    # the challenger is ~20% slower in every round; round 2 of the champion is missing: 2 pairs
    ms = [m(ch, 0, 80.0, 1.8), m(ch, 1, 82.0, 1.8), m(ch, 2, 79.0, 1.8), m(cp, 0, 100.0, 2.4), m(cp, 1, 101.0, 2.4)]
    (row,) = head_to_head(ms, [("EAGLE3 3/1/4", ch, cp)], [1], confidence=0.95, samples=500)
    assert row["rounds"] == 2 and row["ratio"]["speedup"] == pytest.approx(162 / 201)
    assert row["accept_length"]["challenger"]["mean"] == pytest.approx(1.8)
    assert row["accept_length"]["champion"]["n"] == 2
    ms.append(m(cp, 2, 99.0, 2.4))
    (row,) = head_to_head(ms, [("EAGLE3 3/1/4", ch, cp)], [1], confidence=0.95, samples=500)
    assert row["ratio"]["verdict"] == "slower" and row["ratio"]["high"] < 1
    report = {"drafters": {"challenger": "new", "champion": "old"}, "failures": {}, "head_to_head": [row],
              "summary": {"drift": {"1": {"unstable": False}},
                          "rows": [{"key": ch, "batch_size": 1, "speedup": {"speedup": 0.9}},
                                   {"key": cp, "batch_size": 1, "speedup": {"speedup": 1.1}}]}}
    verdict = bench_verdict(report, "new", "old")
    assert len(verdict["problems"]) == 1 and "measurably slower" in verdict["problems"][0]
    assert verdict["rows"][0]["challenger_speedup"] == 0.9 and verdict["rows"][0]["champion_accept_length"] == 2.4
    # a drifting machine's comparison is reported, not used
    drifting = {**report, "summary": {**report["summary"], "drift": {"1": {"unstable": True}}}}
    assert bench_verdict(drifting, "new", "old")["problems"] == []
    assert "drifted" in bench_verdict(drifting, "new", "old")["notes"][0]
    # a challenger whose server failed is a veto; the champion's is a note
    failed = {**report, "head_to_head": [], "failures": {ch: {"config": "challenger EAGLE3 3/1/4", "kind": "crashed"},
                                                          cp: {"config": "champion EAGLE3 3/1/4", "kind": "stalled"}}}
    got = bench_verdict(failed, "new", "old")
    assert got["problems"] == ["the challenger's server failed at challenger EAGLE3 3/1/4 (crashed)"]
    assert "champion's server failed" in got["notes"][0]
    with pytest.raises(RetrainError, match="not challenger new against champion other"):
        bench_verdict(report, "new", "other")


def test_sglang_rules_are_refused_at_config_time():
    with pytest.raises(Exception, match="num_draft_tokens = num_steps \\+ 1"):
        _cfg("sglang", [{"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 16}])
    with pytest.raises(Exception, match="set all three"):
        _cfg("sglang", [{"num_steps": 3}])


def test_server_config_per_server():
    cfg = _cfg("command", [S314])
    plan = plan_sweep(cfg, {"": "/drafts/d"})
    base = server_config(cfg, plan.servers[0], port=31000)
    assert base.serve.speculative is None and base.serve.draft_path is None and base.serve.command == cfg.serve.command
    spec = server_config(cfg, plan.servers[1], port=31001)
    assert spec.serve.port == 31001 and spec.serve.health_url == "http://127.0.0.1:31001/health"
    assert spec.serve.speculative == SpeculativeConfig(**S314) and spec.serve.draft_path == "/drafts/d"
    assert spec.serve.command[-10:] == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                                        "/drafts/d", "--speculative-num-steps", "3", "--speculative-eagle-topk",
                                        "1", "--speculative-num-draft-tokens", "4"]
    assert cfg.serve.port == 31000 and cfg.serve.speculative is None  # the original is untouched
    assert server_key(None) == BASELINE
