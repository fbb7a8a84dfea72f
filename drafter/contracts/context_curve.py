"""Accept length against context length: the one bucket rule of the export judge, the export gate
and the bench, and the training data's lengths in the same buckets.

Accept length falls as the context grows (one EAGLE-3 drafter: 2.30 at 2k tokens, 1.08 at 20k;
one trained at 2k context ran slower than no speculation past 2k), and a figure averaged over
short prompts hides it. A draft block (one verify) is placed at its context position: prompt
tokens + tokens generated before it. Buckets are [lo, hi) up to the target's context length;
a bucket without blocks has accept length None (shown empty, never 0).

The training side: a sample of L tokens (cut to train.max_length) trained the drafter at positions
0 .. L-1, so `samples_reaching` (L > lo) is what says whether it ever trained in a bucket, and
`samples_ending` (lo < L <= hi) is the length distribution itself.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

FIRST_EDGE = 64  # the default edges: powers of two from here up to the context length


def bucket_edges(context: int | None, edges: Sequence[int] | None = None, *, longest: int = 0) -> list[int]:
    """The edges below `context`: the given ones, or powers of two from FIRST_EDGE. Without a
    known context, powers of two up to `longest` (the longest position seen)."""
    if edges:
        return [int(e) for e in edges if context is None or e < context]
    top = context if context is not None else max(longest, FIRST_EDGE)
    out, e = [], FIRST_EDGE
    while e < top:
        out.append(e)
        e *= 2
    return out


def buckets(edges: Sequence[int], context: int | None) -> list[tuple[int, int | None]]:
    """[lo, hi) pairs: 0 to the first edge, ..., the last edge to the context (None: open)."""
    lows = [0, *edges]
    return list(zip(lows, [*edges, context]))


def label(lo: int, hi: int | None) -> str:
    return f"[{lo}, {'inf' if hi is None else hi})"


def _index(position: int, spans: Sequence[tuple[int, int | None]]) -> int:
    return next((j for j, (_, hi) in enumerate(spans) if hi is None or position < hi), len(spans) - 1)


def accept_by_context(blocks: Iterable[tuple[int, int, int]], edges: Sequence[int],
                      context: int | None, *, requests: bool = False) -> list[dict]:
    """`blocks`: (context position, verifies, accepted drafts); a verify of the offline judge is
    (position, 1, accepted), a bench request (its context, its verifies, its accepted drafts:
    `requests` counts them per bucket too). One dict per bucket: its span, its blocks (verifies)
    and accept length 1 + accepted / blocks."""
    spans = buckets(edges, context)
    verifies, accepted, sources = [0] * len(spans), [0] * len(spans), [0] * len(spans)
    for position, n, acc in blocks:
        j = _index(int(position), spans)
        verifies[j] += int(n)
        accepted[j] += int(acc)
        sources[j] += 1
    return [{"positions": label(lo, hi), "lo": lo, "hi": hi, "blocks": v, **({"requests": s} if requests else {}),
             "accept_length": (1 + a / v) if v else None}
            for (lo, hi), v, a, s in zip(spans, verifies, accepted, sources)]


def last_full_bucket(curve: Sequence[dict], min_blocks: int) -> dict | None:
    """The bucket farthest into the context with at least `min_blocks` blocks (the export gate's)."""
    return next((b for b in reversed(curve) if b["blocks"] >= min_blocks), None)


def trained_by_context(lengths: Sequence[int], curve: Sequence[dict], max_length: int | None) -> list[dict]:
    """Per bucket of `curve`: training samples ending in it and reaching into it, each sample cut
    to `max_length` (train.max_length: what the trainer saw)."""
    cut = [min(int(n), max_length) if max_length else int(n) for n in lengths]
    return [{"samples_ending": sum(b["lo"] < n <= (b["hi"] if b["hi"] is not None else n) for n in cut),
             "samples_reaching": sum(n > b["lo"] for n in cut)} for b in curve]


def curve_lines(curve: Sequence[dict], trained: Sequence[dict] | None = None, *, unit: str = "draft blocks",
                untrained_from: int | None = None) -> list[str]:
    """One line per bucket: accept length (blocks), then the training samples there. `trained`
    None with `untrained_from` (no per-sample lengths recorded, only the cut): buckets starting at
    or past it are untrained all the same."""
    width = max((len(b["positions"]) for b in curve), default=0)
    lines = []
    for k, b in enumerate(curve):
        al = f"{b['accept_length']:.2f}" if b["accept_length"] is not None else "  — "
        line = f"{b['positions']:<{width}}  {al} ({b['blocks']} {unit})"
        if trained is not None:
            t = trained[k]
            line += (f"; trained samples reaching it: {t['samples_reaching']}, ending in it: {t['samples_ending']}"
                     + (" — untrained at these lengths" if t["samples_reaching"] == 0 else ""))
        elif untrained_from is not None and b["lo"] >= untrained_from:
            line += f"; past the longest trained sample ({untrained_from} tokens) — untrained at these lengths"
        lines.append(line)
    return lines
