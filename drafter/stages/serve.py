"""The `serve` stage: start the configured engine with the configured drafter, gate it on a real
generation, read back the speculative settings it actually uses, and tear it down.

The drafter: `serve.draft_path` when set (`champion`: the drafter registry's current champion for
this target and `retrain.drafter_name`); otherwise, when `serve.speculative` is set, this
configuration's export (the stage table makes `export` its upstream then). With neither, the target is
served alone. It writes nothing to the store: its result is the server's report (settings read back, phases,
log and launch-environment paths). A failed start raises its typed ServerStartError (crashed,
stalled and health-timeout starts are `retryable`; configuration errors are not), and settings
the server rewrote fail the stage (field note 3).
"""
from __future__ import annotations

from dataclasses import dataclass

from drafter.config import LifecycleConfig
from drafter.formats import EXPORT
from drafter.serving.check import check_server
from drafter.stage_result import StageResult
from drafter.stages.base import StageContext
from drafter.stages.drafters import Drafters, needs_export, resolve_drafter

STAGE = "serve"


def needs(cfg: LifecycleConfig) -> tuple[str, ...]:
    """This run's export, unless the profile names a drafter directory (or `champion`) or serves
    the target alone."""
    return (EXPORT,) if needs_export(cfg, STAGE) else ()


@dataclass(frozen=True)
class Inputs:
    ctx: StageContext
    drafters: Drafters


def inputs(ctx: StageContext) -> Inputs:
    return Inputs(ctx, resolve_drafter(ctx.cfg, ctx.store, ctx.upstream, source=ctx.cfg.serve.draft_path,
                                       source_field="serve.draft_path", identify=False))


def fingerprint(inputs: Inputs) -> None:
    """None: a server is not a stored output (nothing downstream reads one by fingerprint yet)."""
    return None


def draft_path(inputs: Inputs) -> str | None:
    """The directory the server loads (an export fetched in the engine's format), or None."""
    return inputs.drafters.local_paths(inputs.ctx.cfg, inputs.ctx.store).get("")


def build(inputs: Inputs, out: None) -> StageResult:
    """Start, gate, read back, stop. The context's `on_line` receives every server log line (the
    Prefect task streams them into the run log)."""
    cfg = inputs.ctx.cfg
    draft = draft_path(inputs)
    report = check_server(cfg, draft_path=draft, on_line=inputs.ctx.on_line, raise_on_failure=True)
    report["draft_path"] = draft
    table = [{"metric": "base url", "value": str(report["base_url"])},
             {"metric": "log", "value": report["log_path"]},
             {"metric": "launch environment", "value": report["launch_path"]},
             {"metric": "settings read back", "value": str(report["settings"])},
             {"metric": "phases", "value": ", ".join(str(p) for p in report["phases"])}]
    summary = [report["message"]]
    layers = report.get("layer_ids") or {}
    if layers.get("engine_version"):  # which engine version the layer-id rule was taken from
        summary.append(f"{layers['engine']} {layers['engine_version']} ({layers['version_source']}): "
                       + (f"draft layer ids {layers['ids']} = our {layers['aux_layer_ids']} ({layers['rule']})"
                          if layers.get("checked") else f"layer ids not checked: {layers['why']}"))
        table.append({"metric": "engine version (layer-id rule)", "value": f"{layers['engine_version']} "
                                                                         f"({layers['version_source']})"})
    return StageResult(stage=STAGE, status=report["status"], uri=report["base_url"], meta=report,
                       summary=tuple(summary), table=tuple(table))
