"""Bad input as a hostile user gives it: one clean line and a documented exit code from the CLI,
every bad row quarantined with its reason, cheap checks before any server starts, and an empty
output as a named error. In-process CLI calls (`drafter.cli.main`) and the datagen fakes: ~3 s."""
from __future__ import annotations

import json

import pytest

from drafter.stages import TABLE
from drafter.config import ConfigError, StorageConfig, load_config, parse_config
from drafter.stage_output import EmptyOutput
from drafter.stages import prepare
from drafter.store import open_store
from tests.fixtures.datagen_fakes import (datagen_output, fakes, last_user, make_cfg, prepared,  # noqa: F401 (fixture)
                                          run_datagen, sharegpt)
from tests.fixtures.cli import drafter, profile


def test_expected_errors_are_one_line_with_their_exit_code(tmp_path, monkeypatch, capsys):
    missing = profile(tmp_path, data={"sources": [{"kind": "jsonl", "path": str(tmp_path / "nope.jsonl")}]})
    code, err = drafter(monkeypatch, capsys, "prepare", "-c", missing)
    assert code == 4 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"error (SourceError): no such file: {tmp_path / 'nope.jsonl'}"
    code, err = drafter(monkeypatch, capsys, "--debug", "prepare", "-c", missing)
    assert code == 4 and "Traceback" in err and "SourceError" in err

    # a missing upstream stops datagen before any server is started
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"prompt": "hello there"}) + "\n")
    code, err = drafter(monkeypatch, capsys, "datagen", "-c",
                        profile(tmp_path, data={"sources": [{"kind": "jsonl", "path": str(corpus)}]}))
    assert code == 4 and "Traceback" not in err and "error (ObjectNotFound): prepare is not committed" in err
    assert not (tmp_path / "logs").exists()

    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("target: {path: caf\xe9}\n".encode("latin-1"))
    code, err = drafter(monkeypatch, capsys, "prepare", "-c", str(bad))
    assert code == 2 and str(bad) in err and "not UTF-8" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="latin1.yaml"):
        load_config(bad)


def test_config_validate_checks_local_paths_unless_offline(tmp_path, monkeypatch, capsys):
    path = profile(tmp_path, target={"path": str(tmp_path / "no-model"), "num_hidden_layers": 8},
                   data={"sources": [{"kind": "jsonl", "path": str(tmp_path / "no.jsonl")}]})
    code, err = drafter(monkeypatch, capsys, "config", "validate", path)
    # A profile for another machine: valid, its missing paths are warnings with their own exit code.
    assert code == 5
    assert f"warning: target.path: no such directory: {tmp_path / 'no-model'}" in err
    assert f"warning: data.sources.0.path: no such file: {tmp_path / 'no.jsonl'}" in err
    code, err = drafter(monkeypatch, capsys, "config", "validate", "--offline", path)
    assert code == 0


def test_config_validate_warns_of_a_secret_typed_into_serve_env(tmp_path, monkeypatch, capsys):
    path = profile(tmp_path, target={"path": str(tmp_path), "num_hidden_layers": 8},
                   serve={"env": {"NCCL_ALGO": "Ring", "HF_TOKEN": "hf_typed_in", "WANDB_KEY": "k"}})
    code, err = drafter(monkeypatch, capsys, "config", "validate", "--offline", path)
    assert code == 0  # a warning: the profile works, but the value is stored with every run
    assert "warning: serve.env.HF_TOKEN looks like a secret" in err and "serve.env.WANDB_KEY" in err
    assert "NCCL_ALGO" not in err and "hf_typed_in" not in err


def test_a_serve_only_profile_needs_no_train_or_dump_fields(tmp_path):
    cfg = parse_config({"target": {"path": str(tmp_path), "name": "m", "num_hidden_layers": 8, "vocab_size": 1000},
                        "serve": {"engine": "command", "command": ["server", "--port", "{port}"],
                                  "health_url": "http://127.0.0.1:1/health"}})
    assert cfg.train.draft_vocab_size == 1000  # the 32000 default, capped at the target's vocabulary
    with pytest.raises(ConfigError, match="train.draft_vocab_size: 2000 exceeds the target vocab"):
        parse_config({"target": {"path": str(tmp_path), "vocab_size": 1000, "num_hidden_layers": 8},
                      "train": {"draft_vocab_size": 2000}})


def test_every_bad_row_is_quarantined_with_its_reason(tmp_path):
    corpus = tmp_path / "rows.jsonl"
    corpus.write_text("\n".join([
        json.dumps({"id": "good", "messages": [{"role": "user", "content": "a fine question"}]}),
        '{"id": "sur\\udc00", "prompt": "lone surrogate \\ud800 here"}',
        "[" * 200_000,
        "not json at all",
    ]) + "\n")
    cfg = parse_config({"target": {"path": str(tmp_path)}, "storage": {"root": f"file://{tmp_path}/store"},
                        "data": {"sources": [{"kind": "jsonl", "path": str(corpus)}], "eval_fraction": 0}})
    store = open_store(cfg.storage)
    result = TABLE.run("prepare", cfg, store)
    assert result.meta["kept"] == 1
    assert result.meta["quarantined"] == {"invalid_unicode": 1, "json_decode": 1, "json_too_deep": 1}
    from drafter.stage_output import StageOutput

    rows = StageOutput(store, "prepare", result.fingerprint).read_jsonl("quarantine.jsonl")
    assert [r["reason"] for r in rows] == ["invalid_unicode", "json_too_deep", "json_decode"]
    assert rows[0]["id"] == "sur\\udc00"


def test_a_corpus_with_no_usable_row_is_an_error_unless_allowed(tmp_path):
    corpus = tmp_path / "rows.jsonl"
    corpus.write_text('{"prompt": 3}\n{"nothing": 1}\n')
    data = {"target": {"path": str(tmp_path)}, "storage": {"root": f"file://{tmp_path}/store"},
            "data": {"sources": [{"kind": "jsonl", "path": str(corpus)}]}}
    store = open_store(StorageConfig(root=f"file://{tmp_path}/store"))
    with pytest.raises(EmptyOutput, match=r"kept 0 conversations of 2 rows read .*'bad_content': 1, 'no_turns': 1"):
        TABLE.run("prepare", parse_config(data), store)
    data["data"]["allow_empty"] = True
    assert TABLE.run("prepare", parse_config(data), store).meta["kept"] == 0


def test_datagen_commits_without_a_server_and_refuses_an_empty_output(tmp_path, fakes):
    fake = fakes()
    cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"), [sharegpt(i) for i in range(3)])
    store = open_store(cfg.storage)
    fp = prepared(cfg, store)
    run_datagen(cfg, store, fp, [fake.url])
    out = datagen_output(cfg, store, fp)
    store.delete(out.key("_SUCCESS.json"))  # every shard done, only the commit missing
    asked = len(fake.received)
    # no server URL: a server would be started (and fail: the target does not exist); none is
    result = run_datagen(cfg, store, fp, [])
    assert result.status == "done" and len(fake.received) == asked

    bad = fakes()
    bad.fail = lambda body, attempt: 400
    (tmp_path / "e").mkdir()
    empty = make_cfg(tmp_path / "e", StorageConfig(root=f"file://{tmp_path}/e/store"), [sharegpt(i) for i in range(3)])
    store = open_store(empty.storage)
    fp = prepared(empty, store)
    with pytest.raises(EmptyOutput, match=r"generated 0 of 3 train conversations \(errors \{'http_400': 3\}\)"):
        run_datagen(empty, store, fp, [bad.url])
    with pytest.raises(EmptyOutput):  # the re-run finds every shard done: no server, same answer
        run_datagen(empty, store, fp, [])
