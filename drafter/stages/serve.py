"""The `serve` stage: start the configured engine with the configured drafter, gate it on a real
generation, read back the speculative settings it actually uses, and tear it down.

It writes nothing to the store: its result is the server's report (settings read back, phases,
log and launch-environment paths). A failed start raises its typed ServerStartError (crashed,
stalled and health-timeout starts are `retryable`; configuration errors are not), and settings
the server rewrote fail the stage (field note 3).
"""
from __future__ import annotations

from collections.abc import Mapping

from drafter.config import LifecycleConfig
from drafter.serving.check import check_server
from drafter.stage_output import Progress, StageResult
from drafter.store import ObjectStore

STAGE = "serve"


def fingerprint(cfg: LifecycleConfig, upstream: Mapping[str, str]) -> None:
    """None: a server is not a stored output (nothing downstream reads one by fingerprint yet)."""
    return None


def run(cfg: LifecycleConfig, store: ObjectStore, *, upstream: Mapping[str, str] | None = None,
        progress: Progress | None = None, on_line=None) -> StageResult:
    """`on_line` receives every server log line (the Prefect task streams them into the run log)."""
    report = check_server(cfg, draft_path=cfg.serve.draft_path, on_line=on_line, raise_on_failure=True)
    table = [{"metric": "base url", "value": str(report["base_url"])},
             {"metric": "log", "value": report["log_path"]},
             {"metric": "launch environment", "value": report["launch_path"]},
             {"metric": "settings read back", "value": str(report["settings"])},
             {"metric": "phases", "value": ", ".join(str(p) for p in report["phases"])}]
    return StageResult(stage=STAGE, status=report["status"], uri=report["base_url"], meta=report,
                       summary=(report["message"],), table=tuple(table))
