"""Per-TTT-position metrics, the metrics log (JSONL) and the curves (PNG).

Defined once, here, from the summed statistics of `ttt.STATS`. A *draft start* is a position t
whose step 0 carries a loss (the token after it is an answer token in the draft vocab's reach);
step k from t predicts the token k places further on, from the drafter's own hidden state of step
k - 1 and the true tokens (teacher forcing, as SpecForge trains). For each position k:
  loss_k         mean cross entropy over the positions that carry a loss at step k
  acc_k          top-1 agreement with the target's full-vocab argmax over the positions whose step k
                 has a loss mask (SpecForge's `acces`; the steps before k may have been wrong)
  accept_rate_k  share of draft starts whose steps 0..k are all right: what a chain drafter
                 (topk 1) gets accepted at position k per verify (the offline judge's
                 "accepted at position k / verifies"); never increases with k
  cond_acc_k     accept_rate_k / accept_rate_{k-1} (accept_rate_{-1} = 1): step k right given that
                 steps 0..k-1 were; None when no start got that far
  accept_length  1 + sum_k accept_rate_k: tokens per verify of a chain drafter of len(acc) steps,
                 the bonus token included (SpecForge's simulated_acc_len is this minus 1); the
                 prediction at s <= K steps is 1 + sum_{k<s} accept_rate_k
So acc_0 = accept_rate_0 = cond_acc_0, and accept_rate_k = prod_{j<=k} cond_acc_j.

These average over every position alike. Serving does not: a draft starts where the last verify
ended, so hard stretches (one token per verify) get more verifies than easy ones (s + 1 tokens per
verify), and per-verify figures fall below the per-position ones where the drafter's hits cluster.
The held-out evaluation therefore also walks each answer as a chain drafter of s steps would
(`served_walk`: start at the answer's first draft start, accept the leading right steps, n, move
n + 1 positions on, repeat) for every s = 1..K:
  served_accept_length[s-1]     1 + accepted drafts / verifies of that walk
  served_per_position[s-1][k]   verifies whose draft position k was accepted / verifies
This is what the offline judge measures on the same target (greedy, topk 1), up to each request's
first draft, which starts from the prompt's last position (never a draft start in training).
`predicted_accept` (drafter.contracts.accept) uses it when a row has it.
"""
from __future__ import annotations

import io
import json

import torch


def summarize(stats: torch.Tensor) -> dict:
    s = stats.double().cpu()
    div = lambda a, b: float(a / b) if float(b) > 0 else None
    K = s.shape[0]
    loss = [div(s[k, 0], s[k, 1]) or 0.0 for k in range(K)]
    acc = [div(s[k, 3], s[k, 2]) or 0.0 for k in range(K)]
    accept_rate = [div(s[k, 4], s[k, 5]) or 0.0 for k in range(K)]
    cond = [div(s[k, 4], s[k - 1, 4] if k else s[k, 5]) for k in range(K)]
    return {"loss": loss, "acc": acc, "accept_rate": accept_rate, "cond_acc": cond,
            "accept_length": 1.0 + sum(accept_rate),
            "loss_positions": [int(x) for x in s[:, 1]], "mask_positions": [int(x) for x in s[:, 2]],
            "draft_starts": int(s[0, 5])}


def served_walk(correct: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """float64 [K, K + 1]: row s - 1 = (verifies, accepted at draft position 0..K-1) of a chain
    drafter of s steps walking the packed answers. correct [K, T] bool (true only where step k at
    t has a loss, so a chain never leaves its answer); starts [T] bool: the draft starts."""
    K, T = correct.shape
    lead = correct.long().cumprod(0).sum(0).tolist()  # leading right steps of the draft from t
    is_start = starts.tolist()
    out = torch.zeros(K, K + 1, dtype=torch.float64)
    for s in range(1, K + 1):
        t = 0
        while t < T:
            if not is_start[t]:
                t += 1
                continue
            n = min(lead[t], s)
            out[s - 1, 0] += 1
            out[s - 1, 1:1 + n] += 1
            t += n + 1  # the next draft starts after the accepted tokens and the target's bonus token
    return out


def served_figures(walk: torch.Tensor) -> dict:
    w = walk.double().cpu()
    verifies = [float(v) for v in w[:, 0]]
    per_position = [[float(a) / v if v else 0.0 for a in w[s, 1:s + 2]] for s, v in enumerate(verifies)]
    return {"served_accept_length": [1.0 + sum(p) for p in per_position], "served_per_position": per_position,
            "served_verifies": [int(v) for v in verifies]}


def to_jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()


def plot_png(rows: list[dict]) -> bytes:
    """Loss, acc_k and accept length against the step, train and eval (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for split, style in (("train", "-"), ("eval", "--")):
        pts = [r for r in rows if r.get("split") == split]
        if not pts:
            continue
        steps = [r["step"] for r in pts]
        for k in range(len(pts[0]["acc"])):
            axes[0].plot(steps, [r["loss"][k] for r in pts], style, label=f"{split} k={k}")
            axes[1].plot(steps, [r["acc"][k] for r in pts], style, label=f"{split} k={k}")
        axes[2].plot(steps, [r["accept_length"] for r in pts], style, label=split)
    for ax, title in zip(axes, ("loss per TTT position", "acc_k", "simulated accept length")):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()
