"""Our SGLang rules against SGLang 0.5.23's own code (the lite venv `make sglang-env` builds).

One probe process answers the whole module (drafter/engines/sglang_probe.py, ~10-20 s on 2 cores):
- argument resolution (`prepare_server_args` + `resolve_once` + `check_server_args`) of the argv our
  `sglang` engine builds, for every speculative setting our config accepts in a grid, SGLang's own
  numbers per architecture, and each kind of setting we refuse (built by hand: our config cannot);
- the layer-id rule: SGLang's `set_eagle3_layers_to_capture` for Llama, Qwen3, DeepSeek-V3 and
  Kimi-K2.5 at several id triples, fed the ids `engine_layer_ids` writes.
The planted-change tests go through the run-time check (`check_with_sglang`), one more process each.
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from drafter.config import SpeculativeConfig, parse_config
from drafter.layers import UnknownLayerIdRule, engine_layer_ids
from drafter.engines import sglang_rules
from drafter.engines import make_engine
from drafter.server_errors import ServerConfigError
from drafter.engines.sglang_rules import (RESOLVED_FIELDS, _launch_arguments, ask_sglang, check_with_sglang, layer_problems,
                                          predict_resolution, resolution_problems)
from tests.fixtures.sglang_env import SGLANG_VERSION, sglang_env, sglang_py  # noqa: F401  (fixture)

ARCHITECTURES = {"LlamaForCausalLM": 32, "Qwen3ForCausalLM": 36, "DeepseekV3ForCausalLM": 61,
                 "KimiK25ForConditionalGeneration": 61}
DEEPSEEK_PATH = ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")


def _triples(n: int) -> list[list[int]]:
    """Ids starting at 0, 1 (SGLang's DeepSeek switch), 2 and 3, and the SpecForge default."""
    return [[0, 1, 2], [1, n // 2 - 1, n - 4], [2, n // 2, n - 3], [3, n // 2 + 1, n - 2], [0, n // 2, n - 2]]


def _write_targets(root: Path) -> dict[str, Path]:
    """config.json-only targets: resolution reads the architecture, never the weights."""
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config

    small = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128)
    configs = {
        "LlamaForCausalLM": LlamaConfig(**small, num_key_value_heads=2),
        "Qwen3ForCausalLM": Qwen3Config(**small, num_key_value_heads=2, head_dim=16),
        "DeepseekV3ForCausalLM": DeepseekV3Config(
            **small, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1),
    }
    paths = {}
    for arch, config in configs.items():
        config.architectures = [arch]
        config.save_pretrained(root / arch)
        paths[arch] = root / arch
    return paths


def _cfg(target: Path, draft: Path, speculative=None, **serve):
    return parse_config({"target": {"path": str(target)}, "dump": {"aux_layer_ids": [0, 1, 2]},
                         "serve": {"engine": "sglang", "port": 31000, "draft_path": str(draft),
                                   "speculative": speculative, **serve}})


def _argv(cfg, speculating: bool = True) -> list[str]:
    spec = make_engine(cfg.serve.engine).build_launch(cfg, draft_path=cfg.serve.draft_path if speculating else None)
    return spec.argv


def accepted_settings() -> list[dict]:
    """Every S/K/D our config accepts with S <= 6 and K in 1, 2, 4 (and D up to S*K + 1)."""
    out = []
    for s, k in itertools.product(range(1, 7), (1, 2, 4)):
        for d in range(1, s * k + 2):
            try:
                SpeculativeConfig(num_steps=s, eagle_topk=k, num_draft_tokens=d)
            except ValidationError:
                continue
            out.append({"num_steps": s, "eagle_topk": k, "num_draft_tokens": d})
    return out


def _with_flags(argv: list[str], **flags) -> list[str]:
    """argv with --speculative-* values replaced (None drops the flag): settings our config refuses."""
    out, skip = [], False
    names = {f"--speculative-{k.replace('_', '-')}": v for k, v in flags.items()}
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in names:
            skip = True
            if names[arg] is not None:
                out += [arg, str(names[arg])]
            continue
        out.append(arg)
    return out


REFUSED = {  # our refusal -> what SGLang 0.5.23 does with it
    "3/1/16": dict(num_steps=3, eagle_topk=1, num_draft_tokens=16),
    "5/1/2": dict(num_steps=5, eagle_topk=1, num_draft_tokens=2),
    "2/2/8": dict(num_steps=2, eagle_topk=2, num_draft_tokens=8),
    "1/4/8": dict(num_steps=1, eagle_topk=4, num_draft_tokens=8),
    "steps only": dict(num_steps=3, eagle_topk=None, num_draft_tokens=None),
    "steps and topk": dict(num_steps=3, eagle_topk=2, num_draft_tokens=None),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory, sglang_py):
    root = tmp_path_factory.mktemp("sglang-rules")
    targets = _write_targets(root)
    draft = targets["LlamaForCausalLM"]  # resolution loads the draft's config only
    llama = targets["LlamaForCausalLM"]
    launches = []  # (name, predicted, argv)
    for setting in accepted_settings():
        cfg = _cfg(llama, draft, setting)
        launches.append((f"{setting}", predict_resolution(cfg.serve.speculative, "LlamaForCausalLM", speculating=True),
                         _argv(cfg)))
    for arch, path in targets.items():
        cfg = _cfg(path, draft)
        launches.append((f"auto {arch}", predict_resolution(None, arch, speculating=True), _argv(cfg)))
    cfg = _cfg(llama, draft, {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}, max_running_requests=16)
    launches.append(("max_running_requests 16",
                     predict_resolution(cfg.serve.speculative, "LlamaForCausalLM", speculating=True,
                                        max_running_requests=16), _argv(cfg)))
    plain = _cfg(llama, draft)
    launches.append(("no speculation", predict_resolution(None, "LlamaForCausalLM", speculating=False),
                     _argv(plain, speculating=False)))
    base = _argv(_cfg(llama, draft, {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}))
    refused = {name: _with_flags(base, **flags) for name, flags in REFUSED.items()}

    layer_cases = []  # (arch, our ids, written ids or None when our rule refuses)
    for arch, n in ARCHITECTURES.items():
        for ours in _triples(n):
            try:
                written = engine_layer_ids(ours, "sglang", SGLANG_VERSION, arch).ids
            except UnknownLayerIdRule:
                written = None
            layer_cases.append((arch, n, ours, written))
    # For each refusal, what SGLang captures for the ids one might write instead (ours and ours + 1).
    probes = [{"architecture": a, "num_layers": n, "ids": w} for a, n, ours, w in layer_cases if w is not None]
    probes += [{"architecture": a, "num_layers": n, "ids": ids} for a, n, ours, w in layer_cases if w is None
               for ids in (ours, [i + 1 for i in ours])]
    argvs = [_launch_arguments(argv) for _, _, argv in launches] + [_launch_arguments(a) for a in refused.values()]
    answer = ask_sglang(sglang_py, {"resolve": argvs,
                                    "layers": probes},
                        env={**os.environ, **sglang_env()})
    resolved = answer["resolve"]
    return {"answer": answer, "launches": list(zip(launches, resolved[:len(launches)])),
            "refused": dict(zip(refused, resolved[len(launches):])), "layer_cases": layer_cases,
            "layers": {(p["architecture"], tuple(p["ids"])): r for p, r in zip(probes, answer["layers"])},
            "targets": targets, "draft": draft}


def test_it_is_the_pinned_sglang(world):
    assert world["answer"]["version"] == SGLANG_VERSION


def test_every_accepted_setting_resolves_as_we_predict(world):
    problems = []
    for (name, predicted, _), resolved in world["launches"]:
        problems += [f"{name}: {p}" for p in resolution_problems(predicted, resolved, SGLANG_VERSION)]
    assert not problems, "\n".join(problems)
    names = [name for (name, _, _), _ in world["launches"]]
    assert len(names) > 100 and "auto LlamaForCausalLM" in names  # the grid really ran


def test_sglangs_own_numbers_per_architecture(world):
    got = {name: tuple(r["resolved"][RESOLVED_FIELDS[k]] for k in ("num_steps", "eagle_topk", "num_draft_tokens"))
           for (name, _, _), r in world["launches"] if name.startswith("auto ")}
    assert got == {"auto LlamaForCausalLM": (5, 4, 8), "auto Qwen3ForCausalLM": (3, 1, 4),
                   "auto DeepseekV3ForCausalLM": (3, 1, 4)}


def _resolved(answer, name):
    return answer["resolved"][RESOLVED_FIELDS[name]]


def test_every_setting_we_refuse_is_one_sglang_rewrites_rejects_or_leaves_broken(world):
    r = world["refused"]
    # topk 1: SGLang rewrites the draft tokens to steps + 1, with a warning (our message says so).
    for name, steps in (("3/1/16", 3), ("5/1/2", 5)):
        assert _resolved(r[name], "num_draft_tokens") == steps + 1, r[name].get("error")
        assert any("adjusted to speculative_num_steps + 1" in w for w in r[name]["warnings"])
    # Partial sets: SGLang fails on some and leaves a value unset on others.
    assert "error" in r["steps only"]
    assert "error" in r["steps and topk"] or _resolved(r["steps and topk"], "num_draft_tokens") is None
    # More draft tokens than the tree holds: 0.5.23 accepts them as given. We refuse them on purpose
    # (docs/manual.md, Configuration, "speculative settings"): older SGLang and its sweep script skip
    # them, and the draft tree cannot fill them.
    for name in ("2/2/8", "1/4/8"):
        assert "error" not in r[name]
        assert _resolved(r[name], "num_draft_tokens") == 8
    manual = (Path(__file__).resolve().parents[2] / "docs" / "manual.md").read_text()
    assert "stricter than SGLang on purpose" in manual


def test_our_layer_ids_are_what_sglang_captures(world):
    problems, checked = [], 0
    for arch, n, ours, written in world["layer_cases"]:
        if written is None:
            continue
        answer = world["layers"][(arch, tuple(written))]
        problems += layer_problems(ours, written, answer, arch, SGLANG_VERSION)
        checked += 1
    assert not problems, "\n".join(problems)
    assert checked == 16  # 5 triples x 4 architectures, less the 2 x 2 our rule refuses (id 0, DeepSeek path)


def test_where_we_refuse_ids_sglang_cannot_capture_them(world):
    """Our id 0 on SGLang's DeepSeek path: neither ours nor ours + 1 written gives the outputs of our layers."""
    refused = [(arch, ours) for arch, n, ours, written in world["layer_cases"] if written is None]
    assert {arch for arch, _ in refused} == set(DEEPSEEK_PATH)
    assert all(ours[0] == 0 for _, ours in refused)
    for arch, ours in refused:
        for written in (ours, [i + 1 for i in ours]):
            answer = world["layers"][(arch, tuple(written))]
            assert layer_problems(ours, written, answer, arch, SGLANG_VERSION), (arch, ours, written, answer)


# ---- planted changes: the run-time check refuses, naming SGLang's answer ---------------------------

def test_a_planted_layer_rule_change_is_refused_naming_sglangs_capture(world, sglang_py, monkeypatch):
    from drafter import layers

    planted = tuple(r if r.engine != "sglang" or "LlamaForCausalLM" not in r.architectures
                    else layers._Rule(r.engine, r.versions, r.architectures, "plus_one", "planted")
                    for r in layers.RULES)
    monkeypatch.setattr(layers, "RULES", planted)
    cfg = _cfg(world["targets"]["LlamaForCausalLM"], world["draft"])
    with pytest.raises(ServerConfigError) as err:
        check_with_sglang(cfg, [(None, False, _argv(cfg, speculating=False))], python=sglang_py,
                          env={**os.environ, **sglang_env()}, architecture="LlamaForCausalLM",
                          layers={"aux_layer_ids": [1, 15, 28], "num_layers": 32})
    message = str(err.value)
    # We would write [2, 16, 29]; SGLang captures [3, 17, 30] = the outputs of layers [2, 16, 29].
    assert "layers_to_capture [3, 17, 30]" in message and "not our [1, 15, 28]" in message, message


def test_a_planted_draft_token_rule_change_is_refused_naming_sglangs_value(world, sglang_py, monkeypatch):
    monkeypatch.setitem(sglang_rules.AUTO_PARAMS, "LlamaForCausalLM", (3, 1, 4))
    llama = world["targets"]["LlamaForCausalLM"]
    auto = _cfg(llama, world["draft"])
    # What our refusal of 3/1/16 guards: were it accepted, SGLang would serve 4 draft tokens.
    loose = SpeculativeConfig.model_construct(algorithm="EAGLE3", num_steps=3, eagle_topk=1, num_draft_tokens=16)
    loose_argv = _with_flags(_argv(_cfg(llama, world["draft"], {"num_steps": 3, "eagle_topk": 1,
                                                               "num_draft_tokens": 4})), num_draft_tokens=16)
    with pytest.raises(ServerConfigError) as err:
        check_with_sglang(auto, [(None, True, _argv(auto)), (loose, True, loose_argv)], python=sglang_py,
                          env={**os.environ, **sglang_env()}, architecture="LlamaForCausalLM")
    message = str(err.value)
    assert "speculative_num_steps: SGLang 0.5.23 resolves 5 (set by its _handle_eagle_family.auto_params)" \
           ", we predict 3" in message, message
    assert "3/1/16: speculative_num_draft_tokens: SGLang 0.5.23 resolves 4 (set by its _handle_eagle_family)" \
           ", we predict 16" in message, message


def test_without_sglang_the_transcribed_rules_decide_and_say_so(world):
    cfg = _cfg(world["targets"]["LlamaForCausalLM"], world["draft"])
    import sys

    report = check_with_sglang(cfg, [(None, True, _argv(cfg))], python=sys.executable)  # our venv has no sglang
    assert report["asked_sglang"] is False and "transcribed rules" in report["source"]


# ---- at run time the user's SGLang decides: config validate and the serve preflight -----------------

def _profile(tmp_path: Path, target: Path, sglang_py: str, **serve) -> Path:
    import yaml

    body = {"target": {"path": str(target)}, "dump": {"aux_layer_ids": [0, 1, 2]},
            "serve": {"engine": "sglang", "python": sglang_py, "env": sglang_env(), **serve},
            "bench": {"speculative": [{"num_steps": 2, "eagle_topk": 4, "num_draft_tokens": 8}]}}
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_config_validate_asks_the_installed_sglang(world, sglang_py, tmp_path):
    from typer.testing import CliRunner

    from drafter.cli import app

    good = _profile(tmp_path, world["targets"]["LlamaForCausalLM"], sglang_py,
                    speculative={"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4})
    ok = CliRunner().invoke(app, ["config", "validate", str(good)])
    assert ok.exit_code == 0, ok.output
    assert f"checked by sglang {SGLANG_VERSION} installed" in ok.output and "3/1/4 -> 3/1/4, 2/4/8 -> 2/4/8" in ok.output
    assert "draft ids [0, 1, 2] capture the outputs of layers [0, 1, 2]" in ok.output
    # A flag in extra_args that SGLang reads after ours: the launch would not be what the profile says.
    bad = _profile(tmp_path, world["targets"]["LlamaForCausalLM"], sglang_py,
                   speculative={"num_steps": 3, "eagle_topk": 2, "num_draft_tokens": 6},
                   extra_args=["--speculative-num-draft-tokens", "7"])
    refused = CliRunner().invoke(app, ["config", "validate", str(bad)])
    assert refused.exit_code == 1
    assert "3/2/6: speculative_num_draft_tokens: SGLang 0.5.23 resolves 7, we predict 6" in refused.output, \
        refused.output


def test_config_validate_of_a_serve_only_profile_of_a_shallow_target(world, sglang_py, tmp_path):
    """A 4-layer target has no default aux ids, and a serve-only profile names none: SGLang still
    checks the settings, and the draft's own ids are left to the launch's layer check."""
    import yaml
    from typer.testing import CliRunner

    from drafter.cli import app

    path = _profile(tmp_path, world["targets"]["LlamaForCausalLM"], sglang_py,
                    speculative={"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4})
    body = yaml.safe_load(path.read_text())
    del body["dump"], body["bench"]
    path.write_text(yaml.safe_dump(body))
    ok = CliRunner().invoke(app, ["config", "validate", str(path)])
    assert ok.exit_code == 0, ok.output
    assert f"checked by sglang {SGLANG_VERSION} installed" in ok.output and "aux_layer_ids" not in ok.output


def test_the_serve_preflight_refuses_before_any_launch(world, sglang_py, tmp_path):
    from drafter.serving.check import check_server

    cfg = parse_config({"target": {"path": str(world["targets"]["LlamaForCausalLM"])},
                        "dump": {"aux_layer_ids": [0, 1, 2]},
                        "serve": {"engine": "sglang", "python": sglang_py, "env": sglang_env(),
                                  "port": 31000, "log_dir": str(tmp_path / "logs"),
                                  "extra_args": ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                                                 str(world["draft"])]}})
    result = check_server(cfg)  # no drafter asked for: SGLang would speculate anyway
    assert result["status"] == "config_error" and not result["phases"], result
    assert "speculative_algorithm: SGLang 0.5.23 resolves 'EAGLE3'" in result["message"], result["message"]
