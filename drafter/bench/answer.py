"""The bench's answer in front of the user: the table's columns in reading order, one line per
setting (speedup [CI], verdict, accept length vs break-even), the one-line answer (faster or not,
by how much, with the interval, on which engine) and the best setting per batch size as the
engine's own configuration (rendered by the engine: `Engine.per_batch_size`).

Functions of a sweep's summary (drafter.bench.stats.summarize, as stored in report.json: batch-size
keys may be strings there) and its plan (SweepPlan.to_dict); only `deploy` asks the engine (vLLM
checks the drafter directory's config.json, as for its launch). Only real drafter settings
count: the baseline and forced-acceptance servers (points of the accept-length curve, timing only)
are never an answer.
"""
from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

# The headline table's columns, what to read first on the left (Prefect's UI and the markdown keep
# this order; a UI cuts the right-hand columns off first).
COLUMNS = ("config", "batch", "speedup [CI]", "verdict", "accept length", "break-even accept", "output tok/s",
           "rounds", "latency s", "TTFT s", "ITL ms")


def ordered(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each row's columns in COLUMNS order, any other column after them in its own order. report.json
    is written with sorted keys, which would put `ITL ms` and `TTFT s` first."""
    return [{**{c: row[c] for c in COLUMNS if c in row}, **{c: v for c, v in row.items() if c not in COLUMNS}}
            for row in rows]


def _by_batch(mapping: Mapping) -> dict[int, Any]:
    return {int(k): v for k, v in mapping.items()}


def settings(plan: Mapping[str, Any]) -> dict[str, dict]:
    """The real drafter settings of a sweep by server key (not the baseline, not a forced server)."""
    return {s["key"]: s for s in plan.get("servers", [])
            if s.get("speculative") is not None and s.get("forced_accept_length") is None}


def speedup_text(sp: Mapping[str, Any] | None) -> str:
    """`1.45x [1.21, 1.73]`, or `1.45x (no interval: 1 round)`."""
    if not sp:
        return "no paired rounds"
    if sp.get("low") is None:
        return f"{sp['speedup']:.2f}x (no interval: 1 round)"
    return f"{sp['speedup']:.2f}x [{sp['low']:.2f}, {sp['high']:.2f}]"


def _accept_vs_break_even(row: Mapping[str, Any]) -> str:
    accept, even = row.get("accept_length"), row.get("break_even_accept_length")
    got = f"{accept['mean']:.2f}" if accept else "not reported"
    return f"accept length {got} vs break-even " + (f"{even:.2f}" if even is not None else "unknown")


def setting_lines(summary: Mapping[str, Any], plan: Mapping[str, Any],
                  failures: Mapping[str, Mapping] | None = None) -> list[str]:
    """One line per (setting, batch size), e.g. `EAGLE3 3/1/4 @ batch 1: 1.45x [1.21, 1.73] faster,
    accept length 2.31 vs break-even 1.55 (96.1 tok/s)`; the baseline's throughput first."""
    real = settings(plan)
    baselines = {s["key"] for s in plan.get("servers", []) if s.get("speculative") is None}
    failures = failures or {}
    lines = []
    for row in summary["rows"]:
        where = f"{row['config']} @ batch {row['batch_size']}"
        tp = row.get("output_tok_s")
        tok_s = f"{tp['mean']:.1f} tok/s" if tp else ""
        if row["key"] in baselines:
            lines.append(f"{where}: " + (f"{tok_s} (the reference)" if tp else "not measured"))
            continue
        if row["key"] not in real:  # a forced-acceptance server: the accept-length curve's section
            continue
        if not row["rounds"]:
            failed = failures.get(row["key"])
            lines.append(f"{where}: not measured" + (f" (failed: {failed['kind']})" if failed else ""))
            continue
        sp = row.get("speedup")
        lines.append(f"{where}: {speedup_text(sp)} {sp['verdict'] if sp else ''}".rstrip()
                     + f", {_accept_vs_break_even(row)} ({tok_s})")
    return lines


def best_per_batch(summary: Mapping[str, Any], plan: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per batch size: the setting to deploy, the significantly faster one with the highest speedup
    (none on a machine whose baseline drifted), and the best point estimate otherwise, for the
    record. `{"batch_size", "key" (None: no speculation), "config", "speedup", "best", "why",
    "undecided"}`."""
    real = settings(plan)
    drift = _by_batch(summary.get("drift", {}))
    out = []
    for bs in sorted({r["batch_size"] for r in summary["rows"]}):
        rows = [r for r in summary["rows"] if r["batch_size"] == bs and r["key"] in real and r.get("speedup")]
        best = max(rows, key=lambda r: r["speedup"]["speedup"], default=None)
        faster = [r for r in rows if r["speedup"]["verdict"] == "faster"]
        d = drift.get(bs) or {}
        if d.get("unstable"):
            why = (f"the baseline moved {d['per_round']:+.1%} per round (tolerance {d['tolerance']:.0%}); "
                   "re-run on a quiet machine")
            choice = None
        elif faster:
            choice = max(faster, key=lambda r: r["speedup"]["speedup"])
            why = "significantly faster"
        else:
            choice = None
            why = "nothing is significantly faster" if rows else "no speculative setting was measured"
        out.append({"batch_size": bs, "key": choice["key"] if choice else None,
                    "config": choice["config"] if choice else None,
                    "speedup": choice["speedup"] if choice else None,
                    "best": {"config": best["config"], "speedup": best["speedup"]} if best else None, "why": why,
                    "undecided": bool(d.get("unstable"))})
    return out


def _at(choice: Mapping[str, Any]) -> tuple[str, str]:
    """(word, figures) at one batch size."""
    best = choice["best"]
    if choice["key"] is not None:
        return "faster", f"{choice['config']} at {speedup_text(choice['speedup'])}"
    if best is None:
        return "not measured", choice["why"]
    figures = f"the best setting, {best['config']}, at {speedup_text(best['speedup'])}, {best['speedup']['verdict']}"
    if choice.get("undecided"):
        return "undecided", f"{figures}; {choice['why']}"
    return "not faster", figures


def answer(summary: Mapping[str, Any], plan: Mapping[str, Any], confidence: float | None = None) -> str:
    """One line: faster or not, by how much, with the interval, on which engine, e.g. `faster on
    engine vllm at batch 1: EAGLE3 3/1/4 at 1.45x [1.21, 1.73] (speedup over no speculation, 95%
    interval)`; with several batch sizes, each one's word and figures."""
    choices = best_per_batch(summary, plan)
    engine = plan.get("engine", "?")
    scale = "speedup over no speculation" + (f", {confidence:.0%} interval" if confidence else "")
    if len(choices) == 1:
        word, figures = _at(choices[0])
        return f"{word} on engine {engine} at batch {choices[0]['batch_size']}: {figures} ({scale})"
    per = "; ".join(f"batch {c['batch_size']} {word}: {figures}" for c in choices for word, figures in [_at(c)])
    return f"on engine {engine} ({scale}): {per}"


def deploy_section(choices: Sequence[Mapping[str, Any]], engine: str, config: Mapping[str, Any]) -> list[str]:
    """Markdown lines: the best setting per batch size with its interval, then the engine's own
    configuration for it (`PerBatchConfig.to_dict()` of the engine)."""
    parts = ["## Deployable settings per batch size", ""]
    for c in choices:
        if c["key"] is not None:
            parts.append(f"- batch {c['batch_size']}: {c['config']}, {speedup_text(c['speedup'])} faster")
        else:
            parts.append(f"- batch {c['batch_size']}: no speculation ("
                         + ("undecided: " if c.get("undecided") else "") + f"{c['why']})")
    parts.append("")
    if config.get("one_server") is not None:
        args = config["one_server"]
        parts += [f"Engine `{engine}`, one server for every batch size:", "",
                  "```", shlex.join(args) if args else "(no speculative arguments)", "```", ""]
    else:
        parts += [f"Engine `{engine}`, one server per batch size (speculative arguments; the rest of the launch as "
                  f"configured):", ""]
        for bs, args in sorted(_by_batch(config["per_batch"]).items()):
            parts.append(f"- batch {bs}: " + (f"`{shlex.join(args)}`" if args else "no speculative arguments "
                                                                               "(no speculation)"))
        parts.append("")
    if config.get("note"):
        parts += [config["note"], ""]
    return parts


def deploy(summary: Mapping[str, Any], plan: Any) -> dict[str, Any]:
    """The best setting per batch size (`best_per_batch`) and the engine's own configuration for it
    (`Engine.per_batch_size`), JSON-able. `plan`: the sweep's SweepPlan (its servers' settings and
    drafters)."""
    from drafter.engines import BatchSetting, make_engine

    choices = best_per_batch(summary, plan.to_dict())
    servers = {s.key: s for s in plan.servers}
    chosen = [BatchSetting(c["batch_size"], servers[c["key"]].speculative, servers[c["key"]].draft_path)
              if c["key"] is not None else BatchSetting(c["batch_size"]) for c in choices]
    return {"choices": choices, "engine": plan.engine,
            "config": make_engine(plan.engine).per_batch_size(chosen).to_dict()}


def with_answer(md: str, headline: str, lines: Sequence[str], deploy_md: Sequence[str] = ()) -> str:
    """The report's markdown (drafter.bench.report.markdown) with the answer first (before the
    recommendation), each setting's line after the results table, and the deployable settings per
    batch size last."""
    first = md.find("## Recommendation")
    if first >= 0:
        md = md[:first] + f"## Answer\n\n{headline}\n\n" + md[first:]
    results = md.find("## Results")
    after = md.find("\n## ", results + 1) if results >= 0 else -1
    each = "## Each setting\n\n" + "".join(f"- {line}\n" for line in lines) + "\n"
    md = md[:after + 1] + each + md[after + 1:] if after >= 0 else md + "\n" + each
    return md + ("\n" + "\n".join(deploy_md).rstrip() + "\n" if deploy_md else "")
