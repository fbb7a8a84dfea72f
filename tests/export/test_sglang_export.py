"""Our SGLang export checked by SGLang 0.5.23's OWN draft-model code, run in the lite SGLang venv
(`make sglang-env`; a missing venv FAILS these tests through the `sglang_py` fixture, never skips).

One probe process (tests/sglang_probe/export_load.py) serves the whole module (an EAGLE 3.1 export
among them: fc_norm and norm_output): for each export it
builds SGLang's `LlamaForCausalLMEagle3`, fills every parameter with NaN, runs SGLang's own
`load_weights`, compares each parameter with the file (fused qkv = cat(q, k, v), gate_up =
cat(gate, up)), reads `hot_token_id`, and runs one EXTEND forward (attention: a causal SDPA backend
installed through SGLang's forward_context; everything else is SGLang's). The good export has non-unit
norm weights and weights x10 and a non-trivial draft vocab, so a swapped norm, a missing residual or an
ignored d2t shows. Planted broken copies prove each check bites:
  renamed key         -> SGLang silently skips it: the parameter stays NaN;
  fc of the wrong width -> SGLang's loader raises (reported per export, the probe goes on);
  q_proj with extra rows -> SGLang silently keeps the first rows: caught only by comparing with the file;
  hidden_norm <-> input_layernorm swapped -> loads cleanly, caught by the forward against Eagle3Drafter.

Cost on an idle 2-core machine: about 22 s measured (tiny target ~5 s when no other module built it, the
venv's version check a few s, the probe ~14 s for all five exports, almost all of it SGLang's imports +
gloo setup; one more export adds well under a second).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter.export.sglang import TargetInfo, check_sglang_export, draft_target_ids, write_sglang
from drafter.model import init_random_drafter, load_drafter, set_draft_vocab
from tests.fixtures.sglang_env import REPO, SGLANG_VERSION, sglang_env, sglang_py  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PROBE = REPO / "tests" / "sglang_probe" / "export_load.py"
AUX = [0, 1, 2]
DRAFT_VOCAB = 256
TOKENS = 12
TOL = 1e-4
FUSED_QKV = "model.layers.0.self_attn.qkv_proj.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"
RENAMED_FROM, RENAMED_TO = "midlayer.mlp.down_proj.weight", "midlayer.mlp.down.weight"


def _rename_down(t: dict) -> None:
    t[RENAMED_TO] = t.pop(RENAMED_FROM)


def _narrow_fc(t: dict) -> None:
    t["fc.weight"] = t["fc.weight"][:, :128].contiguous()  # as if trained on 2 aux layers, not 3


def _grow_q(t: dict) -> None:
    extra = torch.randn(8, t["midlayer.self_attn.q_proj.weight"].shape[1], generator=torch.Generator().manual_seed(3))
    t["midlayer.self_attn.q_proj.weight"] = torch.cat([t["midlayer.self_attn.q_proj.weight"], extra])


def _swap_norms(t: dict) -> None:
    a, b = "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight"
    t[a], t[b] = t[b], t[a]


PLANTED = {"renamed_key": _rename_down, "fc_too_narrow": _narrow_fc, "q_too_tall": _grow_q,
           "norms_swapped": _swap_norms}


def _plant(good: Path, out: Path, edit) -> Path:
    shutil.copytree(good, out)
    tensors = load_file(str(good / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().nan_to_num(float("inf")).max())


def _random_drafter(tiny_target, out, gen, drafter="eagle3"):
    model = load_drafter(init_random_drafter(tiny_target, out, AUX, DRAFT_VOCAB, seed=0, drafter=drafter))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # each norm its own non-unit weights: a swap changes the output
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            else:  # x10: logits of order 5, so a missing residual or a wrong fusion is far beyond TOL
                param.mul_(10)
        # A scattered draft vocab (d2t non-zero): an ignored d2t would not equal arange.
        set_draft_vocab(model, torch.randperm(model.config.vocab_size, generator=gen)[:DRAFT_VOCAB])
    return model


@pytest.fixture(scope="module")
def exports(tiny_target, tmp_path_factory) -> dict:
    """The good export (our write_sglang), its planted copies, an EAGLE 3.1 export (`eagle31`: fc_norm
    and norm_output, its own random weights), the forward inputs and our reference for each."""
    root = tmp_path_factory.mktemp("sglang-export")
    gen = torch.Generator().manual_seed(1)
    model = _random_drafter(tiny_target, root / "draft", gen)
    info = TargetInfo.read(tiny_target)
    good = root / "good"
    write_sglang(model, info, good, AUX)
    assert check_sglang_export(good, model, info, AUX) == []  # our own read-back check passes first
    dirs = {"good": good} | {name: _plant(good, root / name, edit) for name, edit in PLANTED.items()}

    ids = torch.randint(0, info.vocab_size, (TOKENS,), generator=gen)
    positions = torch.arange(3, 3 + TOKENS)  # not from 0: RoPE must use the given positions
    hidden = torch.randn(TOKENS, 3 * info.hidden_size, generator=gen)
    # Captured states of different scales (as a target's layers are): one norm over the concatenation
    # would not give what one norm per state gives (EAGLE 3.1's fc_norm).
    hidden = hidden * torch.tensor([1.0, 4.0, 0.25]).repeat_interleave(info.hidden_size)
    save_file({"input_ids": ids, "positions": positions, "hidden": hidden}, str(root / "inputs.safetensors"))
    model31 = _random_drafter(tiny_target, root / "draft31", torch.Generator().manual_seed(2), "eagle3.1")
    write_sglang(model31, info, root / "eagle31", AUX)
    assert check_sglang_export(root / "eagle31", model31, info, AUX) == []
    dirs["eagle31"] = root / "eagle31"
    ref = {}
    with torch.no_grad():
        for name, m in (("good", model), ("eagle31", model31)):
            logits, next_hidden = m(info.embedding()[ids][None], hidden[None], positions[None])
            ref[name] = {"logits": logits[0], "hidden": next_hidden[0]}  # 3.1: post-norm
    return {"root": root, "dirs": dirs, "model": model, "inputs": root / "inputs.safetensors", "ref": ref["good"],
            "ref31": ref["eagle31"]}


@pytest.fixture(scope="module")
def sglang(exports, sglang_py) -> dict:
    """SGLang's report per export (one probe process for all), with its forward tensors under 'out'."""
    outs = {name: exports["root"] / f"{name}.forward.safetensors" for name in exports["dirs"]}
    request = {"model_dir": str(exports["dirs"]["good"]), "inputs": str(exports["inputs"]),
               "exports": [{"dir": str(d), "out": str(outs[n])} for n, d in exports["dirs"].items()]}
    proc = subprocess.run([sglang_py, str(PROBE)], input=json.dumps(request), capture_output=True, text=True,
                          timeout=300, env={**os.environ, **sglang_env(cpu_engine=True)})
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"the SGLang probe failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}", pytrace=False)
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["version"] == SGLANG_VERSION
    reports = dict(zip(exports["dirs"], answer["exports"]))
    for name, report in reports.items():
        if "error" not in report and "error" not in report["forward"]:
            report["out"] = load_file(str(outs[name]))
    return reports


def _loaded_cleanly(report: dict) -> None:
    assert "error" not in report, report
    assert report["unloaded"] == [] and report["partly_unloaded"] == [], report["unloaded"] + report["partly_unloaded"]
    assert report["mismatched"] == {}, report["mismatched"]


# ----------------------------------------------------------------------------- the good export

def test_every_sglang_parameter_is_loaded_and_equals_the_file(sglang):
    report = sglang["good"]
    _loaded_cleanly(report)
    assert report["unused_file_keys"] == []  # no file key that no parameter was compared with
    # SGLang fuses q/k/v and gate/up; the comparison was against cat() of our separate tensors.
    assert report["compared"][FUSED_QKV] == [f"midlayer.self_attn.{p}_proj.weight" for p in "qkv"]
    assert report["compared"]["model.layers.0.mlp.gate_up_proj.weight"] == [
        "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"]
    assert report["parameters"]["lm_head.weight"] == [DRAFT_VOCAB, 64]
    assert report["parameters"]["model.embed_tokens.weight"] == [512, 64]


def test_hot_token_id_is_d2t_plus_arange(sglang, exports):
    report = sglang["good"]
    assert report["hot_token_id_ok"]
    d2t = exports["model"].d2t
    assert torch.any(d2t != 0)  # a scattered vocab: hot_token_id == arange would not pass
    assert report["hot_token_id"] == draft_target_ids(d2t).tolist()


def test_fc_reads_three_aux_hidden_states(sglang):
    assert sglang["good"]["num_aux_hidden_states"] == len(AUX)
    assert sglang["good"]["fc_in_features"] == len(AUX) * 64


def test_sglang_forward_equals_our_drafter(sglang, exports):
    report, ref = sglang["good"], exports["ref"]
    assert "error" not in report["forward"], report["forward"]
    got = report["out"]
    assert got["logits"].shape == ref["logits"].shape and got["hidden"].shape == ref["hidden"].shape
    logits, hidden = _max_diff(got["logits"], ref["logits"]), _max_diff(got["hidden"], ref["hidden"])
    scale = float(ref["logits"].abs().max())
    assert logits <= TOL and hidden <= TOL, (f"SGLang vs Eagle3Drafter: max abs diff logits {logits:.3g}, "
                                             f"pre-norm hidden {hidden:.3g} (tolerance {TOL}, logit scale {scale:.3g})")
    assert torch.equal(got["logits"].argmax(-1), ref["logits"].argmax(-1))


def test_sglang_loads_an_eagle31_export_and_its_forward_equals_ours(sglang, exports):
    """SGLang 0.5.23 reads fc_norm / norm_output from our 3.1 config: its fc_norm parameters load from
    `fc_norm.{i}.weight`, and its forward (per-state norms before fc) and the hidden it hands to the
    next draft step (post-norm) equal Eagle3Drafter's."""
    report, ref = sglang["eagle31"], exports["ref31"]
    _loaded_cleanly(report)
    assert report["unused_file_keys"] == []
    assert {f"model.fc_norm.{i}.weight" for i in range(3)} <= set(report["parameters"])
    got = report["out"]
    logits, hidden = _max_diff(got["logits"], ref["logits"]), _max_diff(got["hidden"], ref["hidden"])
    assert logits <= TOL and hidden <= TOL, f"SGLang vs Eagle3Drafter (3.1): logits {logits:.3g}, hidden {hidden:.3g}"
    # post-norm: lm_head's input is the hidden handed on, so the logits are lm_head(hidden)
    lm_head = load_file(str(exports["dirs"]["eagle31"] / "model.safetensors"))["lm_head.weight"]
    assert _max_diff(got["hidden"] @ lm_head.T, got["logits"]) <= TOL
    assert _max_diff(got["hidden"], exports["ref"]["hidden"]) > 1  # not eagle3's numbers by accident


# ----------------------------------------------------------------------------- planted breaks

def test_renamed_key_leaves_the_parameter_unloaded(sglang):
    report = sglang["renamed_key"]
    assert "error" not in report, report  # SGLang does not complain: it drops the unknown key
    assert report["unloaded"] == [DOWN]
    assert RENAMED_TO in report["unused_file_keys"]
    assert not torch.isfinite(report["out"]["logits"]).all()


def test_wrong_fc_width_raises_inside_sglangs_loader(sglang):
    report = sglang["fc_too_narrow"]
    assert report.get("stage") == "load" and report["error"].startswith("AssertionError"), report
    assert "[64, 128]" in report["error"] and "[64, 192]" in report["error"], report["error"]  # file vs parameter


def test_oversized_q_proj_loads_silently_and_only_the_comparison_catches_it(sglang):
    report = sglang["q_too_tall"]
    assert "error" not in report, report
    # SGLang narrows a fused shard to its own size: no error, nothing left NaN...
    assert report["unloaded"] == [] and report["partly_unloaded"] == []
    # ...so only the comparison with the file shows the export is wrong.
    assert set(report["mismatched"]) == {FUSED_QKV}
    assert "file [136, 128]" in report["mismatched"][FUSED_QKV]


def test_swapped_norms_load_cleanly_but_the_forward_differs(sglang, exports):
    report = sglang["norms_swapped"]
    _loaded_cleanly(report)  # the file is self-consistent: the loader cannot see the swap
    diff = _max_diff(report["out"]["logits"], exports["ref"]["logits"])
    assert diff > 100 * TOL, f"swapped hidden_norm/input_layernorm changed the logits by only {diff:.3g}"
