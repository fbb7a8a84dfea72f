"""The retrain verdict: is the challenger measurably better than the champion?

Both drafters are judged offline on the same held-out prompts in the same run (drafter.export.judge,
which records verifies and accepted drafts per prompt). The figure is the offline accept length
(1 + accepted drafts / verifies, SGLang's bonus token included); the interval is a paired percentile
bootstrap over prompts (a prompt keeps its champion and challenger figures together, so an easy
prompt helps both). The challenger is promoted only when its gain is at least `min_improvement` of
the champion's accept length AND the interval of the difference lies above zero.

With `retrain.bench` the bench stage has also served both drafters at the bench settings, in one
interleaved sweep with the baseline (`bench_verdict` reads its report): its figures go into the
decision, and it can veto a promotion the offline judgement allowed, when the challenger's server
failed or the challenger is measurably SLOWER than the champion (challenger / champion throughput
interval below 1, at a batch size whose baseline did not drift). It never promotes on its own:
throughput on a shared machine is noisier than accept length on the same prompts.
"""
from __future__ import annotations

import numpy as np

from drafter.errors import DrafterError


class RetrainError(DrafterError):
    """The inputs of a verdict do not belong together (a bench of another pair). Never retried."""


def _accept_length(per_prompt: np.ndarray) -> np.ndarray:
    """Accept length of the prompts along the last-but-one axis ([..., prompts, (verifies, accepted)])."""
    verifies = per_prompt[..., 0].sum(axis=-1)
    return 1.0 + per_prompt[..., 1].sum(axis=-1) / np.maximum(verifies, 1)


def compare(champion: dict, challenger: dict, *, min_improvement: float, confidence: float,
            samples: int, seed: int) -> dict:
    """The verdict on two judge reports of the same prompts (`per_prompt` [verifies, accepted])."""
    h, c = np.asarray(champion["per_prompt"], float), np.asarray(challenger["per_prompt"], float)
    if h.shape != c.shape or h.ndim != 2 or len(h) < 2:
        raise ValueError(f"need the same >= 2 prompts judged for both drafters, got {h.shape} and {c.shape}")
    al_h, al_c = float(_accept_length(h)), float(_accept_length(c))
    diff, rel = al_c - al_h, (al_c - al_h) / al_h
    idx = np.random.default_rng(seed).integers(0, len(h), size=(samples, len(h)))
    boot = _accept_length(c[idx]) - _accept_length(h[idx])
    alpha = 1.0 - confidence
    low, high = (float(v) for v in np.quantile(boot, [alpha / 2, 1 - alpha / 2]))
    problems = []
    if rel < min_improvement:
        problems.append(f"gain {rel:+.1%} is below retrain.min_improvement {min_improvement:.1%}")
    if low <= 0:
        problems.append(f"the {confidence:.0%} interval of the difference [{low:+.3f}, {high:+.3f}] does not "
                        f"exclude zero (no measurable improvement on {len(h)} prompts)")
    promoted = not problems
    figures = f"challenger accept length {al_c:.3f} vs champion {al_h:.3f} ({rel:+.1%}, difference {diff:+.3f}, " \
              f"{confidence:.0%} interval [{low:+.3f}, {high:+.3f}], {len(h)} prompts)"
    reason = figures + ("; " + "; ".join(problems) if problems else
                        f": better by at least {min_improvement:.1%} with the interval above zero")
    return {"promoted": promoted, "reason": reason, "problems": problems,
            "champion_accept_length": al_h, "challenger_accept_length": al_c, "difference": diff,
            "relative": rel, "interval": [low, high], "confidence": confidence, "prompts": len(h),
            "min_improvement": min_improvement}


def bench_verdict(report: dict, challenger: str, champion: str | None) -> dict:
    """The head-to-head bench's figures per setting and batch size, and the problems that veto a
    promotion. `report`: the bench stage's report.json; it must have benched exactly this pair."""
    expected = {"challenger": challenger, **({"champion": champion} if champion else {})}
    if report.get("drafters") != expected:
        raise RetrainError(f"the bench benched {report.get('drafters')}, not challenger {challenger} against "
                           f"champion {champion}: run the bench stage with retrain.bench for this pair")
    drift = report["summary"]["drift"]
    unstable = {int(bs) for bs, d in drift.items() if d["unstable"]}
    speedups = {(r["key"], r["batch_size"]): r.get("speedup") for r in report["summary"]["rows"]}
    problems = [f"the challenger's server failed at {f['config']} ({f['kind']})"
                for key, f in sorted(report["failures"].items()) if key.startswith("challenger-")]
    notes = [f"the champion's server failed at {f['config']} ({f['kind']})"
             for key, f in sorted(report["failures"].items()) if key.startswith("champion-")]
    mean = lambda entry: entry["mean"] if entry else None
    rows = []
    for p in report.get("head_to_head") or []:
        ratio, bs = p["ratio"], p["batch_size"]
        row = {"setting": p["setting"], "batch_size": bs, "rounds": p["rounds"],
               "challenger_over_champion": ratio["speedup"] if ratio else None,
               "interval": [ratio["low"], ratio["high"]] if ratio else None,
               "verdict": ratio["verdict"] if ratio else None,
               "challenger_accept_length": mean(p["accept_length"]["challenger"]),
               "champion_accept_length": mean(p["accept_length"]["champion"]),
               "challenger_speedup": (speedups.get((p["challenger_key"], bs)) or {}).get("speedup"),
               "champion_speedup": (speedups.get((p["champion_key"], bs)) or {}).get("speedup")}
        rows.append(row)
        if ratio and ratio["verdict"] == "slower":
            what = (f"challenger at {ratio['speedup']:.2f}x the champion's throughput [{ratio['low']:.2f}, "
                    f"{ratio['high']:.2f}] at {p['setting']}, batch {bs}")
            if bs in unstable:
                notes.append(f"{what}, not used: the baseline drifted at batch {bs}")
            else:
                problems.append(f"{what}: measurably slower")
    if champion and not rows:
        notes.append("no setting was measured with both drafters")
    if not champion:  # the first drafter: its figures against the baseline only
        rows = [{"setting": r["config"], "batch_size": r["batch_size"], "rounds": r["rounds"],
                 "challenger_speedup": (r.get("speedup") or {}).get("speedup"),
                 "challenger_accept_length": (r.get("accept_length") or {}).get("mean")}
                for r in report["summary"]["rows"] if r["key"].startswith("challenger-")]
    return {"rows": rows, "problems": problems, "notes": notes}


def plot_decisions(decisions: list[dict]) -> bytes:
    """PNG: the challenger's and the champion's offline accept length at every retrain, promoted
    retrains marked (the registry's `decisions`, oldest first)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(1, len(decisions) + 1))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    chal = [d.get("challenger_accept_length") for d in decisions]
    champ = [d.get("champion_accept_length") for d in decisions]
    ax.plot(xs, [v if v is not None else float("nan") for v in champ], "o--", color="grey", label="champion")
    ax.plot(xs, [v if v is not None else float("nan") for v in chal], "o-", color="tab:blue", label="challenger")
    for x, d, v in zip(xs, decisions, chal):
        if d.get("verdict") == "promoted" and v is not None:
            ax.plot([x], [v], "*", color="tab:green", markersize=14)
    ax.plot([], [], "*", color="tab:green", markersize=10, label="promoted")
    ax.set_xlabel("retrain")
    ax.set_ylabel("offline accept length")
    ax.set_xticks(xs)
    ax.set_title("accept length across retrains")
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()
