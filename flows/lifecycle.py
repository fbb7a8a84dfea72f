"""The `drafter-lifecycle` flow: the stages in order, each one a subflow that may be run alone."""
from __future__ import annotations

from typing import Literal, Optional, get_args

from prefect import flow

from drafter.config import LifecycleConfig, load_config
from tasks.prepare import prepare_task
from tasks.serve import reap_left_servers, serve_task
from tasks.target import ensure_target_task

# Only stages that exist are offered (the UI shows this as a multi-select).
Stage = Literal["prepare", "serve"]
ALL_STAGES: list[str] = list(get_args(Stage))


@flow(name="prepare", log_prints=True)
def prepare_flow(cfg: LifecycleConfig) -> dict:
    return prepare_task(cfg)


@flow(name="serve", log_prints=True, on_cancellation=[reap_left_servers], on_crashed=[reap_left_servers])
def serve_flow(cfg: LifecycleConfig) -> dict:
    """Start, gate and tear down the configured server (the drafter comes from serve.draft_path)."""
    return serve_task(cfg, cfg.serve.draft_path)


STAGE_FLOWS = {"prepare": prepare_flow, "serve": serve_flow}


@flow(name="drafter-lifecycle", log_prints=True,
      on_cancellation=[reap_left_servers], on_crashed=[reap_left_servers])
def drafter_lifecycle(profile: str = "profiles/demo.yaml",
                      config: Optional[LifecycleConfig] = None,
                      stages: list[Stage] = ALL_STAGES) -> dict:
    """Run the selected stages in lifecycle order. `config` wins over `profile` when given."""
    cfg = config if config is not None else load_config(profile)
    results: dict[str, dict] = {"target": ensure_target_task(cfg)}
    for stage in ALL_STAGES:  # lifecycle order, whatever order the caller listed them in
        if stage in stages:
            results[stage] = STAGE_FLOWS[stage](cfg)
    return results


if __name__ == "__main__":
    drafter_lifecycle()
