"""bench_drafter_quality's drafter comparison (`--drafters eagle3 eagle3.1`): the runs it plans, and the
whole chain at its `--small` CPU sizes (~1 min here): both kinds trained on one dump with the same seed
and budget, each judged on the same prompts, the second paired with the first. The toy target's figures
say nothing about which kind is better; the structure is what is checked."""
from __future__ import annotations

import json
import sys

import pytest

from benchmarks import bench_drafter_quality as q
from drafter.model import load_drafter

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_drafters_train_each_variant_once_per_kind_and_pair_the_later_kinds_with_the_first():
    assert q.with_drafters({"ours": {}}, None) == ({"ours": {}}, [])
    runs, pairs = q.with_drafters({"ours": {}}, ["eagle3", "eagle3.1"])
    assert runs == {"eagle3": {"drafter": "eagle3"}, "eagle3.1": {"drafter": "eagle3.1"}}
    assert pairs == [("eagle3.1", "eagle3")]
    runs, pairs = q.with_drafters({"a": {"ttt_length": 5}, "b": {}}, ["eagle3.1", "eagle3"])
    assert runs == {"a/eagle3.1": {"ttt_length": 5, "drafter": "eagle3.1"},
                    "a/eagle3": {"ttt_length": 5, "drafter": "eagle3"},
                    "b/eagle3.1": {"drafter": "eagle3.1"}, "b/eagle3": {"drafter": "eagle3"}}
    assert pairs == [("a/eagle3", "a/eagle3.1"), ("b/eagle3", "b/eagle3.1")]
    with pytest.raises(ValueError, match="sets drafter"):
        q.with_drafters({"x": {"drafter": "eagle3"}}, ["eagle3", "eagle3.1"])
    with pytest.raises(ValueError, match="each kind once"):
        q.with_drafters({"ours": {}}, ["eagle3", "eagle3"])


def test_against_specforge_ours_trains_eagle3_unless_a_variant_says_otherwise():
    assert q.like_specforge({"ours": {}}) == {"ours": {"drafter": "eagle3"}}
    assert q.like_specforge({"a": {"drafter": "eagle3.1", "ttt_length": 5}}) == {
        "a": {"drafter": "eagle3.1", "ttt_length": 5}}


def test_paired_labels_default_to_ours_and_specforge():
    judged = lambda rows: {"judged": {1: {"per_prompt": rows}}, "held_out": {"acc": [0.5]}, "seconds": 1.0}
    ours, theirs = judged([[10, 8], [10, 6], [10, 7]]), judged([[10, 5], [10, 5], [10, 4]])
    row = q.paired(ours, theirs, [1])
    assert set(row["1/1/2"]) == {"ours", "specforge", "difference", "interval", "prompts"}
    row = q.paired(ours, theirs, [1], labels=("eagle3.1", "eagle3"))
    assert row["1/1/2"]["eagle3.1"] == pytest.approx(1.7) and row["1/1/2"]["eagle3"] == pytest.approx(1.4667, abs=1e-4)
    assert row["1/1/2"]["difference"] == pytest.approx(0.2333, abs=1e-4)
    assert set(row["held_out_acc"]) == {"eagle3.1", "eagle3"}


def test_small_chain_trains_both_kinds_on_one_dump_and_pairs_them(tmp_path, monkeypatch):
    corpus = tmp_path / "sharegpt.jsonl.gz"
    q.write_corpus(corpus)
    out, work = tmp_path / "out", tmp_path / "work"
    monkeypatch.setattr(sys, "argv", [
        "bench_drafter_quality.py", "--small", "--corpus", str(corpus), "--work", str(work), "--out", str(out),
        "--conversations", "120", "--epochs", "1", "--prompts", "4", "--max-new-tokens", "24", "--steps", "1,3",
        "--drafters", "eagle3", "eagle3.1"])
    q.main()
    result = json.loads((out / "quality.json").read_text())
    trainers = result["trainers"]
    assert list(trainers) == ["eagle3", "eagle3.1"]
    assert trainers["eagle3"]["overrides"] == {"drafter": "eagle3"}
    assert trainers["eagle3.1"]["overrides"] == {"drafter": "eagle3.1"}
    assert trainers["eagle3"]["steps"] == trainers["eagle3.1"]["steps"] > 0          # same data, same budget
    assert trainers["eagle3"]["held_out"]["tokens"] == trainers["eagle3.1"]["held_out"]["tokens"]
    # two train outputs of the one dump, one per kind
    kinds = sorted(load_drafter(d / "drafter").config.drafter for d in (work / "store" / "train").iterdir())
    assert kinds == ["eagle3", "eagle3.1"] and len(list((work / "store" / "dump").iterdir())) == 1
    pair = result["vs_drafter"]["eagle3.1 - eagle3"]
    assert set(pair["held_out_acc"]) == {"eagle3.1", "eagle3"}
    for steps, key in ((1, "1/1/2"), (3, "3/1/4")):
        row, judged = pair[key], {k: trainers[k]["judged"][str(steps)] for k in ("eagle3", "eagle3.1")}
        assert row["prompts"] == 4 == len(judged["eagle3"]["per_prompt"]) == len(judged["eagle3.1"]["per_prompt"])
        assert row["eagle3.1"] == pytest.approx(judged["eagle3.1"]["accept_length"], abs=1e-4)
        assert row["eagle3"] == pytest.approx(judged["eagle3"]["accept_length"], abs=1e-4)
        assert row["difference"] == pytest.approx(row["eagle3.1"] - row["eagle3"], abs=2e-4)
        assert row["interval"][0] <= row["difference"] <= row["interval"][1]
        for kind in ("eagle3", "eagle3.1"):  # the context curve: every verify in one bucket, lengths beside it
            curve = judged[kind]["by_context"]
            assert sum(b["blocks"] for b in curve) == judged[kind]["verifies"]
            assert judged[kind]["training_lengths"]["recorded_samples"] > 0
            assert curve[0]["trained_samples_reaching"] == judged[kind]["training_lengths"]["recorded_samples"]


def test_merge_pairs_kinds_trained_in_separate_runs():
    judged = lambda rows: {"judged": {"1": {"per_prompt": rows}}, "held_out": {"acc": [0.5]}, "seconds": 1.0}
    a = {"trainers": {"eagle3": judged([[10, 5], [10, 5], [10, 4]])}}
    b = {"trainers": {"eagle3.1": judged([[10, 8], [10, 6], [10, 7]])}}
    merged = q.merge([a, b])
    row = merged["vs_drafter"]["eagle3.1 - eagle3"]["1/1/2"]
    assert row["difference"] == pytest.approx(0.2333, abs=1e-4) and row["prompts"] == 3
    assert q.drafter_pairs({"x/eagle3": {}, "x/eagle3.1": {}, "y/eagle3.1": {}}) == [("x/eagle3.1", "x/eagle3")]
    assert "vs_drafter" not in q.merge([a])
