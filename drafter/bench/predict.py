"""Speedup as a function of accept length, and a drafter's speedup predicted from its accept length.

The bench serves every speculative setting a second time at each `bench.accept_curve` length with
acceptance forced (each engine's own knob: `Engine.forced_acceptance`), in the same interleaved
sweep: the same baseline, rounds and paired intervals as the real drafter. Each forced server is
one point of the curve: its accept length, measured (1 + accepted drafts / verifies, the offline
judge's definition; the forcing knob sets exactly this), and its speedup [CI].

The model between points: a verify cycle costs `r(a) = a / speedup(a)` baseline decode steps
(speedup = a x step / cycle). The cycle time moves little and smoothly with the accepted count
(longer catch-up, more KV writes), so r is interpolated linearly between measured points, and
extended linearly from the two nearest beyond them (marked `extrapolated`). The interval's bounds
are interpolated the same way from each point's interval (conservative: two independent points'
interpolation is tighter than that). An accept length with its own interval widens the
prediction to cover it.

Pure functions of the bench's summary rows; no I/O.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

ACCEPT = "draft_accept_length"  # the measurement field the curve's x comes from (drafter.bench.measure)
# A forced server measured further than this from the accept length asked for did not honour the
# knob (a changed engine version, a wrapper that drops it): the report says so. Forced means vary by
# far less (reference: exact to a token per request; SGLang, vLLM: draws over hundreds of verifies).
HONOURED_WITHIN = 0.25


def not_honoured(points: Iterable[dict]) -> list[dict]:
    """The points whose measured accept length is not the one their engine was asked to force."""
    return [p for p in points if abs(p["accept_length"] - p["requested"]) > HONOURED_WITHIN]


def curve_point(row: dict, requested: float) -> dict | None:
    """One forced server's row (stats.summarize) at one batch size as a curve point; None when it
    has no paired speedup. x is the measured accept length when the engine reports it (a point
    stands where it was measured, even when the knob was not honoured)."""
    sp = row.get("speedup")
    if not sp:
        return None
    measured = row.get(ACCEPT)
    return {"requested": requested, "accept_length": measured["mean"] if measured else requested,
            "accept_interval": [measured["low"], measured["high"]] if measured and measured["low"] is not None
            else None,
            "speedup": sp["speedup"], "low": sp["low"], "high": sp["high"], "rounds": sp["rounds"],
            "key": row["key"]}


def _cost(point: dict) -> tuple[float, float | None, float | None]:
    """(r, r_low, r_high): the cycle's cost in baseline steps, and its bounds from the speedup's."""
    a = point["accept_length"]
    low, high = point["low"], point["high"]
    return (a / point["speedup"], a / high if high else None, a / low if low else None)


def _interp(xs: Sequence[float], ys: Sequence[float | None], x: float) -> float | None:
    """Piecewise linear through (xs, ys), extended from the two nearest points beyond them."""
    if any(y is None for y in ys):
        return None
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    if x1 == x0:
        return (y0 + y1) / 2
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def predict(points: Sequence[dict], accept_length: float, interval: Sequence[float | None] | None = None
            ) -> dict | None:
    """Speedup predicted at `accept_length` (and over its `interval` [low, high] when given) from
    a curve's points; None without points."""
    pts = sorted(points, key=lambda p: p["accept_length"])
    if not pts:
        return None
    xs = [p["accept_length"] for p in pts]
    costs = [_cost(p) for p in pts]
    r, r_low, r_high = ([c[k] for c in costs] for k in range(3))

    def at(a: float, which) -> float | None:
        cost = _interp(xs, which, a)
        return a / cost if cost and cost > 0 else None

    speedup = at(accept_length, r)
    if speedup is None:
        return None
    edges = _span(accept_length, interval)
    lows = [at(a, r_high) for a in edges]  # the dearest cycle gives the low bound
    highs = [at(a, r_low) for a in edges]
    low = min(lows) if None not in lows else None
    high = max(highs) if None not in highs else None
    outside = min(edges) < xs[0] or max(edges) > xs[-1]  # one point: any other accept length is outside
    return {"accept_length": accept_length, "accept_interval": list(interval) if interval else None,
            "speedup": speedup, "low": low, "high": high, "extrapolated": outside}


def _span(a: float, interval: Sequence[float | None] | None) -> list[float]:
    if not interval or interval[0] is None or interval[1] is None:
        return [a]
    return [interval[0], a, interval[1]]


def agree(predicted: dict | None, measured: dict | None) -> bool | None:
    """Whether a prediction and a measured speedup agree: their intervals overlap. None when
    either has no interval."""
    if not predicted or not measured or None in (predicted["low"], predicted["high"], measured.get("low"),
                                                 measured.get("high")):
        return None
    return predicted["low"] <= measured["high"] and measured["low"] <= predicted["high"]


def build_curves(curve_rows: Iterable[dict], rows: Iterable[dict], servers: Sequence[dict]) -> list[dict]:
    """One curve per (speculative setting, batch size) from the forced servers' summary rows, each
    with the real drafters measured at that setting and batch size (`rows`) placed on it: their
    measured (accept length, speedup) next to the speedup the curve predicts at that accept length.

    `servers`: the plan's servers as dicts with `key`, `setting_key` (server_key of the setting),
    `setting` (its description), `num_steps`, `drafter`, `forced_accept_length`."""
    by_key = {s["key"]: s for s in servers}
    curves: dict[tuple[str, int], dict] = {}
    for row in curve_rows:
        s = by_key.get(row["key"])
        if s is None or s.get("forced_accept_length") is None or not row.get("rounds"):
            continue
        point = curve_point(row, s["forced_accept_length"])
        if point is None:
            continue
        curve = curves.setdefault((s["setting_key"], row["batch_size"]), {
            "setting": s["setting"], "setting_key": s["setting_key"], "num_steps": s["num_steps"],
            "batch_size": row["batch_size"], "points": [], "measured": []})
        curve["points"].append(point)
    for row in rows:
        s = by_key.get(row["key"])
        curve = curves.get((s["setting_key"], row["batch_size"])) if s else None
        if curve is None or s.get("forced_accept_length") is not None or not row.get("speedup"):
            continue
        al, sp = row.get(ACCEPT), row["speedup"]
        entry = {"key": row["key"], "drafter": s.get("drafter") or None,
                 "accept_length": al["mean"] if al else None,
                 "accept_interval": [al["low"], al["high"]] if al and al["low"] is not None else None,
                 "speedup": sp["speedup"], "low": sp["low"], "high": sp["high"]}
        entry["predicted"] = predict(curve["points"], entry["accept_length"], entry["accept_interval"]) \
            if entry["accept_length"] is not None else None
        entry["agree"] = agree(entry["predicted"], entry)
        curve["measured"].append(entry)
    for curve in curves.values():
        curve["points"].sort(key=lambda p: p["accept_length"])
    return [curves[k] for k in sorted(curves)]


def newest_curves(stored: Iterable[dict]) -> list[dict]:
    """From stored curves newest first (drafter.formats.stored_accept_curves), the newest one per
    (setting, batch size)."""
    seen: dict[tuple[str, int], dict] = {}
    for curve in stored:
        seen.setdefault((curve["setting_key"], curve["batch_size"]), curve)
    return [seen[k] for k in sorted(seen)]


def fmt_speedup(p: dict) -> str:
    if p["low"] is None or p["high"] is None:
        return f"{p['speedup']:.2f}x (no interval)"
    return f"{p['speedup']:.2f}x [{p['low']:.2f}, {p['high']:.2f}]"


def prediction_lines(curves: Sequence[dict], accept_length: float, num_steps: int, engine: str,
                     what: str = "") -> list[str]:
    """'predicted speedup at <setting>, batch <b>: <x> [lo, hi] from offline accept length <a>' for
    every stored curve measured at `num_steps` draft steps (the offline judgement's), or why none."""
    mine = [c for c in curves if c["num_steps"] == num_steps]
    who = f"{what} " if what else ""
    if not mine:
        return [f"{who}predicted speedup: none yet, no accept-length curve is stored for engine {engine} and this "
                f"target at {num_steps} draft steps (run the bench with bench.accept_curve); offline accept length "
                f"{accept_length:.3f}"]
    lines = []
    for c in mine:
        p = predict(c["points"], accept_length)
        if p is None:
            continue
        line = (f"{who}predicted speedup at {c['setting']}, batch {c['batch_size']}: {fmt_speedup(p)} from offline "
                f"accept length {accept_length:.3f}")
        if p["extrapolated"]:
            xs = [q["accept_length"] for q in c["points"]]
            line += f" (extrapolated: the curve spans {min(xs):.2f} to {max(xs):.2f})"
        if c.get("bench"):
            line += f"; curve: bench {c['bench']}" + (f" of {c['created_at']}" if c.get("created_at") else "")
        lines.append(line)
    return lines
