"""AdamW with fp32 master weights, linear warm-up + cosine decay, gradient clipping.

On GPU the drafter computes in bf16 while AdamW updates fp32 master copies (bf16 cannot hold
small updates of lr 1e-4); on CPU the fp32 parameters are their own masters. The step converts
gradients chunk by chunk, so the fp32 copy of the gradients never exists all at once.
"""
from __future__ import annotations

import math

import torch

CHUNK_ELEMENTS = 64 << 20


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class MasterAdamW:
    """AdamW over fp32 masters of `params` (the masters are the params when already fp32)."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone())
                        for p in self.params]
        fused = all(m.is_cuda for m in self.masters) and bool(self.masters)
        self.opt = torch.optim.AdamW(self.masters, lr=lr, betas=tuple(betas), eps=eps,
                                     weight_decay=weight_decay, fused=fused or None,
                                     foreach=None if fused else False)
        self.base_lr = lr

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        chunk: list[int] = []
        size = 0
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            chunk.append(i)
            size += p.numel()
            if size >= CHUNK_ELEMENTS:
                self._step(chunk)
                chunk, size = [], 0
        if chunk:
            self._step(chunk)

    def _step(self, idx: list[int]) -> None:
        for i in idx:
            p, m = self.params[i], self.masters[i]
            if m is not p:
                m.grad = p.grad.float()
        self.opt.step()  # parameters without a gradient are skipped (their step count too)
        for i in idx:
            p, m = self.params[i], self.masters[i]
            if m is not p:
                m.grad = None
                p.copy_(m)
                p.grad = None

    def state_dict(self) -> dict:
        return {"adamw": self.opt.state_dict(),
                "masters": [m.detach().cpu().clone() for m in self.masters]}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, state["masters"]):
                m.copy_(saved)
                if m is not p:
                    p.copy_(m)
        self.opt.load_state_dict(state["adamw"])


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the total gradient norm in place; returns the norm before clipping (DTensor-aware)."""
    grads = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
