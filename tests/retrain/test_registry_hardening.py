"""The registry under concurrent writers (compare-and-swap, real processes, file:// and a moto
server), promotions that change nothing, documents of the wrong shape, path-like fingerprints."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from drafter.config import StorageConfig
from drafter.errors import exit_code
from drafter.retrain.registry import Registry, RegistryError, list_registries
from drafter.stage_output import StageOutput
from drafter.store import FileStore, open_store
from tests.fixtures.cli import drafter, profile

ROOT = Path(__file__).resolve().parents[2]


def fake_export(store, fp: str, target: str = "t0") -> str:
    out = StageOutput(store, "export", fp)
    out.write_shard("export.json", b"{}")
    out.commit({"export": {"target": {"fingerprint": target}}, "judge": {"accept_length": 1.5, "prompts": 4}})
    return fp


def registry_profile(tmp_path) -> str:
    """A profile whose target is named by a revision (no weights needed for its fingerprint)."""
    return profile(tmp_path, target={"path": str(tmp_path), "revision": "r1", "num_hidden_layers": 8,
                                     "vocab_size": 1000})


# ---- concurrent writers

# One writer process: it reads the registry slowly (every writer has read it before the first one
# writes, so without compare-and-swap all but one update would be lost every time), then promotes.
_WRITER = r"""
import json, os, sys, time
from drafter.config import StorageConfig
from drafter.retrain.registry import Registry
from drafter.store import open_store

root, endpoint, export, go = sys.argv[1:5]
store = open_store(StorageConfig(root=root, endpoint_url=endpoint or None, region="us-east-1"))

def slow(read):
    def wrapped(key, *args):
        got = read(key, *args)
        if key.startswith("_registry/"):
            time.sleep(0.3)
        return got
    return wrapped

for name in ("get_bytes", "get_versioned"):
    if hasattr(store, name):
        setattr(store, name, slow(getattr(store, name)))
while not os.path.exists(go):
    time.sleep(0.01)
print(json.dumps(Registry(store, "t0", "demo").promote(export, "concurrent " + export)))
"""


@pytest.fixture
def atomic_moto_puts(monkeypatch):
    """Real S3 evaluates If-Match / If-None-Match and stores the object in one atomic step. moto
    5.2.5 (server mode) honours both, but checks the condition and then stores without a lock: two
    PUTs in the same microseconds could both pass (not seen in 40 x 8 racing PUTs, yet possible).
    Serialise its PUT handler, so that the test only checks our side of the contract."""
    from moto.s3.responses import S3Response

    lock, put = threading.Lock(), S3Response.put_object

    def locked(self, *args, **kwargs):
        with lock:
            return put(self, *args, **kwargs)

    monkeypatch.setattr(S3Response, "put_object", locked)


@pytest.mark.slow
def test_concurrent_promotions_all_land(any_storage_config, tmp_path, request):
    if any_storage_config.root.startswith("s3://"):
        request.getfixturevalue("atomic_moto_puts")
    store = open_store(any_storage_config)
    exports = [fake_export(store, f"e{i}") for i in range(8)]
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, any_storage_config.root,
                               any_storage_config.endpoint_url or "", fp, str(go)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for fp in exports]
    go.touch()
    printed = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        printed.append(json.loads(out))
    history = Registry(store, "t0", "demo").history()
    assert sorted(e["export"] for e in history) == exports  # 8 lines printed, 8 events kept
    assert [e["seq"] for e in history] == list(range(8))
    assert [e["previous"] for e in history] == [None, *range(7)]
    assert sorted(printed, key=lambda e: e["seq"]) == history  # what each writer printed is what is kept


def test_a_write_that_keeps_losing_fails_by_name(tmp_path, monkeypatch):
    from drafter.retrain.registry import RegistryConflict

    store = FileStore(tmp_path / "store")
    reg = Registry(store, "t0", "demo")
    fake_export(store, "e1")
    monkeypatch.setattr(store, "put_if", lambda key, data, version: False)  # someone always wrote first
    monkeypatch.setattr("drafter.retrain.registry._sleep", lambda s: None)
    with pytest.raises(RegistryConflict, match=r"changed by other writers .* 16 times") as err:
        reg.promote("e1", "why")
    assert err.value.retryable and exit_code(err.value) == 3
    assert reg.history() == []


def test_a_lost_race_reapplies_the_change_to_the_new_state(tmp_path, monkeypatch):
    """Another writer promotes between our read and our write: ours is re-applied on top of it."""
    store = FileStore(tmp_path / "store")
    reg, other = Registry(store, "t0", "demo"), Registry(FileStore(tmp_path / "store"), "t0", "demo")
    for fp in ("e1", "e2"):
        fake_export(store, fp)
    put_if = store.put_if

    def racing(key, data, version):
        if not other.history():
            other.promote("e1", "the other writer")
        return put_if(key, data, version)

    monkeypatch.setattr(store, "put_if", racing)
    event = reg.promote("e2", "ours")
    assert [(e["export"], e["previous"]) for e in reg.history()] == [("e1", None), ("e2", 0)]
    assert event == reg.champion()


def test_a_write_that_landed_but_answered_lost_is_not_applied_twice(tmp_path, monkeypatch):
    """A conditional PUT retried after its answer was lost finds its own write (412): a rollback
    must not roll back twice."""
    store = FileStore(tmp_path / "store")
    reg = Registry(store, "t0", "demo")
    for fp in ("e1", "e2", "e3"):
        reg.promote(fake_export(store, fp), fp)
    put_if = store.put_if
    monkeypatch.setattr(store, "put_if", lambda key, data, version: put_if(key, data, version) and False)
    assert reg.rollback()["export"] == "e2"
    assert [e["export"] for e in reg.history()] == ["e1", "e2", "e3", "e2"]


def test_promoting_the_champion_again_changes_nothing(tmp_path):
    store = FileStore(tmp_path / "store")
    reg = Registry(store, "t0", "demo")
    for fp in ("e1", "e2"):
        fake_export(store, fp)
    reg.promote("e1", "first")
    second = reg.promote("e2", "second")
    assert reg.promote("e2", "again") == second  # the event that made it champion, no new one
    assert [e["export"] for e in reg.history()] == ["e1", "e2"]
    assert reg.rollback()["export"] == "e1"
    with pytest.raises(RegistryError, match="first one"):
        reg.rollback()


def test_rollback_skips_duplicate_promotions_written_before(tmp_path):
    """A registry written by an earlier version may hold the same champion twice in a row: a
    rollback returns to the drafter before it, never to the same one."""
    store = FileStore(tmp_path / "store")
    reg = Registry(store, "t0", "demo")
    ev = lambda seq, fp, prev: {"seq": seq, "action": "promote", "export": fp, "at": "t", "reason": "r",
                                "figures": {}, "previous": prev}
    store.put_bytes(reg.key, json.dumps({"target": "t0", "name": "demo", "decisions": [],
                                         "events": [ev(0, "e1", None), ev(1, "e2", 0), ev(2, "e2", 1)]}).encode())
    assert reg.opponent("e2") == "e1"
    back = reg.rollback()
    assert back["export"] == "e1" and back["previous"] is None


# ---- a registry document of the wrong shape


@pytest.mark.parametrize("doc", ["{}", "[]", "null", '"x"', '{"events": {}, "decisions": []}',
                                 '{"events": [1], "decisions": []}', '{"events": [], "decisions": 3}',
                                 '{"events": [{"seq": 0}], "decisions": []}'])
def test_a_registry_of_the_wrong_shape_is_a_one_line_error(tmp_path, monkeypatch, capsys, doc):
    from drafter.config import load_config

    path = registry_profile(tmp_path)
    reg = Registry.for_config(load_config(path), open_store(StorageConfig(root=f"file://{tmp_path}/store")))
    reg.store.put_bytes(reg.key, doc.encode())
    expected = rf"registry {reg.uri} is not a registry document: expected a JSON object .*events.*, got "
    for read in (reg.load, reg.champion_export, reg.history, lambda: list_registries(reg.store)):
        with pytest.raises(RegistryError, match=expected) as err:
            read()
        assert not err.value.retryable
    for argv in (["registry", "list"], ["registry", "list", "--all"], ["registry", "rollback"]):
        code, err = drafter(monkeypatch, capsys, *argv, "-c", path)
        assert code == 4 and "Traceback" not in err, err
        assert err.strip().splitlines() == [err.strip()] and err.startswith("error (RegistryError): registry ")


# ---- fingerprints that look like paths


@pytest.mark.parametrize("bad", ["../x", "a/b", "..", ".", "x\\y", "-x", "e 1", ""])
def test_a_path_like_fingerprint_is_refused(tmp_path, bad):
    store = FileStore(tmp_path / "store")
    from drafter.store import InvalidName

    with pytest.raises(InvalidName, match="fingerprint") as err:
        Registry(store, "t0", "demo").promote(bad, "why")
    assert not err.value.retryable and exit_code(err.value) == 2
    with pytest.raises(InvalidName, match="fingerprint"):
        StageOutput(store, "export", bad)
    with pytest.raises(InvalidName):
        Registry(store, bad, "demo")


def test_a_path_like_fingerprint_on_the_command_line_is_a_usage_error(tmp_path, monkeypatch, capsys):
    path = registry_profile(tmp_path)
    for argv in (["registry", "promote", "../x", "-c", path], ["registry", "promote", "a/b", "-c", path],
                 ["verify", f"file://{tmp_path}/store/prepare/.."], ["verify", f"file://{tmp_path}/store/prepare/a b"]):
        code, err = drafter(monkeypatch, capsys, *argv)
        assert code == 2 and "Traceback" not in err, (argv, code, err)
        assert err.startswith("error (InvalidName): invalid ") and len(err.strip().splitlines()) == 1, err


# ---- events that `registry list` and the champion's readers could not use (issue 32)


def _event(**changes) -> dict:
    event = {"seq": 0, "action": "promote", "export": "e1", "at": "2026-12-01T00:00:00+00:00", "reason": "r",
             "figures": {}, "previous": None}
    event.update(changes)
    return {k: v for k, v in event.items() if v is not _DROP}


_DROP = object()


@pytest.mark.parametrize("event, says", [
    (_event(at=_DROP), "missing at"),
    (_event(reason=_DROP), "missing reason"),
    (_event(at=_DROP, reason=_DROP), "missing at, reason"),
    (_event(export="../../../../tmp"), "export '../../../../tmp' is not an export fingerprint"),
    (_event(export="/tmp/x"), "export '/tmp/x' is not an export fingerprint"),
    (_event(export=7), "export 7 is not an export fingerprint"),
    (_event(action="delete"), "action 'delete' is not one of promote, rollback"),
    (_event(seq=True), "seq True is not its position 0"),
    (_event(at=3), "at is not text"),
    (_event(previous=0), "previous 0 is not an earlier event"),
    (_event(figures=[1]), "figures is not an object"),
])
def test_an_event_the_readers_cannot_use_is_a_one_line_error(tmp_path, monkeypatch, capsys, event, says):
    """`registry list` died with `KeyError: 'at'` on an event without `at`, and printed an event's
    `export: ../../../../tmp` as the champion: the shape check now names the event and the field."""
    from drafter.config import load_config

    path = registry_profile(tmp_path)
    reg = Registry.for_config(load_config(path), open_store(StorageConfig(root=f"file://{tmp_path}/store")))
    reg.store.put_bytes(reg.key, json.dumps({"target": reg.target, "name": reg.name, "events": [event],
                                             "decisions": []}).encode())
    with pytest.raises(RegistryError, match=f"is not a registry document: .*, got event 0: {says}"):
        reg.champion_export()
    for argv in (["registry", "list"], ["registry", "list", "--all"]):
        code, err = drafter(monkeypatch, capsys, *argv, "-c", path)
        assert code == 4 and "Traceback" not in err and "KeyError" not in err, err
        assert len(err.strip().splitlines()) == 1 and f"got event 0: {says}" in err, err


@pytest.mark.parametrize("decision, says", [
    ({"verdict": "promoted", "challenger": "e1"}, "missing at"),
    ({"at": "t", "verdict": "promoted", "challenger": "../x"}, "challenger '../x' is not an export fingerprint"),
    ("promoted", "not an object"),
])
def test_a_decision_the_report_cannot_use_is_refused(tmp_path, decision, says):
    store = FileStore(tmp_path / "store")
    reg = Registry(store, "t0", "demo")
    store.put_bytes(reg.key, json.dumps({"events": [_event()], "decisions": [decision]}).encode())
    with pytest.raises(RegistryError, match=f"got decision 0: {says}"):
        reg.decisions()


def test_registry_list_prints_what_the_registry_wrote(tmp_path, monkeypatch, capsys):
    """The shape check accepts every document the registry itself writes (promote, rollback, verdicts)."""
    from drafter.config import load_config

    path = registry_profile(tmp_path)
    reg = Registry.for_config(load_config(path), open_store(StorageConfig(root=f"file://{tmp_path}/store")))
    for fp in ("e1", "e2"):
        reg.promote(fake_export(reg.store, fp, reg.target), f"why {fp}",
                    decision={"verdict": "promoted", "challenger": fp})
    reg.record_decision({"verdict": "rejected", "challenger": "e1"})
    reg.rollback()
    monkeypatch.setattr(sys, "argv", ["drafter", "registry", "list", "-c", path])
    from drafter import cli

    with pytest.raises(SystemExit) as done:
        cli.main()
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.splitlines()[0].endswith("champion e1")
    assert [line.split()[2] for line in out.splitlines()[1:]] == ["promote", "promote", "rollback"]
