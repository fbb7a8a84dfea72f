"""The accept-length curve: planning its forced servers, the fit and the prediction, the report's
section and panel, the stored curves later stages read. Pure functions and a local store."""
from __future__ import annotations

import struct

import pytest

from drafter.bench.plan import BASELINE, plan_sweep
from drafter.bench.predict import agree, build_curves, newest_curves, predict, prediction_lines
from drafter.bench.report import markdown, plot_png
from drafter.bench.stats import summarize
from drafter.config import parse_config
from drafter.formats import stored_accept_curves
from drafter.stage_output import StageOutput
from drafter.store import FileStore

S314 = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
S112 = {"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 2}


def _cfg(engine="reference", speculative=(S314,), curve=(1.5, 2.0, 2.5, 3.0), **serve):
    base = {"target": {"path": "/nonexistent/tiny", "num_hidden_layers": 8, "vocab_size": 64000},
            "serve": {"engine": engine, "port": 31000, **serve},
            "bench": {"speculative": list(speculative), "batch_sizes": [1], "accept_curve": list(curve)}}
    if engine == "command":
        base["serve"].update(command=["srv", "--port", "{port}"], health_url="http://127.0.0.1:31000/health")
    return parse_config(base)


# ----------------------------------------------------------------------------- the model

def cycle_cost(a: float) -> float:
    """A physical curve: a verify cycle costs 1.2 decode steps plus 0.3 per token accepted."""
    return 1.2 + 0.3 * a


def point(a: float, rel: float = 0.03, requested: float | None = None) -> dict:
    s = a / cycle_cost(a)
    return {"requested": requested or a, "accept_length": a, "accept_interval": None, "speedup": s,
            "low": s * (1 - rel), "high": s * (1 + rel), "rounds": 3, "key": f"k{a}"}


CURVE = [point(a) for a in (1.5, 2.0, 2.5, 3.0)]


def test_prediction_between_points_recovers_the_cycle_time_model():
    """The cycle cost a / speedup is linear in a here, so interpolating it is exact; the interval is
    the neighbours' interpolated, so it holds the truth."""
    for a in (1.7, 2.25, 2.9):
        p = predict(list(reversed(CURVE)), a)
        assert p["speedup"] == pytest.approx(a / cycle_cost(a), rel=1e-9) and not p["extrapolated"]
        assert p["low"] < p["speedup"] < p["high"]
        assert p["low"] == pytest.approx(a / cycle_cost(a) * 0.97, rel=2e-3)
    at_point = predict(CURVE, 2.5)
    assert (at_point["low"], at_point["high"]) == pytest.approx((CURVE[2]["low"], CURVE[2]["high"]))


def test_prediction_beyond_the_points_extends_the_nearest_two_and_says_so():
    p = predict(CURVE, 3.6)
    assert p["extrapolated"] and p["speedup"] == pytest.approx(3.6 / cycle_cost(3.6), rel=1e-9)
    assert predict(CURVE, 1.2)["extrapolated"]
    # one point: a constant cycle cost (speedup proportional to accept length), always extrapolated
    one = predict([point(2.0)], 3.0)
    assert one["speedup"] == pytest.approx(1.5 * CURVE[1]["speedup"]) and one["extrapolated"]
    assert predict([], 2.0) is None


def test_an_accept_length_interval_widens_the_prediction_and_agreement_is_overlap():
    narrow, wide = predict(CURVE, 2.2), predict(CURVE, 2.2, [2.0, 2.4])
    assert wide["low"] < narrow["low"] and wide["high"] > narrow["high"]
    assert wide["speedup"] == narrow["speedup"] and not wide["extrapolated"]
    assert predict(CURVE, 2.9, [2.7, 3.1])["extrapolated"]  # the interval leaves the curve
    assert agree(narrow, {"low": narrow["high"] - 0.01, "high": 5.0}) is True
    assert agree(narrow, {"low": narrow["high"] + 0.01, "high": 5.0}) is False
    assert agree(narrow, {"low": None, "high": None}) is None
    no_interval = [dict(p, low=None, high=None) for p in CURVE]
    p = predict(no_interval, 2.2)
    assert p["low"] is None and p["high"] is None and agree(p, narrow) is None


# ----------------------------------------------------------------------------- the plan

def test_plan_adds_a_forced_server_per_setting_and_reachable_accept_length():
    plan = plan_sweep(_cfg(speculative=[S314, S112], device="cpu"), {"": "/d"})
    keys = [s.key for s in plan.servers]
    assert keys == [BASELINE, "eagle3-s3-k1-d4", "eagle3-s1-k1-d2", "eagle3-s3-k1-d4-forced1.5",
                    "eagle3-s3-k1-d4-forced2", "eagle3-s3-k1-d4-forced2.5", "eagle3-s3-k1-d4-forced3",
                    "eagle3-s1-k1-d2-forced1.5", "eagle3-s1-k1-d2-forced2"]
    forced = plan.servers[3]
    assert forced.forced_accept_length == 1.5 and forced.draft_path == "/d" and forced.drafter == ""
    assert forced.label == "EAGLE3 3/1/4 forced accept 1.5"
    # 1/1/2 reaches at most 2 tokens per verify: 2.5 and 3 are skipped for it, with the reason
    assert [s.label for s in plan.skipped] == ["bench.accept_curve 2.5 at EAGLE3 1/1/2",
                                               "bench.accept_curve 3 at EAGLE3 1/1/2"]
    assert "must be in [1, 2]" in plan.skipped[0].reason
    assert plan.to_dict()["servers"][3]["forced_accept_length"] == 1.5
    assert plan.curve_servers()[2] == {"key": "eagle3-s3-k1-d4-forced1.5", "setting_key": "eagle3-s3-k1-d4",
                                       "setting": "EAGLE3 3/1/4", "num_steps": 3, "drafter": "",
                                       "forced_accept_length": 1.5}
    # off by default: nothing added
    assert len(plan_sweep(_cfg(curve=()), {"": "/d"}).servers) == 2


def test_plan_skips_the_curve_where_the_engine_has_no_knob_and_serves_one_drafter_in_a_head_to_head():
    cmd = plan_sweep(_cfg("command", curve=(2.0,)), {"": "/d"})
    assert [s.key for s in cmd.servers] == [BASELINE, "eagle3-s3-k1-d4"]
    assert "'command' has no known way to force an accept length" in cmd.skipped[0].reason
    h2h = plan_sweep(_cfg(curve=(2.0,), device="cpu"), {"challenger": "/new", "champion": "/old"})
    assert [(s.key, s.draft_path) for s in h2h.servers][1:] == [
        ("challenger-eagle3-s3-k1-d4", "/new"), ("champion-eagle3-s3-k1-d4", "/old"),
        ("eagle3-s3-k1-d4-forced2", "/new")]
    assert h2h.head_to_head_pairs() == [("EAGLE3 3/1/4", "challenger-eagle3-s3-k1-d4", "champion-eagle3-s3-k1-d4")]


def test_accept_curve_config_is_checked_and_sorted():
    assert _cfg(curve=(3.0, 1.5)).bench.accept_curve == [1.5, 3.0]
    for bad, words in (((0.5,), "at least 1"), ((2.0, 2.0), "repeat")):
        with pytest.raises(Exception, match=words):
            _cfg(curve=bad)


# ----------------------------------------------------------------------------- from a sweep to the report

def _m(key, r, tps, draft_al=None):
    return {"key": key, "batch_size": 1, "round": r, "output_tok_s": tps, "latency_s": 1.0, "ttft_s": None,
            "itl_s": None, "accept_length": draft_al, "draft_acceptance": None, "draft_accept_length": draft_al,
            "step_time_s": 0.01, "cycle_time_s": None}


def _sweep():
    """A baseline at 100 tok/s, forced servers at cycle_cost's speedups, the drafter at 2.2."""
    plan = plan_sweep(_cfg(device="cpu"), {"": "/d"})
    noise = (1.0, 1.01, 0.99)
    ms = [_m(BASELINE, r, 100.0 * noise[r]) for r in range(3)]
    for s in plan.servers[2:]:
        a = s.forced_accept_length
        ms += [_m(s.key, r, 100.0 * a / cycle_cost(a) * noise[r] * (1 + 0.02 * (r - 1)), a) for r in range(3)]
    ms += [_m("eagle3-s3-k1-d4", r, 100.0 * 2.2 / cycle_cost(2.2) * noise[r] * (1 - 0.02 * (r - 1)), 2.2 + 0.01 * r)
           for r in range(3)]
    real = [(s.key, s.label) for s in plan.servers if s.forced_accept_length is None]
    forced = [(s.key, s.label) for s in plan.servers if s.forced_accept_length is not None]
    summary = summarize(ms, real, [1], confidence=0.95)
    curves = build_curves(summarize(ms, forced, [1], confidence=0.95)["rows"], summary["rows"],
                          plan.curve_servers())
    return summary, curves


def test_curves_from_a_sweep_place_the_drafter_next_to_its_prediction():
    summary, curves = _sweep()
    assert [r["key"] for r in summary["rows"]] == [BASELINE, "eagle3-s3-k1-d4"]  # forced rows stay out
    assert summary["recommendation"][1]["key"] in (None, "eagle3-s3-k1-d4")
    (c,) = curves
    assert (c["setting"], c["setting_key"], c["num_steps"], c["batch_size"]) == ("EAGLE3 3/1/4", "eagle3-s3-k1-d4",
                                                                                 3, 1)
    assert [p["requested"] for p in c["points"]] == [1.5, 2.0, 2.5, 3.0]
    assert [p["accept_length"] for p in c["points"]] == pytest.approx([1.5, 2.0, 2.5, 3.0])
    (m,) = c["measured"]
    assert m["accept_length"] == pytest.approx(2.21) and m["accept_interval"][0] < 2.21 < m["accept_interval"][1]
    assert m["predicted"]["speedup"] == pytest.approx(2.21 / cycle_cost(2.21), rel=0.02)
    assert m["agree"] is True and not m["predicted"]["extrapolated"]


def test_report_draws_the_curve_section_and_a_third_panel():
    summary, curves = _sweep()
    plan = {"engine": "reference", "interleave": "concurrent", "rounds": 3, "servers": [{}] * 6, "skipped": []}
    md = markdown(summary, [], plan=plan, failures={}, launches=[],
                  hardware={"cpu_model": "cpu", "cpu_count": 2, "gpus": None, "platform": "linux"},
                  settings={"num_prompts": 4, "max_tokens": 8, "ignore_eos": True, "warmup_requests": 1,
                            "confidence": 0.95}, accept_curves=curves)
    assert "## Speedup against accept length" in md and "### EAGLE3 3/1/4, batch 1" in md
    assert "| forced accept length | measured accept length | speedup [CI] | rounds |" in md
    assert "the drafter: accept length 2.21 [" in md and "agree (intervals overlap)" in md
    png = plot_png(summary, accept_curves=curves)
    assert struct.unpack(">II", png[16:24]) == (1800, 450)
    assert "did not give the accept length asked for" not in md
    # an engine that ignored its knob: the point stands where it was measured, and the report says so
    ignored = [dict(curves[0], points=[dict(p, accept_length=2.2) if p["requested"] == 3.0 else p
                                       for p in curves[0]["points"]])]
    md = markdown(summary, [], plan=plan, failures={}, launches=[],
                  hardware={"cpu_model": "cpu", "cpu_count": 2, "gpus": None, "platform": "linux"},
                  settings={"num_prompts": 4, "max_tokens": 8, "ignore_eos": True, "warmup_requests": 1,
                            "confidence": 0.95}, accept_curves=ignored)
    assert "- forced 3 but measured 2.20: the engine did not give the accept length asked for" in md


# ----------------------------------------------------------------------------- stored curves, later stages

def _bench_output(store, fp, engine, target, curves, created_at):
    out = StageOutput(store, "bench", fp)
    out.write_shard("report.md", "r")
    out.commit({"accept_curve": {"engine": engine, "target": target, "max_tokens": 8, "curves": curves}})
    manifest = out.store.get_bytes(f"bench/{fp}/_SUCCESS.json").decode()  # pin the commit time
    import json

    data = json.loads(manifest)
    data["created_at"] = created_at
    out.store.put_bytes(f"bench/{fp}/_SUCCESS.json", json.dumps(data).encode())


def test_later_stages_read_the_newest_curve_of_their_engine_and_target(tmp_path):
    store = FileStore(tmp_path / "store")
    target = {"target": "0123456789abcdef"}
    curve = {"setting": "EAGLE3 3/1/4", "setting_key": "eagle3-s3-k1-d4", "num_steps": 3, "batch_size": 1,
             "points": CURVE, "measured": []}
    older = dict(curve, points=[dict(p, speedup=p["speedup"] / 2, low=p["low"] / 2, high=p["high"] / 2)
                                for p in CURVE])
    _bench_output(store, "aaaaaaaaaaaaaaaa", "reference", target, [older], "2026-01-01T00:00:00+00:00")
    _bench_output(store, "bbbbbbbbbbbbbbbb", "reference", target, [curve], "2026-02-01T00:00:00+00:00")
    _bench_output(store, "cccccccccccccccc", "vllm", target, [older], "2026-03-01T00:00:00+00:00")
    _bench_output(store, "dddddddddddddddd", "reference", {"target": "ffffffffffffffff"}, [older],
                  "2026-03-01T00:00:00+00:00")
    stored = stored_accept_curves(store, "reference", target)
    assert [c["bench"] for c in stored] == ["bbbbbbbbbbbbbbbb", "aaaaaaaaaaaaaaaa"]
    (newest,) = newest_curves(stored)
    assert newest["bench"] == "bbbbbbbbbbbbbbbb"
    (line,) = prediction_lines([newest], 2.25, 3, "reference")
    want = predict(CURVE, 2.25)
    assert line.startswith(f"predicted speedup at EAGLE3 3/1/4, batch 1: {want['speedup']:.2f}x "
                           f"[{want['low']:.2f}, {want['high']:.2f}] from offline accept length 2.250; curve: "
                           f"bench bbbbbbbbbbbbbbbb of 2026-02-01")
    (none,) = prediction_lines([newest], 2.25, 1, "reference", "challenger")
    assert none.startswith("challenger predicted speedup: none yet, no accept-length curve is stored for engine "
                           "reference and this target at 1 draft steps")
    assert "extrapolated: the curve spans 1.50 to 3.00" in prediction_lines([newest], 3.5, 3, "reference")[0]
