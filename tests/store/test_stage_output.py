"""Stage-output commit protocol, run identically against file:// and a real S3 protocol server."""
from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from drafter.stage_output import (
    FORMAT_VERSION, MANIFEST_NAME, ManifestError, StageOutput, fingerprint, guarded_progress)
from drafter.store import CorruptObject, ObjectNotFound, StoreError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def out(any_store) -> StageOutput:
    return StageOutput(any_store, "dump", "0123456789abcdef")


def _flip_byte(store, key: str, at: int) -> None:
    data = bytearray(store.get_bytes(key))
    data[at] ^= 0x01
    store.put_bytes(key, bytes(data))


# ---- fingerprints


def test_fingerprint_is_stable_and_canonical():
    fp = fingerprint("train", {"lr": 1e-4, "epochs": 1}, ["aaaa", "bbbb"])
    assert fp == fingerprint("train", {"epochs": 1, "lr": 1e-4}, ("aaaa", "bbbb"))  # key order
    assert len(fp) == 16 and int(fp, 16) >= 0
    # Pinned to the documented canonical form: changing it orphans every stored output.
    canonical = b'{"config":{"epochs":1,"lr":0.0001},"format_version":1,"stage":"train","upstream":["aaaa","bbbb"]}'
    assert fp == hashlib.sha256(canonical).hexdigest()[:16] == "7c0de145da91a9d5"


@pytest.mark.parametrize("change", [
    dict(config={"lr": 2e-4, "epochs": 1}),
    dict(config={"lr": 1e-4, "epochs": 1, "extra": None}),
    dict(upstream=["aaaa", "cccc"]),
    dict(upstream=["bbbb", "aaaa"]),  # positional inputs are not interchangeable
    dict(upstream=[]),
    dict(format_version=FORMAT_VERSION + 1),
    dict(stage="dump"),
])
def test_fingerprint_changes_with_every_input(change):
    base = dict(stage="train", config={"lr": 1e-4, "epochs": 1}, upstream=["aaaa", "bbbb"])
    assert fingerprint(**{**base, **change}) != fingerprint(**base)


def test_fingerprint_refuses_unserializable_config():
    with pytest.raises(TypeError, match="not JSON-serializable"):
        fingerprint("x", {"obj": object()})
    assert fingerprint("x", {"p": Path("/a")}) == fingerprint("x", {"p": "/a"})


# ---- write, read, commit


def test_write_read_commit_roundtrip(out, tmp_path):
    src = tmp_path / "shard.bin"
    src.write_bytes(b"\x00\x01" * 50_000)
    a = out.write_shard("b.bin", b"bytes shard", meta={"samples": 3})
    b = out.write_shard("a.jsonl", '{"text": "héllo"}\n')
    c = out.write_shard("c/file.bin", src)
    assert (a.size, b.size, c.size) == (11, len('{"text": "héllo"}\n'.encode()), 100_000)
    assert out.read_shard("a.jsonl").decode() == '{"text": "héllo"}\n'  # readable before commit
    assert not out.is_complete()
    assert not out.store.exists(out.key(MANIFEST_NAME))

    manifest = out.commit({"rows": 42, "aux_layer_ids": [1, 2, 3]})
    assert [s.name for s in manifest.shards] == ["a.jsonl", "b.bin", "c/file.bin"]
    assert manifest.shard("b.bin").meta == {"samples": 3}
    assert manifest.meta == {"rows": 42, "aux_layer_ids": [1, 2, 3]}
    assert (manifest.stage, manifest.fingerprint, manifest.format_version) == ("dump", out.fingerprint, 1)
    datetime.fromisoformat(manifest.created_at)

    fresh = StageOutput(out.store, "dump", out.fingerprint)  # another process, later
    assert fresh.is_complete()
    assert fresh.load_manifest() == manifest
    assert fresh.read_shard("b.bin") == b"bytes shard"
    got = fresh.download_shard("c/file.bin", tmp_path / "dl")
    assert got == tmp_path / "dl" and got.read_bytes() == src.read_bytes()
    (tmp_path / "dir").mkdir()
    assert fresh.download_shard("c/file.bin", tmp_path / "dir") == tmp_path / "dir" / "file.bin"
    assert fresh.prefix == "dump/0123456789abcdef"
    assert fresh.uri.endswith("/dump/0123456789abcdef")


def test_reserved_and_invalid_shard_names(out):
    for bad in ["_SUCCESS.json", "_parts/x", "../x", ""]:
        with pytest.raises(StoreError):
            out.write_shard(bad, b"x")
    with pytest.raises(TypeError):
        out.write_shard("x", 123)


def test_crash_between_upload_and_marker_resumes(out, monkeypatch):
    out.write_shard("shard-000", b"a" * 1000)
    out.write_shard("shard-001", b"b" * 2000)
    real_put = out.store.put_bytes

    def crash_on_marker(key, data):
        if key.endswith("_parts/shard-002.json"):
            raise KeyboardInterrupt("simulated kill after the upload, before the marker")
        real_put(key, data)

    monkeypatch.setattr(out.store, "put_bytes", crash_on_marker)
    with pytest.raises(KeyboardInterrupt):
        out.write_shard("shard-002", b"c" * 3000)
    monkeypatch.undo()

    resumed = StageOutput(out.store, "dump", out.fingerprint)
    assert out.store.exists(resumed.key("shard-002"))  # uploaded, but never vouched for
    assert list(resumed.completed_shards()) == ["shard-000", "shard-001"]
    assert not resumed.store.exists(resumed.key(MANIFEST_NAME)) and not resumed.is_complete()
    with pytest.raises(ObjectNotFound, match="shard-002"):
        resumed.read_shard("shard-002")

    resumed.write_shard("shard-002", b"c" * 3000)
    assert [s.name for s in resumed.commit({}).shards] == ["shard-000", "shard-001", "shard-002"]
    assert resumed.is_complete()


_CHILD = """
import sys, time
from drafter.config import StorageConfig
from drafter.stage_output import StageOutput
from drafter.store import open_store

store = open_store(StorageConfig.model_validate_json(sys.argv[1]))
out = StageOutput(store, "dump", "0123456789abcdef")
out.write_shard("shard-000", b"a" * 1000)
out.write_shard("shard-001", b"b" * 2000)
real_put = store.put_bytes
def put(key, data):
    if key.endswith("_parts/shard-002.json"):
        print("UPLOADED", flush=True)
        time.sleep(120)  # killed here: shard-002 uploaded, its marker not yet written
    real_put(key, data)
store.put_bytes = put
out.write_shard("shard-002", b"c" * 3000)
"""


def test_sigkill_mid_stage_resumes_at_first_missing_shard(out, any_storage_config):
    child = subprocess.Popen([sys.executable, "-c", _CHILD, any_storage_config.model_dump_json()],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip() == "UPLOADED", child.stderr.read()
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    assert list(out.completed_shards()) == ["shard-000", "shard-001"]
    assert not out.is_complete() and not out.store.exists(out.key(MANIFEST_NAME))
    out.write_shard("shard-002", b"c" * 3000)
    out.commit({})
    assert out.is_complete() and out.read_shard("shard-002") == b"c" * 3000


def test_completed_shards_ignores_markers_without_a_good_shard(out):
    out.write_shard("ok", b"1234")
    out.write_shard("gone", b"5678")
    out.write_shard("short", b"abcdef")
    out.store.delete(out.key("gone"))
    out.store.put_bytes(out.key("short"), b"abc")
    out.store.put_bytes(out.key("_parts/junk.json"), b"{not json")
    assert list(out.completed_shards()) == ["ok"]
    assert [s.name for s in out.commit({}).shards] == ["ok"]


def test_rewriting_a_shard_before_commit_updates_its_record(out):
    first = out.write_shard("s", b"version one")
    second = out.write_shard("s", b"version 2")
    assert first.sha256 != second.sha256
    assert out.completed_shards()["s"] == second
    assert out.read_shard("s") == b"version 2"


# ---- corruption is detected, never used


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "uncommitted"])
def test_flipped_byte_raises_corrupt_object_naming_the_key(out, tmp_path, committed):
    out.write_shard("hidden/shard-007.safetensors", bytes(range(256)) * 100)
    if committed:
        out.commit({})
    key = out.key("hidden/shard-007.safetensors")
    _flip_byte(out.store, key, 12_345)
    with pytest.raises(CorruptObject, match="sha256 mismatch") as err:
        out.read_shard("hidden/shard-007.safetensors")
    assert err.value.key == key and key in str(err.value)
    assert out.store.uri(key) in str(err.value)
    dl = tmp_path / "downloads"
    dl.mkdir()
    with pytest.raises(CorruptObject, match="shard-007"):
        out.download_shard("hidden/shard-007.safetensors", dl / "x.safetensors")
    assert list(dl.iterdir()) == []  # the bad download is not left behind
    # Same size, so is_complete (sizes only) still says True; reads are where hashes are enforced.
    assert out.is_complete() is committed


def test_truncated_shard_raises_corrupt_object(out, tmp_path):
    out.write_shard("s.bin", b"x" * 10_000)
    out.commit({})
    key = out.key("s.bin")
    out.store.put_bytes(key, b"x" * 9_999)
    with pytest.raises(CorruptObject, match=r"truncated") as err:
        out.read_shard("s.bin")
    assert key in str(err.value) and "expected 10000 bytes, got 9999" in str(err.value)
    with pytest.raises(CorruptObject, match="size mismatch"):
        out.download_shard("s.bin", tmp_path / "s.bin")
    assert not out.is_complete()


# ---- is_complete / load_manifest


def test_is_complete_false_for_missing_or_broken_state(out):
    assert not out.is_complete()  # nothing at all
    out.write_shard("a", b"aaa")
    out.write_shard("b", b"bbb")
    out.commit({"n": 2})
    assert out.is_complete()
    manifest_key = out.key(MANIFEST_NAME)
    good = out.store.get_bytes(manifest_key)

    out.store.delete(out.key("b"))
    assert not out.is_complete()  # a listed shard is missing
    out.store.put_bytes(out.key("b"), b"bbb")
    assert out.is_complete()

    broken = {
        "not json": b"{truncated",
        "wrong schema": b'{"stage": "dump"}',
        "not utf-8": b"\xff\xfe\x00",
        "other output": good.replace(out.fingerprint.encode(), b"ffffffffffffffff"),
    }
    for why, raw in broken.items():
        out.store.put_bytes(manifest_key, raw)
        assert not out.is_complete(), why
        with pytest.raises(ManifestError, match=MANIFEST_NAME):
            out.load_manifest()


def test_load_manifest_missing_names_the_key(out):
    with pytest.raises(StoreError, match=f"dump/0123456789abcdef/{MANIFEST_NAME}"):
        out.load_manifest()


def test_commit_is_idempotent(out):
    out.write_shard("a", b"aaa")
    first = out.commit({"n": 1})
    raw = out.store.get_bytes(out.key(MANIFEST_NAME))
    again = StageOutput(out.store, "dump", out.fingerprint).commit({"n": 1})
    assert again == first
    assert out.store.get_bytes(out.key(MANIFEST_NAME)) == raw  # not even created_at changed
    with pytest.raises(StoreError, match="reset"):
        out.commit({"n": 2})  # a complete output is never silently changed
    with pytest.raises(StoreError, match="reset"):
        out.write_shard("b", b"bbb")


def test_commit_expect_names_missing_shards(out):
    out.write_shard("shard-0", b"0")
    with pytest.raises(StoreError, match="shard-1"):
        out.commit({}, expect=["shard-0", "shard-1"])
    assert not out.store.exists(out.key(MANIFEST_NAME))


def test_guarded_progress_never_raises_and_stops_after_a_failure(caplog):
    calls = []

    def flaky(*args):
        calls.append(args)
        raise RuntimeError("artifact API down")

    report = guarded_progress(flaky, "dump")
    report(1, 10)
    report(2, 10, "1.0 req/s")
    assert calls == [(1, 10)] and "dump progress callback failed" in caplog.text
    assert guarded_progress(None, "dump") is None


def test_commit_meta_from_the_listed_shards(out):
    out.write_shard("a", b"aaa", meta={"rows": 2})
    out.write_shard("b", b"bb", meta={"rows": 5})
    seen = []

    def meta(shards):
        seen.append(list(shards))
        return {"rows": sum(s.meta["rows"] for s in shards.values())}

    manifest = out.commit(meta, expect=["a", "b"])
    assert seen == [["a", "b"]] and manifest.meta == {"rows": 7}
    with pytest.raises(StoreError, match="shard-c"):
        out.commit(meta, expect=["a", "shard-c"])
    assert len(seen) == 1  # not asked for meta when shards are missing


def test_writing_into_a_broken_commit_repairs_it(out):
    out.write_shard("a", b"aaa")
    out.write_shard("b", b"bbb")
    out.commit({})
    out.store.delete(out.key("b"))  # e.g. lost by a lifecycle rule
    assert not out.is_complete()
    out.write_shard("b", b"bbb")  # resuming removes the broken manifest first
    assert not out.store.exists(out.key(MANIFEST_NAME))
    out.commit({})
    assert out.is_complete()


def test_reset_deletes_everything(out):
    out.write_shard("a", b"aaa")
    out.commit({})
    other = StageOutput(out.store, "dump", "fedcba9876543210")
    other.write_shard("keep", b"k")
    assert out.reset() == 3  # shard, marker, manifest
    assert out.store.list(out.prefix + "/") == []
    assert not out.is_complete() and out.completed_shards() == {}
    assert other.completed_shards().keys() == {"keep"}
    out.write_shard("a", b"new")
    assert out.commit({}).shards[0].size == 3


def test_manifest_on_disk_is_plain_json(out):
    out.write_shard("x", b"x")
    out.commit({"k": "v"})
    doc = json.loads(out.store.get_bytes(out.key(MANIFEST_NAME)))
    assert doc["shards"][0]["name"] == "x" and len(doc["shards"][0]["sha256"]) == 64
    assert doc["meta"] == {"k": "v"}


# ---- repair: a committed output whose shard fails verification is set aside, evidence kept


def test_repair_sets_a_failed_output_aside_so_the_next_run_redoes_it(out):
    for name in ("a", "b"):
        out.write_shard(name, name.encode() * 1000)
    committed = out.commit({"k": "v"})
    assert out.repair()["set_aside"] == []  # all good: nothing changes
    assert out.is_complete()

    _flip_byte(out.store, out.key("a"), 10)
    assert out.is_complete()  # same size: a skipped re-run, and every read refuses
    with pytest.raises(CorruptObject, match=r"sha256 mismatch on read.*; to redo it, run `drafter verify "
                                            r"--repair dump -c PROFILE` \(the profile that made it\), then run dump"):
        StageOutput(out.store, "dump", out.fingerprint).read_shard("a")
    report = out.repair()
    assert report["shards"] == 2 and len(report["problems"]) == 1 and report["problems"][0].startswith("a: ")
    assert "--repair" not in report["problems"][0]  # the hint is for the refusal, not for each line
    [evidence_uri] = report["set_aside"]
    assert not out.is_complete() and list(out.completed_shards()) == ["b"]
    [evidence_key] = [k for k in out.store.list(out.prefix + "/_failed/")]
    assert out.store.uri(evidence_key) == evidence_uri
    evidence = json.loads(out.store.get_bytes(evidence_key))
    assert evidence["manifest"] == committed.model_dump(mode="json")
    assert list(evidence["problems"]) == ["a"] and "sha256 mismatch on verify" in evidence["problems"]["a"]

    # the next run: writes what is missing, commits; the evidence stays, outside the output's shards
    rerun = StageOutput(out.store, "dump", out.fingerprint)
    rerun.write_shard("a", b"a" * 1000)
    assert [s.name for s in rerun.commit({"k": "v"}).shards] == ["a", "b"]
    assert rerun.verify()["problems"] == [] and out.store.exists(evidence_key)
    with pytest.raises(ObjectNotFound, match="not committed"):
        StageOutput(out.store, "dump", "0000000000000000").repair()


def test_repair_of_a_failed_reference_sets_the_output_owning_the_bytes_aside(any_store):
    earlier = StageOutput(any_store, "dump", "feedfacefeedface")
    earlier.write_shard("s0", b"x" * 500)
    earlier.write_shard("s1", b"y" * 500)
    earlier.commit({})
    later = StageOutput(any_store, "dump", "0123456789abcdef")
    later.link_shard("s0", earlier, "s0")
    later.write_shard("s2", b"z" * 500)
    later.commit({})
    _flip_byte(any_store, earlier.key("s0"), 3)
    report = later.repair()
    assert len(report["set_aside"]) == 2 and not later.is_complete() and not earlier.is_complete()
    assert list(later.completed_shards()) == ["s2"] and list(earlier.completed_shards()) == ["s1"]
    [evidence] = any_store.list(earlier.prefix + "/_failed/")
    assert "referenced by" in json.loads(any_store.get_bytes(evidence))["problems"]["s0"]
    with pytest.raises(ObjectNotFound):  # a later run finds no committed output to reference again
        StageOutput.committed(any_store, "dump", "feedfacefeedface")


@pytest.mark.parametrize("bad", ["../x", "a/b", "..", "", "x\\y"])
def test_a_path_like_stage_or_fingerprint_is_refused_not_retried(any_store, bad):
    from drafter.store import InvalidName

    for stage, fp in (("dump", bad), (bad, "0123456789abcdef")):
        with pytest.raises(InvalidName) as err:
            StageOutput(any_store, stage, fp)
        assert not err.value.retryable
