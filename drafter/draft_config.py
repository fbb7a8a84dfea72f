"""The EAGLE-3 drafter's config.json as SGLang reads it (`Eagle3DraftConfig`, contract section 1),
the checkpoint keys that go with it (`EXPECTED_KEYS`) and the file names of a drafter directory.

No network here: `drafter.model` builds the drafter from this config.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from drafter.eagle31 import DRAFTERS
from drafter.errors import DrafterError
from drafter.layers import LAYER_ID_CONVENTION, default_aux_layer_ids

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Keys the drafter may carry but SGLang does not need: it swaps in the target's embedding.
OPTIONAL_KEYS = ("embed_tokens.weight",)
NUM_AUX = 3  # captured hidden states: fc reads 3 x target_hidden_size, fc_norm has one norm each


class DrafterCheckpointError(DrafterError, ValueError):
    """A drafter directory that must not be served or exported (names every problem)."""


@dataclass
class Eagle3DraftConfig:
    """The fields SGLang reads from an EAGLE-3 draft config.json (contract section 1)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    # None = SGLang's default for the target's depth (resolved with `resolved_aux_layer_ids`).
    aux_layer_ids: list[int] | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    head_dim: int | None = None  # None = hidden_size // num_attention_heads
    hidden_act: str = "silu"
    num_hidden_layers: int = 1
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    layer_id_convention: str = LAYER_ID_CONVENTION
    # EAGLE 3.1 (DRAFTERS): an RMSNorm on each captured hidden state before fc, and the post-norm
    # hidden state fed to the next draft step. Written to config.json only when true, so an eagle3
    # config stays byte for byte what it was.
    fc_norm: bool = False
    norm_output: bool = False
    # Fields we do not interpret (bos/eos ids, pretraining_tp, ...) survive a round trip.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        problems = []
        if self.num_hidden_layers != 1:
            problems.append(f"num_hidden_layers={self.num_hidden_layers}: only the single-midlayer "
                            "EAGLE-3 drafter is supported")
        if self.tie_word_embeddings:
            problems.append("tie_word_embeddings must be false (SGLang would tie lm_head to the "
                            "draft embedding)")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act={self.hidden_act!r}: only 'silu' is supported")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            problems.append(f"draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size "
                            f"({self.vocab_size})")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            problems.append(f"eagle_aux_hidden_state_layer_ids must hold 3 ids, got {self.aux_layer_ids}")
        if self.layer_id_convention != LAYER_ID_CONVENTION:
            problems.append(f"layer_id_convention={self.layer_id_convention!r}, expected "
                            f"{LAYER_ID_CONVENTION!r} (id i = output of decoder layer i = HF "
                            "hidden_states[i + 1])")
        if self.rope_scaling and rope_type(self.rope_scaling) not in ("default", "linear", "llama3"):
            problems.append(f"rope_scaling type {rope_type(self.rope_scaling)!r} is not supported")
        if problems:
            raise DrafterCheckpointError("invalid EAGLE-3 draft config: " + "; ".join(problems))

    @property
    def drafter(self) -> str:
        """The variant's name in DRAFTERS ("eagle3", "eagle3.1"), or the flags when they match none."""
        flags = {"fc_norm": self.fc_norm, "norm_output": self.norm_output}
        return next((name for name, f in DRAFTERS.items() if f == flags), f"eagle3 {flags}")

    def resolved_aux_layer_ids(self, target_num_layers: int) -> list[int]:
        """The ids to capture; without the field SGLang uses its default for the target depth."""
        if self.aux_layer_ids is not None:
            return list(self.aux_layer_ids)
        return default_aux_layer_ids(target_num_layers)

    def to_json_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out.update({
            "architectures": [ARCHITECTURE],
            "model_type": "llama",  # SGLang reads the config through transformers' AutoConfig
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": self.torch_dtype,
            "eagle_config": {"use_aux_hidden_state": True},
            "layer_id_convention": self.layer_id_convention,
        })
        if self.aux_layer_ids is not None:
            out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        for flag in ("fc_norm", "norm_output"):
            if getattr(self, flag):
                out[flag] = True
        return out

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> "Eagle3DraftConfig":
        data = dict(data)
        archs = data.pop("architectures", None) or []
        if ARCHITECTURE not in archs:
            raise DrafterCheckpointError(
                f"config.json architectures={archs}: expected [{ARCHITECTURE!r}] (SGLang picks the "
                "draft class from it)")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
                   if k not in data]
        if missing:
            raise DrafterCheckpointError(f"config.json lacks required fields: {missing}")
        eagle = data.pop("eagle_config", None) or {}
        if eagle.get("use_aux_hidden_state") is False:
            raise DrafterCheckpointError("eagle_config.use_aux_hidden_state is false: not an EAGLE-3 drafter")
        rope_theta, rope_scaling = rope_settings(data)
        hidden = data.pop("hidden_size")
        vocab = data.pop("vocab_size")
        heads = data.pop("num_attention_heads")
        for key in ("model_type", "attention_bias", "mlp_bias", "dtype", "rope_theta", "rope_scaling",
                    "rope_parameters"):
            data.pop(key, None)
        known = dict(
            hidden_size=hidden,
            intermediate_size=data.pop("intermediate_size"),
            num_attention_heads=heads,
            num_key_value_heads=data.pop("num_key_value_heads", None) or heads,
            vocab_size=vocab,
            # Without draft_vocab_size SGLang uses the full target vocab.
            draft_vocab_size=data.pop("draft_vocab_size", None) or vocab,
            target_hidden_size=data.pop("target_hidden_size", None) or hidden,
            aux_layer_ids=eagle.get("eagle_aux_hidden_state_layer_ids"),
            rms_norm_eps=data.pop("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=data.pop("max_position_embeddings", 2048),
            head_dim=data.pop("head_dim", None),
            hidden_act=data.pop("hidden_act", "silu"),
            num_hidden_layers=data.pop("num_hidden_layers", 1),
            tie_word_embeddings=data.pop("tie_word_embeddings", False),
            torch_dtype=data.pop("torch_dtype", None) or "float32",
            layer_id_convention=data.pop("layer_id_convention", LAYER_ID_CONVENTION),
            fc_norm=bool(data.pop("fc_norm", False)),
            norm_output=bool(data.pop("norm_output", False)),
        )
        return cls(**known, extra=data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Eagle3DraftConfig":
        return cls.from_json_dict(json.loads(Path(path).read_text()))


def rope_type(scaling: dict[str, Any]) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a Llama config.json, also in transformers 5's spelling
    (`rope_parameters`, which counts as scaling only when its type is not 'default')."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return config.get("rope_theta") or params.get("rope_theta", 10000.0), scaling


def EXPECTED_KEYS(config: Eagle3DraftConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Every required checkpoint key -> (shape, dtype or None for 'any float dtype')."""
    h, ht, hd = config.hidden_size, config.target_hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size
    fc_norm = {f"fc_norm.{i}.weight": ((ht,), None) for i in range(NUM_AUX)} if config.fc_norm else {}
    return {
        **fc_norm,
        "fc.weight": ((h, 3 * ht), None),
        "midlayer.input_layernorm.weight": ((h,), None),
        "midlayer.hidden_norm.weight": ((h,), None),
        "midlayer.post_attention_layernorm.weight": ((h,), None),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * h), None),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * h), None),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * h), None),
        "midlayer.self_attn.o_proj.weight": ((h, q), None),
        "midlayer.mlp.gate_proj.weight": ((inter, h), None),
        "midlayer.mlp.up_proj.weight": ((inter, h), None),
        "midlayer.mlp.down_proj.weight": ((h, inter), None),
        "norm.weight": ((h,), None),
        "lm_head.weight": ((config.draft_vocab_size, h), None),
        "d2t": ((config.draft_vocab_size,), torch.int64),
        "t2d": ((config.vocab_size,), torch.bool),
    }
