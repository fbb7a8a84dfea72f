"""The export stage: SGLang + vLLM (speculators) files checked by reading them back, the vLLM
export loaded by the real `speculators` package with the same logits as our network, the offline
judgement with the reference engine's speculative decoder, and each planted mistake refused with
a message naming it. Built on the crafted "successor" target + drafter of tests/fixtures/speculative.py
(a drafter that is accepted: 1 draft per verify on the +1 runs the chat prompts end in)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter.config import parse_config
from drafter.errors import DrafterError
from drafter.contracts.prompts import prompts_from_conversations
from drafter.export.judge import JudgedTooLow, check, judge_export
from drafter.export.sglang import (
    SGLANG_CONFIG_FIELDS, ExportCheckFailed, ExportError, TargetInfo, check_sglang_export, sglang_layer_ids,
    write_sglang)
from drafter.export.vllm import check_vllm_export, write_vllm
from drafter.layers import LAYER_ID_CONVENTION
from drafter.model import EXPECTED_KEYS, load_drafter
from drafter.stage_output import StageOutput
from drafter.stages import export
from drafter.store import FileStore
from drafter.target import HFTarget
from drafter.target_identity import target_fingerprint
from tests.fixtures.export_upstreams import ACC, AUX, RATE, commit_upstreams
from tests.fixtures.speculative import EOS, build_random_target, successor_pair  # noqa: F401  (fixture)
from drafter.stages import TABLE


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def pair(successor_pair) -> tuple[Path, Path]:
    """The crafted successor target + drafter (built once per session; exports go to tmp_path)."""
    return successor_pair


@pytest.fixture(scope="module")
def eval_conversations(tiny_conversations) -> list[dict]:
    return tiny_conversations[200:]



def _cfg(target: Path, root: Path, **export_section):
    section = dict(eval_prompts=4, judge_max_new_tokens=40, judge_num_steps=3, device="cpu",
                   judge_bucket_edges=[8, 16, 32])
    section.update(export_section)
    return parse_config({"target": {"path": str(target)}, "dump": {"aux_layer_ids": AUX},
                         "train": {"draft_vocab_size": 256}, "export": section,
                         "storage": {"root": f"file://{root}/store"}})


@pytest.fixture
def stage_env(pair, eval_conversations, tmp_path):
    target, draft = pair
    store = FileStore(tmp_path / "store")
    upstream = commit_upstreams(store, tmp_path, target, draft, eval_conversations)
    return target, draft, store, upstream, tmp_path


# ----------------------------------------------------------------------------- the good export

def test_good_export_is_written_checked_judged_committed_and_skipped(stage_env):
    target, draft, store, upstream, tmp = stage_env
    cfg = _cfg(target, tmp)
    lines = []
    result = TABLE.run("export", cfg, store, upstream=upstream, on_line=lines.append)
    assert result.status == "done" and result.fingerprint == TABLE.fingerprint("export", cfg, upstream)
    names = {s.name for s in result.manifest.shards}
    assert names == {"sglang/config.json", "sglang/model.safetensors", "vllm/config.json",
                     "vllm/model.safetensors", "export.json", "judge.json"}
    judge, manifest = result.meta["judge"], result.meta["export"]
    # successor walk: exactly one draft accepted per verify -> 2.0, next to the prediction 2.05
    assert judge["accept_length"] == pytest.approx(2.0) and judge["per_position"] == [1.0, 0.0, 0.0]
    assert judge["predicted"]["accept_length"] == pytest.approx(2.04975) and judge["verdict"]["passed"]
    assert judge["prompts"] == 4 and sum(b["verifies"] for b in judge["by_output_length"]) == judge["verifies"]
    assert manifest["layer_ids"]["trained"]["ids"] == AUX
    assert manifest["layer_ids"]["sglang"]["eagle_aux_hidden_state_layer_ids"] == AUX
    assert manifest["layer_ids"]["vllm"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert manifest["target"]["fingerprint"] == target_fingerprint(target) and manifest["dump_fingerprint"] == "dump0001"
    assert len(manifest["draft_vocab"]["hash"]) == 16 and manifest["training"]["final_eval"]["acc"] == ACC
    assert any("offline accept length 2.000 at 3/1/4" in s and "predicted 2.050" in s for s in result.summary)
    assert any("offline accept length" in line for line in lines)
    assert judge["prompts_past_train_max_length"] == 0 and not any("WARNING" in s for s in result.summary)

    again = TABLE.run("export", cfg, store, upstream=upstream)
    assert again.skipped and again.manifest == result.manifest
    # prepare found through the chain (train -> dump -> prepare) gives the same output
    assert TABLE.run("export", cfg, store, upstream={"train": upstream["train"]}).skipped

    local = export.write_local(store, result.fingerprint, tmp / "local")
    assert load_drafter(local["sglang"]).config.aux_layer_ids == AUX
    assert json.loads((local["vllm"] / "config.json").read_text())["speculators_model_type"] == "eagle3"
    assert json.loads(local["judge"].read_text())["accept_length"] == pytest.approx(2.0)


def test_prompts_past_the_trained_length_are_counted_and_warned(stage_env):
    target, draft, store, upstream, tmp = stage_env
    cfg = _cfg(target, tmp)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_length": 16})})
    result = TABLE.run("export", cfg, store, upstream=upstream)
    judge = result.meta["judge"]
    assert judge["train_max_length"] == 16 and judge["prompts_past_train_max_length"] == judge["prompts"] == 4
    assert any(s.startswith("WARNING: 4 of 4 judged prompts run past train.max_length 16") for s in result.summary)


def test_fingerprint_follows_output_fields_not_operational_ones(stage_env):
    target, _, _, upstream, tmp = stage_env
    fp = TABLE.fingerprint("export", _cfg(target, tmp), upstream)
    assert TABLE.fingerprint("export", _cfg(target, tmp, device="cuda"), upstream) == fp
    assert TABLE.fingerprint("export", _cfg(target, tmp, judge_num_steps=2), upstream) != fp
    assert TABLE.fingerprint("export", _cfg(target, tmp), {"train": "other0001"}) != fp


def test_sglang_export_keys_shapes_and_config_fields(pair, tmp_path):
    target, draft = pair
    info, src = TargetInfo.read(target), load_drafter(draft)
    write_sglang(src, info, tmp_path / "s", AUX)
    assert check_sglang_export(tmp_path / "s", src, info, AUX) == []
    data = json.loads((tmp_path / "s" / "config.json").read_text())
    assert all(f in data for f in SGLANG_CONFIG_FIELDS)
    assert data["architectures"] == ["LlamaForCausalLMEagle3"] and data["draft_vocab_size"] == 256
    assert data["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": AUX}
    assert data["layer_id_convention"] == LAYER_ID_CONVENTION and data["vocab_size"] == info.vocab_size
    tensors = load_file(str(tmp_path / "s" / "model.safetensors"))
    want = {k: shape for k, (shape, _) in EXPECTED_KEYS(src.config).items()}
    want["embed_tokens.weight"] = (info.vocab_size, info.hidden_size)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    assert torch.equal(tensors["embed_tokens.weight"], info.embedding())
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool


def test_export_refuses_a_layer_id_combination_nobody_read():
    # the rules themselves are tests/core/test_layers.py's; the export turns a refusal into an ExportError
    assert sglang_layer_ids([2, 30, 57], "DeepseekV3ForCausalLM").ids == [3, 31, 58]
    with pytest.raises(ExportError, match="no layer-id rule for engine 'sglang' version 0.5.23 with target "
                                          "architecture 'MysteryForCausalLM'"):
        sglang_layer_ids([1, 2, 3], "MysteryForCausalLM")


# ----------------------------------------------------------------------------- the real vLLM client

def test_an_eagle31_drafter_is_not_written_for_an_engine_version_that_may_ignore_its_norms(pair, tmp_path):
    from drafter.model import DRAFTERS, Eagle3DraftConfig, Eagle3Drafter

    target, draft = pair
    info = TargetInfo.read(target)
    src = load_drafter(draft)
    write_sglang(src, info, tmp_path / "old3", AUX, sglang_version="0.5.20")  # eagle3: any 0.5.x
    variant = Eagle3Drafter(Eagle3DraftConfig.from_json_dict({**src.config.to_json_dict(), **DRAFTERS["eagle3.1"]}))
    with pytest.raises(ExportError, match=r"export.sglang_version: sglang 0.5.20 is older than the first version "
                                          r"read with EAGLE 3.1's fc_norm/norm_output"):
        write_sglang(variant, info, tmp_path / "old31", AUX, sglang_version="0.5.20")
    assert not (tmp_path / "old31" / "config.json").exists()


@pytest.mark.parametrize("drafter", ["eagle3", "eagle3.1"])
def test_vllm_export_loads_in_speculators_with_our_logits(pair, tmp_path, drafter):
    """speculators' own Eagle3DraftModel on our vLLM export gives our logits for two TTT steps; for
    EAGLE 3.1 that covers its per-state norms before fc and the post-norm hidden fed to step 2."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    from drafter.model import DRAFTERS, DraftKVCache, Eagle3DraftConfig, Eagle3Drafter, ttt_attention_mask

    target, draft = pair
    info = TargetInfo.read(target)
    # A drafter with every weight random (the successor drafter zeroes o_proj / down_proj).
    src = load_drafter(draft)
    if drafter != "eagle3":  # the same drafter with the variant's parts (weights randomised below)
        variant = Eagle3Drafter(Eagle3DraftConfig.from_json_dict({**src.config.to_json_dict(), **DRAFTERS[drafter]}))
        variant.d2t.copy_(src.d2t)
        variant.t2d.copy_(src.t2d)
        src = variant
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in src.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if name.endswith("norm.weight")
                    else 0.2 * torch.randn(p.shape, generator=gen))
    write_sglang(src, info, tmp_path / "s", AUX)
    write_vllm(tmp_path / "s", info, tmp_path / "v", AUX, speculative_tokens=3)
    assert check_vllm_export(tmp_path / "v", tmp_path / "s", info, AUX) == []
    data = json.loads((tmp_path / "v" / "config.json").read_text())
    assert data["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert data["speculators_config"]["verifier"]["name_or_path"] == info.path
    assert (data["norm_before_residual"], data["norm_before_fc"]) == (False, False)
    assert (data["fc_norm"], data["norm_output"]) == ((False, False) if drafter == "eagle3" else (True, True))

    config = SpeculatorModelConfig.from_pretrained(str(tmp_path / "v"))
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs len % 128 on CPU
    model = SpeculatorModel.from_pretrained(str(tmp_path / "v"), config=config).eval()
    assert type(model).__name__ == "Eagle3DraftModel" and model.config.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    assert torch.equal(model.d2t, src.d2t) and torch.equal(model.t2d, src.t2d)

    T, H = 19, info.hidden_size
    g = torch.Generator().manual_seed(5)
    aux = torch.randn(1, T, 3 * H, generator=g)
    if drafter != "eagle3":  # states of different scales: one norm over the concatenation would differ
        aux = aux * torch.tensor([1.0, 8.0, 0.1]).repeat_interleave(H)
    ids = torch.randint(0, info.vocab_size, (1, T), generator=g)
    captured = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids),
              position_ids=torch.arange(T)[None], ttt_steps=2)
    hook.remove()
    ours = load_drafter(tmp_path / "s")  # the exported SGLang files, embedding included
    assert isinstance(ours, Eagle3Drafter) and ours.embed_tokens is not None
    cache, pos = DraftKVCache(), torch.arange(T)[None]
    with torch.no_grad():
        logits0, h = ours(ours.embed_tokens(ids), aux, pos, cache, ttt_attention_mask(T, 0))
        shifted = torch.cat([ids[:, 1:], torch.zeros(1, 1, dtype=ids.dtype)], dim=1)
        logits1, _ = ours(ours.embed_tokens(shifted), h, pos + 1, cache, ttt_attention_mask(T, 1))
    assert len(captured) == 2
    torch.testing.assert_close(captured[0], logits0, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(captured[1], logits1, atol=2e-5, rtol=1e-4)
    assert logits0.std() > 0.1  # not a degenerate comparison


def test_vllm_export_leaves_maps_out_when_draft_vocab_is_the_target_vocab(pair, tmp_path):
    from drafter.model import init_random_drafter

    target, _ = pair
    info = TargetInfo.read(target)
    src = load_drafter(init_random_drafter(target, tmp_path / "full", aux_layer_ids=AUX))
    write_sglang(src, info, tmp_path / "s", AUX)
    write_vllm(tmp_path / "s", info, tmp_path / "v", AUX, 3)
    keys = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert "d2t" not in keys and "t2d" not in keys
    assert check_vllm_export(tmp_path / "v", tmp_path / "s", info, AUX) == []


# ----------------------------------------------------------------------------- planted mistakes

def _good_export(pair, tmp_path) -> tuple[Path, object, TargetInfo]:
    target, draft = pair
    info, src = TargetInfo.read(target), load_drafter(draft)
    write_sglang(src, info, tmp_path / "s", AUX)
    return tmp_path / "s", src, info


def _edit_tensors(directory: Path, fn) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def _edit_config(directory: Path, fn) -> None:
    path = directory / "config.json"
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _problems(directory, src, info) -> str:
    return "\n".join(check_sglang_export(directory, src, info, AUX))


def test_planted_aux_ids_shifted_by_one(pair, tmp_path):
    out, src, info = _good_export(pair, tmp_path)
    _edit_config(out, lambda d: d["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]))
    assert "eagle_aux_hidden_state_layer_ids=[1, 2, 3], expected [0, 1, 2]" in _problems(out, src, info)
    assert "shifted by +1" in _problems(out, src, info)


def test_planted_d2t_zeros(pair, tmp_path, eval_conversations):
    out, src, info = _good_export(pair, tmp_path)

    def zero(t):
        t["d2t"].zero_()
        t["t2d"].zero_()
        t["t2d"][: len(t["d2t"])] = True  # consistent maps, so only the meaning is wrong
    _edit_tensors(out, zero)
    assert "d2t is all zeros" in _problems(out, src, info)
    # ... and the judge alone, on those files, refuses them too
    with pytest.raises(JudgedTooLow, match="min_accept_length"):
        _judge(pair[0], out, eval_conversations)


def test_planted_vocab_map_from_another_dump(pair, tmp_path, eval_conversations):
    out, src, info = _good_export(pair, tmp_path)
    other = torch.tensor([EOS] + list(range(100, 355)))  # the draft vocab another dump would count

    def swap(t):
        t["d2t"].copy_(other - torch.arange(len(other)))
        t["t2d"].zero_()
        t["t2d"][other] = True
    _edit_tensors(out, swap)
    msg = _problems(out, src, info)
    assert "d2t/t2d: draft vocab" in msg and "differs from the trained drafter's" in msg and "another dump" in msg
    with pytest.raises(JudgedTooLow):
        _judge(pair[0], out, eval_conversations)


def test_planted_random_embedding(pair, tmp_path):
    out, src, info = _good_export(pair, tmp_path)
    _edit_tensors(out, lambda t: t["embed_tokens.weight"].normal_())
    assert "embed_tokens.weight is not the target's input embedding" in _problems(out, src, info)


def test_planted_key_renamed(pair, tmp_path):
    out, src, info = _good_export(pair, tmp_path)

    def rename(t):
        for k in [k for k in t if k.startswith("midlayer.")]:
            t["layers.0." + k[len("midlayer."):]] = t.pop(k)
    _edit_tensors(out, rename)
    msg = _problems(out, src, info)
    assert "misses keys SGLang loads" in msg and "midlayer.self_attn.q_proj.weight" in msg
    assert "outside the SGLang layout" in msg and "'layers.0.' is the speculators/vLLM name" in msg


def test_planted_eagle31_flag_dropped_is_refused_in_both_formats(pair, tmp_path):
    """An EAGLE 3.1 export that lost a flag loads in SGLang / vLLM without a word (fc_norm's weights
    dropped, or the pre-norm hidden fed on): the read-back checks name the flag and the keys."""
    from drafter.model import DRAFTERS, Eagle3DraftConfig, Eagle3Drafter

    target, draft = pair
    info, src3 = TargetInfo.read(target), load_drafter(draft)
    src = Eagle3Drafter(Eagle3DraftConfig.from_json_dict({**src3.config.to_json_dict(), **DRAFTERS["eagle3.1"]}))
    src.load_state_dict(src3.state_dict(), strict=False)  # fc_norm keeps its init: ones
    write_sglang(src, info, tmp_path / "s", AUX)
    assert check_sglang_export(tmp_path / "s", src, info, AUX) == []
    write_vllm(tmp_path / "s", info, tmp_path / "v", AUX, 3)
    assert check_vllm_export(tmp_path / "v", tmp_path / "s", info, AUX) == []
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(load_file(str(tmp_path / "v" / "model.safetensors")))

    _edit_config(tmp_path / "s", lambda d: d.pop("fc_norm"))
    msg = _problems(tmp_path / "s", src, info)
    assert "fc_norm=None, expected True (the trained drafter is eagle3.1" in msg
    assert "outside the SGLang layout" in msg and "fc_norm.0.weight" in msg  # SGLang would drop them
    _edit_config(tmp_path / "v", lambda d: d.update(norm_output=False))
    problems = "\n".join(check_vllm_export(tmp_path / "v", tmp_path / "s", info, AUX))
    assert "norm_output=False, expected True" in problems
    write_sglang(src3, info, tmp_path / "s3", AUX)  # eagle3 exports carry no 3.1 flag at all
    assert not {"fc_norm", "norm_output"} & set(json.loads((tmp_path / "s3" / "config.json").read_text()))


def test_planted_drafter_trained_for_another_target(pair, eval_conversations, tmp_path):
    """Stage gate: the dump the drafter learned from names another target. Judge alone: the same
    drafter on another target's features is refused by its accept length."""
    target, draft = pair
    store = FileStore(tmp_path / "store")
    upstream = commit_upstreams(store, tmp_path, target, draft, eval_conversations, target_fp="feedfacefeedface")
    with pytest.raises(ExportError, match="trained for another target.*feedfacefeedface") as err:
        TABLE.run("export", _cfg(target, tmp_path), store, upstream=upstream)
    assert not err.value.retryable
    other = build_random_target(target, tmp_path / "other-target", seed=4)
    with pytest.raises(JudgedTooLow, match="min_accept_length"):
        _judge(other, _good_export(pair, tmp_path)[0], eval_conversations)


def test_stage_refuses_a_trained_drafter_with_shifted_ids(pair, eval_conversations, tmp_path):
    """The mistake made before the export: a checkpoint whose config carries vLLM's ids."""
    target, draft = pair
    bad = tmp_path / "bad-draft"
    shutil.copytree(draft, bad)
    _edit_config(bad, lambda d: d["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]))
    store = FileStore(tmp_path / "store")
    upstream = commit_upstreams(store, tmp_path, target, bad, eval_conversations)
    with pytest.raises(ExportCheckFailed, match=r"aux layer ids \[1, 2, 3\], the configuration \[0, 1, 2\]"):
        TABLE.run("export", _cfg(target, tmp_path), store, upstream=upstream)


def test_stage_fails_when_judged_below_the_prediction(stage_env):
    target, _, store, upstream, tmp = stage_env
    with pytest.raises(JudgedTooLow, match=r"min_accept_ratio 0.99 x training prediction 2.050") as err:
        TABLE.run("export", _cfg(target, tmp, min_accept_ratio=0.99), store, upstream=upstream)
    assert isinstance(err.value, DrafterError) and not err.value.retryable
    with pytest.raises(JudgedTooLow, match=r"min_accept_length 2.5"):
        TABLE.run("export", _cfg(target, tmp, min_accept_length=2.5), store, upstream=upstream)
    assert not StageOutput(store, "export", TABLE.fingerprint("export", _cfg(target, tmp, min_accept_length=2.5),
                                                               upstream)).is_complete()


def test_check_names_both_thresholds():
    report = {"accept_length": 1.05, "predicted": {"accept_length": 2.0, "per_position": [0.9]}, "per_position": [0.05],
              "num_steps": 1, "prompts": 3, "verifies": 40}
    with pytest.raises(JudgedTooLow) as err:
        check(report, 1.2, 0.7)
    assert "min_accept_length 1.2" in str(err.value) and "min_accept_ratio 0.7" in str(err.value)
    assert check({**report, "accept_length": 1.9}, 1.2, 0.7)["passed"]


def _judge(target_dir: Path, sglang_dir: Path, conversations) -> dict:
    target = HFTarget(target_dir, device="cpu")
    prompts, _ = prompts_from_conversations(target.tokenizer, conversations, 4, 400)
    report = judge_export(sglang_dir, target, prompts, num_steps=3, max_new_tokens=40, bucket_edges=[16],
                          prediction={"accept_rate": RATE})
    return check(report, 1.2, 0.7)
