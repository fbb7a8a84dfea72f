"""Attention of a TTT step, for a SUBSET of query positions of a packed micro-batch.

A query at packed position t (document d) in TTT step k attends to the step-0 keys of d at
positions <= t and to its own keys of steps 1..k (model.ttt_attention_mask, one row of it).
Keys of step 0 exist for every position; the n = k diagonal keys come stacked [n, Q, Hkv, d],
aligned with the queries.

Two exact implementations of the same function:
- `math`: plain autograd over a [heads, Q, T] score matrix (CPU, tests, any dtype);
- `flash` (CUDA, bf16/fp16): FlashAttention varlen over the documents for the step-0 part, its
  log-sum-exp merged with the diagonal scores in closed form. Backward reuses the flash kernel
  with the MERGED output and log-sum-exp: P = exp(s - lse_merged) and D = rowsum(dO * O_merged)
  are then exactly the full softmax's, so dq/dk0/dv0 of the step-0 columns come out right, and
  the diagonal columns' gradients are added by hand. Inactive positions enter the kernel as zero
  queries with zero output gradient, which contributes nothing to dk0/dv0.
Heads are grouped as SGLang / the model do (head h reads kv head h // groups).
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


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulation precision: float32, or float64 when the inputs are (exactness tests)."""
    return x if x.dtype == torch.float64 else x.float()


def _grouped(q: torch.Tensor, kvh: int) -> torch.Tensor:
    return q.view(q.shape[0], kvh, q.shape[1] // kvh, q.shape[2])  # [Q, Hkv, groups, d]


def math_attention(q, k0, v0, dk, dv, qidx, layout: DocLayout, scale: float) -> torch.Tensor:
    """q [Q, H, d]; k0/v0 [T, Hkv, d]; dk/dv [n, Q, Hkv, d] or None. Returns [Q, H, d]."""
    Q, H, d = q.shape
    kvh, T = k0.shape[1], k0.shape[0]
    qg = _acc(_grouped(q, kvh))
    t = torch.arange(T, device=q.device)
    allowed = (layout.doc[qidx][:, None] == layout.doc[None, :]) & (t[None, :] <= qidx[:, None])
    s0 = torch.einsum("qhgd,thd->qhgt", qg, _acc(k0)) * scale
    s0 = s0.masked_fill(~allowed[:, None, None, :], float("-inf"))
    if dk is not None:
        sd = torch.einsum("qhgd,nqhd->qhgn", qg, _acc(dk)) * scale
        s0 = torch.cat([s0, sd], -1)
    p = torch.softmax(s0, -1)
    out = torch.einsum("qhgt,thd->qhgd", p[..., :T], _acc(v0))
    if dv is not None:
        out = out + torch.einsum("qhgn,nqhd->qhgd", p[..., T:], _acc(dv))
    return out.reshape(Q, H, d).to(q.dtype)


def _aten_flash_fwd(q, k, v, cu, max_len, scale):
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)
    return out, lse, (rng, unused)


def _aten_flash_bwd(g, q, k, v, out, lse, cu, max_len, scale, extra):
    rng, unused = extra
    return torch.ops.aten._flash_attention_backward(
        g, q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, rng, unused, scale=scale)


# (forward, backward) of a varlen causal flash kernel: lse is [H, T]. Tests put a plain torch
# implementation here to check the merge algebra on the CPU.
FLASH_KERNELS = [_aten_flash_fwd, _aten_flash_bwd]


def _merge_forward(q, o, lq, dk, dv, scale: float):
    """Merge the step-0 flash output o / lse lq [Q, Hkv, g] with the diagonal keys' scores."""
    kvh = dk.shape[2]
    sd = torch.einsum("qhgd,nqhd->qhgn", _acc(_grouped(q, kvh)), _acc(dk)) * scale
    m = torch.logsumexp(torch.cat([lq[..., None], sd], -1), -1)
    o = o * torch.exp(lq - m)[..., None] + torch.einsum("qhgn,nqhd->qhgd", torch.exp(sd - m[..., None]), _acc(dv))
    return o, m


def _merge_backward(q, g, out, m, dq, dk, dv, scale: float):
    """The diagonal columns' part of the merged softmax's backward, added to the kernel's dq."""
    Q, H, d = q.shape
    kvh = dk.shape[2]
    qg, gq = _acc(_grouped(q, kvh)), _acc(_grouped(g, kvh))
    out = _acc(_grouped(out, kvh))
    w = torch.exp(torch.einsum("qhgd,nqhd->qhgn", qg, _acc(dk)) * scale - m[..., None])
    ds = w * (torch.einsum("qhgd,nqhd->qhgn", gq, _acc(dv)) - (gq * out).sum(-1, keepdim=True))
    dq = (_acc(dq) + torch.einsum("qhgn,nqhd->qhgd", ds, _acc(dk)).reshape(Q, H, d) * scale).to(q.dtype)
    gdk = (torch.einsum("qhgn,qhgd->nqhd", ds, qg) * scale).to(dk.dtype)
    gdv = torch.einsum("qhgn,qhgd->nqhd", w, gq).to(dv.dtype)
    return dq, gdk, gdv


_MERGE_COMPILED: list = []


def _merge_fns(compile: bool):
    if not compile:
        return _merge_forward, _merge_backward
    if not _MERGE_COMPILED:
        _MERGE_COMPILED.extend([torch.compile(_merge_forward, dynamic=True),
                                torch.compile(_merge_backward, dynamic=True)])
    return _MERGE_COMPILED


class _FlashTTT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k0, v0, qidx, layout, scale, dk, dv, compile=False):
        T, (Q, H, d), kvh = k0.shape[0], q.shape, k0.shape[1]
        fwd, _ = FLASH_KERNELS
        qf = q.new_zeros(T, H, d).index_copy_(0, qidx, q)
        out0, lse0, extra = fwd(qf, k0, v0, layout.cu_seqlens, layout.max_len, scale)
        lse0 = lse0.view(H, T)
        lq = _acc(lse0[:, qidx].T.reshape(Q, kvh, H // kvh))               # [Q, Hkv, g]
        o = _acc(out0[qidx]).view(Q, kvh, H // kvh, d)
        if dk is not None:
            o, m = _merge_fns(compile)[0](q, o, lq, dk, dv, scale)
        else:
            m = lq
        out = o.reshape(Q, H, d).to(q.dtype)
        # What the kernel's backward must see: merged output and lse on the active rows.
        out0.index_copy_(0, qidx, out)
        lse0.index_copy_(1, qidx, m.reshape(Q, H).T.contiguous())
        ctx.save_for_backward(q, k0, v0, qidx, out0, lse0, m, dk, dv)
        ctx.layout, ctx.scale, ctx.extra, ctx.compile = layout, scale, extra, compile
        return out

    @staticmethod
    def backward(ctx, g):
        q, k0, v0, qidx, out_full, lse_full, m, dk, dv = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        T, (Q, H, d), kvh = k0.shape[0], q.shape, k0.shape[1]
        _, bwd = FLASH_KERNELS
        qf = q.new_zeros(T, H, d).index_copy_(0, qidx, q)
        gf = g.new_zeros(T, H, d).index_copy_(0, qidx, g.contiguous())
        dqf, dk0, dv0 = bwd(gf, qf, k0, v0, out_full, lse_full, layout.cu_seqlens, layout.max_len, scale,
                            ctx.extra)
        dq = dqf[qidx]
        gdk = gdv = None
        if dk is not None:
            dq, gdk, gdv = _merge_fns(ctx.compile)[1](q, g, out_full[qidx], m, dq, dk, dv, scale)
        return dq, dk0, dv0, None, None, None, gdk, gdv, None


def flash_attention(q, k0, v0, dk, dv, qidx, layout: DocLayout, scale: float, compile: bool = False) -> torch.Tensor:
    c = lambda x: None if x is None else x.contiguous()
    return _FlashTTT.apply(q.contiguous(), k0.contiguous(), v0.contiguous(), qidx, layout, scale, c(dk), c(dv),
                           compile)


def ttt_attention(q, k0, v0, dk, dv, qidx, layout: DocLayout, scale: float, backend: str = "auto",
                  compile: bool = False):
    """`compile`: torch.compile the flash path's merge algebra (same math, fewer kernels)."""
    if backend == "auto":
        backend = "flash" if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else "math"
    if backend == "flash":
        return flash_attention(q, k0, v0, dk, dv, qidx, layout, scale, compile)
    return math_attention(q, k0, v0, dk, dv, qidx, layout, scale)


# ---- a plain varlen causal "flash" pair (any device / dtype), for tests of the merge algebra

def reference_flash_fwd(q, k, v, cu, max_len, scale):
    T, H, d = q.shape
    kvh = k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.zeros(H, T, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype, device=q.device)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qq, kk, vv = q[a:b], k[a:b].repeat_interleave(H // kvh, 1), v[a:b].repeat_interleave(H // kvh, 1)
        s = torch.einsum("qhd,khd->hqk", _acc(qq), _acc(kk)) * scale
        s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        lse[:, a:b] = torch.logsumexp(s, -1)
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), _acc(vv)).to(q.dtype)
    return out, lse, None


def reference_flash_bwd(g, q, k, v, out, lse, cu, max_len, scale, extra):
    T, H, d = q.shape
    kvh = k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qq, kk, vv = _acc(q[a:b]), _acc(k[a:b].repeat_interleave(H // kvh, 1)), _acc(v[a:b].repeat_interleave(H // kvh, 1))
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        p = torch.exp(s - lse[:, a:b, None])
        gg, oo = _acc(g[a:b]), _acc(out[a:b])
        dvv = torch.einsum("hqk,qhd->khd", p, gg)
        dp = torch.einsum("qhd,khd->hqk", gg, vv)
        ds = p * (dp - (gg * oo).sum(-1).T[..., None])
        dq[a:b] = (torch.einsum("hqk,khd->qhd", ds, kk) * scale).to(q.dtype)
        dkk = torch.einsum("hqk,qhd->khd", ds, qq) * scale
        dk[a:b] = dkk.view(b - a, kvh, H // kvh, d).sum(2).to(k.dtype)
        dv[a:b] = dvv.view(b - a, kvh, H // kvh, d).sum(2).to(v.dtype)
    return dq, dk, dv
