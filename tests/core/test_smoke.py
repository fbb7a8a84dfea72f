"""`drafter smoke` (drafter/smoke.py) on a small trained demo-style target with the reference engine:
the profile made small (its own store prefix, other fingerprints than the real outputs), every stage,
the capture re-checked, one server with the overfit drafter accepting full draft blocks on training
prompts; a capture planted one layer off is named as the layer-id contract, one line, exit 4."""
from __future__ import annotations

import sys
import time

import pytest

from drafter import cli
from drafter.config import load_config
from drafter.smoke import SmokeFailed, contract_of, smoke_config
from drafter.stages import TABLE
from drafter.store import FileStore
from tests.fixtures.bench import no_servers_left
from tests.fixtures.cli import drafter
from tests.fixtures.net import free_port
from tests.fixtures.smoke import AUX, smoke_profile, smoke_target  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

REFERENCE = {"engine": "reference", "device": "cpu", "extra_args": ["--cpu-threads", "1"]}


def test_the_smoke_configuration_is_small_and_stores_apart(smoke_target, tmp_path):
    cfg = load_config(smoke_profile(tmp_path, smoke_target, {**REFERENCE, "port": free_port()}))
    small = smoke_config(cfg)
    assert small.storage.root == cfg.storage.root + "/smoke"
    # what it runs on is the profile's; how much it runs is tiny
    assert small.aux_layer_ids() == cfg.aux_layer_ids() == AUX
    assert (small.target, small.serve.engine, small.train.draft_vocab_size, small.export.formats) == (
        cfg.target, cfg.serve.engine, cfg.train.draft_vocab_size, cfg.export.formats)
    assert small.serve.speculative == cfg.serve.speculative and small.serve.draft_path is None
    assert small.data.limit == 4 and small.datagen.temperature == 0.0 and small.datagen.max_tokens == 32
    assert small.train.ttt_length == 3 and small.export.min_accept_length == 1.0
    # content-addressed: no stage of the smoke shares an output with the profile's
    real, smoke = TABLE.fingerprints(cfg), TABLE.fingerprints(small)
    for stage in ("prepare", "datagen", "dump", "train", "export"):
        assert smoke[stage] != real[stage], stage


def test_an_errors_line_names_its_contract():
    assert contract_of("export: eagle_aux_hidden_state_layer_ids=[1, 2, 3], expected [0, 1, 2]") == "layer ids"
    assert contract_of("d2t/t2d: draft vocab differs from the trained drafter's") == "vocab map"
    assert contract_of("the server does not use the requested speculative settings: ...") == "settings"
    assert contract_of("model.safetensors misses keys SGLang loads") == "format"
    assert contract_of("server crashed with exit code 1") is None
    err = SmokeFailed("serve", "settings", "x", cause=SmokeFailed("a", None, "b"))
    assert str(err) == "smoke failed at serve: settings contract broken: x" and err.exit_code == 4


def test_smoke_passes_on_the_reference_engine(smoke_target, tmp_path, monkeypatch, capsys):
    profile = smoke_profile(tmp_path, smoke_target, {**REFERENCE, "port": free_port()})
    monkeypatch.setattr(sys, "argv", ["drafter", "smoke", "--config", str(profile)])
    began = time.monotonic()
    with pytest.raises(SystemExit) as done:
        cli.main()
    seconds = time.monotonic() - began
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    assert out.startswith("smoke passed in ") and "accepted a full block of 3 drafts on" in out
    steps = [line for line in err.splitlines() if line.startswith("smoke: ")]
    assert [line.split(":")[1].strip() for line in steps] == ["prepare", "datagen", "dump", "capture", "train",
                                                               "export", "serve"]
    assert "aux states are the outputs of layers [0, 1, 2]" in err and "accepted a full block of 3 drafts" in err
    # its outputs are under the smoke prefix only: nothing of the real store was written
    root = tmp_path / "store"
    assert sorted(p.name for p in root.iterdir()) == ["smoke"]
    assert not FileStore(root).list("prepare")
    no_servers_left(tmp_path / "logs")
    assert seconds < 600, seconds
    print(f"drafter smoke (reference engine) took {seconds:.0f}s: {out}")


def test_a_capture_one_layer_off_is_named_by_the_layer_id_contract(smoke_target, tmp_path, monkeypatch, capsys):
    """The dump stores the outputs of layers [1, 2, 3] and its manifest says [0, 1, 2]: no record
    shows it; the smoke's capture re-check does, before anything trains on it."""
    import drafter.capture.hf as hf

    captured = hf.aux_from_hidden_states
    monkeypatch.setattr(hf, "aux_from_hidden_states", lambda states, ids: captured(states, [i + 1 for i in ids]))
    profile = smoke_profile(tmp_path, smoke_target, {**REFERENCE, "port": free_port()})
    code, err = drafter(monkeypatch, capsys, "smoke", "--config", str(profile))
    assert code == 4, err
    (line,) = [line for line in err.splitlines() if line.startswith("error")]
    assert line == ("error (SmokeFailed): smoke failed at capture: layer ids contract broken: the aux states "
                    "dumped as the outputs of layers [0, 1, 2] (dump.aux_layer_ids) are those of layers "
                    "[1, 2, 3]: the capture is off by +1")
    assert "Traceback" not in err and "smoke: train" not in err  # stopped before training on them
    no_servers_left(tmp_path / "logs")


def test_a_wrapped_error_is_one_clean_line(smoke_target, tmp_path, monkeypatch, capsys):
    """A target that is not there: datagen's server preflight refuses it; the line says why, then the
    error's type, and names the step."""
    import yaml

    profile = smoke_profile(tmp_path, smoke_target, {**REFERENCE, "port": free_port()})
    data = yaml.safe_load(profile.read_text())
    data["target"]["path"] = str(tmp_path / "no-target")
    profile.write_text(yaml.safe_dump(data))
    code, err = drafter(monkeypatch, capsys, "smoke", "--config", str(profile))
    (line,) = [line for line in err.splitlines() if line.startswith("error")]
    assert line.startswith("error (SmokeFailed): smoke failed at datagen: preflight failed: ") and \
        line.endswith(f"{tmp_path / 'no-target'} (ServerConfigError)"), line
    assert code == 4 and "Traceback" not in err  # a retry cannot help


def test_the_demo_target_is_built_before_the_smoke_runs(monkeypatch, capsys):
    """On a profile with target.demo, `drafter smoke` makes sure of the demo target first, as the
    lifecycle does (a fresh checkout has none)."""
    import drafter.demo_target as demo_target
    import drafter.smoke as smoke

    calls = []
    monkeypatch.setattr(demo_target, "ensure_demo_target", lambda spec, path, progress=None: calls.append(path))

    def run_smoke(cfg, **_):
        calls.append("smoke")
        raise SmokeFailed("prepare", None, "stop here")

    monkeypatch.setattr(smoke, "run_smoke", run_smoke)
    code, err = drafter(monkeypatch, capsys, "smoke", "--config", "profiles/demo.yaml")
    assert calls == [".cache/demo-target", "smoke"] and code == 4, err
