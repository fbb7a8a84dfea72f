"""The Prefect task of any stage in the table: run it, log its outcome, publish its report.

The library decides what a stage does and returns one StageResult; this module only turns it into
Prefect things (run-log lines, a progress artifact, a table artifact, a gate's verdict as a markdown
artifact, a skipped stage's state message) and returns `StageResult.to_dict()`: URIs and manifest
meta, never data. The store is the source of truth, so a deleted output is recomputed, never "Cached".
"""
from __future__ import annotations

from prefect import Task, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.states import Completed
from prefect.tasks import exponential_backoff

from drafter.config import LifecycleConfig
from drafter.errors import DrafterError, describe
from drafter.serving.launcher import ServerLine
from drafter.fanout import RangeTask, done_line
from drafter.stage_output import StageResult
from drafter.stages import Stage, StageTable
from drafter.store import open_store
from tasks.common import ProgressArtifact, log, retry_retryable, this_run_owns_its_servers
from tasks.fanout import fan_out_runner


def skipped_message(uri: str) -> str:
    """A skipped stage's task-run state message (else it looks like a one-second run in the UI)."""
    return f"skipped: output already complete at {uri}"


def stage_task(stage: Stage, table: StageTable) -> Task:
    """A task running `stage`: `(cfg, fingerprints) -> dict`, where `fingerprints` holds what the
    flow knows (upstream stages that ran in this flow run); the rest come from the table."""

    def verdict(result=None, error=None) -> None:
        markdown = stage.verdict(result, error) if stage.verdict is not None else None
        if markdown is not None:
            create_markdown_artifact(key=f"{stage.name}-verdict", markdown=markdown,
                                     description=f"{stage.name}: the gate's verdict")

    def run(cfg: LifecycleConfig, fingerprints: dict[str, str | None]) -> dict:
        fan_out = fan_out_runner(cfg) if stage.fans_out else None
        result = _run_logged(stage, lambda **kw: table.run(stage.name, cfg, open_store(cfg.storage),
                                                           fingerprints=table.fingerprints(cfg, fingerprints),
                                                           fan_out=fan_out, **kw), verdict)
        if result.table and not result.skipped:
            create_table_artifact(key=f"{stage.name}-summary", description=f"{stage.name} {result.uri}",
                                  table=list(result.table))
        if result.skipped:  # a skipped gate published its verdict in the run that decided
            return Completed(message=skipped_message(result.uri), data=result.to_dict())
        verdict(result)
        fanned = result.meta.get("fan_out")
        if fanned:  # the stage's state message keeps the ranges' count
            return Completed(message=done_line(stage.name, fanned), data=result.to_dict())
        return result.to_dict()

    return task(run, name=stage.name, retries=stage.retries, retry_delay_seconds=exponential_backoff(10),
                retry_jitter_factor=0.5, retry_condition_fn=retry_retryable)


def range_task(stage: Stage, table: StageTable) -> Task:
    """A task computing one range of a fanned-out stage (a child run, flows/fanout.py): the same
    logging, progress and retry policy as the stage's own task; it writes shards, never commits."""

    def run(cfg: LifecycleConfig, upstream: dict[str, str], task: dict) -> dict:
        spec = RangeTask.from_dict(task)
        result = _run_logged(stage, lambda **kw: table.run(stage.name, cfg, open_store(cfg.storage), upstream=upstream,
                                                           range_task=spec, **kw))
        return Completed(message=result.summary[0], data=result.to_dict())

    return task(run, name=f"{stage.name}-range", retries=stage.retries, retry_delay_seconds=exponential_backoff(10),
                retry_jitter_factor=0.5, retry_condition_fn=retry_retryable)


def _run_logged(stage: Stage, run, verdict=None) -> StageResult:
    """Run the stage with this run owning its servers, server lines and progress into Prefect,
    its outcome and summary lines logged."""
    logger = log()
    progress = ProgressArtifact(f"{stage.name}-progress", stage.description)

    def on_line(line: str) -> None:
        # Server output never reaches the UI by itself: stream it into the run log, marked as
        # the server's; the stage's own lines go as they are.
        logger.info("[server] %s" if isinstance(line, ServerLine) else "%s", line)

    try:
        with this_run_owns_its_servers():
            result = run(progress=progress, on_line=on_line)
    except DrafterError as err:
        # The CLI's one line, in the run log too (Prefect's own traceback follows it).
        logger.error("%s: %s", stage.name, describe(err))
        if verdict is not None:
            verdict(error=err)
        raise
    if result.skipped:
        logger.info("%s: skipped, output already complete at %s", stage.name, result.uri)
    elif result.manifest is not None:
        logger.info("%s: wrote %s", stage.name, result.uri)
    for line in result.summary:
        logger.info("%s: %s", stage.name, line)
    return result
