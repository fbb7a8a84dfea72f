"""A fanned-out stage's children as Prefect flow runs of the range deployment (drafter.fanout).

Each range is one `run_deployment` of `<stage>.worker_deployment` (flows/fanout.py) on that
deployment's work pool, with `<stage>.worker_job_variables` (e.g. `gpus` on the Kubernetes pool),
started from inside the stage's task so that the UI's run graph draws the children under it, named
by their range. Keys and tags carry the parent run:
- the idempotency key is (parent run, stage, output, range, attempt): a re-run of the lifecycle
  launches new children (and only for the ranges the store says are unfinished); a retried stage
  task of the same run gets the children it launched already;
- the tag `drafter-fanout-of:<id>` (the parent stage run and the lifecycle run) lets the lifecycle
  run's cancellation hook cancel every child at once (`cancel_fanned_out_children`).
The parent's state message says how many ranges are done and failed while it waits.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, FlowRunFilterTags
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.logging import get_run_logger
from prefect.states import Cancelled, Cancelling, Crashed, Running

from drafter.config import ConfigError, LifecycleConfig
from drafter.fanout import ChildState, FanOut, RangeTask, ShardRange, child_config, run_ranges
from drafter.store import open_store

TAG = "drafter-fanout-of:"
KIND = {StateType.SCHEDULED: "waiting", StateType.PENDING: "starting", StateType.PAUSED: "waiting",
        StateType.RUNNING: "running", StateType.COMPLETED: "done", StateType.FAILED: "failed",
        StateType.CRASHED: "lost", StateType.CANCELLED: "cancelled", StateType.CANCELLING: "cancelled"}
UNFINISHED = [StateType.SCHEDULED, StateType.PENDING, StateType.PAUSED, StateType.RUNNING]


class PrefectLauncher:
    """drafter.fanout.Launcher over Prefect deployments (one flow run per range and attempt)."""

    def __init__(self, cfg: LifecycleConfig, job: FanOut):
        from prefect.runtime import flow_run, task_run

        self.cfg, self.job = cfg, job
        self.settings = getattr(cfg, job.stage)
        self.parent, self.root, self.task_run = str(flow_run.id), str(flow_run.root_flow_run_id), task_run.id
        self.client = get_client(sync_client=True)

    def launch(self, part: ShardRange, attempt: int) -> Any:
        s, job = self.settings, self.job
        task = RangeTask(part, job.fingerprint, job.plan, attempt, lease_interval_s=s.worker_lease_timeout_s / 4)
        try:
            run = run_deployment(
                name=s.worker_deployment, timeout=0, as_subflow=True,
                parameters={"stage": job.stage, "config": child_config(self.cfg, part).model_dump(mode="json"),
                            "upstream": dict(job.upstream), "task": task.to_dict()},
                flow_run_name=f"{job.stage} {part.label}" + (f" (attempt {attempt})" if attempt > 1 else ""),
                idempotency_key=f"{self.parent}/{job.stage}/{job.fingerprint}/{part.slug}/a{attempt}",
                tags=[f"{TAG}{self.parent}", f"{TAG}{self.root}", f"drafter-stage:{job.stage}"],
                job_variables=s.worker_job_variables or None)
        except ObjectNotFound:
            raise ConfigError([(f"{job.stage}.worker_deployment", f"no deployment {s.worker_deployment!r} on the "
                                "Prefect server: deploy deployments/prefect.yaml (infra/prefect-up.sh does)")]) from None
        return run.id

    def state(self, run_id) -> ChildState:
        state = self.client.read_flow_run(run_id).state
        if state is None:
            return ChildState("waiting")
        return ChildState(KIND.get(state.type, "waiting"), state.message or state.name)

    def mark_lost(self, run_id, why: str) -> None:
        self.client.set_flow_run_state(run_id, Crashed(message=why), force=True)

    def cancel(self, run_ids: Sequence[Any]) -> None:
        for run_id in run_ids:
            cancel_run(self.client, run_id, f"the {self.job.stage} stage that launched it stopped")

    def report(self, line: str) -> None:
        """The parent's state message while it waits (the stage's task run, still Running)."""
        get_run_logger().info(line)
        if self.task_run is not None:
            self.client.set_task_run_state(self.task_run, Running(message=line), force=True)


def fan_out_runner(cfg: LifecycleConfig) -> Callable[[FanOut], dict]:
    """What a stage's task hands the library (StageContext.fan_out): run the ranges as children."""

    def fan_out(job: FanOut) -> dict:
        launcher = PrefectLauncher(cfg, job)
        s = launcher.settings
        with launcher.client:
            return run_ranges(job, launcher, open_store(cfg.storage), attempts=s.worker_attempts,
                              lease_timeout_s=s.worker_lease_timeout_s, start_timeout_s=s.worker_start_timeout_s,
                              on_status=launcher.report)

    return fan_out


def cancel_run(client, run_id, why: str) -> None:
    """Cancel one child: one that never started is Cancelled at once; a started one is set
    Cancelling, which its worker turns into killing it (and its own hooks reap its servers)."""
    run = client.read_flow_run(run_id)
    if run.state is None or run.state.type not in UNFINISHED:
        return
    started = run.state.type == StateType.RUNNING or run.infrastructure_pid
    client.set_flow_run_state(run_id, (Cancelling if started else Cancelled)(message=why), force=True)


def cancel_fanned_out_children(flow, flow_run, state) -> None:
    """on_cancellation / on_crashed hook of the lifecycle flows: cancel every unfinished child that a
    fanned-out stage of this run launched, all at once (Prefect's own cleanup reaches them one by one)."""
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[f"{TAG}{flow_run.id}"]), state=FlowRunFilterState(type=FlowRunFilterStateType(any_=UNFINISHED))))
        for child in children:
            cancel_run(client, child.id, f"its lifecycle run {flow_run.id} was {state.name.lower()}")
            print(f"cancelled fan-out child {child.name} ({child.id})", flush=True)
