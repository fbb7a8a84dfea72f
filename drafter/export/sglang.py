"""The SGLang export: `config.json` (LlamaForCausalLMEagle3) + `model.safetensors`, checked by
reading the files back (contract sections 1, 2 and 8 of sglang-eagle3-contract.md).

SGLang silently drops unknown keys and silently falls back to defaults for missing config fields,
so an export is only trusted after `check_sglang_export` has compared every key, shape and value
with what SGLang loads and with the trained drafter it came from.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from drafter.eagle31 import FLAGS as EAGLE31_FLAGS
from drafter.eagle31 import eagle31_engine_problem, flags_kind
from drafter.errors import DrafterError
from drafter.hashing import short_hash
from drafter.layers import LAYER_ID_CONVENTION, READ_VERSIONS, EngineLayerIds, UnknownLayerIdRule, engine_layer_ids
from drafter.model import (
    ARCHITECTURE, CONFIG_FILE, EXPECTED_KEYS, WEIGHTS_FILE, Eagle3DraftConfig, Eagle3Drafter, check_drafter_weights)

EMBED_KEY = "embed_tokens.weight"
# Fields SGLang's LlamaForCausalLMEagle3 reads from the draft config.json (contract section 1).
SGLANG_CONFIG_FIELDS = (
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "vocab_size",
    "draft_vocab_size", "target_hidden_size", "tie_word_embeddings", "rope_theta", "rope_scaling",
    "max_position_embeddings", "eagle_config")
EAGLE_CONFIG_FIELDS = ("use_aux_hidden_state", "eagle_aux_hidden_state_layer_ids")
# Where we record our own ids in an engine's config (next to the ids the engine reads).
PROVENANCE_KEY = "drafter_lifecycle"

class ExportError(DrafterError):
    """An export that must not be served. Never retried: the same inputs give the same export."""

    retryable = False


class ExportCheckFailed(ExportError, ValueError):
    """The files read back differ from what the engine loads or from the trained drafter; the
    message lists every problem."""


def sglang_layer_ids(our_ids: list[int], target_architecture: str, sglang_version: str = READ_VERSIONS["sglang"]
                     ) -> EngineLayerIds:
    """The ids to write into an SGLang draft config (drafter.layers.engine_layer_ids), an unknown
    combination refused as an ExportError naming it."""
    try:
        return engine_layer_ids(our_ids, "sglang", sglang_version, target_architecture)
    except UnknownLayerIdRule as err:
        raise ExportError(str(err)) from None


def draft_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids of the draft vocab (d2t holds offsets: target = draft + d2t[draft])."""
    return torch.arange(len(d2t), dtype=torch.int64) + d2t.to(torch.int64).cpu()


def draft_vocab_hash(d2t: torch.Tensor) -> str:
    """16 hex chars naming the draft vocab (its sorted target ids)."""
    return short_hash(",".join(str(i) for i in draft_target_ids(d2t).tolist()))


# --------------------------------------------------------------------------- the target's side

@dataclass
class TargetInfo:
    """What the export needs from the target directory (no model load)."""

    path: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    config: dict

    @classmethod
    def read(cls, target_dir: str | Path) -> "TargetInfo":
        data = json.loads((Path(target_dir) / "config.json").read_text())
        text = data.get("text_config", data)
        arch = (data.get("architectures") or ["?"])[0]
        return cls(path=str(Path(target_dir).resolve()), architecture=arch, num_layers=int(text["num_hidden_layers"]),
                   hidden_size=int(text["hidden_size"]), vocab_size=int(text["vocab_size"]), config=text)

    def embedding(self) -> torch.Tensor:
        """The target's input embedding [vocab, hidden], read from its safetensors files."""
        from safetensors import safe_open

        files = sorted(Path(self.path).glob("*.safetensors"))
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                keys = [k for k in fh.keys() if k.endswith("embed_tokens.weight") and "mtp" not in k]
                if keys:
                    return fh.get_tensor(sorted(keys, key=len)[0])
        raise ExportError(f"target {self.path}: no '*embed_tokens.weight' in {[f.name for f in files]}: "
                          "cannot export the target embedding (vLLM does not swap it in)")


# --------------------------------------------------------------------------- writing

def refuse_old_engine(config: Eagle3DraftConfig, engine: str, version: str) -> None:
    """An EAGLE 3.1 drafter is not written for an engine version that may ignore its flags."""
    if (problem := eagle31_engine_problem(flags_kind(config), engine, version)) is not None:
        raise ExportError(f"export.{engine}_version: {problem}")


def write_sglang(drafter: Eagle3Drafter, target: TargetInfo, out_dir: str | Path,
                 our_aux_ids: list[int], sglang_version: str = READ_VERSIONS["sglang"]) -> dict[str, Any]:
    """Write the SGLang-format directory; returns what was written (ids, rule, dtype)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mapped = sglang_layer_ids(our_aux_ids, target.architecture, sglang_version)
    refuse_old_engine(drafter.config, "sglang", sglang_version)
    ids, rule = mapped.ids, mapped.rule
    dtype = drafter.lm_head.weight.dtype
    tensors = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items() if k != EMBED_KEY}
    tensors[EMBED_KEY] = target.embedding().to(dtype).contiguous()
    cfg = Eagle3DraftConfig.from_json_dict(drafter.config.to_json_dict())
    cfg.aux_layer_ids = ids
    cfg.torch_dtype = str(dtype).removeprefix("torch.")
    data = cfg.to_json_dict()
    data[PROVENANCE_KEY] = {"aux_layer_ids": [int(i) for i in our_aux_ids], "layer_id_convention": LAYER_ID_CONVENTION,
                            "sglang_layer_ids_rule": rule, "target_architecture": target.architecture,
                            "engine_version": mapped.engine_version}
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n")
    return {"eagle_aux_hidden_state_layer_ids": ids, "rule": rule, "engine_version": mapped.engine_version,
            "dtype": cfg.torch_dtype}


# --------------------------------------------------------------------------- checking (read back)

def _shift_hint(got: list[int], want: list[int]) -> str:
    if len(got) == len(want) and all(g - w == 1 for g, w in zip(got, want)):
        return " (shifted by +1: vLLM's 'input of layer i' ids written into an SGLang config)"
    if len(got) == len(want) and all(w - g == 1 for g, w in zip(got, want)):
        return " (shifted by -1)"
    return ""


def check_sglang_export(out_dir: str | Path, source: Eagle3Drafter, target: TargetInfo,
                        our_aux_ids: list[int], sglang_version: str = READ_VERSIONS["sglang"]) -> list[str]:
    """Every problem with the SGLang export at `out_dir`, read back from disk, against what SGLang
    loads (keys, shapes, config fields), the trained drafter `source` (every tensor, the draft
    vocab) and the target (vocab, hidden size, embedding, layer ids). Empty = good."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    try:
        data = json.loads((out_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError) as err:
        return [f"{CONFIG_FILE}: unreadable ({err})"]
    problems = _config_problems(data, source, target, our_aux_ids, sglang_version)
    try:
        tensors = load_file(str(out_dir / WEIGHTS_FILE))
    except Exception as err:  # safetensors raises its own error types
        return problems + [f"{WEIGHTS_FILE}: unreadable ({err})"]
    try:
        cfg = Eagle3DraftConfig.from_json_dict(data)
    except DrafterError as err:
        return problems + [str(err)]
    problems += _layout_problems(tensors, cfg, source, target)
    if problems:
        return problems
    problems += check_drafter_weights(cfg, tensors)  # dtypes, d2t/t2d consistency
    return problems + _value_problems(tensors, source, target)


def _config_problems(data: dict, source: Eagle3Drafter, target: TargetInfo, our_aux_ids: list[int],
                     sglang_version: str) -> list[str]:
    """The config.json fields SGLang reads: present, the layer ids for this engine version, and the
    shape of the trained drafter and the target."""
    problems: list[str] = []
    missing = [f for f in SGLANG_CONFIG_FIELDS if f not in data]
    eagle = data.get("eagle_config") or {}
    missing += [f"eagle_config.{f}" for f in EAGLE_CONFIG_FIELDS if f not in eagle]
    if missing:
        problems.append(f"{CONFIG_FILE} lacks fields SGLang reads (it would fall back to defaults): {missing}")
    if data.get("architectures") != [ARCHITECTURE]:
        problems.append(f"architectures={data.get('architectures')}, expected [{ARCHITECTURE!r}]")
    want_ids = sglang_layer_ids(our_aux_ids, target.architecture, sglang_version).ids
    got_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if got_ids is not None and [int(i) for i in got_ids] != want_ids:
        problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids={got_ids}, expected {want_ids} (the drafter "
                        f"was trained on the outputs of layers {list(our_aux_ids)}, {LAYER_ID_CONVENTION})"
                        + _shift_hint([int(i) for i in got_ids], want_ids))
    if eagle.get("use_aux_hidden_state") is not True:
        problems.append(f"eagle_config.use_aux_hidden_state={eagle.get('use_aux_hidden_state')}, expected true")
    if data.get("layer_id_convention") != LAYER_ID_CONVENTION:
        problems.append(f"layer_id_convention={data.get('layer_id_convention')!r}, expected {LAYER_ID_CONVENTION!r}")
    sc = source.config
    expect_values = {"vocab_size": target.vocab_size, "target_hidden_size": target.hidden_size,
                     "hidden_size": sc.hidden_size, "intermediate_size": sc.intermediate_size,
                     "num_attention_heads": sc.num_attention_heads, "num_key_value_heads": sc.num_key_value_heads,
                     "head_dim": sc.head_dim, "num_hidden_layers": 1, "draft_vocab_size": sc.draft_vocab_size,
                     "tie_word_embeddings": False, "rms_norm_eps": sc.rms_norm_eps, "rope_theta": sc.rope_theta,
                     "max_position_embeddings": sc.max_position_embeddings}
    for key, want in expect_values.items():
        if key in data and data[key] != want:
            who = "the target" if key in ("vocab_size", "target_hidden_size") else "the trained drafter"
            problems.append(f"{CONFIG_FILE} {key}={data[key]!r}, expected {want!r} (from {who})")
    # an export of a 3.1 drafter that lost a flag loads cleanly and drafts with the wrong math
    for flag in EAGLE31_FLAGS:
        if data.get(flag, False) is not getattr(sc, flag):
            problems.append(f"{CONFIG_FILE} {flag}={data.get(flag)!r}, expected {getattr(sc, flag)} (the trained "
                            f"drafter is {sc.drafter}; SGLang reads {flag}, absent = false)")
    return problems


def _layout_problems(tensors: dict[str, torch.Tensor], cfg: Eagle3DraftConfig, source: Eagle3Drafter,
                     target: TargetInfo) -> list[str]:
    """The weights' keys and shapes against the SGLang layout (the embedding: the target's shape)."""
    problems: list[str] = []
    expected = EXPECTED_KEYS(cfg)
    missing_keys = sorted((set(expected) | {EMBED_KEY}) - set(tensors))
    unknown = sorted(set(tensors) - set(expected) - {EMBED_KEY})
    if missing_keys:
        problems.append(f"{WEIGHTS_FILE} misses keys SGLang loads: {missing_keys}")
    if unknown:
        hint = ""
        if any(k.startswith("layers.0.") for k in unknown):
            # SGLang 0.5.23's loader maps any key containing "midlayer" and also takes 'layers.0.'
            # (tests/export/test_sglang_export.py); our export writes one layout, so anything else is a mistake.
            hint = (" ('layers.0.' is the speculators/vLLM name; our SGLang export writes 'midlayer.', "
                    "though SGLang 0.5.23 loads both)")
        problems.append(f"{WEIGHTS_FILE} has keys outside the SGLang layout (SGLang silently drops keys it does "
                        f"not know): {unknown}{hint}")
    shapes = {k: shape for k, (shape, _) in expected.items()}
    shapes[EMBED_KEY] = (target.vocab_size, source.config.hidden_size)
    for key in sorted(set(tensors) & set(shapes)):
        if tuple(tensors[key].shape) != tuple(shapes[key]):
            problems.append(f"{key}: shape {list(tensors[key].shape)}, expected {list(shapes[key])}")
    return problems


def _value_problems(tensors: dict[str, torch.Tensor], source: Eagle3Drafter, target: TargetInfo) -> list[str]:
    """The values: the trained drafter's tensors (the draft vocab named), the target's embedding."""
    problems: list[str] = []
    src = {k: v.detach().cpu() for k, v in source.state_dict().items() if k != EMBED_KEY}
    d2t = tensors["d2t"]
    if not torch.any(d2t) and torch.any(src["d2t"]):
        problems.append("d2t is all zeros: every draft id would map to the first "
                        f"{len(d2t)} target ids (d2t holds offsets target = draft + d2t[draft])")
    elif not torch.equal(d2t, src["d2t"]) or not torch.equal(tensors["t2d"], src["t2d"]):
        problems.append(f"d2t/t2d: draft vocab {draft_vocab_hash(d2t)} differs from the trained drafter's "
                        f"{draft_vocab_hash(src['d2t'])} (a vocab map from another dump or run: lm_head rows "
                        "would map to the wrong target tokens)")
    for key, want in sorted(src.items()):
        if key in ("d2t", "t2d") or key not in tensors:
            continue
        if not torch.equal(tensors[key].float(), want.to(tensors[key].dtype).float()):
            problems.append(f"{key}: values differ from the trained drafter's")
    embed = target.embedding()
    if not torch.equal(tensors[EMBED_KEY].float(), embed.to(tensors[EMBED_KEY].dtype).float()):
        problems.append(f"{EMBED_KEY} is not the target's input embedding (random or from another model: "
                        "vLLM uses the draft's embedding as is)")
    return problems


def require_good(problems: list[str], what: str) -> None:
    if problems:
        raise ExportCheckFailed(f"{what}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
