"""Statistics of a bench sweep: pure functions of measured numbers, no I/O.

A speculative "speedup" is only a speedup when it survives the noise (field note 6: "94 vs 88.8
tok/s" was a fresh-boot artifact). Every figure here comes with an interval:

- `mean_ci`: mean and Student-t interval over rounds;
- `paired_speedup`: ratio of mean throughputs (config / baseline) over PAIRED rounds (round i of
  the config against round i of the baseline, measured back to back), with a percentile bootstrap
  over rounds (deterministic seed) widened to at least the paired Student-t interval of the log
  ratios: with 3 rounds a bootstrap has only 10 distinct resamples and its percentile interval is
  far too narrow, the t interval is the honest small-sample bound;
- `verdict`: faster / slower / no measurable difference (the interval contains 1.0);
- `baseline_drift`: the baseline's trend per round, flagging a machine whose speed moved faster
  than a paired round can carry (first vs last rounds reported beside it);
- `break_even_accept_length`: the accept length a configuration needs to match the baseline,
  from measured costs: its verify-cycle time over the baseline's per-token step time;
- `head_to_head`: challenger / champion output tokens/s over paired rounds, the same interval, per
  speculative setting and batch size (a retrain's bench: drafter.stages.champion reads it).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

FASTER, SLOWER, NO_DIFFERENCE = "faster", "slower", "no measurable difference"


# ---------------------------------------------------------------- Student t (no scipy here)

def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(ln)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2.0, 0.5, x)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Inverse Student t CDF by bisection (accurate to ~1e-7, plenty for an interval)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-11:
            break
    return (lo + hi) / 2.0


# ---------------------------------------------------------------- intervals

@dataclass(frozen=True)
class Interval:
    mean: float
    low: float | None
    high: float | None
    n: int

    def to_dict(self) -> dict:
        return asdict(self)


def _clean(values: Sequence[float | None]) -> np.ndarray:
    return np.array([float(v) for v in values if v is not None and math.isfinite(float(v))], dtype=float)


def mean_ci(values: Sequence[float | None], confidence: float) -> Interval | None:
    """Mean and two-sided Student-t interval; None without values, no interval with one value."""
    x = _clean(values)
    if x.size == 0:
        return None
    mean = float(x.mean())
    if x.size < 2:
        return Interval(mean, None, None, 1)
    half = t_quantile(0.5 + confidence / 2.0, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Interval(mean, mean - half, mean + half, int(x.size))


@dataclass(frozen=True)
class Speedup:
    speedup: float                 # mean(config) / mean(baseline) over the paired rounds
    low: float | None              # the reported interval: the hull of the two below
    high: float | None
    bootstrap_low: float | None
    bootstrap_high: float | None
    t_low: float | None
    t_high: float | None
    rounds: int
    verdict: str

    def to_dict(self) -> dict:
        return asdict(self)


def verdict(low: float | None, high: float | None) -> str:
    """faster only when the whole interval is above 1.0, slower only when below it."""
    if low is None or high is None:
        return NO_DIFFERENCE
    if low > 1.0:
        return FASTER
    if high < 1.0:
        return SLOWER
    return NO_DIFFERENCE


def paired_speedup(baseline: Sequence[float], config: Sequence[float], confidence: float,
                   samples: int = 5000, seed: int = 0) -> Speedup:
    """Speedup of `config` over `baseline`, `baseline[i]` and `config[i]` measured in round i.

    Interval: percentile bootstrap of the ratio of means, resampling ROUNDS (pairs stay together,
    so drift that hits both members of a pair cancels), widened to the paired Student-t interval of
    log(config_i / baseline_i) where that is wider (small numbers of rounds)."""
    if len(baseline) != len(config):
        raise ValueError(f"paired rounds differ in length: {len(baseline)} vs {len(config)}")
    b, c = np.asarray(baseline, dtype=float), np.asarray(config, dtype=float)
    if b.size == 0:
        raise ValueError("no paired rounds")
    if np.any(b <= 0) or np.any(c <= 0) or not (np.all(np.isfinite(b)) and np.all(np.isfinite(c))):
        raise ValueError("throughputs must be positive and finite")
    point = float(c.mean() / b.mean())
    n = int(b.size)
    if n < 2:
        return Speedup(point, None, None, None, None, None, None, n, NO_DIFFERENCE)
    alpha = 1.0 - confidence
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(samples, n))
    ratios = c[idx].mean(axis=1) / b[idx].mean(axis=1)
    boot_lo, boot_hi = (float(v) for v in np.quantile(ratios, [alpha / 2.0, 1.0 - alpha / 2.0]))
    logs = np.log(c / b)
    half = t_quantile(1.0 - alpha / 2.0, n - 1) * float(logs.std(ddof=1)) / math.sqrt(n)
    t_lo, t_hi = float(math.exp(logs.mean() - half)), float(math.exp(logs.mean() + half))
    low, high = min(boot_lo, t_lo), max(boot_hi, t_hi)
    return Speedup(point, low, high, boot_lo, boot_hi, t_lo, t_hi, n, verdict(low, high))


# ---------------------------------------------------------------- drift and break-even

@dataclass(frozen=True)
class Drift:
    first: float | None
    last: float | None
    relative_change: float | None   # (last - first) / first, over the whole sweep (reported)
    rounds_compared: int            # rounds averaged at each end for first / last
    per_round: float | None         # least-squares trend per round / mean: what the check judges
    unstable: bool
    tolerance: float

    def to_dict(self) -> dict:
        return asdict(self)


def baseline_drift(baseline_rounds: Sequence[float], tolerance: float) -> Drift:
    """Is the machine's speed moving faster than the pairing cancels?

    A configuration is compared with the baseline of the SAME round, measured at most one round
    apart (the order rotates), so the drift a pair can carry is the machine's change over one
    round: the least-squares slope of the baseline's throughput against its round index, relative
    to its mean. Beyond `tolerance` every comparison from the sweep is suspect, whatever its
    interval says. A slow change over a long sweep (a neighbour's job winding down) moves both
    members of each pair alike and is reported (first vs last third of the rounds) but not judged:
    more, shorter rounds make the same drift smaller per round."""
    x = _clean(baseline_rounds)
    if x.size < 2:
        return Drift(float(x[0]) if x.size else None, None, None, 0, None, False, tolerance)
    k = max(1, x.size // 3)
    first, last = float(x[:k].mean()), float(x[-k:].mean())
    rounds = np.arange(x.size, dtype=float)
    slope = float(np.polyfit(rounds, x, 1)[0])
    per_round = slope / float(x.mean())
    return Drift(first, last, (last - first) / first, k, per_round, abs(per_round) > tolerance, tolerance)


def break_even_accept_length(cycle_time_s: float | None, baseline_step_time_s: float | None) -> float | None:
    """Accept length at which speculation only matches the baseline: one verify cycle (draft +
    verify) must yield as many tokens as plain decoding makes in the same time. The field notes'
    ~2.46 (29.5 ms verify vs 12 ms decode) is this number for their machine."""
    if not cycle_time_s or not baseline_step_time_s:
        return None
    return cycle_time_s / baseline_step_time_s


# ---------------------------------------------------------------- a whole sweep

def summarize(measurements: Sequence[dict], servers: Sequence[tuple[str, str]], batch_sizes: Sequence[int], *,
              confidence: float, samples: int = 5000, seed: int = 0, drift_tolerance: float = 0.05,
              baseline_key: str = "baseline") -> dict:
    """Rows per (server configuration, batch size) from measurement records (dicts with `key`,
    `batch_size`, `round`, `output_tok_s`, `latency_s`, `ttft_s`, `itl_s`, `accept_length`,
    `draft_acceptance`, `step_time_s`, `cycle_time_s`), the baseline drift per batch size and the
    recommendation per batch size. `servers`: (key, label) in plan order, baseline first."""
    by: dict[tuple[str, int], dict[int, dict]] = {}
    for m in measurements:
        by.setdefault((m["key"], m["batch_size"]), {})[m["round"]] = m
    rows, drift, recommend = [], {}, {}
    for bs in batch_sizes:
        base = by.get((baseline_key, bs), {})
        base_tp = [base[r]["output_tok_s"] for r in sorted(base)]
        d = baseline_drift(base_tp, drift_tolerance)
        drift[bs] = d.to_dict()
        base_step = mean_ci([base[r].get("step_time_s") for r in sorted(base)], confidence)
        best = None
        for key, label in servers:
            rounds = by.get((key, bs), {})
            if not rounds:
                rows.append({"key": key, "config": label, "batch_size": bs, "rounds": 0})
                continue
            ms = [rounds[r] for r in sorted(rounds)]
            row: dict = {"key": key, "config": label, "batch_size": bs, "rounds": len(ms)}
            for field_name in ("output_tok_s", "latency_s", "ttft_s", "itl_s", "accept_length",
                               "draft_acceptance", "draft_accept_length", "cycle_time_s", "step_time_s"):
                ci = mean_ci([m.get(field_name) for m in ms], confidence)
                row[field_name] = ci.to_dict() if ci else None
            if key != baseline_key:
                paired = sorted(set(rounds) & set(base))
                if paired:
                    sp = paired_speedup([base[r]["output_tok_s"] for r in paired],
                                        [rounds[r]["output_tok_s"] for r in paired], confidence, samples, seed)
                    row["speedup"] = sp.to_dict()
                    if sp.verdict == FASTER and (best is None or sp.speedup > best[1]):
                        best = (key, sp.speedup, label)
                else:
                    row["speedup"] = None
                cycle = row["cycle_time_s"]["mean"] if row["cycle_time_s"] else None
                row["break_even_accept_length"] = break_even_accept_length(
                    cycle, base_step.mean if base_step else None)
            rows.append(row)
        if d.unstable:
            recommend[bs] = {"key": None, "text": (
                f"no recommendation: the baseline moved {d.per_round:+.1%} per round (tolerance "
                f"{drift_tolerance:.0%}); the machine was not stable, re-run")}
        elif best is not None:
            recommend[bs] = {"key": best[0], "text": f"{best[2]} ({best[1]:.2f}x, significantly faster)"}
        else:
            recommend[bs] = {"key": None, "text": "keep the baseline: no configuration is significantly faster"}
    return {"rows": rows, "drift": drift, "recommendation": recommend}


def head_to_head(measurements: Sequence[dict], pairs: Sequence[tuple[str, str, str]], batch_sizes: Sequence[int],
                 *, confidence: float, samples: int = 5000, seed: int = 0) -> list[dict]:
    """One row per (setting, batch size): the challenger's throughput over the champion's at the
    same speculative setting, over the rounds both measured (`paired_speedup`, the champion in
    the baseline's place), with both servers' accept lengths. `pairs`: (setting label,
    challenger key, champion key)."""
    by: dict[tuple[str, int], dict[int, dict]] = {}
    for m in measurements:
        by.setdefault((m["key"], m["batch_size"]), {})[m["round"]] = m
    rows = []
    for label, challenger, champion in pairs:
        for bs in batch_sizes:
            c, h = by.get((challenger, bs), {}), by.get((champion, bs), {})
            paired = sorted(set(c) & set(h))
            ratio = paired_speedup([h[r]["output_tok_s"] for r in paired], [c[r]["output_tok_s"] for r in paired],
                                   confidence, samples, seed).to_dict() if paired else None
            accept = {who: (ci.to_dict() if (ci := mean_ci([m.get("accept_length") for m in side.values()],
                                                          confidence)) else None)
                      for who, side in (("challenger", c), ("champion", h))}
            rows.append({"setting": label, "batch_size": bs, "challenger_key": challenger, "champion_key": champion,
                         "rounds": len(paired), "ratio": ratio, "accept_length": accept})
    return rows
