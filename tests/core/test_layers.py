"""Layer ids per engine, engine version and target architecture (drafter.layers.engine_layer_ids):
each case the engines' own code shows, checked against a model of what that code captures, and
every unknown combination refused with a message naming it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafter.config import load_config
from drafter.layers import UnknownLayerIdRule, engine_layer_ids, parse_version

PROFILES = Path(__file__).resolve().parents[2] / "profiles"


# What each engine's capture loop does with draft-config ids, as outputs of decoder layers (ours).
def sglang_llama_captures(written: list[int]) -> list[int]:
    # llama.py: layers_to_capture = [i + 1 for i in ids], captured at the INPUT of that layer
    return [(i + 1) - 1 for i in written]


def sglang_0523_deepseek_v2_captures(written: list[int]) -> list[int]:
    # deepseek_v2.py (0.5.23): +1 only when ids[0] == 1, then captured at the input of the layer
    to_capture = [i + 1 for i in written] if written[0] == 1 else list(written)
    return [j - 1 for j in to_capture]


def vllm_captures(written: list[int]) -> list[int]:
    # vllm llama.py / deepseek_v2.py: id i = input of layer i = output of layer i - 1
    return [i - 1 for i in written]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"])
def test_sglang_llama_like_ids_are_written_unchanged(arch):
    got = engine_layer_ids([1, 15, 28], "sglang", "0.5.23", arch)
    assert got.ids == [1, 15, 28] and sglang_llama_captures(got.ids) == [1, 15, 28]
    assert "written unchanged" in got.rule and got.engine_version == "0.5.23"
    assert engine_layer_ids([1, 15, 28], "sglang", "0.5.4.post1", arch).ids == [1, 15, 28]


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"])
def test_sglang_0523_deepseek_v2_ids_starting_at_1_are_written_unchanged(arch):
    got = engine_layer_ids([1, 29, 57], "sglang", "0.5.23", arch)
    assert got.ids == [1, 29, 57] and sglang_0523_deepseek_v2_captures(got.ids) == [1, 29, 57]
    assert "ids[0] == 1" in got.rule


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "KimiK2ForCausalLM"])
def test_sglang_0523_deepseek_v2_other_ids_are_written_plus_one(arch):
    got = engine_layer_ids([2, 30, 58], "sglang", "0.5.23", arch)
    assert got.ids == [3, 31, 59] and sglang_0523_deepseek_v2_captures(got.ids) == [2, 30, 58]
    # what the old rule (ids as they are) would have served: the field notes' one-layer-off bug
    assert sglang_0523_deepseek_v2_captures([2, 30, 58]) == [1, 29, 57]


def test_sglang_0523_deepseek_v2_cannot_express_our_id_0():
    with pytest.raises(UnknownLayerIdRule, match=r"our id 0 cannot be expressed for DeepseekV3ForCausalLM on "
                                                 r"sglang 0.5.23"):
        engine_layer_ids([0, 29, 57], "sglang", "0.5.23", "DeepseekV3ForCausalLM")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
def test_vllm_ids_are_written_plus_one(arch):
    got = engine_layer_ids([1, 15, 28], "vllm", "0.32.0", arch)
    assert got.ids == [2, 16, 29] and vllm_captures(got.ids) == [1, 15, 28] and "written +1" in got.rule
    assert engine_layer_ids([0, 1, 2], "vllm", "0.32.0+cpu", arch).ids == [1, 2, 3]


@pytest.mark.parametrize("engine, version, arch", [
    ("sglang", "0.5.24", "LlamaForCausalLM"),           # newer than any version read
    ("sglang", "0.5.22", "DeepseekV3ForCausalLM"),      # before/after sglang#25454 unknown
    ("sglang", "0.5.23", "MysteryForCausalLM"),         # architecture nobody read
    ("vllm", "0.31.2", "LlamaForCausalLM"),
    ("vllm", "0.32.0", "Glm4MoeLiteForCausalLM"),
    ("tgi", "3.0.0", "LlamaForCausalLM"),
])
def test_unknown_combination_is_an_error_naming_it(engine, version, arch):
    with pytest.raises(UnknownLayerIdRule) as err:
        engine_layer_ids([1, 2, 3], engine, version, arch)
    msg = str(err.value)
    assert f"engine {engine!r} version {version} with target architecture {arch!r}" in msg
    assert "refusing to guess" in msg and not err.value.retryable


def test_versions_parse_with_local_and_pre_release_tags():
    assert parse_version("0.32.0+cpu") == (0, 32, 0)
    assert parse_version("0.5.23.post1") == (0, 5, 23)
    assert parse_version("v0.6.0rc1") == (0, 6, 0)
    with pytest.raises(UnknownLayerIdRule, match="not a version number"):
        parse_version("latest")


def test_kimi_profile_validates_and_its_ids_capture_the_layers_it_names(tmp_path):
    """profiles/kimi-k2.5-8xpcie.yaml names the outputs of layers [2, 30, 58]: what each engine is
    given must capture exactly those (SGLang 0.5.23's DeepSeek path: [3, 31, 59], not [2, 30, 58])."""
    target = tmp_path / "Kimi-K2.5"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840}}))
    cfg = load_config(PROFILES / "kimi-k2.5-8xpcie.yaml", overrides={"target.path": str(target)})
    ours = cfg.aux_layer_ids()
    assert ours == [2, 30, 58]
    arch = "KimiK25ForConditionalGeneration"
    sglang = engine_layer_ids(ours, "sglang", cfg.export.sglang_version, arch)
    assert sglang.ids == [3, 31, 59] and sglang_0523_deepseek_v2_captures(sglang.ids) == ours
    vllm = engine_layer_ids(ours, "vllm", cfg.export.vllm_version, arch)
    assert vllm.ids == [3, 31, 59] and vllm_captures(vllm.ids) == ours


# ------------------------------------------------------------------ serve: the installed engine's rule

def _draft(tmp_path, written, ours, layout="sglang", version=None):
    d = tmp_path / f"draft-{layout}"
    d.mkdir(parents=True, exist_ok=True)
    record = {"aux_layer_ids": ours, **({"engine_version": version} if version else {})}
    config = ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": written}} if layout == "sglang"
              else {"eagle_aux_hidden_state_layer_ids": written})
    (d / "config.json").write_text(json.dumps({**config, "drafter_lifecycle": record}))
    return str(d)


def _target(tmp_path, arch):
    t = tmp_path / "target"
    t.mkdir(exist_ok=True)
    (t / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return str(t)


def _fake_python(tmp_path, version: str) -> str:
    """An 'engine interpreter' whose installed engine reports `version`."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return str(path)


def test_serve_uses_the_installed_version_and_refuses_ids_it_would_read_one_layer_off(tmp_path):
    from drafter.server_errors import ServerConfigError
    from drafter.engines.layer_check import check_draft_layer_ids

    target = _target(tmp_path, "KimiK25ForConditionalGeneration")
    good = _draft(tmp_path, [3, 31, 59], [2, 30, 58], version="0.5.23")
    seen = check_draft_layer_ids("sglang", good, target, _fake_python(tmp_path, "0.5.23"))
    assert seen["checked"] and seen["engine_version"] == "0.5.23" and seen["version_source"].startswith("installed")
    # the ids as they were before the rule was known: one layer off on this version
    bad = _draft(tmp_path, [2, 30, 58], [2, 30, 58], layout="speculators")
    with pytest.raises(ServerConfigError, match=r"needs draft-config layer ids \[3, 31, 59\] .* has \[2, 30, 58\]"):
        check_draft_layer_ids("sglang", bad, target, _fake_python(tmp_path, "0.5.23"))
    # an installed version nobody read: refused by name, before any launch
    with pytest.raises(ServerConfigError, match="no layer-id rule for engine 'sglang' version 0.5.24"):
        check_draft_layer_ids("sglang", good, target, _fake_python(tmp_path, "0.5.24"))


def test_an_eagle31_drafter_is_refused_by_an_engine_version_that_may_ignore_its_norms(tmp_path):
    """SGLang 0.5.x below 0.5.23 passes the layer-id rule, but its draft model was not read with
    fc_norm / norm_output: an EAGLE 3.1 export would load there and draft without its norms."""
    from drafter.eagle31 import eagle31_engine_problem
    from drafter.engines.layer_check import check_draft_layer_ids
    from drafter.server_errors import ServerConfigError

    target = _target(tmp_path, "LlamaForCausalLM")
    draft = _draft(tmp_path, [1, 15, 28], [1, 15, 28], version="0.5.23")
    config = json.loads((Path(draft) / "config.json").read_text())
    assert check_draft_layer_ids("sglang", draft, target, _fake_python(tmp_path, "0.5.20"))["checked"]  # eagle3
    (Path(draft) / "config.json").write_text(json.dumps({**config, "fc_norm": True, "norm_output": True}))
    with pytest.raises(ServerConfigError, match=r"sglang 0.5.20 is older than the first version read with EAGLE "
                                                r"3.1's fc_norm/norm_output \(sglang 0.5.23\)"):
        check_draft_layer_ids("sglang", draft, target, _fake_python(tmp_path, "0.5.20"))
    assert check_draft_layer_ids("sglang", draft, target, _fake_python(tmp_path, "0.5.23"))["checked"]
    assert "vllm 0.31.2 is older" in eagle31_engine_problem("eagle3.1", "vllm", "0.31.2")
    assert eagle31_engine_problem("eagle3.1", "vllm", "0.32.0+cpu") is None
    assert eagle31_engine_problem("eagle3.1", "reference", "ours") is None
    assert eagle31_engine_problem("eagle3", "vllm", "0.31.2") is None  # EAGLE-3: no version floor
    assert eagle31_engine_problem("eagle3.1", "sglang", "main") == "sglang: engine version 'main' is not a version number"
    # one flag is enough: either changes the drafting math
    (Path(draft) / "config.json").write_text(json.dumps({**config, "norm_output": True}))
    with pytest.raises(ServerConfigError, match="sglang 0.5.20 is older"):
        check_draft_layer_ids("sglang", draft, target, _fake_python(tmp_path, "0.5.20"))


def test_a_profile_exporting_eagle31_for_an_engine_too_old_is_refused_before_training(tmp_path):
    from drafter.config import ConfigError, parse_config

    old = {"target": {"path": str(tmp_path)}, "export": {"sglang_version": "0.5.20"}}
    with pytest.raises(ConfigError, match=r"export.sglang_version: sglang 0.5.20 is older than the first version"):
        parse_config(old)
    assert parse_config({**old, "train": {"drafter": "eagle3"}}).export.sglang_version == "0.5.20"


def test_serve_without_the_engine_importable_says_which_version_it_assumed(tmp_path):
    import sys

    from drafter.engines.layer_check import check_draft_layer_ids

    target = _target(tmp_path, "LlamaForCausalLM")
    draft = _draft(tmp_path, [1, 15, 28], [1, 15, 28], version="0.5.23")
    seen = check_draft_layer_ids("sglang", draft, target, sys.executable)  # no sglang in the project env
    assert seen["checked"] and seen["engine_version"] == "0.5.23"
    assert "not importable" in seen["version_source"] and "the export was written for" in seen["version_source"]
    assert check_draft_layer_ids("reference", draft, target, sys.executable)["checked"] is True


def test_the_reference_engine_refuses_ids_it_would_read_wrong(tmp_path):
    """It reads draft-config ids as ours: an export written +1 for another engine, or ids outside the
    target, are refused before launch (they used to crash it, retryable)."""
    import sys

    from drafter.server_errors import ServerConfigError
    from drafter.engines.layer_check import check_draft_layer_ids

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32}))
    shifted = _draft(tmp_path / "a", [2, 16, 29], [1, 15, 28])
    with pytest.raises(ServerConfigError, match=r"layer ids \[2, 16, 29\] but records .* layers \[1, 15, 28\]"):
        check_draft_layer_ids("reference", shifted, str(target), sys.executable)
    outside = _draft(tmp_path / "b", [1, 15, 40], [1, 15, 40])
    with pytest.raises(ServerConfigError, match=r"\[40\] out of range for a target with 32 layers") as err:
        check_draft_layer_ids("reference", outside, str(target), sys.executable)
    assert err.value.retryable is False
