"""Prefect task around drafter.prepare.run_prepare."""
from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.tasks import exponential_backoff

from drafter.config import LifecycleConfig
from drafter.prepare import run_prepare
from drafter.store import open_store
from tasks.common import ProgressArtifact, log, retry_transient


@task(name="prepare-prompts", retries=3, retry_delay_seconds=exponential_backoff(5),
      retry_jitter_factor=0.5, retry_condition_fn=retry_transient)
def prepare_task(cfg: LifecycleConfig) -> dict:
    """Returns the stage's URI and manifest meta (never data): the store is the source of truth."""
    result = run_prepare(cfg, open_store(cfg.storage),
                         progress=ProgressArtifact("prepare-progress", "prompt preparation"))
    meta = result.manifest.meta
    if result.skipped:
        log().info("prepare: skipped, output already complete at %s", result.uri)
    else:
        log().info("prepare: wrote %s", result.uri)
        create_table_artifact(key="prepare-summary", description=f"prepare {result.uri}",
                              table=[{"metric": k, "value": str(v)} for k, v in meta.items()])
    return {"stage": "prepare", "uri": result.uri, "fingerprint": result.manifest.fingerprint,
            "skipped": result.skipped, "meta": meta}
