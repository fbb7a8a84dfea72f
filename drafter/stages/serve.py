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

from collections.abc import Mapping
from pathlib import Path

from drafter.config import LifecycleConfig
from drafter.formats import EXPORT, download_export
from drafter.retrain.registry import CHAMPION, Registry
from drafter.serving.check import check_server
from drafter.stage_output import Progress, StageResult
from drafter.store import ObjectStore

STAGE = "serve"


def export_dir(cfg: LifecycleConfig, store: ObjectStore, export_fp: str) -> str:
    """An export as a local directory the configured engine loads, in that engine's format (vLLM's
    layer ids are one higher): `<serve.log_dir>/../drafters/export-<fp>[-vllm]/`, kept between
    runs (files re-verified, not re-fetched)."""
    fmt = "vllm" if cfg.serve.engine == "vllm" else "sglang"
    root = Path(cfg.serve.log_dir).parent / "drafters"
    name = f"export-{export_fp}" + ("-vllm" if fmt == "vllm" else "")
    return str(download_export(store, export_fp, root / name, fmt).resolve())


def draft_path(cfg: LifecycleConfig, store: ObjectStore, upstream: Mapping[str, str]) -> str | None:
    """`serve.draft_path` (`champion`: the registry's current champion export), else this run's
    export when the table made it an upstream, else None."""
    if cfg.serve.draft_path == CHAMPION:
        return export_dir(cfg, store, Registry.for_config(cfg, store).require_champion())
    if cfg.serve.draft_path:
        return cfg.serve.draft_path
    return export_dir(cfg, store, upstream[EXPORT]) if EXPORT in upstream else None


def fingerprint(cfg: LifecycleConfig, upstream: Mapping[str, str]) -> None:
    """None: a server is not a stored output (nothing downstream reads one by fingerprint yet)."""
    return None


def run(cfg: LifecycleConfig, store: ObjectStore, *, upstream: Mapping[str, str] | None = None,
        progress: Progress | None = None, on_line=None) -> StageResult:
    """`on_line` receives every server log line (the Prefect task streams them into the run log)."""
    draft = draft_path(cfg, store, upstream or {})
    report = check_server(cfg, draft_path=draft, on_line=on_line, raise_on_failure=True)
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
