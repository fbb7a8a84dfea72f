"""Integrity on commit: a shard is re-hashed before `_SUCCESS.json` vouches for it, and
`drafter verify` re-hashes a committed output end to end. Through the prepare stage and the CLI
entry point, file store: ~1 s."""
from __future__ import annotations

import json
import sys

import pytest

from drafter.stages import TABLE
from drafter import cli
from drafter.stage_output import CorruptObject, StageOutput
from drafter.stages import prepare
from drafter.store import open_store
from drafter.config import load_config
from tests.fixtures.cli import drafter, profile


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))


def _prepared(tmp_path):
    """A small corpus prepared: (profile path, config, store, the prepare result)."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"question number {i}"}) + "\n" for i in range(20)))
    path = profile(tmp_path, data={"sources": [{"kind": "jsonl", "path": str(corpus)}], "eval_fraction": 0.2})
    cfg = load_config(path)
    store = open_store(cfg.storage)
    return path, cfg, store, TABLE.run("prepare", cfg, store)


def test_recommit_verifies_shards_and_verify_rehashes_end_to_end(tmp_path, monkeypatch, capsys):
    path, cfg, store, first = _prepared(tmp_path)
    code, err = drafter(monkeypatch, capsys, "verify", "prepare", "-c", path)
    assert code == 0, err
    out = StageOutput(store, "prepare", first.fingerprint)
    shard = tmp_path / "store" / "prepare" / first.fingerprint / "train.jsonl"

    # corrupted at rest (same size), manifest lost: the re-run must not commit it as done
    _flip_a_byte(shard)
    code, err = drafter(monkeypatch, capsys, "verify", out.uri)
    assert code == 4 and "train.jsonl: corrupt object" in err and "sha256 mismatch" in err
    (shard.parent / "_SUCCESS.json").unlink()
    with pytest.raises(CorruptObject, match=r"1 of 3 shards failed verification before commit .*train.jsonl"):
        TABLE.run("prepare", cfg, store)
    assert not (shard.parent / "_SUCCESS.json").exists()
    assert "train.jsonl" not in out.completed_shards()  # its marker is gone: the next run redoes it
    again = TABLE.run("prepare", cfg, store)
    assert again.status == "done" and again.meta == first.meta
    monkeypatch.setattr(sys, "argv", ["drafter", "verify", out.uri])
    with pytest.raises(SystemExit) as done:
        cli.main()
    assert done.value.code == 0
    assert capsys.readouterr().out.strip().endswith("3 shards, " + f"{first.manifest.total_bytes / 1e6:.2f} MB verified (sha256): ok")


def test_a_flipped_shard_under_an_intact_success_marker_is_repaired(tmp_path, monkeypatch, capsys):
    """Before: the stage said skipped, every reader refused, and only deleting `_SUCCESS.json` by
    hand got out of it. Now the refusals name `drafter verify --repair STAGE`, and the repair sets
    the output aside (its manifest and the failures kept under `_failed/`) so the next run redoes it."""
    from drafter.formats import load_prepared

    path, cfg, store, first = _prepared(tmp_path)
    _flip_a_byte(tmp_path / "store" / "prepare" / first.fingerprint / "train.jsonl")

    assert TABLE.run("prepare", cfg, store).status == "skipped"  # sizes match: looks complete
    fix = "to redo it, run `drafter verify --repair prepare -c PROFILE` (the profile that made it), then run prepare again"
    with pytest.raises(CorruptObject, match="sha256 mismatch on read") as err:
        load_prepared(store, first.fingerprint, "train")  # what datagen and dump read
    assert str(err.value).endswith(fix)
    code, err = drafter(monkeypatch, capsys, "verify", "prepare", "-c", path)
    assert code == 4 and err.strip().splitlines()[-1].endswith(f"1 of 3 shards failed verification; {fix}")

    code, err = drafter(monkeypatch, capsys, "verify", "--repair", "prepare", "-c", path)  # what the message says
    assert code == 0 and "train.jsonl" in err and "set aside: " in err, err
    again = TABLE.run("prepare", cfg, store)
    assert again.status == "done" and again.meta == first.meta
    code, err = drafter(monkeypatch, capsys, "verify", "prepare", "-c", path)
    assert code == 0, err
    assert len(store.list(f"prepare/{first.fingerprint}/_failed/")) == 1  # the evidence stays


def test_the_trainers_refusal_of_a_flipped_dump_shard_names_the_repair(tmp_path):
    from drafter.store import FileStore
    from drafter.training.data import fetch_verified

    store = FileStore(tmp_path / "store")
    out = StageOutput(store, "dump", "0123456789abcdef")
    out.write_shard("hs-00000.safetensors", b"s" * 4096)
    out.commit({})
    _flip_a_byte(tmp_path / "store" / "dump" / "0123456789abcdef" / "hs-00000.safetensors")
    with pytest.raises(CorruptObject, match=r"sha256 mismatch on read: .*; to redo it, run `drafter verify --repair "
                                            r"dump -c PROFILE` \(the profile that made it\), then run dump again"):
        fetch_verified(StageOutput.committed(store, "dump", "0123456789abcdef"), "hs-00000.safetensors",
                       tmp_path / "x")
