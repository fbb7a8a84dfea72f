"""Per-TTT-position metrics, the metrics log (JSONL) and the curves (PNG).

From the summed statistics of `ttt.STATS`, for each position k:
  loss_k       mean cross entropy over the positions that carry a loss at step k
  acc_k        top-1 agreement with the target's full-vocab argmax over loss-masked positions
  cond_acc_k   acc at k among positions whose steps 0..k-1 were all right
  accept_len   1 + sum_k prod_{j<=k} acc_j (a chain drafter's accepted tokens per verify, bonus
               token included; SpecForge's simulated_acc_len is this minus 1)
"""
from __future__ import annotations

import io
import json

import torch


def summarize(stats: torch.Tensor) -> dict:
    s = stats.double().cpu()
    div = lambda a, b: float(a / b) if float(b) > 0 else 0.0
    loss = [div(s[k, 0], s[k, 1]) for k in range(s.shape[0])]
    acc = [div(s[k, 3], s[k, 2]) for k in range(s.shape[0])]
    cond = [div(s[k, 4], s[k, 5]) for k in range(s.shape[0])]
    run, accept = 1.0, 1.0
    for a in acc:
        run *= a
        accept += run
    return {"loss": loss, "acc": acc, "cond_acc": cond, "accept_length": accept,
            "loss_positions": [int(x) for x in s[:, 1]], "mask_positions": [int(x) for x in s[:, 2]]}


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
