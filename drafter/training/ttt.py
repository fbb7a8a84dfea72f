"""The test-time-training (TTT) unroll of EAGLE-3, as SpecForge trains it, on packed batches.

Semantics (SpecForge `OnlineEagle3Model`, read from its source), per document of n tokens, for
TTT step k = 0..K-1 and position t:
  input token   ids[t + 1 + k]            (id 0 past the document's end)
  hidden        fc(aux[t]) at k = 0, else the drafter's own output of step k-1 at t
                (EAGLE 3.1: fc(per-state norms of aux[t]), and the output after the final norm)
  RoPE position t + k; attention to step-0 keys 0..t and to t's own keys of steps 1..k
  teacher       softmax over the draft vocab of lm_head_target(final[t + 1 + k])
  loss weight   decay**k * lm[t + k] * [argmax_full(final[t + 1 + k]) in draft vocab]
                (lm = loss mask with the document's last token cleared: it has no teacher)
  loss          sum over positions of weight * CE(teacher, drafter) / tokens in the global batch

Fast path (`fast_ttt_loss`), exact: position t's steps >= 1 depend only on step-0 keys and its own
chain, so step k is computed only at positions carrying a loss at step k or later (A_k, shrinking
with k); step 0 computes keys/values everywhere but queries, attention, MLP only on A_0; lm_head and
the loss only where the loss weight is non-zero; the teacher only at the rows that are used.
`dense_ttt_loss` is the plain implementation (every position, every step, full logits, the serving
model's own forward and `ttt_attention_mask`) that the fast path is tested against.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafter.contracts.shards import decode_states
from drafter.model import DraftKVCache, Eagle3Drafter, apply_rope, ttt_attention_mask
from drafter.training.attention import DocLayout, ttt_attention
from drafter.training.teacher import TargetHead, Teacher, linear_soft_cross_entropy, reference_teacher

# Columns of the per-step statistics tensor [K, len(STATS)] (sums: add across batches / ranks).
# chain_correct[k]: draft starts (positions whose step 0 carries a loss) with steps 0..k all right;
# draft_starts: how many starts there are (the same in every row). drafter.training.metrics turns
# these into acc_k, accept_rate_k, cond_acc_k and the simulated accept length.
STATS = ("loss_sum", "loss_positions", "mask_positions", "correct", "chain_correct", "draft_starts")


@dataclass
class MicroBatch:
    """Packed samples (CPU tensors): documents concatenated, no padding. fp8 states may stay
    encoded (`aux_scales` set) until `decoded` puts them, decoded, on the training device."""

    input_ids: torch.Tensor   # int64 [T]
    loss_mask: torch.Tensor   # bool [T]
    aux: torch.Tensor         # [T, 3, H_target]
    final: torch.Tensor       # [T, H_target]
    doc_lens: list[int]
    sample_ids: list[str]
    aux_scales: torch.Tensor | None = None    # float32 [T, 3] when aux is still fp8
    final_scales: torch.Tensor | None = None  # float32 [T]
    decode_dtype: torch.dtype | None = None   # what the fp8 states decode to (the capture dtype)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def decoded(self, device: torch.device) -> MicroBatch:
        """The states on `device`, decoded there (half the bytes of bf16 cross to it, and no CPU
        thread decodes); itself on the CPU when they are decoded already. The copies are
        asynchronous from page-locked batches (`Packer.pin`). The same values as decoding on the
        CPU: fp8 -> float32 is exact and the scale's product rounds the same way on any IEEE device."""
        device = torch.device(device)
        move = lambda t: t.to(device, non_blocking=True)
        if self.aux_scales is None:
            if device.type == "cpu":
                return self
            return dataclasses.replace(self, aux=move(self.aux), final=move(self.final))
        states = decode_states({"aux_hidden_states": move(self.aux), "hidden_states": move(self.final),
                                "aux_scales": move(self.aux_scales),
                                "hidden_scales": move(self.final_scales)}, self.decode_dtype)
        return dataclasses.replace(self, aux=states["aux_hidden_states"], final=states["hidden_states"],
                                   aux_scales=None, final_scales=None, decode_dtype=None)


@dataclass
class StepInputs:
    """A micro-batch on the device with its TTT plan (everything the fast path needs)."""

    T: int
    K: int
    layout: DocLayout
    pos: torch.Tensor          # int64 [T] position inside the document
    e_next: torch.Tensor       # [T, H] embedding of ids[t + 1] (id 0 at a document's end)
    aux: torch.Tensor          # [T, 3 * H_target]
    teacher: Teacher           # rows = positions v with lm[v] (teacher of final[v + 1])
    rows: torch.Tensor         # int64 [K, T] teacher row of (k, t) (valid where lm_k)
    lm: torch.Tensor           # bool [K, T] loss mask shifted by k (accuracy denominators)
    pm: torch.Tensor           # bool [K, T] loss weight non-zero (position mask)
    active: torch.Tensor       # bool [K, T] some loss at step k or later
    target_id: torch.Tensor    # int64 [K, T] full-vocab argmax of the teacher of (k, t)
    # The plan, computed once on the CPU (one device sync per micro-batch, none inside the unroll):
    idx: list[torch.Tensor] = None    # per k: sorted positions of A_k
    sel: list[torch.Tensor] = None    # per k >= 1: where A_k sits inside A_{k-1}
    hit: list[torch.Tensor] = None    # per k: rows of A_k that carry a loss
    hit_k: torch.Tensor = None        # every loss row of every step, in step order: its step k
    hit_at: torch.Tensor = None       # ... and its packed position t


def doc_positions(doc_lens: list[int], device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(document index, position in document, document length) of each packed token."""
    lens = torch.tensor(doc_lens, dtype=torch.int64, device=device)
    doc = torch.repeat_interleave(torch.arange(len(doc_lens), device=device), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(doc.numel(), device=device) - starts[doc]
    return doc, pos, lens[doc]


def next_token_ids(mb: MicroBatch) -> torch.Tensor:
    """ids[t + 1] inside each document, 0 at its last token (SpecForge pads the shift with 0)."""
    _doc, pos, dlen = doc_positions(mb.doc_lens, mb.input_ids.device)
    return torch.where(pos == dlen - 1, torch.zeros_like(mb.input_ids), torch.roll(mb.input_ids, -1))


def embed_next(mb: MicroBatch, embed: torch.Tensor) -> torch.Tensor:
    """Rows of the frozen target embedding for the shifted ids: data preparation, done where the
    table lives (the CPU), so the 1 GB table of an 8B target never occupies the GPU."""
    return embed[next_token_ids(mb).to(embed.device)]


def step_loss_mask(loss_mask: torch.Tensor, pos: torch.Tensor, dlen: torch.Tensor,
                   K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lm [T], v [K, T], lm_k [K, T]): the loss mask with each document's last token cleared (it
    has no teacher); v = t + k, the position whose mask and teacher step k at t uses (t itself
    when t + k leaves t's document); lm_k = lm[v] where t + k is inside the document."""
    lm = loss_mask.bool() & (pos != dlen - 1)
    t = torch.arange(pos.numel(), device=pos.device)
    ks = torch.arange(K, device=pos.device)[:, None]
    valid = pos[None] + ks < dlen[None]
    v = torch.where(valid, t[None] + ks, t[None])
    return lm, v, valid & lm[v]


def prepare(mb: MicroBatch, embed: torch.Tensor | None, head: TargetHead, K: int, device, dtype,
            e_next: torch.Tensor | None = None) -> StepInputs:
    """Clear each document's last loss position, run the teacher where it is used and lay out the
    per-step masks, all on `device`. `e_next` (from `embed_next`) or `embed` (the table) gives the
    input embeddings."""
    if e_next is None:
        e_next = embed_next(mb, embed)
    ids = mb.input_ids.to(device)
    T = ids.numel()
    doc, pos, dlen = doc_positions(mb.doc_lens, device)
    lm, v, lmk = step_loss_mask(mb.loss_mask.to(device), pos, dlen, K)
    lm_idx = lm.nonzero().flatten()
    teacher = head(mb.final.to(device)[lm_idx + 1])
    row_of = (torch.cumsum(lm.long(), 0) - 1).clamp_min(0)
    ind = torch.zeros(T, dtype=torch.bool, device=device)
    tid = torch.zeros(T, dtype=torch.int64, device=device)
    ind[lm_idx] = teacher.in_draft
    tid[lm_idx] = teacher.target_id
    pm = lmk & ind[v]
    active = pm.flip(0).cumsum(0).flip(0) > 0
    lens = torch.tensor([0] + list(mb.doc_lens), dtype=torch.int64)
    layout = DocLayout(doc=doc, cu_seqlens=torch.cumsum(lens, 0).to(device=device, dtype=torch.int32),
                       max_len=max(mb.doc_lens))
    idx, sel, hit, hit_k, hit_at = _plan(pm.cpu(), active.cpu(), device)
    return StepInputs(T=T, K=K, layout=layout, pos=pos, e_next=e_next.to(device=device, dtype=dtype),
                      aux=mb.aux.reshape(T, -1).to(device=device, dtype=dtype), teacher=teacher,
                      rows=row_of[v], lm=lmk, pm=pm, active=active, target_id=tid[v], idx=idx, sel=sel, hit=hit,
                      hit_k=hit_k, hit_at=hit_at)


def _plan(pm: torch.Tensor, active: torch.Tensor, device) -> tuple:
    """Index lists of the unroll, built on the CPU and shipped in one copy."""
    parts, idx_prev, ks, ats = [], None, [], []
    for k in range(pm.shape[0]):
        idx = active[k].nonzero().flatten()
        sel = torch.searchsorted(idx_prev, idx) if k else torch.zeros(0, dtype=torch.int64)
        hit = pm[k, idx].nonzero().flatten()
        parts += [idx, sel, hit]
        ks.append(torch.full((hit.numel(),), k, dtype=torch.int64))
        ats.append(idx[hit])
        idx_prev = idx
    parts += [torch.cat(ks), torch.cat(ats)]
    flat = torch.cat(parts)
    flat = flat.pin_memory() if torch.device(device).type == "cuda" else flat
    flat = flat.to(device, non_blocking=True)
    views, a = [], 0
    for part in parts:
        views.append(flat[a:a + part.numel()])
        a += part.numel()
    steps = views[:-2]
    return steps[0::3], steps[1::3], steps[2::3], views[-2], views[-1]


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    # model.apply_rope takes [B, heads, T, d]; ours are [N, heads, d].
    return apply_rope(x.transpose(0, 1)[None], positions[None], inv_freq)[0].transpose(0, 1)


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    """model.RMSNorm's math (normalise in float32, cast back, then the weight) in fused kernels."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.eps).to(x.dtype)


def _attn_input(layer, e: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
    return torch.cat((_norm(layer.input_layernorm, e), _norm(layer.hidden_norm, hid)), dim=-1)


def _mlp_block(layer, h: torch.Tensor) -> torch.Tensor:
    return h + layer.mlp(_norm(layer.post_attention_layernorm, h))


def _first_step_inputs(layer, attn, e, h_in, pos, inv_freq, idx, heads: int, kvh: int, d: int):
    """Step 0: keys / values at every position, queries at the active ones A_0."""
    x = _attn_input(layer, e, h_in)
    n = x.shape[0]
    k0 = _rope(attn.k_proj(x).view(n, kvh, d), pos, inv_freq)
    v0 = attn.v_proj(x).view(n, kvh, d)
    q = _rope(attn.q_proj(x[idx]).view(-1, heads, d), pos[idx], inv_freq)
    return q, k0, v0


def _next_step_inputs(layer, attn, e, hid, positions, inv_freq, heads: int, kvh: int, d: int):
    """Step k >= 1 at A_k: queries and the step's own (diagonal) keys / values."""
    xq = _attn_input(layer, e, hid)
    kk = _rope(attn.k_proj(xq).view(-1, kvh, d), positions, inv_freq)
    vv = attn.v_proj(xq).view(-1, kvh, d)
    q = _rope(attn.q_proj(xq).view(-1, heads, d), positions, inv_freq)
    return q, kk, vv


def _after_attention(layer, attn, hid, out):
    return _mlp_block(layer, hid + attn.o_proj(out.reshape(out.shape[0], -1)))


def _final_norm(model, h):
    return _norm(model.norm, h)


def fc_input(model: Eagle3Drafter, aux: torch.Tensor) -> torch.Tensor:
    """fc over the captured states; EAGLE 3.1 first norms each one (model.Eagle3Drafter.project)."""
    if model.fc_norm is not None:
        aux = torch.cat([_norm(n, x) for n, x in zip(model.fc_norm, aux.chunk(len(model.fc_norm), dim=-1))], dim=-1)
    return model.fc(aux)


_COMPILED: dict = {}


def _fn(name: str, fn, compile: bool):
    """`fn`, or its torch.compile'd version (dynamic row counts) when asked for."""
    if not compile:
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


def fast_ttt_loss(model: Eagle3Drafter, si: StepInputs, decay: float, norm: float,
                  attention: str = "auto", compile: bool = False, return_correct: bool = False) -> tuple:
    """(weighted loss, statistics [K, len(STATS)] float64) of one micro-batch; with
    `return_correct` also bool [K, T]: step k at t was right (the evaluation's served walk).

    The unroll runs the attention / MLP chain step by step; the drafter's lm_head and the loss of
    every step's loss rows run afterwards in one chunked pass (`linear_soft_cross_entropy`)."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    heads, kvh, d = attn.heads, attn.kv_heads, attn.head_dim
    scale = d ** -0.5
    dev = si.aux.device
    if attn.inv_freq.device != dev:
        attn.inv_freq = attn.inv_freq.to(dev)
    first_inputs = _fn("first", _first_step_inputs, compile)
    next_inputs = _fn("next", _next_step_inputs, compile)
    after_attention = _fn("after", _after_attention, compile)
    final_norm = _fn("norm", _final_norm, compile)
    acc_dtype = torch.float64 if si.aux.dtype == torch.float64 else torch.float32
    loss_sums = torch.zeros(si.K, dtype=torch.float64, device=dev)
    correct = torch.zeros(si.K, si.T, dtype=torch.bool, device=dev)

    h_in = fc_input(model, si.aux)
    norm_output = model.config.norm_output  # EAGLE 3.1: the post-norm hidden goes on, and to lm_head
    prev_h = dk = dv = k0 = v0 = None
    hs = []
    for k in range(si.K):
        idx = si.idx[k]
        if idx.numel() == 0:
            break  # A_k shrinks with k: nothing carries a loss from here on
        if k == 0:
            hid = h_in[idx]
            q, k0, v0 = first_inputs(layer, attn, si.e_next, h_in, si.pos, attn.inv_freq, idx, heads, kvh, d)
        else:
            sel = si.sel[k]
            hid = prev_h[sel]
            q, kk, vv = next_inputs(layer, attn, si.e_next[idx + k], hid, si.pos[idx] + k, attn.inv_freq,
                                    heads, kvh, d)
            dk = kk[None] if dk is None else torch.cat([dk[:, sel], kk[None]])
            dv = vv[None] if dv is None else torch.cat([dv[:, sel], vv[None]])
        out = ttt_attention(q, k0, v0, dk, dv, idx, si.layout, scale, attention, compile)
        h = after_attention(layer, attn, hid, out)
        if norm_output:
            h = final_norm(model, h)
        if si.hit[k].numel():
            hs.append(h[si.hit[k]])
        prev_h = h
    if not hs:  # no loss position in this micro-batch: a zero that backward accepts
        total = torch.zeros((), dtype=acc_dtype, device=dev) + 0.0 * h_in.sum()
        stats = step_stats(si.lm, si.pm, loss_sums, correct)
        return (total, stats, correct) if return_correct else (total, stats)
    n = sum(x.shape[0] for x in hs)
    ks, at = si.hit_k[:n], si.hit_at[:n]
    weights = torch.tensor([(decay ** k) / norm for k in range(si.K)], dtype=acc_dtype, device=dev)[ks]
    hn = torch.cat(hs) if len(hs) > 1 else hs[0]
    hn = hn if norm_output else final_norm(model, hn)
    total, ce, pred = linear_soft_cross_entropy(hn, model.lm_head.weight, si.teacher.probs, si.rows[ks, at],
                                                weights, compile=compile)
    with torch.no_grad():
        loss_sums.index_add_(0, ks, ce.double())
        correct[ks, at] = model.draft_to_target(pred) == si.target_id[ks, at]
    stats = step_stats(si.lm, si.pm, loss_sums, correct)
    return (total, stats, correct) if return_correct else (total, stats)


@torch.no_grad()
def step_stats(lm: torch.Tensor, pm: torch.Tensor, loss_sums: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """The STATS columns from [K, positions] masks (loss mask, position mask, correct), all at once.

    `correct[k, t]` may only be true where step k at t carries a loss. A chain drafter starts at a
    position t whose step 0 carries a loss (lm[0, t]) and keeps its step k only while steps 0..k
    were all right; a start whose chain leaves the answer (no loss at step k) stops there, as a
    served draft stops at the end of the answer."""
    chain = correct.long().cumprod(0).bool() & lm[:1]            # right at every step 0..k, from a start
    starts = lm[0].sum().expand(lm.shape[0])
    cols = [loss_sums, pm.sum(1), lm.sum(1), (correct & lm).sum(1), chain.sum(1), starts]
    return torch.stack([c.double() for c in cols], 1)


def dense_ttt_loss(model: Eagle3Drafter, mb: MicroBatch, embed: torch.Tensor, lm_head: torch.Tensor,
                   t2d: torch.Tensor, K: int, decay: float, norm: float) -> torch.Tensor:
    """The plain reference: per document, every position at every step through the drafter's own
    forward with `ttt_attention_mask`, full-vocab fp32 teacher logits, full drafter logits."""
    dev = model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    total = torch.zeros((), dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=dev)
    start = 0
    for n in mb.doc_lens:
        sl = slice(start, start + n)
        start += n
        ids, lm = mb.input_ids[sl].to(dev), mb.loss_mask[sl].bool().to(dev).clone()
        lm[-1] = False
        ref = reference_teacher(mb.final[sl].to(dev), lm_head.to(dev), t2d.to(dev))
        hidden = mb.aux[sl].reshape(1, n, -1).to(device=dev, dtype=dtype)
        cache = DraftKVCache()
        for k in range(K):
            shifted = torch.zeros(n, dtype=torch.int64, device=dev)
            if n - 1 - k > 0:
                shifted[:n - 1 - k] = ids[1 + k:]
            emb = embed.to(dev)[shifted].to(dtype)[None]
            positions = (torch.arange(n, device=dev) + k)[None]
            mask = ttt_attention_mask(n, k, dev)[None, None]
            logits, hidden = model(emb, hidden, positions, cache, mask)
            logits = logits[0] if dtype == torch.float64 else logits[0].float()
            u = torch.arange(n, device=dev) + 1 + k      # teacher row of (k, t)
            v = torch.arange(n, device=dev) + k          # loss-mask index of (k, t)
            ok = u < n
            uc, vc = u.clamp(max=n - 1), v.clamp(max=n - 1)
            weight = ok & lm[vc] & ref.in_draft[uc]
            ce = -(ref.probs[uc] * F.log_softmax(logits, -1)).sum(-1)
            total = total + (decay ** k) * (ce * weight).sum() / norm
    return total
