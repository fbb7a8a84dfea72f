"""Accept length by context position: the bucket math (drafter.contracts.context_curve), the export
judge's curve with the training samples' lengths beside it, and the export gate on the last bucket
with enough draft blocks (export.min_last_bucket_accept_length), failing and passing with its reason.
The stage runs use the crafted successor target + drafter of tests/fixtures/speculative.py (one
draft accepted per verify: accept length exactly 2.0 everywhere) and a 512-token context."""
from __future__ import annotations

import pytest

from drafter.config import ConfigError
from drafter.contracts.context_curve import (
    accept_by_context, bucket_edges, buckets, curve_lines, last_full_bucket, trained_by_context)
from drafter.export.judge import JudgedTooLow, check_last_bucket
from drafter.stages import TABLE
from drafter.stages.export import training_lengths
from drafter.stages.verdicts import export_verdict
from drafter.store import FileStore
from tests.export.test_export import _cfg, eval_conversations, pair  # noqa: F401  (fixtures)
from tests.fixtures.export_upstreams import commit_upstreams
from tests.fixtures.speculative import successor_pair  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# ----------------------------------------------------------------------------- bucket math

def test_default_edges_are_powers_of_two_below_the_context_and_given_edges_are_cut_to_it():
    assert bucket_edges(512) == [64, 128, 256]
    assert bucket_edges(1000) == [64, 128, 256, 512]
    assert bucket_edges(64) == []  # a context of 64 tokens is one bucket
    assert bucket_edges(4096, [100, 1000, 5000]) == [100, 1000]
    assert bucket_edges(None, longest=300) == [64, 128, 256]  # no context known: up to the longest seen
    assert buckets([64, 128], 512) == [(0, 64), (64, 128), (128, 512)]
    assert buckets([], None) == [(0, None)]


def test_blocks_land_in_their_bucket_and_an_empty_bucket_is_empty_not_zero():
    # (context position, verifies, accepted drafts); 63 and 64 sit either side of an edge
    curve = accept_by_context([(0, 1, 2), (63, 1, 0), (64, 1, 3), (200, 2, 1), (511, 1, 1)], [64, 128, 256], 512)
    assert [b["positions"] for b in curve] == ["[0, 64)", "[64, 128)", "[128, 256)", "[256, 512)"]
    assert [b["blocks"] for b in curve] == [2, 1, 2, 1]
    assert [b["accept_length"] for b in curve] == [2.0, 4.0, 1.5, 2.0]
    assert "requests" not in curve[0]
    empty = accept_by_context([(10, 1, 1)], [64, 128], 512, requests=True)
    assert empty[1] == {"positions": "[64, 128)", "lo": 64, "hi": 128, "blocks": 0, "requests": 0,
                        "accept_length": None}
    assert last_full_bucket(curve, 2)["positions"] == "[128, 256)"  # [256, 512) has 1 block only
    assert last_full_bucket(curve, 3) is None


def test_training_lengths_in_the_same_buckets_cut_to_train_max_length():
    curve = accept_by_context([], [64, 128, 256], 512)
    # 300 is cut to 200 (train.max_length): it trained up to position 199, never in [256, 512)
    trained = trained_by_context([10, 64, 65, 128, 300], curve, 200)
    assert [t["samples_ending"] for t in trained] == [2, 2, 1, 0]    # lo < length <= hi
    assert [t["samples_reaching"] for t in trained] == [5, 3, 1, 0]  # length > lo
    lines = curve_lines(curve, trained)
    assert lines[3] == ("[256, 512)    —  (0 draft blocks); trained samples reaching it: 0, ending in it: 0 — "
                        "untrained at these lengths")
    assert "untrained" not in lines[2]
    # no per-sample lengths recorded: only the cut says where the drafter never trained
    assert curve_lines(curve, None, untrained_from=128)[2].endswith(
        "past the longest trained sample (128 tokens) — untrained at these lengths")
    assert "untrained" not in curve_lines(curve, None, untrained_from=128)[1]


def test_context_bucket_edges_are_checked_like_the_output_length_edges(tmp_path):
    with pytest.raises(ConfigError, match="strictly increasing"):
        _cfg(tmp_path, tmp_path, context_bucket_edges=[128, 64])
    with pytest.raises(ConfigError, match="min_last_bucket_accept_length"):
        _cfg(tmp_path, tmp_path, min_last_bucket_accept_length=0.5)
    assert _cfg(tmp_path, tmp_path).export.min_last_bucket_accept_length is None  # the gate is off by default


# ----------------------------------------------------------------------------- the gate, alone

def _report(curve):
    return {"by_context": curve, "verifies": sum(b["blocks"] for b in curve), "accept_length": 1.9}


def test_last_bucket_gate_fails_in_one_line_naming_the_bucket_and_passes_above_it():
    # a drafter that falls with the context: 2.5, then 1.5, then 1.2 in the last bucket (5 blocks)
    curve = accept_by_context([(10, 4, 6), (100, 4, 2), (300, 4, 1), (400, 1, 0)], [64, 256], 512)
    assert [(b["blocks"], b["accept_length"]) for b in curve] == [(4, 2.5), (4, 1.5), (5, 1.2)]
    with pytest.raises(JudgedTooLow) as err:
        check_last_bucket(_report(curve), 1.5, 4)
    assert str(err.value) == (
        "export judged too low at long context: accept length 1.200 at context positions [256, 512) (5 draft "
        "blocks, the last bucket with >= 4) < export.min_last_bucket_accept_length 1.5 (offline accept length "
        "over all positions 1.900)")
    assert check_last_bucket(_report(curve), 1.2, 4) == {
        "positions": "[256, 512)", "blocks": 5, "accept_length": 1.2, "min_accept_length": 1.2, "min_blocks": 4}
    assert check_last_bucket(_report(curve), None, 4) is None  # off
    assert check_last_bucket({**_report(curve), "by_context": None}, 1.5, 4) is None  # no curve (old judgements)


def test_last_bucket_gate_skips_thin_buckets_and_refuses_when_none_has_enough():
    curve = accept_by_context([(10, 20, 30), (300, 2, 0)], [64, 256], 512)  # [256, 512): 2 blocks at 1.0
    assert check_last_bucket(_report(curve), 2.0, 16)["positions"] == "[0, 64)"  # 2.5 there
    with pytest.raises(JudgedTooLow, match=r"no context bucket has export.last_bucket_min_blocks 50 draft blocks"):
        check_last_bucket(_report(curve), 2.0, 50)


# ----------------------------------------------------------------------------- the export stage

@pytest.fixture
def upstreams_with_lengths(pair, eval_conversations, tmp_path):
    """Committed upstreams whose dump's shard marker records 5 training samples' lengths."""
    target, draft = pair
    store = FileStore(tmp_path / "store")
    upstream = commit_upstreams(store, tmp_path, target, draft, eval_conversations,
                                sample_tokens=[30, 70, 100, 200, 120])
    return target, store, upstream, tmp_path


def test_export_judgement_has_the_curve_with_the_training_lengths_beside_it(upstreams_with_lengths):
    target, store, upstream, tmp = upstreams_with_lengths
    lines: list[str] = []
    result = TABLE.run("export", _cfg(target, tmp), store, upstream=upstream, on_line=lines.append)
    judge = result.meta["judge"]
    curve = judge["by_context"]
    assert judge["context_length"] == 512  # the tiny target's max_position_embeddings: powers of two below it
    assert [b["positions"] for b in curve] == ["[0, 64)", "[64, 128)", "[128, 256)", "[256, 512)"]
    assert sum(b["blocks"] for b in curve) == judge["verifies"]  # every draft block placed once
    # the successor drafter accepts exactly one draft per verify wherever it runs
    assert {b["accept_length"] for b in curve if b["blocks"]} == {2.0}
    assert [b["trained_samples_reaching"] for b in curve] == [5, 4, 1, 0]
    assert [b["trained_samples_ending"] for b in curve] == [1, 3, 1, 0]
    assert judge["training_lengths"] == {"dump": "dump0001", "unrecorded_samples": 0, "max_trained_length": 2048,
                                         "recorded_samples": 5}
    # the 4 prompts (+ 40 new tokens) stay below 256 tokens: the last bucket is empty, shown as such
    assert curve[3]["blocks"] == 0 and curve[3]["accept_length"] is None
    at = result.summary.index(next(s for s in result.summary if s.startswith("accept length by context position")))
    assert result.summary[at] == ("accept length by context position (prompt + generated tokens where each draft "
                                  "block starts; target context 512):")
    assert result.summary[at + 4] == ("  [256, 512)    —  (0 draft blocks); trained samples reaching it: 0, ending "
                                      "in it: 0 — untrained at these lengths")
    assert result.summary[at + 1].startswith(f"  [0, 64)     2.00 ({curve[0]['blocks']} draft blocks); trained "
                                             "samples reaching it: 5, ending in it: 1")
    assert "export:   [256, 512)    —  (0 draft blocks); trained samples reaching it: 0, ending in it: 0 — " \
           "untrained at these lengths" in lines  # said as it is judged (the demo's run log)
    assert "last_bucket" in judge["verdict"] and judge["verdict"]["last_bucket"] is None  # the gate is off
    row = next(r for r in result.table if r["metric"] == "accept length, farthest context judged")
    assert row["value"] == f"2.000 at [128, 256) ({curve[2]['blocks']} draft blocks)"  # [256, 512) is empty


def test_without_recorded_lengths_the_cut_says_where_it_never_trained(pair, eval_conversations, tmp_path):
    target, draft = pair
    store = FileStore(tmp_path / "store")
    upstream = commit_upstreams(store, tmp_path, target, draft, eval_conversations, dump_max_length=100)
    result = TABLE.run("export", _cfg(target, tmp_path), store, upstream=upstream)
    at = next(i for i, s in enumerate(result.summary) if s.startswith("accept length by context position"))
    assert result.summary[at].endswith("no per-sample lengths in dump/dump0001 (dumped before they were recorded); "
                                       "no training sample is longer than 100 tokens")
    assert "untrained" not in result.summary[at + 2]  # [64, 128) starts below 100
    assert result.summary[at + 3].endswith("past the longest trained sample (100 tokens) — untrained at these lengths")
    assert training_lengths(store, "dump0001", 64)["max_trained_length"] == 64  # train.max_length cuts further


def test_export_gate_on_the_last_full_bucket_refuses_and_passes(upstreams_with_lengths):
    target, store, upstream, tmp = upstreams_with_lengths
    # the judged accept length is 2.0 in every bucket; requiring 2.5 there refuses the export in one line
    with pytest.raises(JudgedTooLow) as err:
        TABLE.run("export", _cfg(target, tmp, min_last_bucket_accept_length=2.5, last_bucket_min_blocks=10),
                  store, upstream=upstream)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("export judged too low at long context: accept length 2.000 at context "
                                     "positions [128, 256) (")
    assert "the last bucket with >= 10) < export.min_last_bucket_accept_length 2.5" in str(err.value)
    verdict = export_verdict(None, err.value)
    assert verdict.startswith("## export: refused (JudgedTooLow)\n\n- export judged too low at long context")
    cfg = _cfg(target, tmp, min_last_bucket_accept_length=1.8, last_bucket_min_blocks=10)
    result = TABLE.run("export", cfg, store, upstream=upstream)
    last = result.meta["judge"]["verdict"]["last_bucket"]
    assert last["positions"] == "[128, 256)" and last["accept_length"] == 2.0 and last["blocks"] >= 10
    md = export_verdict(result)
    assert (f"export.min_last_bucket_accept_length 1.8 (accept length 2.00 at context positions [128, 256), "
            f"{last['blocks']} draft blocks)") in md.splitlines()[2]
