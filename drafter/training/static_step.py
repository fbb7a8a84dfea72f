"""The TTT step with fixed shapes, and its forward + backward captured as a CUDA graph.

The fast path (`ttt.fast_ttt_loss`) is exact but its row counts change with every micro-batch
and with the teacher's output, so its ~thousand small kernels are launched one by one from
Python and the GPU waits on the CPU. Here every shape is fixed by a small key, so one CUDA graph
per key replays the whole forward and backward with one launch (`GraphedTTT`):

- the micro-batch is padded to `T` tokens (trailing documents without loss, none longer than
  the real ones);
- every TTT step runs at the same position set S: the positions with a loss-mask token at some
  step (lm[t + k] inside t's document), padded with other positions to a multiple of
  `row_multiple`. Exact for the same reason as the fast path: a position outside
  "loss at step k or later" only feeds its own later steps, which carry no loss, so the extra
  rows get zero gradient; and since S does not depend on the teacher, the plan is built on the
  CPU from the loss mask alone (no device sync);
- the teacher runs at S (its rows are the positions v whose teacher is final[v + 1]);
- the loss covers all K x |S| rows with weight decay^k / norm * lm * [teacher argmax in the
  draft vocab]: zero-weight rows cost lm_head work but keep the row count fixed.

`static_ttt_loss` gives the fast path's loss, gradients and statistics (tests: float64 on the
CPU against the fast and the dense implementations).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch

from drafter.model import Eagle3Drafter
from drafter.training.attention import DocLayout, ttt_attention
from drafter.training.teacher import TargetHead, linear_soft_cross_entropy
from drafter.training.ttt import (MicroBatch, _after_attention, _final_norm, _first_step_inputs, _fn,
                                  _next_step_inputs, doc_positions, embed_next, fc_input, step_loss_mask,
                                  step_stats)

log = logging.getLogger(__name__)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def bucket_rows(n: int, multiple: int) -> int:
    """n rounded up to a multiple of max(multiple, an eighth of n's power of two): at most 12.5%
    extra rows, and about 8 distinct sizes (CUDA graphs) per doubling of n."""
    step = max(multiple, 1 << max(0, n.bit_length() - 4))
    return _round_up(max(1, n), step)


@dataclass
class StaticBatch:
    """A micro-batch laid out for the fixed-shape step (CPU tensors from `plan_static`, or the
    device buffers a graph reads)."""

    S: torch.Tensor           # int64 [R]: the positions every TTT step runs at (sorted)
    pos: torch.Tensor         # int64 [T]: position inside the document
    doc: torch.Tensor         # int64 [T]: document index (padding documents come last)
    cu_seqlens: torch.Tensor  # int32 [D + 1]: document starts, trailing empty documents up to D
    rows: torch.Tensor        # int64 [K * R]: teacher row (index into S) of step k at S[j], 0 if no loss
    lm: torch.Tensor          # bool [K, R]: loss mask of step k at S[j] (accuracy denominators)
    w: torch.Tensor           # float64 [K * R]: decay^k / norm where lm (times in-draft on the device)
    e_next: torch.Tensor      # [T, H]: embedding of the next token
    aux: torch.Tensor         # [T, 3 * H_target]
    final: torch.Tensor       # [T, H_target]
    max_len: int
    num_tokens: int           # real (unpadded) tokens

    @property
    def key(self) -> tuple:
        """What fixes every shape of the step (one CUDA graph per key)."""
        return (self.pos.numel(), self.S.numel(), self.cu_seqlens.numel(), self.max_len, self.lm.shape[0],
                self.aux.dtype)

    def to(self, device, dtype) -> "StaticBatch":
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                fl = v.is_floating_point() and f.name != "w"
                v = v.to(device=device, dtype=dtype if fl else v.dtype, copy=True)  # own buffers
            out[f.name] = v
        return StaticBatch(**out)

    def copy_(self, src: "StaticBatch") -> None:
        """Fill these (graph-read) buffers with `src`'s values; shapes must match (same key).
        Host tensors are page-locked first: a copy from pageable memory would wait for the GPU to
        finish the steps queued before it."""
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                x = getattr(src, f.name)
                if v.is_cuda and not x.is_cuda:
                    x = x.pin_memory()
                v.copy_(x, non_blocking=True)


def plan_static(mb: MicroBatch, K: int, decay: float, norm: float, tokens: int, row_multiple: int = 128,
                embed: torch.Tensor | None = None, e_next: torch.Tensor | None = None,
                buckets: int = 0) -> StaticBatch:
    """Lay out `mb` (CPU tensors) padded to max(tokens, its length) rounded to `row_multiple`.

    `buckets` 0: rows by `bucket_rows`, documents and the longest one by powers of two (~8 row
    sizes per doubling, each a shape key). N > 0: a few fixed keys: the length rounded up to a
    multiple of `tokens`, the rows to a multiple of 1/N of it, the padding one document, at least
    T/16 document slots and the longest document taken as T: at most N keys per multiple of
    `tokens` (more only past T/16 documents), at the cost of more padded rows."""
    if e_next is None:
        e_next = embed_next(mb, embed)
    n = mb.num_tokens
    T = _round_up(max(tokens, n), _round_up(tokens, row_multiple) if buckets else row_multiple)
    doc, pos, dlen = doc_positions(mb.doc_lens)
    ks = torch.arange(K)[:, None]
    lmk = torch.zeros(K, T, dtype=torch.bool)
    lmk[:, :n] = step_loss_mask(mb.loss_mask.cpu(), pos, dlen, K)[2]
    active = lmk.any(0)
    s_real = active.nonzero().flatten()
    R = min(T, _round_up(max(1, s_real.numel()), _round_up(-(-T // buckets), row_multiple)) if buckets
            else bucket_rows(s_real.numel(), row_multiple))
    S = torch.cat([s_real, (~active).nonzero().flatten()[:R - s_real.numel()]]).sort().values
    where = torch.full((T,), -1, dtype=torch.int64)
    where[S] = torch.arange(R)
    lmS = lmk[:, S]
    teacher_pos = (S[None] + ks).clamp(max=T - 1)        # loss of step k at t uses the teacher of t + k
    rows = torch.where(lmS, where[teacher_pos], 0)
    assert bool((rows >= 0).all()), "a loss position outside S"
    w = torch.where(lmS, (decay ** ks.double()) / norm, 0.0)
    pad = T - n
    # The padding is split into documents no longer than the real ones (rounded to a power of
    # two), so the attention kernel's max length, and the shape key, do not follow the padding.
    n_docs = len(mb.doc_lens)
    split = T if buckets else min(T, _pow2(max(max(mb.doc_lens), 1)))  # buckets: the padding is one document
    pad_lens = [split] * (pad // split) + ([pad % split] if pad % split else [])
    lens = list(mb.doc_lens) + pad_lens
    D = max(_pow2(len(lens)), _pow2(T // 16) if buckets else 1)
    max_len = T if buckets else split  # the attention kernel's bound: any value >= the longest document
    cu = torch.full((D + 1,), T, dtype=torch.int32)
    cu[:len(lens) + 1] = torch.cumsum(torch.tensor([0] + lens, dtype=torch.int64), 0).to(torch.int32)
    pad_doc, pad_pos, _ = doc_positions(pad_lens) if pad_lens else (torch.zeros(0, dtype=torch.int64),) * 3
    def zpad(x: torch.Tensor) -> torch.Tensor:  # on x's own device: the states need not visit the CPU
        x = x.reshape(x.shape[0], -1)
        return torch.cat([x, x.new_zeros(pad, x.shape[1])])

    return StaticBatch(
        S=S, pos=torch.cat([pos, pad_pos]), doc=torch.cat([doc, pad_doc + n_docs]),
        cu_seqlens=cu, rows=rows.flatten(), lm=lmS, w=w.flatten(),
        e_next=zpad(e_next), aux=zpad(mb.aux), final=zpad(mb.final),
        max_len=max_len, num_tokens=n)


def static_ttt_loss(model: Eagle3Drafter, head: TargetHead, sb: StaticBatch, attention: str = "auto",
                    compile: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted loss, statistics [K, len(STATS)] float64) of `sb`: no device sync, no host tensor,
    fixed shapes (capturable)."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    heads, kvh, d = attn.heads, attn.kv_heads, attn.head_dim
    K, R = sb.lm.shape
    T = sb.pos.numel()
    first_inputs = _fn("first", _first_step_inputs, compile)
    next_inputs = _fn("next", _next_step_inputs, compile)
    after_attention = _fn("after", _after_attention, compile)
    final_norm = _fn("norm", _final_norm, compile)
    layout = DocLayout(doc=sb.doc, cu_seqlens=sb.cu_seqlens, max_len=sb.max_len)
    S, scale = sb.S, d ** -0.5
    if attn.inv_freq.device != sb.aux.device:  # a plain attribute, not moved by .to(): once, before capture
        attn.inv_freq = attn.inv_freq.to(sb.aux.device)

    teacher = head(sb.final[(S + 1).clamp(max=T - 1)])
    h_in = fc_input(model, sb.aux)
    # EAGLE 3.1 (norm_output): the post-norm hidden is the next step's input and lm_head's (as in ttt.py)
    out_norm = (lambda h: final_norm(model, h)) if model.config.norm_output else (lambda h: h)
    q, k0, v0 = first_inputs(layer, attn, sb.e_next, h_in, sb.pos, attn.inv_freq, S, heads, kvh, d)
    h = out_norm(after_attention(layer, attn, h_in[S], ttt_attention(q, k0, v0, None, None, S, layout, scale,
                                                                      attention, compile)))
    hs, dk, dv = [h], None, None
    for k in range(1, K):
        q, kk, vv = next_inputs(layer, attn, sb.e_next[(S + k).clamp(max=T - 1)], h, sb.pos[S] + k,
                                attn.inv_freq, heads, kvh, d)
        dk = kk[None] if dk is None else torch.cat([dk, kk[None]])
        dv = vv[None] if dv is None else torch.cat([dv, vv[None]])
        h = out_norm(after_attention(layer, attn, h, ttt_attention(q, k0, v0, dk, dv, S, layout, scale, attention,
                                                                    compile)))
        hs.append(h)
    pm = sb.lm & teacher.in_draft[sb.rows].view(K, R)
    acc_dtype = torch.float64 if sb.aux.dtype == torch.float64 else torch.float32
    w = (sb.w * pm.flatten()).to(acc_dtype)
    hn = torch.cat(hs) if model.config.norm_output else final_norm(model, torch.cat(hs))
    total, ce, pred = linear_soft_cross_entropy(hn, model.lm_head.weight,
                                                teacher.probs, sb.rows, w, compile=compile)
    with torch.no_grad():
        loss_sums = torch.where(pm, ce.view(K, R), 0).sum(1).double()
        correct = pm & (model.draft_to_target(pred).view(K, R) == teacher.target_id[sb.rows].view(K, R))
        stats = step_stats(sb.lm, pm, loss_sums, correct)
    return total, stats


class GraphedTTT:
    """Forward + backward of `static_ttt_loss`, one CUDA graph per `StaticBatch.key`.

    Gradients live in persistent buffers (`grads`, the parameters' .grad) that every replay adds
    to, as autograd accumulation does, so micro-batches of one step accumulate; `zero_grads()`
    starts a step. The optimizer must not replace or drop `.grad` (MasterAdamW keep_grads=True).
    `buckets`: how the callers' `plan_static` forms the keys (its `buckets` argument)."""

    def __init__(self, model: Eagle3Drafter, head: TargetHead, attention: str = "auto", compile: bool = True,
                 warmup: int = 2, buckets: int = 0):
        self.model, self.head, self.attention, self.compile, self.warmup = model, head, attention, compile, warmup
        self.buckets = buckets
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.grads = [p.grad for p in self.params]
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.device = self.params[0].device
        self.dtype = self.params[0].dtype

    def zero_grads(self) -> None:
        torch._foreach_zero_(self.grads)

    def attach_grads(self) -> None:
        """Put the persistent buffers back as .grad (for clipping and the optimizer)."""
        for p, g in zip(self.params, self.grads):
            p.grad = g

    def _loss(self, sb: StaticBatch):
        return static_ttt_loss(self.model, self.head, sb, self.attention, self.compile)

    def _capture(self, host: StaticBatch):
        buf = host.to(self.device, self.dtype)
        for p in self.params:  # warm-up gradients are thrown away (the buffers keep this step's)
            p.grad = None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup if not self.graphs else 1):  # compiles (first key), settles the allocator
                loss, _stats = self._loss(buf)
                loss.backward()
        torch.cuda.current_stream().wait_stream(side)
        self.attach_grads()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the shard reader's threads may use CUDA (pinned copies) meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            loss, stats = self._loss(buf)
            loss.backward()  # accumulates into the persistent .grad buffers, in place
        return graph, buf, (loss, stats)

    def __call__(self, host: StaticBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one micro-batch: its gradients are added to `grads`; returns (loss, stats), valid
        until the next call."""
        key = host.key
        if key not in self.graphs:
            self.graphs[key] = self._capture(host)
            log.info("captured CUDA graph %d for shape %s", len(self.graphs), key[:4])
        graph, buf, out = self.graphs[key]
        buf.copy_(host)
        graph.replay()
        return out
