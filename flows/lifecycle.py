"""The `drafter-lifecycle` flow: the stages of the table in order, each one a subflow.

Nothing here knows which stage feeds which: the stage table (drafter.stages) says it. A stage that
is not selected is not run, but its fingerprint still names the output the next stage reads
(fingerprints are pure functions of the configuration), so a single stage can be started alone
once its upstream outputs exist; if they do not, it fails naming what is missing.

A stage that fails (a gate's refusal or any error) stops the run: the later stages are not run,
the summary says so, and the run ends Failed with the stage's one-line reason as its state
message, which `prefect deployment run --watch` and `make demo` print.
"""
# No `from __future__ import annotations`: the flow's parameter types are built from the table at
# import time, and Prefect reads them from the signature to render the UI's form and multi-select.
import logging
from dataclasses import dataclass
from typing import Literal, Optional, Union

from prefect import Flow, flow
from prefect.artifacts import create_table_artifact
from prefect.exceptions import FailedRun
from prefect.logging import get_run_logger
from prefect.states import Completed, Failed, State
from prefect.utilities.urls import url_for

from drafter.config import LifecycleConfig
from drafter.errors import describe
from drafter.stages import TABLE, Stage, StageTable
from flows.parameters import Refused, resolve
from tasks.common import failure_of, reap_left_servers
from tasks.fanout import cancel_fanned_out_children
from tasks.lineage import publish_lineage
from tasks.orphans import crash_orphaned_subflows
from tasks.stage import stage_task
from tasks.target import ensure_target_task

# A cancelled or crashed run: its servers reaped, its fanned-out children cancelled, all at once.
# A crashed one (its process killed: the worker reports it and runs these hooks in another process)
# also ends the subflows and task runs its process left Running (`crash_orphaned_subflows`).
REAP = dict(on_cancellation=[reap_left_servers, cancel_fanned_out_children],
            on_crashed=[crash_orphaned_subflows, reap_left_servers, cancel_fanned_out_children])
NOT_RUN = "not run (an earlier stage failed)"


class _RefusalIsNotABug(logging.Filter):
    """A run that ends Failed with its one-line reason (a stage failed or a gate refused, a parameter
    the run cannot use) says so in its own error line and final state. Prefect's engine then asks the
    finished run for its result, which raises `FailedRun` (the wrapper of a Failed state the flow
    returned, never of an exception the flow raised), and logs it as "Engine execution exited with
    unexpected exception" with a traceback (prefect.flow_engine.run_flow, Prefect 3.9). That record
    is dropped: no traceback for a failure that is not a bug. Any other record is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, FailedRun) and str(record.msg).startswith("Engine execution exited"))


logging.getLogger("prefect.flow_runs").addFilter(_RefusalIsNotABug())


def stage_flow(stage: Stage, table: StageTable) -> Flow:
    """The subflow of one stage (its own entry in the UI, with its stage task inside)."""
    run_task = stage_task(stage, table)

    def run(cfg: LifecycleConfig, fingerprints: dict[str, Optional[str]]) -> dict:
        state = run_task(cfg, fingerprints, return_state=True)
        result = state.result()  # the stage's error fails this subflow as well
        # a skipped stage says so on its subflow too, not only on its task run
        return Completed(name=state.name, message=state.message, data=result) if result["skipped"] else result

    run.__doc__ = stage.description
    return flow(run, name=stage.name, log_prints=True, **(REAP if stage.starts_servers else {}))


@dataclass
class StageFailure:
    stage: str
    verb: str                 # "refused" (a gate's decision) or "failed"
    reason: str               # the error's one line (drafter.errors.describe)
    where: str                # the stage's run in the UI, or what else says more

    def line(self) -> str:
        """The run's state message: what `--watch`, `make demo` and the UI show."""
        return f"stage {self.stage} {self.verb}: {self.reason} (see {self.where})"


def _failure(stage: Optional[Stage], name: str, state: Optional[State], error: Optional[BaseException]) -> StageFailure:
    if error is None and state is not None:
        error = failure_of(state)
    reason = describe(error) if error is not None else f"{state.name}: {state.message}"
    run_id = state.state_details.flow_run_id if state is not None else None
    where = (url_for("flow-run", obj_id=run_id) if run_id else None) or (
        f"flow run {run_id} in the run log" if run_id else "the run log")
    verb = "refused" if stage is not None and error is not None and stage.refuses(error) else "failed"
    return StageFailure(name, verb, reason, where)


def graph_edge(subflow_state: State) -> State:
    """What makes the UI's run graph draw upstream stage -> stage. Our stages hand on fingerprints
    (strings), which Prefect cannot trace, and a subflow's state names no task run. The graph keys
    a subflow's node by its flow-run id and draws an edge from any input naming that id: the
    state, naming its flow run as the run to wait for, gives the edge."""
    details = subflow_state.state_details
    waits_on = details.model_copy(update={"task_run_id": details.flow_run_id})
    return subflow_state.model_copy(update={"state_details": waits_on})


def refuse(refused: Refused) -> State:
    """A parameter the run cannot use (flows/parameters.py): the run ends Failed with its one line,
    logged as the run's error, no traceback."""
    get_run_logger().error(str(refused))
    return Failed(message=str(refused))


def run_stages(table: StageTable, subflows: dict[str, Flow], cfg: LifecycleConfig,
               stages, profile: Optional[str] = None) -> Union[dict[str, dict], State]:
    """The target, then the selected stages in lifecycle order, each as its subflow; one summary,
    and the lineage of the last output the run reached (`profile`: the re-run commands' --config).
    Returns every stage's result, or, when one failed, a Failed state naming it (the run's end)."""
    ordered = table.in_order(stages)
    results: dict[str, dict] = {}
    failure: Optional[StageFailure] = None
    target = ensure_target_task(cfg, return_state=True)
    if target.is_completed():
        results["target"] = target.result()
    else:
        failure = _failure(None, "target", target, None)
    fps = table.fingerprints(cfg)
    ran: dict[str, State] = {}
    for stage in ordered:
        if failure is not None:
            break
        try:
            after = [graph_edge(ran[name]) for name in table.upstream_names(stage.name, cfg) if name in ran]
            state = subflows[stage.name](cfg, fps.upstream(stage.name), return_state=True, wait_for=after)
        except Exception as err:  # its upstream fingerprints could not be computed: it never started
            failure = _failure(stage, stage.name, None, err)
            break
        if not state.is_completed():
            failure = _failure(stage, stage.name, state, None)
            break
        results[stage.name] = state.result()
        ran[stage.name] = state
        fps.record(results[stage.name])
    _summarise(ordered, results, failure)
    publish_lineage(cfg, results, [stage.name for stage in ordered], profile)
    if failure is None:
        return results
    get_run_logger().error(failure.line())
    return Failed(message=failure.line())


def lifecycle_flow(table: StageTable) -> Flow:
    """The whole-lifecycle flow over `table` (tests build one over a table with an extra stage)."""
    subflows = {stage.name: stage_flow(stage, table) for stage in table.stages}
    StageName = Literal[tuple(table.names)]  # the UI shows this as a multi-select

    def drafter_lifecycle(profile: str = "profiles/demo.yaml", config: Optional[LifecycleConfig] = None,
                          stages: list[StageName] = list(table.names), run_smoke_first: bool = False) -> dict:
        """Run the selected stages in lifecycle order. `config` wins over `profile` when given.
        `run_smoke_first`: the smoke run (flows/smoke.py) first; when it fails, no stage runs."""
        resolved = resolve(profile, config, stages, table.names)
        if isinstance(resolved, Refused):  # a bad profile, no stage selected: one line, no traceback
            return refuse(resolved)
        cfg, stages = resolved
        if run_smoke_first and (failed := smoke_first(cfg)) is not None:
            return failed
        return run_stages(table, subflows, cfg, stages, profile if config is None else None)

    return flow(drafter_lifecycle, name="drafter-lifecycle", log_prints=True, **REAP)


def smoke_first(cfg: LifecycleConfig) -> Optional[State]:
    """The smoke run as a subflow: None when it passed, else the Failed state that ends the run with
    its reason."""
    from flows.smoke import drafter_smoke  # here: flows/smoke.py imports this module

    state = drafter_smoke(config=cfg, return_state=True)
    if state.is_completed():
        return None
    line = f"smoke run failed, no stage was run: {state.message}"
    get_run_logger().error(line)
    return Failed(message=line)


def answer_line(result: dict) -> str:
    """A stage's headline (the bench's answer) with the run that wrote its output: the last line of
    the parent run's log, which `make demo` prints last."""
    where = result.get("written_by")
    return f"answer: {result['headline']}" + (f"; from run {where}" if where else "")


def _summarise(ordered: list[Stage], results: dict[str, dict], failure: Optional[StageFailure]) -> None:
    """One line per selected stage in the parent run's log (what `make demo` prints) and a table
    artifact, written whether or not the run got through: the failed stage and those not run marked.
    Then each stage's headline (the bench's answer), with the run that wrote it."""
    rows = []
    for stage in ordered:
        result = results.get(stage.name)
        if result is not None:
            state = {"skipped": "skipped (output already complete)"}.get(result["status"], result["status"])
            writer = result.get("written_by") if result["skipped"] else None
            written = f" (written by run {writer})" if writer else ""
            print(f"stage {stage.name}: {state} {result['uri'] or ''}{written}")
            for line in result.get("summary") or []:  # the stage's own figures (accept lengths, the bench table)
                print(f"stage {stage.name} | {line}")
            rows.append({"stage": stage.name, "state": state, "where": result["uri"] or "", "reason": "",
                         "written by": result.get("written_by") or ""})
        elif failure is not None and failure.stage == stage.name:
            print(f"stage {stage.name}: {failure.verb}")
            rows.append({"stage": stage.name, "state": failure.verb, "where": failure.where, "reason": failure.reason,
                         "written by": ""})
        else:
            print(f"stage {stage.name}: {NOT_RUN}")
            rows.append({"stage": stage.name, "state": NOT_RUN, "where": "", "reason": "", "written by": ""})
    if failure is not None and failure.stage == "target":
        rows.insert(0, {"stage": "target", "state": failure.verb, "where": failure.where, "reason": failure.reason,
                        "written by": ""})
    for stage in ordered:
        if (results.get(stage.name) or {}).get("headline"):
            print(answer_line(results[stage.name]))
    create_table_artifact(key="lifecycle-summary", table=rows,
                          description="drafter-lifecycle stages" + (f": {failure.line()}" if failure else ""))


drafter_lifecycle = lifecycle_flow(TABLE)

if __name__ == "__main__":
    drafter_lifecycle()
