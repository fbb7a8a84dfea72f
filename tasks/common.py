"""What every stage task shares: the one retry policy, progress artifacts, run logging."""
from __future__ import annotations

import os
import time

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger

from drafter.errors import is_retryable
from drafter.secrets import register_resolver


def _prefect_secret(block_name: str) -> str:
    """`prefect:BLOCK` in serve.secrets: a Prefect Secret block, read in the worker at launch."""
    from prefect.blocks.system import Secret

    return Secret.load(block_name).get()


register_resolver("prefect", _prefect_secret)


def failure_of(state) -> BaseException | None:
    try:
        result = state.result(raise_on_failure=False)
    except Exception as exc:  # the result itself could not be loaded
        return exc
    return result if isinstance(result, BaseException) else None


def retry_retryable(task, task_run, state) -> bool:
    """The Prefect `retry_condition_fn` of every stage task: retry exactly when the error says a
    later attempt can succeed (`drafter.errors.DrafterError.retryable`): transient storage and
    network trouble, crashed / stalled / health-timeout starts, a server that went down mid-run.
    Configuration, integrity and missing-upstream errors fail at once."""
    exc = failure_of(state)
    return exc is not None and is_retryable(exc)


class ProgressArtifact:
    """A Prefect progress artifact fed by library callbacks, throttled (each update is an API call)."""

    def __init__(self, key: str, description: str, min_interval_s: float = 2.0):
        self.key = key
        self.description = description
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._id = None  # created on the first report, so a skipped stage makes no API calls

    def __call__(self, done: int, total: int | None = None, *info) -> None:
        now = time.monotonic()
        finished = total is not None and done >= total
        if not total or (now - self._last < self.min_interval_s and not finished):
            return
        self._last = now
        if self._id is None:
            self._id = create_progress_artifact(progress=0.0, key=self.key, description=self.description)
        update_progress_artifact(self._id, progress=min(100.0, 100.0 * done / total))


def log():
    return get_run_logger()


def this_run_owns_its_servers():
    """Context for a stage task: servers it launches record this flow run (and the lifecycle run
    it belongs to) in their pid files, so the hooks below reap only this run's servers."""
    from prefect.runtime import flow_run

    from drafter.serving.ownership import owned_by

    try:
        root = flow_run.root_flow_run_id
    except Exception:  # no API to ask: the run's own id still identifies it
        root = None
    return owned_by(kind="prefect", flow_run_id=flow_run.id, root_flow_run_id=root, pid=os.getpid())


def reap_left_servers(flow, flow_run, state) -> None:
    """on_cancellation / on_crashed hook (it runs in ANOTHER process): kill the servers of THIS run
    (their pid files name it, `this_run_owns_its_servers`) still in the run's log directory, i.e.
    ones the run could not tear down. Another run's servers, and a foreground `drafter serve`
    sharing the directory, are left alone."""
    from drafter.config import LifecycleConfig, load_config
    from drafter.serving.ownership import owns, pid_files, reap

    params = flow_run.parameters or {}
    config = params.get("config") or params.get("cfg")
    if config is not None:
        cfg = config if isinstance(config, LifecycleConfig) else LifecycleConfig.model_validate(config)
    else:
        cfg = load_config(params.get("profile", "profiles/demo.yaml"))
    run_id = str(flow_run.id)
    # Only this user's regular files (a link or another user's file in a shared log dir is
    # skipped), and the owner is only a filter: reap signals nothing it has not verified in the
    # kernel as this server's (drafter.serving.ownership.reap).
    for pid_path, info in pid_files(cfg.serve.log_dir):
        if owns(info.get("owner"), run_id):
            print(f"reaping {pid_path}: {reap(pid_path)}", flush=True)
