"""The `drafter-smoke` flow: `drafter smoke` under Prefect (drafter.smoke, one task). The lifecycle
flow runs it first with `run_smoke_first` and stops with its reason when it fails."""
# No `from __future__ import annotations`: Prefect reads the parameter types from the signature.
from typing import Optional, Union

from prefect import flow
from prefect.logging import get_run_logger
from prefect.states import Failed, State

from drafter.config import LifecycleConfig
from drafter.errors import describe
from flows.lifecycle import REAP, refuse
from flows.parameters import Refused, config_or_refuse
from tasks.common import failure_of
from tasks.smoke import smoke_task
from tasks.target import ensure_target_task


def smoke_line(state: State) -> str:
    """A failed smoke's one line (the lifecycle's state message when it stops on it)."""
    error = failure_of(state)
    return describe(error) if error is not None else f"smoke {state.name}: {state.message}"


@flow(name="drafter-smoke", log_prints=True, **REAP)
def drafter_smoke(profile: str = "profiles/demo.yaml", config: Optional[LifecycleConfig] = None) -> Union[dict, State]:
    """A few prompts through datagen, a small dump, a drafter overfit on them, export, the profile's engine
    serving it, a full draft block accepted on a training prompt: minutes. Outputs under <storage.root>/smoke."""
    try:
        cfg = config_or_refuse(profile, config)
    except Refused as refused:
        return refuse(refused)
    target = ensure_target_task(cfg, return_state=True)  # the demo builds its own, as the lifecycle does
    state = smoke_task(cfg, return_state=True) if target.is_completed() else target
    if state.is_completed():
        return state.result()
    line = smoke_line(state)
    get_run_logger().error(line)
    return Failed(message=line)


if __name__ == "__main__":
    drafter_smoke()
