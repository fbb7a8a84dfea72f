"""What a gate stage decided, as markdown (the Prefect task publishes it as an artifact).

Each verdict takes the stage's StageResult (it ran or was skipped) or the error it raised, and returns
None for an error that is not the gate's refusal (a crash, storage trouble: that is a failure, not a
verdict). A gate's stage module names its verdict `verdict` (the stage table's `gate` rows). They
read the gates' own error types, so they sit with the stages, above the stage packages.
"""
from __future__ import annotations


def _markdown(title: str, lines, table=()) -> str:
    text = [f"## {title}", ""] + [f"- {line}" for line in lines]
    rows = list(table)
    if rows:
        cols = list(rows[0])
        cell = lambda v: str(v if v is not None else "-").replace("|", "\\|").replace("\n", " ")
        text += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        text += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(text) + "\n"


def _refusal(stage: str, error: BaseException, refusals: tuple[type, ...]) -> str | None:
    """A gate refuses with one of its own error types, never with one a retry may fix."""
    if not isinstance(error, refusals) or getattr(error, "retryable", False):
        return None
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return _markdown(f"{stage}: refused ({type(error).__name__})", lines)


def export_verdict(result, error: BaseException | None = None) -> str | None:
    """The offline judge: passed (with the thresholds it met) or refused (the threshold missed, or
    files that differ from what the engine loads)."""
    from drafter.export.sglang import ExportError

    if error is not None:
        return _refusal("export", error, (ExportError,))
    v = (result.meta.get("judge") or {}).get("verdict") or {}
    bar = [f"export.min_accept_length {v['min_accept_length']}", f"export.min_accept_ratio {v['min_accept_ratio']}"
           + (f" (ratio to training's prediction {v['ratio_to_prediction']:.2f})" if v.get("ratio_to_prediction") else "")]
    if v.get("last_bucket"):  # export.min_last_bucket_accept_length, when it is on
        lb = v["last_bucket"]
        bar.append(f"export.min_last_bucket_accept_length {lb['min_accept_length']} (accept length "
                   f"{lb['accept_length']:.2f} at context positions {lb['positions']}, {lb['blocks']} draft blocks)")
    return _markdown("export: passed", [f"met {' and '.join(bar)}", *result.summary], result.table)


def champion_verdict(result, error: BaseException | None = None) -> str | None:
    """promoted / rejected / unchanged, why, and the two drafters' figures side by side."""
    from drafter.retrain.registry import RegistryError
    from drafter.retrain.verdict import RetrainError

    if error is not None:
        return _refusal("champion", error, (RegistryError, RetrainError))
    return _markdown(f"champion: {result.meta['verdict']}", result.summary, result.table)


def bench_verdict(result, error: BaseException | None = None) -> str | None:
    """The answer (faster or not, by how much, on which engine), the recommendation per batch size
    (or why there is none), then every setting's figures."""
    from drafter.bench import BenchError

    if error is not None:
        return _refusal("bench", error, (BenchError,))
    recs = result.meta.get("recommendation") or {}
    decided = ([f"**{result.headline}**"] if result.headline else []) + [
        f"**batch {bs}: {rec['text']}**" for bs, rec in recs.items()]
    rest = [line for line in result.summary if not line.startswith("batch ")]  # the recommendations lead
    return _markdown("bench: recommendation", [*decided, *rest], result.table)
