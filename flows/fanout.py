"""The `drafter-stage-range` flow: one contiguous range of a fanned-out stage's shards.

A stage with `<stage>.workers` > 1 (datagen, dump) launches one run of this flow per range
(tasks/fanout.py), through `<stage>.worker_deployment` (by default `drafter-stage-range/local`,
deployments/prefect.yaml), on that deployment's work pool.
The run computes the range's pending shards and writes them with their markers, beating a lease in
the store meanwhile; the parent stage commits once every range is done (drafter.fanout). Its own
servers (datagen without `server_urls`) are torn down by the stage, and reaped by the hooks when
the run is cancelled or crashes.
"""
# No `from __future__ import annotations`: Prefect reads the parameter types from the signature.
from prefect import flow

from drafter.config import LifecycleConfig
from drafter.stages import TABLE
from tasks.common import reap_left_servers
from tasks.stage import range_task

RANGE_TASKS = {stage.name: range_task(stage, TABLE) for stage in TABLE.stages if stage.fans_out}


@flow(name="drafter-stage-range", log_prints=True, on_cancellation=[reap_left_servers],
      on_crashed=[reap_left_servers])
def drafter_stage_range(stage: str, config: LifecycleConfig, upstream: dict[str, str], task: dict) -> dict:
    """Compute one range of a fanned-out stage (`task`: the range, the parent's plan and output)."""
    if stage not in RANGE_TASKS:
        raise ValueError(f"stage {stage!r} does not fan out; stages that do: {', '.join(RANGE_TASKS)}")
    return RANGE_TASKS[stage](config, upstream, task)
