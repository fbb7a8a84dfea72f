"""The bench's accept length by context position: per request its context (prompt + completion
tokens) and its acceptance from the engine's answer (drafter.bench.measure.by_request), grouped per
setting and batch size in the export judge's buckets (drafter.bench.report), and said to be
unavailable, never estimated, where the engine only has aggregate counters (vLLM's /metrics).
The end-to-end case runs the fake SGLang-style server (tests/fixtures/fake_server.py) through the
real bench stage."""
from __future__ import annotations

import json

from drafter.bench.measure import by_request
from drafter.bench.report import accept_by_context_position, context_lines, context_section
from drafter.stage_output import StageOutput
from drafter.stages import TABLE
from tests.fixtures.bench import FAST, S314, UPSTREAM, fake_config, make_store, no_servers_left


def _answer(prompt, completion, verify, correct=None):
    return {"prompt_tokens": prompt, "completion_tokens": completion, "spec_verify_ct": verify,
            **({"spec_num_correct_drafts": correct} if correct is not None else {})}


def test_by_request_takes_each_requests_context_and_acceptance_from_its_answer():
    rows, figure = by_request([_answer(100, 20, 8, 12), _answer(3000, 20, 16, 4)])
    assert rows == [[120, 8, 12], [3020, 16, 4]] and figure == "draft"
    # SGLang's answers without correct-draft counts: completion / verifies, said so
    rows, figure = by_request([_answer(100, 20, 8), _answer(50, 20, 8, 10)])
    assert rows == [[120, 8, 12], [70, 8, 12]] and figure == "completion / verifies"
    # no verify count (no speculation; vLLM's OpenAI answers) or no prompt length: nothing per request
    assert by_request([{"prompt_tokens": 5, "completion_tokens": 20}]) == (None, None)
    assert by_request([{**_answer(5, 20, 8, 12), "prompt_tokens": None}]) == (None, None)


def _m(config, bs, by_req, *, baseline=False, forced=None, figure="draft"):
    out = {"config": config, "batch_size": bs, "baseline": baseline, "forced_accept_length": forced,
           "verify_ct": None if baseline else 10, "by_request": by_req, "by_request_figure": figure}
    return out


def test_requests_are_grouped_per_setting_over_rounds_in_the_judges_buckets():
    ms = [_m("no speculation", 1, None, baseline=True),
          _m("EAGLE3 3/1/4", 1, [[100, 10, 15], [700, 10, 5]]),   # round 0: 2.5 early, 1.5 late
          _m("EAGLE3 3/1/4", 1, [[90, 10, 15], [900, 10, 3]]),    # round 1
          _m("EAGLE3 3/1/4 (forced 2.0)", 1, [[100, 10, 10]], forced=2.0)]  # forced servers are not a drafter
    [entry] = accept_by_context_position(ms, "reference", 1024)
    assert (entry["config"], entry["batch_size"], entry["figure"], entry["why"]) == ("EAGLE3 3/1/4", 1, "draft", None)
    curve = entry["curve"]
    assert [b["positions"] for b in curve] == ["[0, 64)", "[64, 128)", "[128, 256)", "[256, 512)", "[512, 1024)"]
    assert [b["requests"] for b in curve] == [0, 2, 0, 0, 2]
    assert [b["blocks"] for b in curve] == [0, 20, 0, 0, 20]
    assert [b["accept_length"] for b in curve] == [None, 2.5, None, None, 1.4]
    assert context_lines([entry]) == ["accept length by context position at EAGLE3 3/1/4 @ batch 1: [0, 64) — "
                                      "(0 requests), [64, 128) 2.50 (2 requests), [128, 256) — (0 requests), "
                                      "[256, 512) — (0 requests), [512, 1024) 1.40 (2 requests)"]
    md = context_section([entry])
    assert md[:3] == ["## Accept length by context position", "", "### EAGLE3 3/1/4, batch 1"]
    table = md[4].splitlines()
    assert table[0] == "| context positions | requests | verifies | accept length (1 + accepted / verifies) |"
    assert table[2] == "| [0, 64) | 0 | 0 | — |" and table[6] == "| [512, 1024) | 2 | 20 | 1.40 |"
    # the export's edges when set
    [custom] = accept_by_context_position(ms, "reference", 1024, [800])
    assert [(b["positions"], b["requests"]) for b in custom["curve"]] == [("[0, 800)", 3), ("[800, 1024)", 1)]


def test_an_engine_with_aggregate_counters_only_gets_no_curve_and_says_so():
    ms = [_m("EAGLE3 3/1/4", 1, None, figure=None), {**_m("EAGLE3 1/1/2", 4, None), "by_request": None}]
    entries = accept_by_context_position(ms, "vllm", 4096)
    assert [e["curve"] for e in entries] == [None, None]
    assert context_lines(entries)[0] == (
        "accept length by context position at EAGLE3 3/1/4 @ batch 1: engine vllm reports acceptance only as "
        "aggregate counters (no per-request figure): no accept length by context position")
    assert "- engine vllm reports acceptance only as aggregate counters" in "\n".join(context_section(entries))
    old = {k: v for k, v in _m("EAGLE3 3/1/4", 1, None).items() if k != "by_request"}  # a record from before
    assert accept_by_context_position([old], "reference", 512)[0]["why"] == \
        "measured before per-request acceptance was recorded"


def test_bench_report_and_summary_give_accept_length_by_context(tmp_path):
    """The fake server answers SGLang's /generate with prompt_tokens 2, 16 completion tokens in 6
    verify cycles (accept length 3 asked) and 10 correct drafts: every request sits at context 18."""
    store = make_store(tmp_path)
    cfg = fake_config(tmp_path, [S314], fake_args=["--token-delay-s", "0.002", "--accept-length", "3"],
                      bench_extra={"repeats": 1, "batch_sizes": [1], "num_prompts": 2})
    result = TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    out = StageOutput.committed(store, "bench", result.fingerprint)
    report = json.loads(out.read_shard("report.json"))
    [entry] = report["by_context"]
    # the fake target has no config.json: no context known, so one bucket up to the longest seen
    assert entry["curve"] == [{"positions": "[0, inf)", "lo": 0, "hi": None, "blocks": 12, "requests": 2,
                               "accept_length": 1 + 20 / 12}]
    md = out.read_shard("report.md").decode()
    assert "## Accept length by context position\n\n### EAGLE3 3/1/4, batch 1" in md
    assert "| [0, inf) | 2 | 12 | 2.67 |" in md
    assert "accept length by context position at EAGLE3 3/1/4 @ batch 1: [0, inf) 2.67 (2 requests)" in result.summary
    no_servers_left(tmp_path / "logs")
