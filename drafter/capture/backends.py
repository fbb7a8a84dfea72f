"""The capture backend of `dump.backend`: transformers in this process (`hf`, drafter.capture.hf) or a
vLLM worker process (`vllm`, drafter.capture.vllm). The dump talks to either through these three."""
from __future__ import annotations

import torch

from drafter.capture import hf


def open_capture(cfg, device: torch.device, dtype: torch.dtype, aux_layer_ids: list[int]):
    """The capture model of `dump.backend`: transformers on `device` (hf), or a vLLM worker (vllm).
    Close it with `close_capture`."""
    if cfg.dump.backend == "vllm":
        from drafter.capture.vllm import load_vllm_capture  # torch-only hosts never import it

        return load_vllm_capture(cfg, dtype, aux_layer_ids, work_root=cfg.dump.spool_dir)
    return hf.load_capture_model(cfg.target.path, device, dtype, aux_layer_ids, cfg.target.trust_remote_code)


def close_capture(cm) -> None:
    if hasattr(cm, "close"):
        cm.close()


def capture_batch(cm, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: (aux [T, 3, H], final [T, H]), padding removed, from either backend."""
    if isinstance(cm, hf.CaptureModel):
        return hf.capture_batch(cm, sequences)
    return cm.capture_batch(sequences)
