"""The Prefect task of any stage in the table: run it, log its outcome, publish its report.

The library decides what a stage does and returns one StageResult; this module only turns it into
Prefect things (run-log lines, a progress artifact, a table artifact, a gate's verdict as a markdown
artifact, a skipped stage's state message) and returns `StageResult.to_dict()`: URIs and manifest
meta, never data, plus `written_by`, the URL of the stage run that wrote the output. The store is
the source of truth, so a deleted output is recomputed, never "Cached".

Which run wrote an output: the stage run (its subflow, flows/lifecycle.py) that wrote it carries the
tag `drafter-wrote:<stage>/<fingerprint>`. A skipped stage looks that run up, names it in its state
message and publishes the figures it skipped with (its table artifact, again), and shows that it
skipped where runs are listed and drawn: its state is named `Skipped`, its runs are renamed
`<stage> (skipped)` and tagged `skipped`.
"""
from __future__ import annotations

from collections.abc import Sequence

from prefect import Task, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.states import Completed
from prefect.tasks import exponential_backoff
from prefect.utilities.urls import url_for

from drafter.config import LifecycleConfig
from drafter.errors import DrafterError, describe
from drafter.serving.launcher import ServerLine
from drafter.fanout import RangeTask, done_line
from drafter.stage_result import StageResult
from drafter.stages import Stage, StageTable
from drafter.store import open_store
from tasks.common import ProgressArtifact, log, retry_retryable, this_run_owns_its_servers
from tasks.fanout import fan_out_runner


WROTE = "drafter-wrote:"   # + "<stage>/<fingerprint>": the tag of the stage run that wrote that output
SKIPPED = "skipped"        # the tag of a stage run that found its output complete
SKIPPED_STATE = "Skipped"  # its state's name (type COMPLETED): what the run list's badge says


def skipped_message(uri: str, written_by: str | None = None, headline: str = "") -> str:
    """A skipped stage's task-run state message (else it looks like a one-second run in the UI)."""
    return (f"skipped: output already complete at {uri}" + (f" (written by run {written_by})" if written_by else "")
            + (f": {headline}" if headline else ""))


def table_columns(rows: Sequence[dict]) -> dict[str, list]:
    """A table artifact as columns in the rows' own order: Prefect's UI takes the columns of a list
    of rows from the first row's keys only; columns keep the order and every row's keys."""
    names = list(dict.fromkeys(k for row in rows for k in row))
    return {name: [row.get(name, "") for row in rows] for name in names}


def _run_url(run_id) -> str:
    """The run's page in the UI; its id where no UI URL is configured."""
    return url_for("flow-run", obj_id=run_id) or str(run_id)


def _stage_run(stage: Stage):
    """The id of the stage's own subflow run this task runs in (flows/lifecycle.py), else None."""
    from prefect.runtime import flow_run

    try:
        return flow_run.id if flow_run.flow_name == stage.name else None
    except Exception:  # no run context to ask
        return None


def mark_written(stage: Stage, result: StageResult) -> str | None:
    """Tag this stage run as the one that wrote `result`'s output; its URL. Best effort: the output
    is committed whatever the API says."""
    run_id = _stage_run(stage)
    if run_id is None or result.fingerprint is None:
        return None
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            tags = client.read_flow_run(run_id).tags or []
            client.update_flow_run(run_id, tags=[*tags, f"{WROTE}{stage.name}/{result.fingerprint}"])
    except Exception as err:
        log().warning("%s: could not tag run %s as the one that wrote %s (%s)", stage.name, run_id, result.uri, err)
    return _run_url(run_id)


def mark_skipped(stage: Stage, result: StageResult) -> str | None:
    """Show that this stage run skipped (state name, run names, tag); the URL of the run that wrote
    the output (the latest completed stage run tagged so), None when none is known here."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                FlowRunFilterTags)
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.context import TaskRunContext

    run_id = _stage_run(stage)
    writer = None
    try:
        with get_client(sync_client=True) as client:
            if result.fingerprint is not None:
                found = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    tags=FlowRunFilterTags(all_=[f"{WROTE}{stage.name}/{result.fingerprint}"]),
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.COMPLETED]))),
                    sort=FlowRunSort.START_TIME_DESC, limit=1)
                writer = _run_url(found[0].id) if found else None
            ctx = TaskRunContext.get()
            if ctx is not None:  # the engine reports its task run (name included) with each state
                ctx.task_run.name = f"{stage.name} (skipped)"
                client.request("PATCH", "/task_runs/{id}", path_params={"id": ctx.task_run.id},
                               json={"name": ctx.task_run.name}).raise_for_status()
            if run_id is not None:
                tags = client.read_flow_run(run_id).tags or []
                client.update_flow_run(run_id, name=f"{stage.name} (skipped)", tags=[*tags, SKIPPED])
    except Exception as err:
        log().warning("%s: could not mark this run as skipped or find the run that wrote %s (%s)", stage.name,
                      result.uri, err)
    return writer


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
        if result.skipped:  # a skipped gate published its verdict in the run that decided
            written_by = mark_skipped(stage, result)
            if result.table:  # the figures it skipped with, on its own page too
                create_table_artifact(key=f"{stage.name}-summary", table=table_columns(result.table),
                                      description=f"{stage.name} {result.uri}: skipped, output already complete; "
                                                  f"the figures of the run that wrote it ({written_by or 'unknown'})")
            return Completed(name=SKIPPED_STATE, message=skipped_message(result.uri, written_by, result.headline),
                             data={**result.to_dict(), "written_by": written_by})
        written_by = mark_written(stage, result)
        if result.table:
            create_table_artifact(key=f"{stage.name}-summary", description=f"{stage.name} {result.uri}",
                                  table=table_columns(result.table))
        verdict(result)
        data = {**result.to_dict(), "written_by": written_by}
        fanned = result.meta.get("fan_out")
        if fanned:  # the stage's state message keeps the ranges' count
            return Completed(message=done_line(stage.name, fanned), data=data)
        if result.headline:
            return Completed(message=result.headline, data=data)
        return data

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
