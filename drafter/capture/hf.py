"""The `hf` capture backend: run the target (transformers) over token sequences and capture, per
token, what EAGLE-3 trains on: the outputs of the three aux layers and the final hidden state
(after the final norm, the input of lm_head).

Layer ids follow drafter.config.LAYER_ID_CONVENTION (id i = output of decoder layer i = Hugging
Face `hidden_states[i + 1]`); loading and the range check are drafter.target's, so the serving
and dump paths cannot drift apart.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from drafter.capture.base import CaptureShape
from drafter.layers import check_aux_layer_ids
from drafter.target import HFTarget, aux_from_hidden_states


@dataclass
class CaptureModel(CaptureShape):
    model: torch.nn.Module      # the CausalLM (hooks for tests go on it)


# transformers' from_pretrained is not thread-safe (its meta-device init patches torch globally:
# two concurrent loads failed with "Cannot copy out of meta tensor" on 2 GPUs): one load at a time.
_LOAD_LOCK = threading.Lock()


def load_capture_model(model_path: str, device: torch.device, dtype: torch.dtype,
                       aux_layer_ids: list[int], trust_remote_code: bool = False) -> CaptureModel:
    with _LOAD_LOCK:
        target = HFTarget(model_path, device=str(device), dtype=dtype, trust_remote_code=trust_remote_code)
    ids = check_aux_layer_ids(aux_layer_ids, target.num_layers)
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    return CaptureModel(model=target.model, tokenizer=tok, device=target.device, dtype=target.dtype,
                        aux_layer_ids=ids, num_layers=target.num_layers, hidden_size=target.hidden_size,
                        pad_id=int(pad))


def warm_up_device(device: torch.device, dtype: torch.dtype) -> None:
    """First use of a GPU's matmul and attention kernels, from the calling (main) thread.

    Measured on 2 x H200: when two worker threads made the first CUDA calls of their devices at the
    same time, the first shard of one worker differed from a one-GPU run by 1-2 bf16 ulps (4 of 4
    fresh processes); with this warm-up first, 2 of 2 were byte-identical. Cheap, so always done."""
    if device.type != "cuda":
        return
    a = torch.randn(64, 64, device=device, dtype=dtype)
    q = torch.randn(1, 4, 16, 16, device=device, dtype=dtype)
    (a @ a).sum().item()
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().item()


@torch.inference_mode()
def capture_batch(cm: CaptureModel, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: (aux [T, 3, H], final [T, H]) on the model's device, padding removed.

    Right padding without an attention mask: under causal attention a real token never sees the
    pads after it, so its states equal an unpadded run's up to float rounding of the longer kernels,
    and SDPA keeps its is_causal fast path. The decoder runs without lm_head (no logits needed).
    """
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), cm.pad_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    decoder = cm.model.get_decoder() if hasattr(cm.model, "get_decoder") else cm.model
    if cm.device.type == "cuda":  # pinned + async: the host does not wait for the device's queue
        ids = ids.pin_memory().to(cm.device, non_blocking=True)
    out = decoder(input_ids=ids.to(cm.device), use_cache=False, output_hidden_states=True)
    hidden = out.hidden_states
    if len(hidden) != cm.num_layers + 1:
        raise RuntimeError(f"expected {cm.num_layers + 1} hidden states (embeddings + one per layer), "
                           f"got {len(hidden)}: cannot map layer ids safely")
    aux = aux_from_hidden_states(hidden, cm.aux_layer_ids)
    final = out.last_hidden_state  # = hidden[-1]: after the final norm
    return [(aux[row, :len(seq)], final[row, :len(seq)]) for row, seq in enumerate(sequences)]
