"""The train stage of the table: a committed dump in, a committed drafter + metrics out; a re-run
skips; `train.nproc_per_node: 2` launches torchrun itself (gloo on CPU) and commits the same layout."""
import json

import pytest

from drafter.formats import TRAINED_DRAFTER_FILES, download_trained_drafter
from drafter.model import load_drafter
from drafter.stage_output import StageOutput
from drafter.stages import TABLE, train
from drafter.store import FileStore
from drafter.target_identity import target_fingerprint
from tests.fixtures.training_data import make_cfg, make_dump, make_target


@pytest.fixture
def env(tmp_path):
    target = make_target(tmp_path / "target")
    store = FileStore(tmp_path / "store")
    dump_fp = make_dump(store, tmp_path, target_fp=target_fingerprint(target))
    return target, store, dump_fp, tmp_path


def test_train_stage_commits_a_loadable_drafter_and_skips_on_rerun(env):
    target, store, dump_fp, tmp = env
    cfg = make_cfg(target, f"file://{tmp}/store", max_steps=6, epochs=4)
    seen = []
    result = TABLE.run("train", cfg, store, upstream={"dump": dump_fp}, progress=lambda *a: seen.append(a))
    assert result.status == "done" and result.fingerprint == TABLE.fingerprints(cfg, {"dump": dump_fp})["train"]
    names = {s.name for s in result.manifest.shards}
    assert set(TRAINED_DRAFTER_FILES) | {"metrics.jsonl", "curves.png"} == names
    meta = result.manifest.meta
    assert meta["dump_fingerprint"] == dump_fp and meta["steps"] == 6 and meta["aux_layer_ids"] == [0, 1, 2]
    assert len(meta["final_eval"]["acc"]) == 3 and meta["final_eval"]["accept_length"] >= 1.0
    assert any("simulated accept length" in line for line in result.summary) and seen
    drafter = load_drafter(download_trained_drafter(store, result.fingerprint, tmp / "got"))
    assert drafter.config.draft_vocab_size == 40
    rows = StageOutput.committed(store, "train", result.fingerprint).read_jsonl("metrics.jsonl")
    assert {r["split"] for r in rows} == {"train", "eval"}

    again = TABLE.run("train", cfg, store, upstream={"dump": dump_fp})
    assert again.skipped and again.manifest == result.manifest


def test_train_fingerprint_follows_what_changes_the_drafter(env):
    target, store, dump_fp, tmp = env
    cfg = make_cfg(target, f"file://{tmp}/store", max_steps=6)
    fp = TABLE.fingerprint("train", cfg, {"dump": dump_fp})
    faster = make_cfg(target, f"file://{tmp}/store", max_steps=6, log_every_steps=3, cache_shards=4)
    assert TABLE.fingerprint("train", faster, {"dump": dump_fp}) == fp  # operational fields
    assert TABLE.fingerprint("train", make_cfg(target, f"file://{tmp}/store", max_steps=7), {"dump": dump_fp}) != fp
    assert TABLE.fingerprint("train", cfg, {"dump": "another0"}) != fp


def test_eagle31_is_the_default_enters_the_fingerprint_and_trains_its_parts(env, monkeypatch):
    """`train.drafter: eagle3.1` is the default and in the fingerprint; eagle3 is left out of it, so
    eagle3 outputs from before the field keep theirs. eagle3.1 trains fc_norm and commits a drafter
    whose config carries both flags; an eagle3 drafter is refused as its starting point."""
    from drafter.config import ConfigError
    from drafter.stages import train as train_stage
    from drafter.training.errors import TrainingError

    target, store, dump_fp, tmp = env
    root = f"file://{tmp}/store"
    payloads = []
    real = train_stage.stage_fingerprint
    monkeypatch.setattr(train_stage, "stage_fingerprint", lambda *a: payloads.append(a[1]) or real(*a))
    assert make_cfg(target, root).train.drafter == "eagle3.1"
    fp = TABLE.fingerprint("train", make_cfg(target, root, max_steps=2, drafter="eagle3"), {"dump": dump_fp})
    assert all("drafter" not in p["train"] for p in payloads)  # the payload eagle3 outputs were fingerprinted with
    cfg31 = make_cfg(target, root, max_steps=2)
    assert TABLE.fingerprint("train", cfg31, {"dump": dump_fp}) != fp and payloads[-1]["train"]["drafter"] == "eagle3.1"

    result = TABLE.run("train", cfg31, store, upstream={"dump": dump_fp})
    drafter = load_drafter(download_trained_drafter(store, result.fingerprint, tmp / "got31"))
    assert drafter.config.drafter == "eagle3.1" and drafter.config.fc_norm and drafter.config.norm_output
    assert all(not bool((n.weight == 1).all()) for n in drafter.fc_norm)  # trained away from their init (ones)
    eagle3 = TABLE.run("train", make_cfg(target, root, max_steps=2, drafter="eagle3"), store, upstream={"dump": dump_fp})
    start = download_trained_drafter(store, eagle3.fingerprint, tmp / "got3")
    with pytest.raises(ConfigError, match=r"train.drafter: eagle3.1, but train.init_from .*got3 is an eagle3 "
                                          r"drafter: set train.drafter: eagle3 to fine-tune it"):
        make_cfg(target, root, max_steps=2, init_from=str(start))  # caught when the profile is read
    fine_tune = make_cfg(target, root, max_steps=2, drafter="eagle3", init_from=str(start))
    # the trainer refuses it too: a champion is only known when the stage runs
    mixed = fine_tune.model_copy(update={"train": fine_tune.train.model_copy(update={"drafter": "eagle3.1"})})
    with pytest.raises(TrainingError, match=r"drafter: eagle3, train.drafter is eagle3.1 \(train.drafter: eagle3 "
                                            r"fine-tunes it\)"):
        TABLE.run("train", mixed, store, upstream={"dump": dump_fp})


def test_missing_dump_is_named(env):
    from drafter.store import ObjectNotFound

    target, store, _, tmp = env
    with pytest.raises(ObjectNotFound, match="dump is not committed"):
        TABLE.run("train", make_cfg(target, f"file://{tmp}/store", max_steps=2), store, upstream={"dump": "nope0000"})


@pytest.mark.slow
def test_two_processes_under_torchrun_launched_by_the_stage(env):
    target, store, dump_fp, tmp = env
    cfg = make_cfg(target, f"file://{tmp}/store", max_steps=4, nproc_per_node=2, parallel="ddp")
    lines = []
    result = TABLE.run("train", cfg, store, upstream={"dump": dump_fp}, on_line=lines.append)
    assert result.manifest.meta["world_size"] == 2 and result.manifest.meta["steps"] == 4
    assert lines  # the ranks' output reached the caller (the Prefect run log)
    assert json.loads(StageOutput.committed(store, "train", result.fingerprint)
                      .read_shard("drafter/config.json"))["architectures"] == ["LlamaForCausalLMEagle3"]
