"""AdamW with fp32 master weights, linear warm-up + cosine decay, gradient clipping.

On GPU the drafter computes in bf16 while AdamW updates fp32 master copies (bf16 cannot hold
small updates of lr 1e-4); on CPU the fp32 parameters are their own masters. The step converts
gradients chunk by chunk, so the fp32 copy of the gradients never exists all at once.

`state_dtype=torch.bfloat16` (train.optimizer_state_dtype) keeps the two AdamW moments in bf16
(half their memory; the masters stay fp32): the same update computed in fp32 from the rounded
moments, so it is not the exact float32 AdamW. The default float32 is torch's fused AdamW.
"""
from __future__ import annotations

import math

import torch

CHUNK_ELEMENTS = 64 << 20


LR_REFERENCE_TOKENS = 2048  # train.learning_rate is the peak lr at this many tokens per optimizer step


def peak_learning_rate(learning_rate: float, tokens_per_step: int, scaling: str) -> float:
    """The peak lr of a global batch of `tokens_per_step` tokens (train.lr_scaling). Adam's update
    size does not grow with the batch, so a batch k times larger needs about sqrt(k) times the lr
    to learn as much per token (the square-root rule); measured in benchmarks/RESULTS.md."""
    if scaling == "none":
        return learning_rate
    return learning_rate * math.sqrt(tokens_per_step / LR_REFERENCE_TOKENS)


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
                 weight_decay: float = 0.0, state_dtype: torch.dtype = torch.float32, compile: bool = False,
                 keep_grads: bool = False):
        # keep_grads: .grad tensors are persistent buffers (a CUDA graph writes them): zeroed in
        # place, never dropped.
        self.keep_grads = keep_grads
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone())
                        for p in self.params]
        self.state_dtype = state_dtype
        if state_dtype != torch.float32:
            self.lowp = _LowPrecisionMoments(self.masters, lr, tuple(betas), eps, weight_decay, state_dtype, compile)
            self.opt = self.lowp  # param_groups / state_dict / load_state_dict
            self.base_lr = lr
            return
        self.lowp = None
        fused = all(m.is_cuda for m in self.masters) and bool(self.masters)
        self.opt = torch.optim.AdamW(self.masters, lr=lr, betas=tuple(betas), eps=eps,
                                     weight_decay=weight_decay, fused=fused or None,
                                     foreach=None if fused else False)
        self.base_lr = lr

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def zero_grad(self) -> None:
        if self.keep_grads:
            torch._foreach_zero_([p.grad for p in self.params if p.grad is not None])
            return
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
        if self.lowp is not None:
            for i in idx:
                p, m = self.params[i], self.masters[i]
                self.lowp.update(i, p.grad)
                if m is not p:
                    p.copy_(m)
                    if not self.keep_grads:
                        p.grad = None
            return
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
                if not self.keep_grads:
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


def _adamw_moments(master, grad, exp_avg, exp_avg_sq, lr, bc1, bc2_sqrt, b1: float, b2: float, eps: float,
                   wd: float) -> None:
    """torch.optim.AdamW's update (decoupled decay) of one flat chunk, moments stored low-precision."""
    g = grad.float()
    m = exp_avg.float().lerp_(g, 1 - b1)
    v = exp_avg_sq.float().mul_(b2).addcmul_(g, g, value=1 - b2)
    if wd:
        master.mul_(1 - lr * wd)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    master.add_((m / denom) * (-(lr / bc1)))
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


class _LowPrecisionMoments:
    """AdamW over fp32 masters with moments of `dtype`, updated in chunks of CHUNK_ELEMENTS // 4."""

    def __init__(self, masters, lr, betas, eps, weight_decay, dtype, compile):
        self.masters = masters
        self.param_groups = [{"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}]
        self.exp_avg = [torch.zeros_like(m, dtype=dtype) for m in masters]
        self.exp_avg_sq = [torch.zeros_like(m, dtype=dtype) for m in masters]
        self.steps = [0] * len(masters)
        self.dtype = dtype
        self.fn = _adamw_moments
        if compile and masters and masters[0].is_cuda:
            self.fn = torch.compile(_adamw_moments, dynamic=True)

    @torch.no_grad()
    def update(self, i: int, grad: torch.Tensor) -> None:
        g = self.param_groups[0]
        (b1, b2), eps, wd = g["betas"], g["eps"], g["weight_decay"]
        self.steps[i] += 1
        s = self.steps[i]
        m = self.masters[i]
        dev = m.device
        lr = torch.tensor(g["lr"], dtype=torch.float32, device=dev)
        bc1 = torch.tensor(1 - b1 ** s, dtype=torch.float32, device=dev)
        bc2_sqrt = torch.tensor(math.sqrt(1 - b2 ** s), dtype=torch.float32, device=dev)
        flat, gf = m.view(-1), grad.reshape(-1)
        ea, es = self.exp_avg[i].view(-1), self.exp_avg_sq[i].view(-1)
        step = max(1, CHUNK_ELEMENTS // 4)
        for a in range(0, flat.numel(), step):
            sl = slice(a, a + step)
            self.fn(flat[sl], gf[sl], ea[sl], es[sl], lr, bc1, bc2_sqrt, b1, b2, eps, wd)

    def state_dict(self) -> dict:
        return {"lowp": str(self.dtype).removeprefix("torch."), "steps": list(self.steps),
                "exp_avg": [t.detach().cpu().clone() for t in self.exp_avg],
                "exp_avg_sq": [t.detach().cpu().clone() for t in self.exp_avg_sq],
                "param_groups": [dict(g) for g in self.param_groups]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("lowp") != str(self.dtype).removeprefix("torch."):
            raise ValueError(f"optimizer state has moments {state.get('lowp', 'float32')!r}, this run "
                             f"{str(self.dtype).removeprefix('torch.')!r} (train.optimizer_state_dtype)")
        self.steps = list(state["steps"])
        with torch.no_grad():
            for t, saved in zip(self.exp_avg + self.exp_avg_sq, state["exp_avg"] + state["exp_avg_sq"]):
                t.copy_(saved)
        for g, saved in zip(self.param_groups, state["param_groups"]):
            g.update(saved)


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the total gradient norm in place; returns the norm before clipping as a tensor (no
    device sync: the GPU keeps its queue; DTensor-aware)."""
    grads = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm
