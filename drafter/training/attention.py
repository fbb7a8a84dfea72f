"""Attention of a TTT step, for a SUBSET of query positions of a packed micro-batch.

A query at packed position t (document d) in TTT step k attends to the step-0 keys of d at
positions <= t and to its own keys of steps 1..k (model.ttt_attention_mask, one row of it).
Keys of step 0 exist for every position; the diagonal keys are passed aligned with the queries.

Two exact implementations of the same function:
- `math`: plain autograd over a [heads, Q, T] score matrix (CPU, tests, any dtype);
- `flash` (CUDA, bf16/fp16): FlashAttention varlen over the documents for the step-0 part, its
  log-sum-exp merged with the diagonal scores in closed form. Backward reuses the flash kernel
  with the MERGED output and log-sum-exp: P = exp(s - lse_merged) and D = rowsum(dO * O_merged)
  are then exactly the full softmax's, so dq/dk0/dv0 of the step-0 columns come out right, and
  the diagonal columns' gradients are added by hand. Inactive positions enter the kernel as zero
  queries with zero output gradient, which contributes nothing to dk0/dv0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DocLayout:
    """Where the documents of a packed micro-batch lie (device tensors)."""

    doc: torch.Tensor         # int64 [T]: document index of each packed position
    cu_seqlens: torch.Tensor  # int32 [D + 1]: document starts (FlashAttention varlen)
    max_len: int


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    # [N, kv_heads, d] -> [N, heads, d]; head h reads kv head h // groups (repeat_interleave).
    return kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulation precision: float32, or float64 when the inputs are (exactness tests)."""
    return x if x.dtype == torch.float64 else x.float()


def math_attention(q, k0, v0, dk, dv, qidx, layout: DocLayout, scale: float) -> torch.Tensor:
    """q [Q, H, d]; k0/v0 [T, Hkv, d]; dk/dv: lists of [Q, Hkv, d]. Returns [Q, H, d]."""
    heads = q.shape[1]
    kk, vv = _expand(k0, heads), _expand(v0, heads)
    t = torch.arange(k0.shape[0], device=q.device)
    allowed = (layout.doc[qidx][:, None] == layout.doc[None, :]) & (t[None, :] <= qidx[:, None])
    s0 = _acc(torch.einsum("qhd,thd->hqt", q, kk)) * scale
    s0 = s0.masked_fill(~allowed[None], float("-inf"))
    sd = [_acc((q * _expand(k, heads)).sum(-1)).T[..., None] * scale for k in dk]  # [H, Q, 1]
    p = torch.softmax(torch.cat([s0, *sd], -1), -1)
    out = _acc(torch.einsum("hqt,thd->qhd", p[..., :k0.shape[0]].to(vv.dtype), vv))
    for j, v in enumerate(dv):
        out = out + p[..., k0.shape[0] + j].T[..., None] * _acc(_expand(v, heads))
    return out.to(q.dtype)


class _FlashTTT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k0, v0, qidx, layout, scale, *diag):
        n = len(diag) // 2
        dk, dv = diag[:n], diag[n:]
        T, heads, d = k0.shape[0], q.shape[1], q.shape[2]
        qf = q.new_zeros(T, heads, d)
        qf[qidx] = q
        cu = layout.cu_seqlens
        out0, lse0, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            qf, k0, v0, cu, cu, layout.max_len, layout.max_len, 0.0, True, False, scale=scale)
        lse0 = _lse_rows(lse0, T)                                   # [T, H] float32
        lq = lse0[qidx]
        sd = [(q.float() * _expand(k, heads).float()).sum(-1) * scale for k in dk]  # [Q, H]
        m = torch.logsumexp(torch.stack([lq, *sd], -1), -1)
        out = out0[qidx].float() * torch.exp(lq - m)[..., None]
        for s, v in zip(sd, dv):
            out = out + torch.exp(s - m)[..., None] * _expand(v, heads).float()
        out = out.to(q.dtype)
        out_full = out0.clone()
        out_full[qidx] = out
        lse_full = lse0.clone()
        lse_full[qidx] = m
        ctx.save_for_backward(q, k0, v0, qidx, out_full, lse_full, rng, unused, *dk, *dv)
        ctx.layout, ctx.scale, ctx.n, ctx.lse_shape = layout, scale, n, _LSE_SHAPE[0]
        return out

    @staticmethod
    def backward(ctx, g):
        q, k0, v0, qidx, out_full, lse_full, rng, unused, *diag = ctx.saved_tensors
        n, scale, layout = ctx.n, ctx.scale, ctx.layout
        dk, dv = diag[:n], diag[n:]
        T, heads, d = k0.shape[0], q.shape[1], q.shape[2]
        qf = q.new_zeros(T, heads, d)
        qf[qidx] = q
        gf = g.new_zeros(T, heads, d)
        gf[qidx] = g
        cu = layout.cu_seqlens
        lse_k = lse_full.T.contiguous() if ctx.lse_shape == "HT" else lse_full.contiguous()
        dqf, dk0, dv0 = torch.ops.aten._flash_attention_backward(
            gf, qf, k0, v0, out_full, lse_k, cu, cu, layout.max_len, layout.max_len, 0.0, True,
            rng, unused, scale=scale)
        dq = dqf[qidx].float()
        m = lse_full[qidx]
        out = out_full[qidx].float()
        gq = g.float()
        groups = heads // k0.shape[1]
        grads_k, grads_v = [], []
        for k, v in zip(dk, dv):
            ke, ve = _expand(k, heads).float(), _expand(v, heads).float()
            w = torch.exp((q.float() * ke).sum(-1) * scale - m)            # [Q, H]
            ds = w * (gq * (ve - out)).sum(-1)                              # d loss / d score
            dq = dq + ds[..., None] * scale * ke
            grads_k.append((ds[..., None] * scale * q.float()).view(q.shape[0], -1, groups, d)
                           .sum(2).to(k.dtype))
            grads_v.append((w[..., None] * gq).view(q.shape[0], -1, groups, d).sum(2).to(v.dtype))
        return (dq.to(q.dtype), dk0, dv0, None, None, None, *grads_k, *grads_v)


_LSE_SHAPE = ["HT"]  # FlashAttention varlen returns lse as [heads, total]; set by _lse_rows


def _lse_rows(lse: torch.Tensor, T: int) -> torch.Tensor:
    if lse.dim() == 3:  # [1, H, T] on some builds
        lse = lse[0]
    if lse.shape[-1] == T:
        _LSE_SHAPE[0] = "HT"
        return lse.T.float()
    _LSE_SHAPE[0] = "TH"
    return lse.float()


def flash_attention(q, k0, v0, dk, dv, qidx, layout: DocLayout, scale: float) -> torch.Tensor:
    return _FlashTTT.apply(q.contiguous(), k0.contiguous(), v0.contiguous(), qidx, layout, scale,
                           *[k.contiguous() for k in dk], *[v.contiguous() for v in dv])


def ttt_attention(q, k0, v0, dk, dv, qidx, layout: DocLayout, scale: float, backend: str = "auto"):
    if backend == "auto":
        backend = "flash" if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else "math"
    fn = flash_attention if backend == "flash" else math_attention
    return fn(q, k0, v0, dk, dv, qidx, layout, scale)
