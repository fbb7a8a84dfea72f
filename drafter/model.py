"""The EAGLE-3 drafter: ONE definition for training, export and the reference server.

Layout and math follow SGLang's `LlamaForCausalLMEagle3` (python/sglang/srt/models/llama_eagle3.py),
so a checkpoint saved here loads there key for key (contract section 1):

    hidden = fc(concat(aux_low, aux_mid, aux_high))   only when the incoming width is 3 * H_target
    x      = concat(input_layernorm(embed(token)), hidden_norm(hidden))      -> [.., 2H]
    h      = hidden + o_proj(attn(q/k/v_proj(x)))      attention over the drafter's own KV cache
    h      = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                          over the DRAFT vocab; d2t maps ids back
    h (before `norm`) is the hidden state fed to the next draft step.

EAGLE 3.1 (`config.fc_norm`, `config.norm_output`; `train.drafter: eagle3.1`) changes two lines:
    hidden = fc(concat(fc_norm[0](aux_low), fc_norm[1](aux_mid), fc_norm[2](aux_high)))
    norm(h) (after `norm`) is the hidden state fed to the next draft step
Read in the engines' source: vLLM 0.32.0 vllm/model_executor/models/llama_eagle3.py (fc_norm: one
RMSNorm(target_hidden_size) per aux state, l.231-240, applied chunk by chunk before fc in
combine_hidden_states, l.409-418; norm_output: `aux_output = hidden_states if self.norm_output else
hidden_prenorm`, l.283-286; both flags from the speculators config, transformers_utils/configs/
speculators/algos.py l.37-38), SGLang 0.5.23 sglang/srt/models/llama_eagle3.py (fc_norm: RMSNorm(target
hidden) per aux state, l.184-196 and 240-247; norm_output: `aux = hidden_states_to_logits if
self.norm_output`, l.263-269), speculators 0.9.0 models/eagle3/core.py (l.130-141, 238-243, 302-304).
All three name the weights `fc_norm.{i}.weight` and keep the residual = the incoming (un-normed) hidden.

At position p the drafter sees the token at p+1 and the target's features at p, and predicts the
token at p+2: the caller shifts tokens by one (see drafter/engines/reference/speculative.py).

Pure torch (no transformers import) so training and serving on any device share it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# The config and the file layout live in drafter.draft_config; imported from here as before.
from drafter.draft_config import (
    ARCHITECTURE, CONFIG_FILE, DRAFTERS, EXPECTED_KEYS, NUM_AUX, OPTIONAL_KEYS, WEIGHTS_FILE, DrafterCheckpointError,
    Eagle3DraftConfig, rope_settings, rope_type)
from drafter.dtypes import dtype_of
from drafter.layers import check_aux_layer_ids, default_aux_layer_ids

__all__ = ["ARCHITECTURE", "CONFIG_FILE", "DRAFTERS", "WEIGHTS_FILE", "OPTIONAL_KEYS", "EXPECTED_KEYS", "DrafterCheckpointError",
           "Eagle3DraftConfig", "RMSNorm", "rope_inv_freq", "apply_rope", "DraftKVCache", "Eagle3Attention",
           "Eagle3MLP", "Eagle3MidLayer", "Eagle3Drafter", "ttt_attention_mask", "check_drafter_weights",
           "load_drafter", "save_drafter", "read_target_config", "draft_config_for_target", "set_draft_vocab",
           "init_random_drafter"]

# --------------------------------------------------------------------------- building blocks

class RMSNorm(nn.Module):
    """Llama RMSNorm: statistics in float32, result back in the input dtype, then the weight."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(config: Eagle3DraftConfig) -> torch.Tensor:
    """Inverse frequencies for the config's rope_theta, with linear / llama3 scaling."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = rope_type(scaling) if scaling else "default"
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short kept, smooth blend in between.
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_ctx / low, inv / factor,
                          torch.where(wavelen < old_ctx / high, inv, blended))
    return inv.float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, D] for positions [B, T] (float32 math, then `dtype`)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2], float32 always
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]                           # [B, 1, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE with precomputed cos/sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; positions: [B, T]. HF's rotate-half convention."""
    return rotate(x, *rope_cos_sin(positions, inv_freq, x.dtype))


class DraftKVCache:
    """Keys/values of the drafter's attention; grows by draft steps, cropped on rejection."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [B, kv_heads, T, D], after RoPE
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (drops rejected / speculative entries)."""
        if self.k is not None and length < len(self):
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3DraftConfig):
        super().__init__()
        hd = config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        # q/k/v read concat(embedding, hidden): 2 * hidden inputs.
        self.q_proj = nn.Linear(2 * config.hidden_size, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, config.hidden_size, bias=False)
        # A plain attribute, not a buffer: `.to(bfloat16)` must not round the frequencies.
        self.inv_freq = rope_inv_freq(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: DraftKVCache | None,
                attn_mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        # One cos/sin for q and k, and SDPA's own GQA instead of repeating k/v: the same numbers
        # (tests/core/test_model.py), fewer ops on the serving path, where a draft step's cost decides
        # whether speculation pays.
        cos, sin = rope_cos_sin(positions, self.inv_freq, q.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        past = 0 if cache is None else len(cache)
        if cache is not None:
            k, v = cache.append(k, v)
        if attn_mask is None and t > 1:
            # Causal over [cache + new]: new query i sees keys 0 .. past + i.
            attn_mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3MidLayer(nn.Module):
    """A Llama decoder layer whose attention reads [normed embedding, normed hidden]."""

    def __init__(self, config: Eagle3DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: DraftKVCache | None, attn_mask: torch.Tensor | None) -> torch.Tensor:
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        h = hidden + self.self_attn(x, positions, cache, attn_mask)  # residual = incoming hidden
        return h + self.mlp(self.post_attention_layernorm(h))


# --------------------------------------------------------------------------- the drafter

class Eagle3Drafter(nn.Module):
    """SGLang `LlamaForCausalLMEagle3` layout; parameter names are the checkpoint keys."""

    def __init__(self, config: Eagle3DraftConfig, with_embedding: bool = False):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        # EAGLE 3.1: one norm per captured hidden state (per layer, not one over the concatenation).
        self.fc_norm = (nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in range(NUM_AUX))
                        if config.fc_norm else None)
        self.midlayer = Eagle3MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # Optional: SGLang replaces it with the target's embedding when hidden sizes match.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if with_embedding else None
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    # The pieces, separately usable by training (which unrolls steps itself).
    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """fc over concat(aux) from the target; the drafter's own hidden passes unchanged."""
        if hidden.shape[-1] == self.config.hidden_size:  # SGLang's test: width == embedding width
            return hidden
        if hidden.shape[-1] != 3 * self.config.target_hidden_size:
            raise ValueError(f"hidden width {hidden.shape[-1]}: expected 3 x target_hidden_size "
                             f"({3 * self.config.target_hidden_size}) or hidden_size ({self.config.hidden_size})")
        if self.fc_norm is not None:
            hidden = torch.cat([norm(x) for norm, x in zip(self.fc_norm, hidden.chunk(NUM_AUX, dim=-1))], dim=-1)
        return self.fc(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits from the pre-norm hidden state."""
        return self.lm_head(self.norm(hidden))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """d2t holds offsets: target_id = draft_id + d2t[draft_id]."""
        return draft_ids + self.d2t[draft_ids]

    def forward(self, input_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None,
                cache: DraftKVCache | None = None, attn_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter pass over T positions.

        input_embeds [B, T, H]: embeddings of the token at p+1 (the target's embedding table).
        hidden [B, T, 3*H_target] (target aux features at p) or [B, T, H] (drafter's own output).
        positions [B, T]: RoPE positions (default: continue after the cache).
        attn_mask: optional bool [B or 1, 1, T, past+T], True = may attend (default causal).
        Returns (draft-vocab logits [B, T, V_draft], the hidden [B, T, H] for the next step: pre-norm,
        or post-norm with config.norm_output).
        """
        b, t, _ = input_embeds.shape
        if positions is None:
            past = 0 if cache is None else len(cache)
            positions = torch.arange(past, past + t, device=input_embeds.device).expand(b, t)
        h = self.midlayer(input_embeds, self.project(hidden), positions, cache, attn_mask)
        normed = self.norm(h)
        return self.lm_head(normed), (normed if self.config.norm_output else h)


def ttt_attention_mask(seq_len: int, step: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Mask for training-time-test step `step` (0-based) over a cache of (step + 1) * seq_len keys.

    Step 0 is the ordinary causal pass over target features. At step k every row t also sees its
    own unrolled keys from steps 1..k (a diagonal per step): exactly the keys a serving draft
    step k from position t sees (the prefix 0..t plus its own drafts). Call the drafter with
    positions = arange(seq_len) + step and the same DraftKVCache across steps.
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    eye = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


# --------------------------------------------------------------------------- checkpoints

def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise DrafterCheckpointError(f"{directory}: no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for key, value in load_file(str(f)).items():
            if key in tensors:
                raise DrafterCheckpointError(f"{directory}: key {key!r} appears in more than one shard")
            tensors[key] = value
    return tensors


def check_drafter_weights(config: Eagle3DraftConfig, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Every problem with a checkpoint's keys, shapes, dtypes and vocab maps (empty = loadable)."""
    expected = EXPECTED_KEYS(config)
    problems = []
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected) - set(OPTIONAL_KEYS))
    if missing:
        problems.append(f"missing keys: {missing}")
    if unknown:
        hint = ""
        if any(k.startswith("model.") and k[6:] in expected for k in unknown):
            hint = " (strip the 'model.' prefix: SGLang's names are relative to the drafter)"
        problems.append(f"unknown keys (SGLang would silently drop them): {unknown}{hint}")
    shapes = dict(expected)
    shapes["embed_tokens.weight"] = ((config.vocab_size, config.hidden_size), None)
    for key, tensor in sorted(tensors.items()):
        if key not in shapes:
            continue
        shape, dtype = shapes[key]
        if tuple(tensor.shape) != shape:
            problems.append(f"{key}: shape {list(tensor.shape)}, expected {list(shape)}")
        elif dtype is not None and tensor.dtype != dtype:
            problems.append(f"{key}: dtype {tensor.dtype}, expected {dtype}")
        elif dtype is None and not tensor.is_floating_point():
            problems.append(f"{key}: dtype {tensor.dtype}, expected a floating point dtype")
    if not problems:
        problems += _vocab_map_problems(config, tensors["d2t"], tensors["t2d"])
    return problems


def _vocab_map_problems(config: Eagle3DraftConfig, d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    target_ids = torch.arange(config.draft_vocab_size) + d2t
    if target_ids.min() < 0 or target_ids.max() >= config.vocab_size:
        return [f"d2t maps draft ids outside the target vocab 0..{config.vocab_size - 1} "
                "(d2t must hold offsets: target_id = draft_id + d2t[draft_id])"]
    if len(set(target_ids.tolist())) != config.draft_vocab_size:
        return ["d2t maps two draft ids to the same target id"]
    in_draft = torch.zeros(config.vocab_size, dtype=torch.bool)
    in_draft[target_ids] = True
    if not torch.equal(in_draft, t2d):
        return [f"t2d disagrees with d2t on {int((in_draft != t2d).sum())} target ids"]
    return []


def load_drafter(directory: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> Eagle3Drafter:
    """Load an SGLang-format drafter, refusing anything SGLang would half-load."""
    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file():
        raise DrafterCheckpointError(f"{directory}: no {CONFIG_FILE}")
    config = Eagle3DraftConfig.load(directory / CONFIG_FILE)
    tensors = _read_weights(directory)
    problems = check_drafter_weights(config, tensors)
    if problems:
        raise DrafterCheckpointError(f"{directory}: not a loadable EAGLE-3 drafter:\n  " + "\n  ".join(problems))
    model = Eagle3Drafter(config, with_embedding="embed_tokens.weight" in tensors)
    model.load_state_dict(tensors, strict=True)
    dtype = dtype or dtype_of(config.torch_dtype)
    return model.to(device=device, dtype=dtype).eval()  # .to(dtype) leaves int/bool buffers alone


def save_drafter(model: Eagle3Drafter, directory: str | Path) -> Path:
    """Write config.json + model.safetensors in the layout SGLang loads."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    problems = check_drafter_weights(model.config, tensors)
    if problems:
        raise DrafterCheckpointError("refusing to save an inconsistent drafter:\n  " + "\n  ".join(problems))
    model.config.torch_dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    model.config.save(directory / CONFIG_FILE)
    return directory


def read_target_config(target_dir: str | Path) -> dict[str, Any]:
    """The text model's config.json of a Hugging Face target (multimodal configs nest it)."""
    data = json.loads((Path(target_dir) / "config.json").read_text())
    return data.get("text_config", data)


def draft_config_for_target(target: dict[str, Any], aux_layer_ids: list[int] | None = None,
                            draft_vocab_size: int | None = None, drafter: str = "eagle3") -> Eagle3DraftConfig:
    """A drafter config shaped like the target's layers (what SpecForge does by default); `drafter`
    names the variant (DRAFTERS: eagle3, eagle3.1)."""
    layers = target["num_hidden_layers"]
    ids = default_aux_layer_ids(layers) if aux_layer_ids is None else aux_layer_ids
    ids = check_aux_layer_ids(ids, layers)  # the serving target's check: it must capture them
    vocab = target["vocab_size"]
    rope_theta, rope_scaling = rope_settings(target)
    return Eagle3DraftConfig(
        hidden_size=target["hidden_size"],
        intermediate_size=target["intermediate_size"],
        num_attention_heads=target["num_attention_heads"],
        num_key_value_heads=target.get("num_key_value_heads") or target["num_attention_heads"],
        head_dim=target.get("head_dim"),
        vocab_size=vocab,
        draft_vocab_size=min(draft_vocab_size or vocab, vocab),
        target_hidden_size=target["hidden_size"],
        aux_layer_ids=ids,
        rms_norm_eps=target.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=target.get("max_position_embeddings", 2048),
        **DRAFTERS[drafter],
    )


def set_draft_vocab(model: Eagle3Drafter, target_ids: torch.Tensor) -> None:
    """Fill d2t/t2d from the sorted target ids making up the draft vocab."""
    target_ids = torch.as_tensor(target_ids, dtype=torch.int64).sort().values
    if len(target_ids) != model.config.draft_vocab_size:
        raise ValueError(f"{len(target_ids)} ids for a draft vocab of {model.config.draft_vocab_size}")
    model.d2t.copy_(target_ids - torch.arange(len(target_ids)))
    model.t2d.zero_()
    model.t2d[target_ids] = True


def init_random_drafter(target_dir: str | Path, out_dir: str | Path, aux_layer_ids: list[int] | None = None,
                        draft_vocab_size: int | None = None, seed: int = 0, drafter: str = "eagle3") -> Path:
    """A randomly initialised drafter for `target_dir`, saved in SGLang format at `out_dir`.

    The draft vocab is the first `draft_vocab_size` target ids (good enough for a random drafter;
    trained drafters use the most frequent ones).
    """
    target = read_target_config(target_dir)
    config = draft_config_for_target(target, aux_layer_ids, draft_vocab_size, drafter)
    gen = torch.Generator().manual_seed(seed)
    model = Eagle3Drafter(config)
    std = float(target.get("initializer_range", 0.02))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    set_draft_vocab(model, torch.arange(config.draft_vocab_size))
    return save_drafter(model, out_dir)
