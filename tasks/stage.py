"""The Prefect task of any stage in the table: run it, log its outcome, publish its report.

The library decides what a stage does and returns one StageResult; this module only turns it into
Prefect things (run-log lines, a progress artifact, a table artifact) and returns
`StageResult.to_dict()`: URIs and manifest meta, never data. The store is the source of truth, so
a deleted output is recomputed, never "Cached".
"""
from __future__ import annotations

from prefect import Task, task
from prefect.artifacts import create_table_artifact
from prefect.tasks import exponential_backoff

from drafter.config import LifecycleConfig
from drafter.errors import DrafterError, describe
from drafter.stages import Stage, StageTable
from drafter.store import open_store
from tasks.common import ProgressArtifact, log, retry_retryable, this_run_owns_its_servers


def stage_task(stage: Stage, table: StageTable) -> Task:
    """A task running `stage`: `(cfg, fingerprints) -> dict`, where `fingerprints` holds what the
    flow knows (upstream stages that ran in this flow run); the rest come from the table."""

    def run(cfg: LifecycleConfig, fingerprints: dict[str, str | None]) -> dict:
        logger = log()
        fps = table.fingerprints(cfg, fingerprints)
        progress = ProgressArtifact(f"{stage.name}-progress", stage.description)
        # Server output never reaches the UI by itself: stream its lines into the run log.
        try:
            with this_run_owns_its_servers():
                result = table.run(stage.name, cfg, open_store(cfg.storage), fingerprints=fps, progress=progress,
                                   on_line=lambda line: logger.info("[server] %s", line))
        except DrafterError as err:
            # The CLI's one line, in the run log too (Prefect's own traceback follows it).
            logger.error("%s: %s", stage.name, describe(err))
            raise
        if result.skipped:
            logger.info("%s: skipped, output already complete at %s", stage.name, result.uri)
        elif result.manifest is not None:
            logger.info("%s: wrote %s", stage.name, result.uri)
        for line in result.summary:
            logger.info("%s: %s", stage.name, line)
        if result.table and not result.skipped:
            create_table_artifact(key=f"{stage.name}-summary", description=f"{stage.name} {result.uri}",
                                  table=list(result.table))
        return result.to_dict()

    return task(run, name=stage.name, retries=stage.retries, retry_delay_seconds=exponential_backoff(10),
                retry_jitter_factor=0.5, retry_condition_fn=retry_retryable)
