"""The bench report: a markdown document, rows for a table artifact (plain dicts) and a PNG plot.

How to read it: `speedup` is config / baseline output tokens/s over paired rounds with its
interval; the verdict says "faster" or "slower" only when the whole interval is on one side of
1.0. `break-even` is the accept length the configuration needs to match the baseline on this
machine (its verify-cycle time over the baseline's per-token step time); compare it with the
accept length it got. A configuration is recommended only when it is significantly faster and the
baseline did not drift. With `bench.accept_curve`, a section and a plot panel show speedup against
accept length from the forced-acceptance servers, and each drafter's measured point next to the
speedup the curve predicts at its accept length (drafter.bench.predict).
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from drafter.bench.predict import not_honoured
from drafter.contracts.context_curve import accept_by_context, bucket_edges


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if value is None else fmt.format(value)


def _ci(entry: dict | None, fmt: str = "{:.1f}") -> str:
    if not entry:
        return "—"
    mean, lo, hi = entry["mean"], entry["low"], entry["high"]
    if lo is None:
        return f"{fmt.format(mean)} (1 round)"
    return f"{fmt.format(mean)} ± {fmt.format((hi - lo) / 2)}"


def _speedup(sp: dict | None) -> str:
    if not sp:
        return "—"
    if sp["low"] is None:
        return f"{sp['speedup']:.2f}x (no interval: 1 round)"
    return f"{sp['speedup']:.2f}x [{sp['low']:.2f}, {sp['high']:.2f}]"


def table_rows(summary: dict, failures: dict[str, dict]) -> list[dict[str, Any]]:
    """One plain dict per (configuration, batch size): the headline table."""
    out = []
    for row in summary["rows"]:
        sp = row.get("speedup")
        failed = failures.get(row["key"])
        status = ("not measured" if not row["rounds"] else "baseline" if "speedup" not in row
                  else sp["verdict"] if sp else "no paired rounds")
        if failed:
            status = f"failed ({failed['kind']})" + (f" after {row['rounds']} rounds" if row["rounds"] else "")
        out.append({
            "config": row["config"], "batch": row["batch_size"], "rounds": row["rounds"],
            "output tok/s": _ci(row.get("output_tok_s")),
            "speedup [CI]": ("—" if not row["rounds"] else _speedup(sp) if "speedup" in row
                             else "1.00x (reference)"),
            "verdict": status,
            "accept length": _ci(row.get("accept_length"), "{:.2f}"),
            "break-even accept": _num(row.get("break_even_accept_length"), "{:.2f}"),
            "latency s": _ci(row.get("latency_s"), "{:.3f}"),
            "TTFT s": _ci(row.get("ttft_s"), "{:.3f}"),
            "ITL ms": _ci(_scaled(row.get("itl_s"), 1000.0), "{:.2f}"),
        })
    return out


def _scaled(entry: dict | None, k: float) -> dict | None:
    if not entry:
        return None
    return {**entry, **{f: (entry[f] * k if entry[f] is not None else None) for f in ("mean", "low", "high")}}


def markdown_table(rows: Sequence[dict]) -> str:
    if not rows:
        return "(no measurements)\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def interleave_note(mode: str, servers: int, rounds: int) -> str:
    if mode == "concurrent":
        return (f"Interleaving: the {servers} planned servers were launched once each and kept alive at "
                f"once (consecutive ports; one that failed to start is left out), measured one at a time, rounds round-robin across configurations (round r "
                f"starts at configuration r mod {servers}). Idle servers stay resident in memory while "
                f"another is measured.")
    return (f"Interleaving: one server at a time; every (configuration, round) got its own launch "
            f"({servers} x {rounds} launches), in rotating order, because the servers cannot share "
            f"the accelerator. Every measurement is on a fresh server after the warm-up requests.")


def _versus(ratio: dict | None) -> str:
    if not ratio:
        return "not measured"
    return ratio["verdict"] if ratio["verdict"] not in ("faster", "slower") else f"challenger {ratio['verdict']}"


def head_to_head_rows(pairs: Sequence[dict]) -> list[dict[str, Any]]:
    """The challenger-vs-champion table: one plain dict per (setting, batch size)."""
    return [{"setting": p["setting"], "batch": p["batch_size"], "rounds": p["rounds"],
             "challenger / champion tok/s [CI]": _speedup(p["ratio"]),
             "verdict": _versus(p["ratio"]),
             "accept length challenger": _ci(p["accept_length"]["challenger"], "{:.2f}"),
             "accept length champion": _ci(p["accept_length"]["champion"], "{:.2f}")} for p in pairs]


def _interval(p: dict | None) -> str:
    if not p:
        return "—"
    if p.get("low") is None or p.get("high") is None:
        return f"{p['speedup']:.2f}x (no interval)"
    return f"{p['speedup']:.2f}x [{p['low']:.2f}, {p['high']:.2f}]"


def _accept(value: float | None, interval: Sequence[float] | None) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def accept_curve_section(curves: Sequence[dict]) -> list[str]:
    """Markdown lines: per (setting, batch size) the forced points, then each drafter measured
    there with the speedup the curve predicts at its accept length."""
    parts = ["## Speedup against accept length", ""]
    for c in curves:
        parts += [f"### {c['setting']}, batch {c['batch_size']}", "",
                  markdown_table([{"forced accept length": f"{p['requested']:g}",
                                   "measured accept length": _accept(p["accept_length"], p["accept_interval"]),
                                   "speedup [CI]": _interval(p), "rounds": p["rounds"]} for p in c["points"]])]
        parts += [f"- forced {p['requested']:g} but measured {p['accept_length']:.2f}: the engine did not give the "
                  f"accept length asked for (its knob, `Engine.forced_acceptance`); the point stands where it was "
                  f"measured" for p in not_honoured(c["points"])]
        for m in c["measured"]:
            who = f"{m['drafter']} drafter" if m["drafter"] else "the drafter"
            pred = m.get("predicted")
            verdict = {True: "agree (intervals overlap)", False: "DISAGREE (intervals apart)",
                       None: "not compared (no interval)"}[m.get("agree")]
            parts.append(f"- {who}: accept length {_accept(m['accept_length'], m['accept_interval'])}, measured "
                         f"{_interval(m)}; predicted from the curve {_interval(pred)}"
                         + (" (extrapolated)" if pred and pred["extrapolated"] else "") + f": {verdict}")
        parts.append("")
    parts += ["Each point is the same setting served with acceptance forced (the engine's own knob) in the same "
              "interleaved sweep: the speedup a drafter with that accept length would get here. Accept length: "
              "1 + accepted drafts / verifies, the offline judge's figure. Between points the cycle cost "
              "(accept length / speedup) is interpolated linearly.", ""]
    return parts


def accept_by_context_position(measurements: Sequence[dict], engine: str, context: int | None,
                               edges: Sequence[int] | None = None) -> list[dict]:
    """Per drafter setting and batch size (forced-acceptance servers and the baseline left out):
    accept length by context position over every round, each request placed at its context
    (prompt + completion tokens), in the export judge's buckets. `curve` None, with `why`, where
    the engine's answers carry no per-request acceptance (aggregate counters only) or the records
    predate it; never estimated."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for m in measurements:
        if m.get("baseline") or m.get("forced_accept_length") is not None or not m.get("verify_ct"):
            continue
        groups.setdefault((m["config"], m["batch_size"]), []).append(m)
    out = []
    for (config, bs), ms in groups.items():
        entry = {"config": config, "batch_size": bs, "curve": None, "figure": None, "why": None}
        if any("by_request" not in m for m in ms):
            entry["why"] = "measured before per-request acceptance was recorded"
        elif any(m["by_request"] is None for m in ms):
            entry["why"] = (f"engine {engine} reports acceptance only as aggregate counters (no per-request "
                            "figure): no accept length by context position")
        else:
            rows = [r for m in ms for r in m["by_request"]]
            entry["curve"] = accept_by_context(rows, bucket_edges(context, edges, longest=max(r[0] for r in rows)),
                                               context, requests=True)
            entry["figure"] = ms[0]["by_request_figure"]
        out.append(entry)
    return out


def context_lines(entries: Sequence[dict]) -> list[str]:
    """One line per setting and batch size: its accept length in each context bucket."""
    lines = []
    for e in entries:
        head = f"accept length by context position at {e['config']} @ batch {e['batch_size']}: "
        if e["curve"] is None:
            lines.append(head + e["why"])
            continue
        lines.append(head + ", ".join(
            f"{b['positions']} " + (f"{b['accept_length']:.2f}" if b["accept_length"] is not None else "—")
            + f" ({b['requests']} requests)" for b in e["curve"]))
    return lines


def context_section(entries: Sequence[dict]) -> list[str]:
    """Markdown: accept length by context position, per setting and batch size."""
    if not entries:
        return []
    parts = ["## Accept length by context position", ""]
    for e in entries:
        parts += [f"### {e['config']}, batch {e['batch_size']}", ""]
        if e["curve"] is None:
            parts += [f"- {e['why']}", ""]
            continue
        figure = "1 + accepted / verifies" if e["figure"] == "draft" else e["figure"]
        parts.append(markdown_table([{"context positions": b["positions"], "requests": b["requests"],
                                      "verifies": b["blocks"],
                                      f"accept length ({figure})": _num(b["accept_length"], "{:.2f}")}
                                     for b in e["curve"]]))
    parts += ["Each request counts at its context: prompt + completion tokens, where its last draft block ran "
              "(its earlier blocks started up to bench.max_tokens before it). Accept length: 1 + accepted drafts / "
              "verifies where the engine's answer counts accepted drafts, else completion tokens / verifies "
              "(SGLang's figure). A bucket without requests is empty (—), not zero; the offline judge's curve "
              "(export) places every draft block at its own position.", ""]
    return parts


def markdown(summary: dict, rows: Sequence[dict], *, plan: dict, failures: dict[str, dict],
             launches: Sequence[dict], hardware: dict, settings: dict, notes: Sequence[str] = (),
             head_to_head: Sequence[dict] = (), accept_curves: Sequence[dict] = (),
             by_context: Sequence[dict] = ()) -> str:
    b = settings
    parts = ["# Bench report", "",
             f"Engine `{plan['engine']}`, {b['num_prompts']} held-out prompts, {b['max_tokens']} new tokens "
             f"per request (ignore_eos={b['ignore_eos']}), temperature 0, {b['warmup_requests']} warm-up "
             f"requests discarded per measurement, {plan['rounds']} rounds, confidence {b['confidence']:.0%}, "
             f"concurrency = batch size.", "",
             interleave_note(plan["interleave"], len(plan["servers"]), plan["rounds"]), ""]
    parts += ["## Recommendation", ""]
    for bs, rec in summary["recommendation"].items():
        parts.append(f"- batch {bs}: {rec['text']}")
    parts += ["", "## Results", "", markdown_table(rows)]
    parts += ["Speedup: config / baseline output tokens/s over paired rounds; interval: paired-round "
              "bootstrap widened to the paired t interval of the log ratios. Break-even accept: the "
              "accept length needed to match the baseline (verify-cycle time / baseline step time).", ""]
    if head_to_head:
        parts += ["## Challenger vs champion", "", markdown_table(head_to_head_rows(head_to_head)),
                  "Challenger / champion: output tokens/s at the same setting over paired rounds, the same "
                  "interval as the speedup (the champion in the baseline's place).", ""]
    if accept_curves:
        parts += accept_curve_section(accept_curves)
    parts += context_section(by_context)
    parts += ["## Baseline drift", ""]
    for bs, d in summary["drift"].items():
        if d["relative_change"] is None:
            parts.append(f"- batch {bs}: fewer than 2 baseline rounds, not checked")
        else:
            flag = "UNSTABLE machine" if d["unstable"] else "stable"
            parts.append(f"- batch {bs}: {d['per_round']:+.1%} per round (tolerance {d['tolerance']:.0%}): "
                         f"{flag}; first {d['first']:.1f} -> last {d['last']:.1f} tok/s "
                         f"({d['relative_change']:+.1%} over the sweep)")
    if plan["skipped"] or failures:
        parts += ["", "## Skipped and failed configurations", ""]
        parts += [f"- skipped {s['config']}: {s['reason']}" for s in plan["skipped"]]
        parts += [f"- failed {f['config']}: {f['kind']}: {f['message'].splitlines()[0] if f['message'] else ''}"
                  + (f" ({f['fix']})" if f.get("fix") else "") for f in failures.values()]
    parts += ["", "## What ran", ""]
    for launch in launches:
        s = launch.get("settings") or {}
        spec = (f"{s.get('algorithm')} {s.get('num_steps')}/{s.get('eagle_topk')}/{s.get('num_draft_tokens')}"
                if s.get("algorithm") else "no speculation")
        parts.append(f"- {launch['config']} (launch {launch['launch']}): server reports {spec}; engine version "
                     f"{launch.get('engine_version') or 'unknown'}; ready in {launch['seconds_to_ready']:.1f} s; "
                     f"log `{launch['log_path']}`")
    gpus = hardware.get("gpus")
    parts += ["", f"Hardware: {hardware.get('cpu_model') or 'unknown CPU'} x {hardware.get('cpu_count')}, "
                  f"{hardware.get('memory_gib', '?')} GiB; GPUs: {', '.join(gpus) if gpus else 'none seen'}; "
                  f"{hardware.get('platform')}."]
    parts += [f"- {n}" for n in notes]
    return "\n".join(parts) + "\n"


def plot_png(summary: dict, title: str = "bench", accept_curves: Sequence[dict] = ()) -> bytes:
    """Throughput (mean with CI error bars) per configuration and batch size; accept length with
    the break-even accept length marked; with accept-length curves, a third panel with them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if r.get("output_tok_s")]
    configs = list(dict.fromkeys(r["config"] for r in summary["rows"]))
    batches = sorted({r["batch_size"] for r in summary["rows"]})
    if accept_curves:
        fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 4.5))
        draw_accept_curves(ax3, accept_curves)
    else:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(configs))
    for i, config in enumerate(configs):
        xs, ys, errs = [], [], [[], []]
        for j, bs in enumerate(batches):
            row = next((r for r in rows if r["config"] == config and r["batch_size"] == bs), None)
            if row is None:
                continue
            tp = row["output_tok_s"]
            xs.append(j + (i - (len(configs) - 1) / 2) * width)
            ys.append(tp["mean"])
            errs[0].append(tp["mean"] - tp["low"] if tp["low"] is not None else 0.0)
            errs[1].append(tp["high"] - tp["mean"] if tp["high"] is not None else 0.0)
        ax1.bar(xs, ys, width, yerr=errs, capsize=3, label=config)
    ax1.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax1.set_ylabel("output tokens/s (mean, CI)")
    ax1.set_title("throughput")
    ax1.legend(fontsize=7)
    spec_rows = [r for r in rows if r.get("accept_length")]
    labels = [f"{r['config']}\nbatch {r['batch_size']}" for r in spec_rows]
    for k, r in enumerate(spec_rows):
        a = r["accept_length"]
        err = [[a["mean"] - a["low"] if a["low"] is not None else 0.0],
               [a["high"] - a["mean"] if a["high"] is not None else 0.0]]
        ax2.bar([k], [a["mean"]], 0.6, yerr=err, capsize=3, color="tab:green",
                label="accept length" if k == 0 else None)
        if r.get("break_even_accept_length"):
            ax2.hlines(r["break_even_accept_length"], k - 0.35, k + 0.35, colors="tab:red",
                       label="break-even" if k == 0 else None)
    ax2.set_xticks(range(len(labels)), labels, fontsize=7)
    ax2.set_ylabel("tokens per verify cycle")
    ax2.set_title("accept length vs break-even")
    if spec_rows:
        ax2.legend(fontsize=7)
    else:
        ax2.text(0.5, 0.5, "no speculative measurements", ha="center", va="center", transform=ax2.transAxes)
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _yerr(p: dict) -> list[list[float]]:
    lo, hi = p.get("low"), p.get("high")
    return [[p["speedup"] - lo if lo is not None else 0.0], [hi - p["speedup"] if hi is not None else 0.0]]


def draw_accept_curves(ax, curves: Sequence[dict]) -> None:
    """Speedup against accept length: each curve's forced points (intervals, joined), each drafter's
    measured point and the curve's prediction at its accept length, side by side."""
    for k, c in enumerate(curves):
        color = f"C{k % 10}"
        xs = [p["accept_length"] for p in c["points"]]
        ax.plot(xs, [p["speedup"] for p in c["points"]], "-", color=color, alpha=0.6)
        for p in c["points"]:
            ax.errorbar([p["accept_length"]], [p["speedup"]], yerr=_yerr(p), fmt="s", color=color, capsize=3,
                        markersize=4)
        for m in c["measured"]:
            if m["accept_length"] is None:
                continue
            ax.errorbar([m["accept_length"]], [m["speedup"]], yerr=_yerr(m), fmt="o", color=color, capsize=3,
                        label=f"{c['setting']} b{c['batch_size']}: {m['drafter'] or 'drafter'} measured")
            if m.get("predicted"):
                ax.errorbar([m["accept_length"] + 0.03], [m["predicted"]["speedup"]], yerr=_yerr(m["predicted"]),
                            fmt="x", color=color, capsize=3, label="predicted from the curve")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("accept length (1 + accepted drafts / verifies)")
    ax.set_ylabel("speedup over the baseline")
    ax.set_title("speedup against accept length (squares: forced)")
    ax.legend(fontsize=7)
