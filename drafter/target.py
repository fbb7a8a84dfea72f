"""A Hugging Face causal LM as the target: logits for serving, EAGLE-3 aux features for the dump.

One wrapper for the reference engine, the speculative decoder and the hidden-state dump, so the
serving and capture paths load the target and map layer ids the same way.

Aux layer ids follow our one convention (drafter.layers.LAYER_ID_CONVENTION): id i is the OUTPUT
of decoder layer i, which is Hugging Face `hidden_states[i + 1]` (hidden_states[0] is the
embedding output). This is what SGLang captures for the draft config's ids.
"""
from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from drafter.dtypes import dtype_of, parse_dtype
from drafter.layers import check_aux_layer_ids

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config_dtype: str | None) -> torch.dtype:
    """'auto' = the checkpoint's dtype on GPU; float32 on CPU (half precision is slow there)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        return parse_dtype(dtype)
    if device.type == "cpu":
        return torch.float32
    return dtype_of(config_dtype, torch.bfloat16)


def aux_from_hidden_states(hidden_states: tuple[torch.Tensor, ...], aux_layer_ids: list[int]) -> torch.Tensor:
    """[B, L, 3, H] from HF `hidden_states` (embeddings first): id i -> hidden_states[i + 1].
    The one place the convention is turned into an index."""
    return torch.stack([hidden_states[i + 1] for i in aux_layer_ids], dim=2)


@dataclass
class TargetOutput:
    logits: torch.Tensor            # [B, T_kept, vocab] float32
    aux: torch.Tensor | None        # [B, T, 3 * hidden] concat of the aux layers' outputs


class HFTarget:
    """Causal LM + tokenizer on one device, one dtype; caller owns the KV caches."""

    def __init__(self, model_path: str | Path, device: str = "auto", dtype: str | torch.dtype = "auto",
                 aux_layer_ids: list[int] | None = None, trust_remote_code: bool = False):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.model_path = str(model_path)
        self.device = resolve_device(device)
        config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        text_config = getattr(config, "text_config", None) or config
        self.dtype = resolve_dtype(dtype, self.device, str(getattr(text_config, "dtype", None)
                                                          or getattr(text_config, "torch_dtype", None) or ""))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        # transformers >= 4.56 spells it `dtype`; older releases only know `torch_dtype`.
        dtype_kw = "dtype" if _transformers_major_minor() >= (4, 56) else "torch_dtype"
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, trust_remote_code=trust_remote_code, **{dtype_kw: self.dtype}
        ).to(self.device).eval()
        if self.device.type == "cpu":
            use_masked_gqa_sdpa(self.model)
        self.config = text_config
        self.architecture = (getattr(config, "architectures", None) or [type(self.model).__name__])[0]
        self.num_layers = int(text_config.num_hidden_layers)
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(text_config.vocab_size)
        self.max_position_embeddings = int(getattr(text_config, "max_position_embeddings", 4096))
        self.aux_layer_ids = None if aux_layer_ids is None else check_aux_layer_ids(aux_layer_ids, self.num_layers)
        self.eos_token_ids = self._eos_ids()
        # transformers 5.x renamed `past_key_values` to `cache`; use whichever this version has.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _eos_ids(self) -> set[int]:
        """The ids `generate()` stops on: generation_config first, like transformers."""
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return set()
        return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}

    def set_aux_layer_ids(self, ids: list[int]) -> None:
        self.aux_layer_ids = check_aux_layer_ids(ids, self.num_layers)

    def new_cache(self):
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            return DynamicCache()

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's input embedding (SGLang feeds it to the drafter too)."""
        return self.model.get_input_embeddings()(token_ids.to(self.device))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache, want_aux: bool = False,
                last_only: bool = False) -> TargetOutput:
        """Run input_ids [B, T] after whatever `cache` already holds; the cache grows by T."""
        input_ids = input_ids.to(self.device)
        past = cache.get_seq_length()
        positions = torch.arange(past, past + input_ids.shape[1], device=self.device)[None]
        out = self.model(input_ids=input_ids, use_cache=True, position_ids=positions.expand(input_ids.shape[0], -1),
                         output_hidden_states=want_aux, logits_to_keep=1 if last_only else 0,
                         **{self._cache_kwarg: cache})
        aux = None
        if want_aux:
            if self.aux_layer_ids is None:
                raise ValueError("aux features requested but no aux layer ids are set")
            aux = aux_from_hidden_states(out.hidden_states, self.aux_layer_ids).flatten(-2)  # [B, T, 3H]
        return TargetOutput(logits=out.logits.float(), aux=aux)


MASKED_GQA_SDPA = "drafter_masked_gqa_sdpa"


def _masked_gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, *,
                     sdpa_attention_forward, **kwargs):
    """transformers' sdpa attention, except that a masked grouped-query call (a multi-token verify
    over a KV cache) lets torch's SDPA share the KV heads (`enable_gqa`) instead of copying the whole
    cache per layer to repeat them: on CPU that copy made a 4-token verify cost ~1.4 one-token steps.
    The same numbers (tests/core/test_target.py); every other call goes to transformers' own
    (bound once at registration, not imported on every layer's call)."""
    if (getattr(module, "num_key_value_groups", 1) > 1 and attention_mask is not None and query.device.type == "cpu"
            and attention_mask.dtype == torch.bool and kwargs.get("position_bias") is None
            and kwargs.get("cache") is None and not kwargs.get("output_attentions")):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def use_masked_gqa_sdpa(model) -> bool:
    """Switch a model that runs transformers' sdpa attention to `_masked_gqa_sdpa`; False where it
    cannot be (another attention implementation, or a transformers without the interface)."""
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    AttentionInterface.register(MASKED_GQA_SDPA, functools.partial(
        _masked_gqa_sdpa, sdpa_attention_forward=sdpa_attention_forward))
    # The masks sdpa gets: without this entry transformers builds none for an unknown implementation.
    AttentionMaskInterface.register(MASKED_GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(MASKED_GQA_SDPA)
    return True


def _transformers_major_minor() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache (rejected drafts out).

    transformers < 5 takes the new length; 5.x takes a negative number of tokens to remove.
    """
    current = cache.get_seq_length()
    if length >= current:
        return
    cache.crop(length - current if _crop_takes_tokens_to_remove(type(cache)) else length)


@functools.lru_cache(maxsize=None)
def _crop_takes_tokens_to_remove(cache_type: type) -> bool:
    """Read once per cache class (not on every verify of the decode loop)."""
    params = list(inspect.signature(cache_type.crop).parameters)  # unbound: [self, <length>]
    return params[1:2] == ["tokens_to_remove"]
