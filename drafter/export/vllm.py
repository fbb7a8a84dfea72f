"""The vLLM export: the speculators format (vllm-speculators-contract.md), converted from the
SGLang export files read back, and checked the same way.

Three things go silently wrong in this format and are handled here:
- layer ids: vLLM/speculators id i = INPUT of layer i = output of layer i - 1, so our ids
  (output of layer i) are written +1 and the conversion is recorded next to them;
- norm flags: speculators' `norm_before_residual` defaults to TRUE in vLLM when absent and
  `norm_output` means Eagle-3.1's post-norm feedback (not SpecForge's "norm before lm_head"):
  every flag is written explicitly with the value that matches our network (`norm_flags`: all
  false for eagle3; `fc_norm` and `norm_output` true for eagle3.1, read by vLLM 0.32.0 in
  transformers_utils/configs/speculators/algos.py l.33-38);
- vocab maps: `d2t`/`t2d` buffers are required when the draft vocab is smaller than the target's
  (without `d2t` vLLM maps draft ids to the first N target ids) and refused by vLLM when it is the
  same size (contract section 9): left out then.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from drafter.export.sglang import EMBED_KEY, PROVENANCE_KEY, ExportError, TargetInfo, refuse_old_engine
from drafter.layers import (INPUT_OF_LAYER_CONVENTION, LAYER_ID_CONVENTION, READ_VERSIONS, EngineLayerIds,
                            UnknownLayerIdRule, engine_layer_ids)
from drafter.model import CONFIG_FILE, WEIGHTS_FILE, Eagle3DraftConfig

VLLM_LAYER_ID_CONVENTION = INPUT_OF_LAYER_CONVENTION  # vLLM / speculators / ModelOpt: HF hidden_states[i]
ARCHITECTURES = ["Eagle3DraftModel"]                # what speculators tags a saved Eagle-3 draft with
# Our network (drafter.model): residual = the incoming hidden (un-normed), no single norm over the fc
# input (norm_before_fc); EAGLE 3.1 adds one norm per captured state (fc_norm) and feeds the
# post-norm hidden to the next step (norm_output).
NORM_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}


def norm_flags(cfg: Eagle3DraftConfig) -> dict[str, bool]:
    """The speculators norm flags of a drafter: NORM_FLAGS with its EAGLE 3.1 parts."""
    return {**NORM_FLAGS, "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output}
_RENAME = (("midlayer.", "layers.0."),)


def vllm_layer_ids(our_ids: list[int], target_architecture: str, vllm_version: str = READ_VERSIONS["vllm"]
                   ) -> EngineLayerIds:
    """Our 'output of layer i' ids in vLLM's 'input of layer i' convention (drafter.layers.engine_layer_ids:
    +1), an unknown combination refused as an ExportError naming it."""
    try:
        return engine_layer_ids(our_ids, "vllm", vllm_version, target_architecture)
    except UnknownLayerIdRule as err:
        raise ExportError(str(err)) from None


def vllm_key(sglang_key: str) -> str:
    for old, new in _RENAME:
        if sglang_key.startswith(old):
            return new + sglang_key[len(old):]
    return sglang_key


def _layer_config(cfg: Eagle3DraftConfig, target: TargetInfo) -> dict[str, Any]:
    """The nested Llama decoder config speculators builds the draft layer from."""
    out = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": target.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    }
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if target.config.get(key) is not None:
            out[key] = target.config[key]
    return out


def write_vllm(sglang_dir: str | Path, target: TargetInfo, out_dir: str | Path, our_aux_ids: list[int],
               speculative_tokens: int, vllm_version: str = READ_VERSIONS["vllm"]) -> dict[str, Any]:
    """Convert the SGLang export at `sglang_dir` (read back from disk) into speculators format."""
    from safetensors.torch import load_file, save_file

    sglang_dir, out_dir = Path(sglang_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = Eagle3DraftConfig.load(sglang_dir / CONFIG_FILE)
    tensors = load_file(str(sglang_dir / WEIGHTS_FILE))
    with_maps = cfg.draft_vocab_size != target.vocab_size
    out = {vllm_key(k): v.contiguous() for k, v in tensors.items() if with_maps or k not in ("d2t", "t2d")}
    mapped = vllm_layer_ids(our_aux_ids, target.architecture, vllm_version)
    refuse_old_engine(cfg, "vllm", vllm_version)
    ids = mapped.ids
    data = {
        "architectures": ARCHITECTURES,
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target.path, "architectures": [target.architecture]},
        },
        "transformer_layer_config": _layer_config(cfg, target),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": target.hidden_size,
        "eagle_aux_hidden_state_layer_ids": ids,
        **norm_flags(cfg),
        "torch_dtype": cfg.torch_dtype,
        PROVENANCE_KEY: {
            "layer_id_convention": VLLM_LAYER_ID_CONVENTION,
            "aux_layer_ids": [int(i) for i in our_aux_ids],
            "aux_layer_ids_convention": LAYER_ID_CONVENTION,
            "conversion": mapped.rule,
            "engine_version": mapped.engine_version,
            "target_architecture": target.architecture,
            "vocab_maps": "d2t/t2d included" if with_maps else "left out: draft vocab == target vocab (vLLM "
                                                               "refuses d2t then)",
        },
    }
    save_file(out, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n")
    return {"eagle_aux_hidden_state_layer_ids": ids, "rule": mapped.rule, "engine_version": mapped.engine_version,
            "vocab_maps": with_maps, "dtype": cfg.torch_dtype}


def check_vllm_export(out_dir: str | Path, sglang_dir: str | Path, target: TargetInfo,
                      our_aux_ids: list[int], vllm_version: str = READ_VERSIONS["vllm"]) -> list[str]:
    """Every problem with the vLLM export read back, against the (checked) SGLang export."""
    from safetensors.torch import load_file

    out_dir, sglang_dir = Path(out_dir), Path(sglang_dir)
    try:
        data = json.loads((out_dir / CONFIG_FILE).read_text())
        tensors = load_file(str(out_dir / WEIGHTS_FILE))
    except Exception as err:
        return [f"vLLM export unreadable: {err}"]
    problems = []
    if data.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type={data.get('speculators_model_type')!r}, expected 'eagle3'")
    spec = data.get("speculators_config") or {}
    verifier = (spec.get("verifier") or {}).get("name_or_path")
    if not verifier or not (Path(verifier) / "config.json").is_file():
        problems.append(f"speculators_config.verifier.name_or_path={verifier!r} is not a local target directory "
                        "(offline loading fails)")
    if not spec.get("proposal_methods"):
        problems.append("speculators_config.proposal_methods is empty")
    want = vllm_layer_ids(our_aux_ids, target.architecture, vllm_version).ids
    if data.get("eagle_aux_hidden_state_layer_ids") != want:
        problems.append(f"eagle_aux_hidden_state_layer_ids={data.get('eagle_aux_hidden_state_layer_ids')}, expected "
                        f"{want} (our {list(our_aux_ids)} + 1: vLLM counts the input of layer i)")
    sglang_cfg = Eagle3DraftConfig.load(sglang_dir / CONFIG_FILE)
    for flag, value in norm_flags(sglang_cfg).items():
        if data.get(flag) is not value:
            problems.append(f"{flag}={data.get(flag)!r}, expected {value} (the drafter is {sglang_cfg.drafter}; "
                            "vLLM's default for a missing norm_before_residual is true)")
    layer = data.get("transformer_layer_config") or {}
    if layer.get("vocab_size") != target.vocab_size:
        problems.append(f"transformer_layer_config.vocab_size={layer.get('vocab_size')}, expected {target.vocab_size}")
    sglang = load_file(str(sglang_dir / WEIGHTS_FILE))
    with_maps = data.get("draft_vocab_size") != target.vocab_size
    expected = {vllm_key(k): v for k, v in sglang.items() if with_maps or k not in ("d2t", "t2d")}
    missing, unknown = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"vLLM export misses keys: {missing}")
    if unknown:
        problems.append(f"vLLM export has unexpected keys: {unknown}")
    for key in sorted(set(expected) & set(tensors)):
        if tensors[key].shape != expected[key].shape or not torch.equal(tensors[key], expected[key]):
            problems.append(f"{key}: differs from the SGLang export's {key.replace('layers.0.', 'midlayer.')}")
    if EMBED_KEY not in tensors:
        problems.append(f"{EMBED_KEY} missing: vLLM does not swap in the target's embedding")
    return problems
