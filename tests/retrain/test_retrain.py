"""The retrain loop's library parts: growing sources, incremental datagen and dump (references to
earlier outputs, integrity through them), the drafter registry and the promotion rule."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drafter.config import DataConfig, DataSource, LifecycleConfig, StorageConfig, TargetConfig, parse_config
from drafter.formats import iter_dump_samples, iter_generations, load_prepared
from drafter.retrain.registry import Registry, RegistryError
from drafter.retrain.verdict import compare
from drafter.stage_output import StageOutput, to_jsonl
from drafter.stages import TABLE, datagen, dump, prepare
from drafter.store import CorruptObject, FileStore, open_store
from tests.fixtures.datagen_fakes import FakeOpenAI, fakes, sharegpt, with_datagen  # noqa: F401 (fixture)


def write_file(folder: Path, name: str, rows: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def folder_cfg(folder: Path, storage: StorageConfig, **datagen_settings) -> LifecycleConfig:
    settings = dict(max_tokens=16, concurrency_per_server=2, request_timeout_s=10, max_retries=1, shard_size=4)
    settings.update(datagen_settings)
    return parse_config({"target": {"path": "/nonexistent/target", "name": "fake-model"},
                         "data": {"sources": [{"kind": "jsonl", "path": str(folder)}], "eval_fraction": 0},
                         "datagen": settings, "storage": storage.model_dump()})


# ---- growing sources


def test_folder_source_versions_by_content_and_keeps_ids(tmp_path):
    folder = tmp_path / "prompts"
    write_file(folder, "day-1.jsonl", [{"prompt": f"question {i}"} for i in range(3)])
    cfg = folder_cfg(folder, StorageConfig(root=f"file://{tmp_path / 'store'}"))
    store = open_store(cfg.storage)
    v1 = TABLE.run("prepare", cfg, store)
    assert [c["id"] for c in load_prepared(store, v1.fingerprint, "train")] == [
        "day-1.jsonl:0", "day-1.jsonl:1", "day-1.jsonl:2"]
    assert TABLE.run("prepare", cfg, store).skipped
    write_file(folder, "day-2.jsonl", [{"prompt": "question 9"}])
    v2 = TABLE.run("prepare", cfg, store)
    assert v2.fingerprint != v1.fingerprint and not v2.skipped
    assert StageOutput(store, "prepare", v1.fingerprint).is_complete()  # the old version is untouched
    assert [c["id"] for c in load_prepared(store, v2.fingerprint, "train")][-1] == "day-2.jsonl:0"
    (folder / "day-2.jsonl").write_text(json.dumps({"prompt": "question 10"}) + "\n")  # same name, new content
    assert TABLE.fingerprint("prepare", cfg) not in (v1.fingerprint, v2.fingerprint)


@pytest.mark.s3
def test_s3_prefix_source(s3_storage_config, tmp_path):
    src_store = open_store(s3_storage_config)
    src_store.put_bytes("incoming/b.jsonl", b'{"id": "b1", "prompt": "second"}\n')
    src_store.put_bytes("incoming/a.jsonl", b'{"id": "a1", "prompt": "first"}\n')
    src_store.put_bytes("incoming/notes.txt", b"not a prompt file")
    source = {"kind": "jsonl", "path": f"{s3_storage_config.root}/incoming", "endpoint_url": s3_storage_config.endpoint_url,
              "region": "us-east-1"}
    cfg = parse_config({"target": {"path": "/nonexistent"}, "data": {"sources": [source], "eval_fraction": 0},
                        "storage": {"root": f"file://{tmp_path / 'store'}"}})
    store = open_store(cfg.storage)
    result = TABLE.run("prepare", cfg, store)
    assert [c["id"] for c in load_prepared(store, result.fingerprint, "train")] == ["a1", "b1"]
    src_store.put_bytes("incoming/c.jsonl", b'{"id": "c1", "prompt": "third"}\n')
    assert TABLE.fingerprint("prepare", cfg) != result.fingerprint


# ---- incremental datagen


def test_datagen_asks_only_new_conversations_and_references_earlier_shards(tmp_path, fakes):
    fake = fakes()
    folder = tmp_path / "prompts"
    write_file(folder, "day-1.jsonl", [sharegpt(i) for i in range(10)])
    cfg = folder_cfg(folder, StorageConfig(root=f"file://{tmp_path / 'store'}"), server_urls=[fake.url])
    store = open_store(cfg.storage)
    first = TABLE.run("datagen", cfg, store, upstream={"prepare": TABLE.run("prepare", cfg, store).fingerprint})
    assert len(fake.prompts) == 10 and first.meta["reuse"]["linked_shards"] == 0

    write_file(folder, "day-2.jsonl", [sharegpt(i) for i in range(10, 13)])
    fake.received.clear()
    v2 = TABLE.run("prepare", cfg, store).fingerprint
    second = TABLE.run("datagen", cfg, store, upstream={"prepare": v2})
    assert sorted(fake.prompts) == ["question 10.0", "question 11.0", "question 12.0"]
    reuse = second.meta["reuse"]
    assert (reuse["linked_shards"], reuse["linked_conversations"], reuse["asked_conversations"]) == (3, 10, 3)
    linked = [s for s in second.manifest.shards if s.source]
    assert {s.source.split("/")[1] for s in linked} == {first.fingerprint}
    records = list(iter_generations(store, second.manifest))
    assert sorted(r["id"] for r in records) == sorted(f"c{i:03d}" for i in range(13))
    assert second.meta["generated"] == 13

    # Sample granularity: drop one old conversation; the shard holding it cannot be referenced
    # whole, its other answers are copied; nothing is asked.
    write_file(folder, "day-1.jsonl", [sharegpt(i) for i in range(10) if i != 1])
    fake.received.clear()
    third = TABLE.run("datagen", cfg, store, upstream={"prepare": TABLE.run("prepare", cfg, store).fingerprint})
    assert fake.prompts == [] and third.meta["reuse"]["copied_conversations"] == 3
    assert sorted(r["id"] for r in iter_generations(store, third.manifest)) == sorted(
        f"c{i:03d}" for i in range(13) if i != 1)
    # Other settings are other work: nothing is reused across them.
    hotter = with_datagen(cfg, temperature=0.7)
    fake.received.clear()
    TABLE.run("datagen", hotter, store, upstream={"prepare": v2})
    assert len(fake.prompts) == 13


# ---- incremental dump

AUX = [0, 1, 2]


def dump_cfg(target, root: str) -> LifecycleConfig:
    return parse_config({"target": {"path": str(target)}, "storage": {"root": root},
                         "dump": {"aux_layer_ids": AUX, "max_length": 64, "tokens_per_batch": 400,
                                  "samples_per_shard": 3, "devices": ["cpu"], "upstream": "prepare"},
                         "train": {"draft_vocab_size": 256}})


def put_prepared(store, fp: str, conversations: list[dict]) -> str:
    out = StageOutput(store, "prepare", fp)
    out.write_shard("train.jsonl", to_jsonl(conversations))
    out.write_shard("eval.jsonl", to_jsonl([]))
    out.commit({})
    return fp


def test_dump_references_earlier_shards_and_checks_them_on_read(tmp_path, tiny_target, tiny_conversations):
    convs = [{"id": c["id"], "messages": [{"role": m["role"], "content": m["content"][:80]} for m in c["messages"][:2]]}
             for c in tiny_conversations[:8]]
    store = FileStore(tmp_path / "store")
    cfg = dump_cfg(tiny_target, f"file://{tmp_path / 'store'}")
    first = TABLE.run("dump", cfg, store, upstream={"prepare": put_prepared(store, "prep1", convs[:6])})
    assert first.meta["reuse"]["linked_shards"] == 0 and first.meta["num_shards"] == 2
    second = TABLE.run("dump", cfg, store, upstream={"prepare": put_prepared(store, "prep2", convs)})
    reuse = second.meta["reuse"]
    assert (reuse["linked_shards"], reuse["computed_shards"], reuse["computed_records"]) == (2, 1, 2)
    assert reuse["earlier_outputs"] == [first.fingerprint]
    assert all(s.source.startswith(f"dump/{first.fingerprint}/") for s in second.manifest.shards[:2])
    samples = {s["id"]: s for s in iter_dump_samples(store, second.manifest, expect_aux_layer_ids=AUX)}
    before = {s["id"]: s for s in iter_dump_samples(store, first.manifest, expect_aux_layer_ids=AUX)}
    assert len(samples) == second.meta["num_samples"] and set(before) < set(samples)
    assert all(torch.equal(samples[k]["hidden_states"], before[k]["hidden_states"]) for k in before)
    from drafter.training.data import fetch_verified  # the trainer's reader follows references too

    linked_name = second.manifest.shards[0].name
    assert fetch_verified(StageOutput.committed(store, "dump", second.fingerprint), linked_name,
                          tmp_path / "x.safetensors").read_bytes() == (tmp_path / "store" / second.manifest.shards[0].source).read_bytes()

    # Integrity follows the references: a flipped byte in the earlier dump fails the later one's read,
    # a deleted shard makes it incomplete (and a re-run recomputes it).
    victim = tmp_path / "store" / second.manifest.shards[0].source
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptObject, match="sha256 mismatch"):
        list(iter_dump_samples(store, second.manifest, expect_aux_layer_ids=AUX))
    victim.unlink()
    assert not StageOutput(store, "dump", second.fingerprint).is_complete()
    StageOutput(store, "dump", first.fingerprint).reset()
    redone = TABLE.run("dump", cfg, store, upstream={"prepare": "prep2"})
    assert not redone.skipped and redone.meta["reuse"]["computed_shards"] == 3
    assert StageOutput(store, "dump", second.fingerprint).is_complete()


# ---- registry and the promotion rule


def fake_export(store, fp: str, target: str) -> str:
    out = StageOutput(store, "export", fp)
    out.write_shard("export.json", b"{}")
    out.commit({"export": {"target": {"fingerprint": target}}, "judge": {"accept_length": 1.5, "prompts": 4}})
    return fp


def test_registry_promote_rollback_and_refusals(tmp_path):
    store = FileStore(tmp_path / "store")
    reg = Registry(store, "t0", "demo")
    assert reg.champion_export() is None
    with pytest.raises(RegistryError, match="no champion yet"):
        reg.rollback()
    with pytest.raises(RegistryError, match="no committed export"):
        reg.promote("missing", "why")
    with pytest.raises(RegistryError, match="made for target t1"):
        reg.promote(fake_export(store, "other", "t1"), "why")
    assert reg.opponent("e1") is None
    for fp in ("e1", "e2", "e3"):
        reg.promote(fake_export(store, fp, "t0"), f"retrain {fp}", {"accept_length": 1.5})
    assert reg.champion_export() == "e3"
    # who a challenger faces: the champion, or the one it replaced when it already is the champion
    assert reg.opponent("e9") == "e3" and reg.opponent("e3") == "e2"
    assert reg.rollback()["export"] == "e2" and reg.champion_export() == "e2"
    assert reg.rollback()["export"] == "e1"
    with pytest.raises(RegistryError, match="first one"):
        reg.rollback()
    history = Registry(store, "t0", "demo").history()  # what another process reads
    assert [(e["action"], e["export"]) for e in history] == [
        ("promote", "e1"), ("promote", "e2"), ("promote", "e3"), ("rollback", "e2"), ("rollback", "e1")]
    assert Registry(store, "t0", "other-name").champion_export() is None  # per name
    with pytest.raises(RegistryError, match="drafter name"):
        Registry(store, "t0", "../x")


def judged(pairs):
    return {"per_prompt": [list(p) for p in pairs]}


@pytest.mark.parametrize("challenger, promoted, why", [
    ([(10, 9), (10, 8), (10, 9), (10, 9)], True, None),                    # clearly better everywhere
    ([(10, 5), (10, 5), (10, 5), (10, 5)], False, "below retrain.min_improvement"),  # equal
    ([(10, 2), (10, 2), (10, 2), (10, 2)], False, "below retrain.min_improvement"),  # worse
    ([(10, 10), (10, 0), (10, 10), (10, 10)], False, "does not exclude zero"),       # +17% on average, noisy
])
def test_promotion_needs_the_gain_and_an_interval_above_zero(challenger, promoted, why):
    champion = judged([(10, 5), (10, 5), (10, 5), (10, 5)])
    verdict = compare(champion, judged(challenger), min_improvement=0.05, confidence=0.95, samples=2000, seed=0)
    assert verdict["promoted"] is promoted
    assert verdict["champion_accept_length"] == pytest.approx(1.5)
    if why:
        assert why in verdict["reason"]
    low, high = verdict["interval"]
    assert low <= verdict["difference"] <= high


def test_validate_accepts_champion_and_a_source_folder(tmp_path):
    from drafter.config import path_problems

    (tmp_path / "prompts").mkdir()
    cfg = parse_config({"target": {"path": str(tmp_path)}, "train": {"init_from": "champion", "draft_vocab_size": 8},
                        "serve": {"draft_path": "champion"},
                        "data": {"sources": [{"kind": "jsonl", "path": str(tmp_path / "prompts")},
                                             {"kind": "jsonl", "path": "s3://bucket/incoming"},
                                             {"kind": "jsonl", "path": str(tmp_path / "missing")}]}})
    assert [field for field, _ in path_problems(cfg)] == ["data.sources.2.path"]


def test_retrain_bench_needs_settings_and_puts_the_bench_before_the_verdict(tmp_path):
    from drafter.config import ConfigError
    from drafter.stages import TABLE

    base = {"target": {"path": str(tmp_path)}, "train": {"draft_vocab_size": 8}, "retrain": {"bench": True}}
    with pytest.raises(ConfigError, match="retrain.bench: needs bench.speculative"):
        parse_config(base)
    cfg = parse_config({**base, "serve": {"draft_path": "champion"},
                        "bench": {"speculative": [{"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 2}]}})
    assert TABLE["bench"].upstream_of(cfg) == ("prepare", "export")  # the challenger, whatever serve loads
    assert TABLE["champion"].upstream_of(cfg) == ("export", "prepare", "bench")
    assert TABLE.names.index("bench") < TABLE.names.index("champion") < TABLE.names.index("serve")
    plain = parse_config({**base, "retrain": {}})
    assert TABLE["champion"].upstream_of(plain) == ("export", "prepare")


def test_champion_stage_a_failed_bench_vetoes_even_the_first_drafter(tmp_path):
    """The champion stage with `retrain.bench`: the bench's figures go into the decision, and a
    challenger whose server failed in the bench is not promoted although it passed the export gate."""
    from drafter.stages import champion as champion_stage

    store_dir = tmp_path / "store"
    cfg = parse_config({"name": "veto", "target": {"path": str(tmp_path / "target"), "revision": "r1"},
                        "train": {"draft_vocab_size": 8}, "retrain": {"bench": True},
                        "bench": {"speculative": [{"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 2}]},
                        "storage": {"root": f"file://{store_dir}"}})
    store = FileStore(store_dir)
    reg = Registry.for_config(cfg, store)
    fake_export(store, "e1", reg.target)

    def bench(fp: str, failures: dict) -> str:
        out = StageOutput(store, "bench", fp)
        rows = [{"key": "challenger-eagle3-s1-k1-d2", "config": "challenger EAGLE3 1/1/2", "batch_size": 1,
                 "rounds": 2, "speedup": {"speedup": 0.8}, "accept_length": {"mean": 1.4}}]
        out.write_shard("report.json", json.dumps({
            "drafters": {"challenger": "e1"}, "failures": failures, "head_to_head": [],
            "summary": {"drift": {"1": {"unstable": False}}, "rows": rows}}))
        out.write_shard("report.md", "# Bench report\n")
        out.commit({})
        return fp

    crashed = {"challenger-eagle3-s1-k1-d2": {"config": "challenger EAGLE3 1/1/2", "kind": "crashed"}}
    vetoed = TABLE.run("champion", cfg, store, upstream={"export": "e1", "prepare": "p1", "bench": bench("b1", crashed)})
    assert vetoed.meta["verdict"] == "rejected" and "the challenger's server failed" in vetoed.meta["reason"]
    assert reg.champion_export() is None and reg.decisions()[-1]["bench"]["problems"]
    fine = TABLE.run("champion", cfg, store, upstream={"export": "e1", "prepare": "p1", "bench": bench("b2", {})})
    assert fine.meta["verdict"] == "promoted" and reg.champion_export() == "e1"
    assert fine.meta["bench"]["rows"] == [{"setting": "challenger EAGLE3 1/1/2", "batch_size": 1, "rounds": 2,
                                           "challenger_speedup": 0.8, "challenger_accept_length": 1.4}]
    assert any("speedup vs baseline" in row["figure"] for row in fine.table)
    assert [line for line in fine.summary if "predicted speedup" in line] == [
        "challenger predicted speedup: none yet, no accept-length curve is stored for engine reference and this "
        f"target at {cfg.export.judge_num_steps} draft steps (run the bench with bench.accept_curve); offline accept "
        "length 1.500"]
    # the re-run finds the same pair (the challenger now faces the champion it replaced: none) and skips;
    # a bench that stored an accept-length curve meanwhile gives the challenger's predicted speedup
    from drafter.target_identity import target_identity

    curve = StageOutput(store, "bench", "c1")
    curve.write_shard("report.md", "# Bench report\n")
    points = [{"requested": a, "accept_length": a, "speedup": a / 2, "low": a / 2.2, "high": a / 1.8}
              for a in (1.0, 2.0)]
    curve.commit({"accept_curve": {"engine": "reference", "target": target_identity(cfg.target), "curves": [
        {"setting": "EAGLE3 3/1/4", "setting_key": "eagle3-s3-k1-d4", "num_steps": cfg.export.judge_num_steps,
         "batch_size": 1, "points": points, "measured": []}]}})
    again = TABLE.run("champion", cfg, store, upstream={"export": "e1", "prepare": "p1", "bench": "b2"})
    assert again.skipped and again.meta["verdict"] == "promoted"
    (line,) = [line for line in again.summary if "predicted speedup" in line]
    assert line.startswith("challenger predicted speedup at EAGLE3 3/1/4, batch 1: 0.75x [0.68, 0.83] from offline "
                           "accept length 1.500; curve: bench c1")
