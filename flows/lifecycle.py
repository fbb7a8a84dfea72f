"""The `drafter-lifecycle` flow: the stages of the table in order, each one a subflow.

Nothing here knows which stage feeds which: the stage table (drafter.stages) says it. A stage that
is not selected is not run, but its fingerprint still names the output the next stage reads
(fingerprints are pure functions of the configuration), so a single stage can be started alone
once its upstream outputs exist; if they do not, it fails naming what is missing.
"""
# No `from __future__ import annotations`: the flow's parameter types are built from the table at
# import time, and Prefect reads them from the signature to render the UI's form and multi-select.
from typing import Literal, Optional

from prefect import Flow, flow
from prefect.artifacts import create_table_artifact

from drafter.config import LifecycleConfig, load_config
from drafter.stages import TABLE, Stage, StageTable
from tasks.common import reap_left_servers
from tasks.stage import stage_task
from tasks.target import ensure_target_task

REAP = dict(on_cancellation=[reap_left_servers], on_crashed=[reap_left_servers])


def stage_flow(stage: Stage, table: StageTable) -> Flow:
    """The subflow of one stage (its own entry in the UI, with its stage task inside)."""
    run_task = stage_task(stage, table)

    def run(cfg: LifecycleConfig, fingerprints: dict[str, Optional[str]]) -> dict:
        return run_task(cfg, fingerprints)

    run.__doc__ = stage.description
    return flow(run, name=stage.name, log_prints=True, **(REAP if stage.starts_servers else {}))


def run_stages(table: StageTable, subflows: dict[str, Flow], cfg: LifecycleConfig, stages) -> dict[str, dict]:
    """The target, then the selected stages in lifecycle order, each as its subflow; one summary."""
    results: dict[str, dict] = {"target": ensure_target_task(cfg)}
    fps = table.fingerprints(cfg)
    for stage in table.in_order(stages):
        results[stage.name] = subflows[stage.name](cfg, fps.upstream(stage.name))
        fps.record(results[stage.name])
    _summarise({k: v for k, v in results.items() if k != "target"})
    return results


def lifecycle_flow(table: StageTable) -> Flow:
    """The whole-lifecycle flow over `table` (tests build one over a table with an extra stage)."""
    subflows = {stage.name: stage_flow(stage, table) for stage in table.stages}
    StageName = Literal[tuple(table.names)]  # the UI shows this as a multi-select

    def drafter_lifecycle(profile: str = "profiles/demo.yaml", config: Optional[LifecycleConfig] = None,
                          stages: list[StageName] = list(table.names)) -> dict:
        """Run the selected stages in lifecycle order. `config` wins over `profile` when given."""
        cfg = config if config is not None else load_config(profile)
        return run_stages(table, subflows, cfg, stages)

    return flow(drafter_lifecycle, name="drafter-lifecycle", log_prints=True, **REAP)


def _summarise(results: dict[str, dict]) -> None:
    """One line per stage in the parent run's log (what `make demo` prints) and a table artifact."""
    rows = []
    for stage, result in results.items():
        state = {"skipped": "skipped (output already complete)"}.get(result["status"], result["status"])
        print(f"stage {stage}: {state} {result['uri'] or ''}")
        for line in result.get("summary") or []:  # the stage's own figures (accept lengths, the bench table)
            print(f"stage {stage} | {line}")
        rows.append({"stage": stage, "state": state, "where": result["uri"] or ""})
    create_table_artifact(key="lifecycle-summary", table=rows, description="drafter-lifecycle stages")


drafter_lifecycle = lifecycle_flow(TABLE)

if __name__ == "__main__":
    drafter_lifecycle()
