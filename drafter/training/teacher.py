"""The teacher: the target's final hidden state through the target's own lm_head.

Only the draft-vocab columns get a softmax (what the drafter learns); the full-vocab argmax is
needed for SpecForge's position mask (a position counts only when the target's top token is in
the draft vocab) and for accuracy. Neither ever materialises [tokens, full vocab]: the draft rows
are one matmul, the other rows are scanned in chunks keeping a running max / argmax.

The target's `embed_tokens` and `lm_head` come straight from its safetensors files (one tensor
each, found through the index), never by loading the whole model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from drafter.training.errors import TargetWeightsError

EMBED_SUFFIX = "embed_tokens.weight"
HEAD_NAME = "lm_head.weight"


def _weight_files(target_dir: Path) -> dict[str, Path]:
    """tensor name -> file, from the safetensors index or by opening each file's header."""
    from safetensors import safe_open

    index = sorted(target_dir.glob("*.safetensors.index.json"))
    if index:
        weight_map = json.loads(index[0].read_text())["weight_map"]
        return {k: target_dir / v for k, v in weight_map.items()}
    out: dict[str, Path] = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def _pick(names: dict[str, Path], suffix: str, what: str, target_dir: Path) -> str:
    # Text models name it model.embed_tokens.weight; multimodal wrappers add a prefix.
    hits = sorted((k for k in names if k == suffix or k.endswith("." + suffix)), key=len)
    if not hits:
        raise TargetWeightsError(f"{target_dir}: no {what} tensor (*{suffix}) in its safetensors files")
    return hits[0]


def load_target_head(target_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) of a Hugging Face target, read tensor by tensor.
    A tied target (tie_word_embeddings, no lm_head tensor) returns the embedding twice."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    names = _weight_files(target_dir)
    if not names:
        raise TargetWeightsError(f"{target_dir}: no *.safetensors weights")
    embed_key = _pick(names, EMBED_SUFFIX, "embedding", target_dir)
    with safe_open(str(names[embed_key]), framework="pt") as f:
        embed = f.get_tensor(embed_key)
    head_keys = [k for k in names if k == HEAD_NAME or k.endswith("." + HEAD_NAME)]
    if head_keys:
        key = min(head_keys, key=len)
        with safe_open(str(names[key]), framework="pt") as f:
            head = f.get_tensor(key)
    else:
        cfg = json.loads((target_dir / "config.json").read_text())
        if not cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings")):
            raise TargetWeightsError(f"{target_dir}: no {HEAD_NAME} and tie_word_embeddings is not set")
        head = embed
    if head.shape != embed.shape:
        raise TargetWeightsError(f"{target_dir}: lm_head {list(head.shape)} and embedding "
                                 f"{list(embed.shape)} differ in shape")
    return embed, head


@dataclass
class Teacher:
    """Teacher quantities at the rows asked for (all detached)."""

    probs: torch.Tensor      # float32 [U, draft_vocab]: softmax over the draft-vocab logits
    target_id: torch.Tensor  # int64 [U]: argmax over the FULL target vocab
    in_draft: torch.Tensor   # bool [U]: that argmax lies in the draft vocab


class TargetHead:
    """The target's lm_head split into draft rows (in draft-id order) and the other rows."""

    def __init__(self, lm_head: torch.Tensor, t2d: torch.Tensor, device: torch.device | str,
                 dtype: torch.dtype, vocab_chunk: int = 32768, row_chunk: int = 4096):
        t2d = t2d.to(torch.bool).cpu()
        if lm_head.shape[0] != t2d.numel():
            raise TargetWeightsError(f"target lm_head has {lm_head.shape[0]} rows, t2d {t2d.numel()}")
        # W[t2d] keeps target-id order = draft-id order (draft ids are sorted target ids).
        self.draft_rows = lm_head[t2d].to(device=device, dtype=dtype).contiguous()
        self.rest_rows = lm_head[~t2d].to(device=device, dtype=dtype).contiguous()
        self.draft_ids = t2d.nonzero().flatten().to(device)
        self.rest_ids = (~t2d).nonzero().flatten().to(device)
        self.vocab_chunk, self.row_chunk = vocab_chunk, row_chunk

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor) -> Teacher:
        probs, tid, ind = [], [], []
        for a in range(0, hidden.shape[0], self.row_chunk):
            p, t, i = self._rows(hidden[a:a + self.row_chunk].to(self.draft_rows.dtype))
            probs.append(p), tid.append(t), ind.append(i)
        if not probs:
            z = hidden.new_zeros(0)
            return Teacher(z.float().view(0, self.draft_rows.shape[0]), z.long(), z.bool())
        return Teacher(torch.cat(probs), torch.cat(tid), torch.cat(ind))

    def _rows(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        draft_logits = _acc(F.linear(h, self.draft_rows))
        best_draft, arg_draft = draft_logits.max(-1)  # first max = lowest target id among them
        best_rest = torch.full_like(best_draft, float("-inf"))
        arg_rest = torch.zeros_like(arg_draft)
        for a in range(0, self.rest_rows.shape[0], self.vocab_chunk):
            val, idx = _acc(F.linear(h, self.rest_rows[a:a + self.vocab_chunk])).max(-1)
            take = val > best_rest  # strict: an earlier (lower-id) chunk keeps a tie
            best_rest = torch.where(take, val, best_rest)
            arg_rest = torch.where(take, idx + a, arg_rest)
        id_draft = self.draft_ids[arg_draft]
        id_rest = self.rest_ids[arg_rest] if self.rest_ids.numel() else id_draft
        # torch.argmax over the full vocab returns the lowest id among equal maxima.
        in_draft = (best_draft > best_rest) | ((best_draft == best_rest) & (id_draft < id_rest))
        target_id = torch.where(in_draft, id_draft, id_rest)
        return torch.softmax(draft_logits, -1), target_id, in_draft


def reference_teacher(final_hidden: torch.Tensor, lm_head: torch.Tensor, t2d: torch.Tensor) -> Teacher:
    """The plain definition (full fp32 logits), for tests and the dense reference."""
    logits = _acc(final_hidden) @ _acc(lm_head).T
    target_id = logits.argmax(-1)
    return Teacher(torch.softmax(logits[:, t2d], -1), target_id, t2d[target_id])


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulation precision: float32, or float64 when the inputs are (exactness tests)."""
    return x if x.dtype == torch.float64 else x.float()


def _ce_rows(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    lf = _acc(logits)
    return torch.logsumexp(lf, -1) * p.sum(-1) - (p * lf).sum(-1)


def _ce_grad(logits: torch.Tensor, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    d = torch.softmax(_acc(logits), -1) * p.sum(-1, keepdim=True) - p
    return (d * g[:, None]).to(logits.dtype)


_CE_COMPILED: dict = {}


def _ce_fns(compile: bool):
    if not compile:
        return _ce_rows, _ce_grad
    if not _CE_COMPILED:
        _CE_COMPILED["f"] = torch.compile(_ce_rows, dynamic=True)
        _CE_COMPILED["b"] = torch.compile(_ce_grad, dynamic=True)
    return _CE_COMPILED["f"], _CE_COMPILED["b"]


class _SoftCE(torch.autograd.Function):
    """Per-row cross entropy -sum_v p(v) log softmax(logits)(v), p = teacher rows `rows`.

    Saves the (low-precision) logits and recomputes the softmax in backward instead of keeping an
    fp32 log-softmax per TTT step, and never copies the teacher rows for autograd."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, chunk: int, compile: bool):
        fwd, _ = _ce_fns(compile)
        out = _acc(logits.new_empty(logits.shape[0]))
        for a in range(0, logits.shape[0], chunk):
            out[a:a + chunk] = fwd(logits[a:a + chunk], probs[rows[a:a + chunk]])
        ctx.save_for_backward(logits, probs, rows)
        ctx.chunk, ctx.compile = chunk, compile
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logits, probs, rows = ctx.saved_tensors
        _, bwd = _ce_fns(ctx.compile)
        g = torch.empty_like(logits)
        for a in range(0, logits.shape[0], ctx.chunk):
            g[a:a + ctx.chunk] = bwd(logits[a:a + ctx.chunk], probs[rows[a:a + ctx.chunk]], grad[a:a + ctx.chunk])
        return g, None, None, None, None


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor,
                       chunk: int = 2048, compile: bool = False) -> torch.Tensor:
    """float32 [n]: cross entropy of each logits row against teacher row probs[rows[i]]."""
    return _SoftCE.apply(logits, probs, rows, chunk, compile)


# ---- the drafter's lm_head fused with the soft cross entropy, over the rows of every TTT step

def _ce_rows_at(logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return _ce_rows(logits, probs[rows])


def _ce_grad_at(logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _ce_grad(logits, probs[rows], w)


_LCE_COMPILED: dict = {}


def _lce_fns(compile: bool):
    if not compile:
        return _ce_rows_at, _ce_grad_at
    if not _LCE_COMPILED:  # the teacher rows are gathered inside the kernel: no [rows, V] fp32 copy
        _LCE_COMPILED["f"] = torch.compile(_ce_rows_at, dynamic=True)
        _LCE_COMPILED["b"] = torch.compile(_ce_grad_at, dynamic=True)
    return _LCE_COMPILED["f"], _LCE_COMPILED["b"]


class _LinearSoftCE(torch.autograd.Function):
    """loss = sum_i w_i * CE(probs[rows_i], x_i @ W.T), with the per-row CE and argmax.

    The weights w are constants, so d loss / d logits is known in forward: each chunk of rows
    computes its logits, CE, argmax, and (when a gradient is wanted) dx and dW at once; no logits
    are kept for backward, which only scales dx and dW by the incoming gradient."""

    @staticmethod
    def forward(ctx, x, weight, probs, rows, w, chunk: int, compile: bool):
        fwd, bwd = _lce_fns(compile)
        n = x.shape[0]
        ce = _acc(x.new_empty(n))
        pred = torch.empty(n, dtype=torch.int64, device=x.device)
        want = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dx = torch.empty_like(x) if want else None
        dw = None
        for a in range(0, n, chunk):
            xc = x[a:a + chunk]
            logits = F.linear(xc, weight)
            ce[a:a + chunk] = fwd(logits, probs, rows[a:a + chunk])
            pred[a:a + chunk] = logits.argmax(-1)
            if want:
                g = bwd(logits, probs, rows[a:a + chunk], w[a:a + chunk])
                del logits
                dx[a:a + chunk] = g @ weight
                gw = g.T @ xc
                dw = gw if dw is None else dw.add_(gw)
        loss = (ce * w.to(ce.dtype)).sum()
        ctx.save_for_backward(dx, dw)
        ctx.mark_non_differentiable(ce, pred)
        return loss, ce, pred

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_ce, _grad_pred):
        dx, dw = ctx.saved_tensors
        gx = None if dx is None or not ctx.needs_input_grad[0] else dx * grad_loss.to(dx.dtype)
        gw = None if dw is None or not ctx.needs_input_grad[1] else dw * grad_loss.to(dw.dtype)
        return gx, gw, None, None, None, None, None


def linear_soft_cross_entropy(x: torch.Tensor, weight: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor,
                              w: torch.Tensor, chunk: int = 2048, compile: bool = False):
    """(loss = sum_i w_i CE_i with grad, CE [n] float32, argmax [n]) of logits x @ weight.T
    against teacher rows probs[rows]; never holds more than `chunk` rows of logits."""
    return _LinearSoftCE.apply(x, weight, probs, rows, w, chunk, compile)
