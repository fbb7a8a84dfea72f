"""A crashed lifecycle run's subflows and task runs, ended with it.

Prefect 3 runs a subflow (each stage of `drafter-lifecycle`) and its tasks inside the parent's own
process. When that process dies without a word (`kill -9`, the OOM killer), the process worker sees
it exit and sets the parent `Crashed` (prefect.runner._flow_run_executor: "Process exited with
status code: -9"), then runs the parent's `on_crashed` hooks in another process; nothing reports
the subflows and task runs that were running inside it, and Prefect leaves them `Running` forever.
This hook (`on_crashed` of the lifecycle flows, flows/lifecycle.py) sets every unfinished subflow of
the crashed run (recursively) and every unfinished task run in them `Crashed`, naming the run whose
process died. A child that runs in a process of its own (a fan-out range, a deployment run: it has a
deployment) is left to `cancel_fanned_out_children` and its own worker.
"""
from __future__ import annotations

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterParentFlowRunId, FlowRunFilterState,
                                            FlowRunFilterStateType, TaskRunFilter, TaskRunFilterFlowRunId,
                                            TaskRunFilterState, TaskRunFilterStateType)
from prefect.client.schemas.objects import StateType
from prefect.states import Crashed

UNFINISHED = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]


def orphan_message(flow_run, state) -> str:
    why = f": {state.message}" if state is not None and state.message else ""
    return f"orphaned: the process of run {flow_run.name!r} ({flow_run.id}), which ran this, crashed{why}"


def crash_orphaned_subflows(flow, flow_run, state) -> None:
    """on_crashed hook: end the subflows and task runs the crashed run's process left unfinished."""
    message = orphan_message(flow_run, state)
    with get_client(sync_client=True) as client:
        ended = _crash_under(client, flow_run.id, message)
    for kind, name, run_id in ended:
        print(f"marked {kind} {name!r} ({run_id}) Crashed: {message}", flush=True)


def _crash_under(client, parent_id, message: str, depth: int = 0) -> list[tuple[str, str, object]]:
    ended: list[tuple[str, str, object]] = []
    if depth > 16:  # a cycle would be Prefect's bug; never loop on it
        return ended
    subflows = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id]),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=UNFINISHED))))
    for sub in subflows:
        if sub.deployment_id is not None:  # its own process (a fan-out child): not this process's
            continue
        ended += _crash_under(client, sub.id, message, depth + 1)
        client.set_flow_run_state(sub.id, Crashed(message=message), force=True)
        ended.append(("subflow", sub.name, sub.id))
    tasks = client.read_task_runs(task_run_filter=TaskRunFilter(
        flow_run_id=TaskRunFilterFlowRunId(any_=[parent_id]),
        state=TaskRunFilterState(type=TaskRunFilterStateType(any_=UNFINISHED))))
    for task_run in tasks:
        client.set_task_run_state(task_run.id, Crashed(message=message), force=True)
        ended.append(("task run", task_run.name, task_run.id))
    return ended
