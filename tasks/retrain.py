"""What a retrain publishes to Prefect: the verdict as an event, accept length across retrains as
an artifact. The verdict itself is the champion stage's (drafter.stages.champion); the
champion-vs-challenger table is that stage's table artifact (`champion-summary`)."""
from __future__ import annotations

import base64

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event

from drafter.config import LifecycleConfig
from drafter.retrain.registry import Registry
from drafter.stage_output import StageOutput
from drafter.formats import CHAMPION, CHAMPION_PLOT
from drafter.store import open_store
from tasks.common import log

EVENTS = {"promoted": "drafter.promoted", "rejected": "drafter.rejected"}


@task(name="publish-verdict")
def publish_verdict(cfg: LifecycleConfig, champion_result: dict) -> dict | None:
    """`drafter.promoted` / `drafter.rejected` with the figures as payload (once per verdict: a
    skipped stage already published it), and the accept-length plot as a markdown artifact."""
    decision = champion_result["meta"]
    event = EVENTS.get(decision["verdict"])
    emitted = None
    if event and not champion_result["skipped"]:
        payload = {k: decision.get(k) for k in (
            "verdict", "reason", "challenger", "champion", "champion_after", "champion_accept_length",
            "challenger_accept_length", "difference", "relative", "interval", "prompts", "min_improvement",
            "corpus", "registry", "bench")}
        emitted = emit_event(event=event, payload=payload,
                             resource={"prefect.resource.id": f"drafter.registry.{decision['target']}.{decision['drafter']}",
                                       "prefect.resource.name": decision["drafter"]},
                             related=[{"prefect.resource.id": f"drafter.export.{decision['challenger']}",
                                       "prefect.resource.role": "challenger"}])
        log().info("emitted %s for export %s", event, decision["challenger"])
    store = open_store(cfg.storage)
    png = StageOutput.committed(store, CHAMPION, champion_result["fingerprint"]).read_shard(CHAMPION_PLOT)
    rows = Registry.for_config(cfg, store).decisions()
    table = "\n".join(f"| {i} | {d['at']} | {d['verdict']} | {_fmt(d.get('champion_accept_length'))} | "
                      f"{_fmt(d.get('challenger_accept_length'))} | {d['challenger']} |" for i, d in enumerate(rows, 1))
    create_markdown_artifact(
        key="accept-length-across-retrains", description=f"drafter {decision['drafter']}: every retrain's verdict",
        markdown=f"![accept length across retrains](data:image/png;base64,{base64.b64encode(png).decode()})\n\n"
                 "| retrain | at | verdict | champion | challenger | challenger export |\n|---|---|---|---|---|---|\n"
                 + table + "\n")
    return {"event": event if emitted else None, "decisions": len(rows)}


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"
