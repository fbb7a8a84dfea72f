"""What every capture backend shares: the devices and dtype a dump runs on, the shape of a capture
model, and how sequences are grouped into batches."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter import dtypes
from drafter.target import resolve_device


def resolve_dtype(dump_dtype: str, target_dtype: str, device: torch.device) -> torch.dtype:
    """The first explicit setting of dump.dtype, target.dtype; else float32 on CPU (half precision
    is slow there and tests compare exactly) and bfloat16 on GPU (half the bytes, what SpecForge
    stores)."""
    return dtypes.resolve_dtype([dump_dtype, target_dtype], device)


def resolve_devices(devices: list[str]) -> list[torch.device]:
    """'auto' = every visible GPU (one worker each), else the CPU. One device type per run: the
    dtype (and so the fingerprint) must not depend on which worker computed a shard."""
    out: list[torch.device] = []
    for d in devices:
        if d == "auto":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            out += [torch.device(f"cuda:{i}") for i in range(n)] or [torch.device("cpu")]
        else:
            out.append(resolve_device(d))
    if not out:
        raise ValueError("no devices given")
    if len({d.type for d in out}) > 1:
        raise ValueError(f"devices {[str(d) for d in out]} mix device types; use one type per run")
    return out


@dataclass
class CaptureShape:
    """What every capture backend's model carries; the dump reads these (hf: drafter.capture.hf.CaptureModel,
    vllm: drafter.capture.vllm.VLLMCaptureModel)."""

    tokenizer: object           # hf: this worker's own copy, HF fast tokenizers are not thread-safe
    device: torch.device
    dtype: torch.dtype
    aux_layer_ids: list[int]
    num_layers: int
    hidden_size: int
    pad_id: int


def plan_batches(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Indices grouped into batches whose padded size (count x longest) fits the token budget.
    Longest first, so each batch holds similar lengths (little padding); ties keep input order, so
    the plan is a pure function of the lengths: a resumed shard gets the same batches, hence the
    same floats. A sequence longer than the budget runs alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= tokens_per_batch:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
