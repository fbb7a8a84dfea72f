"""The `drafter-retrain` flow: the stages of the table in order (each a subflow, as in
`drafter-lifecycle`), then the verdict published to Prefect.

With a retrain profile (a growing source, `train.init_from: champion`, `serve.draft_path:
champion`, `retrain.bench`) each run prepares the corpus version the source holds now, generates
and dumps only what earlier runs did not (drafter.contracts.reuse), fine-tunes the champion, exports and
judges the challenger, benches it side by side with the champion and the baseline, lets the
`champion` stage promote or reject it, then serves the champion.
The verdict becomes a `drafter.promoted` / `drafter.rejected` event (the figures as payload, for
automations: notify, redeploy) and the accept length across retrains an artifact.
"""
from typing import Literal, Optional

from prefect import Flow, flow
from prefect.states import State

from drafter.config import LifecycleConfig
from drafter.stages import TABLE, StageTable
from flows.lifecycle import REAP, refuse, run_stages, stage_flow
from flows.parameters import Refused, resolve
from tasks.retrain import publish_verdict


def retrain_flow(table: StageTable) -> Flow:
    subflows = {stage.name: stage_flow(stage, table) for stage in table.stages}
    StageName = Literal[tuple(table.names)]

    def drafter_retrain(profile: str = "profiles/retrain-demo.yaml", config: Optional[LifecycleConfig] = None,
                        stages: list[StageName] = list(table.names)) -> dict:
        """Retrain on the source's current files; promote the challenger only when it is better."""
        resolved = resolve(profile, config, stages, table.names)
        if isinstance(resolved, Refused):  # a bad profile, no stage selected: one line, no traceback
            return refuse(resolved)
        cfg, stages = resolved
        results = run_stages(table, subflows, cfg, stages, profile if config is None else None)
        if isinstance(results, State):  # a stage failed: the run ends with its reason
            return results
        if "champion" in results:
            results["published"] = publish_verdict(cfg, results["champion"])
        return results

    return flow(drafter_retrain, name="drafter-retrain", log_prints=True, **REAP)


drafter_retrain = retrain_flow(TABLE)

if __name__ == "__main__":
    drafter_retrain()
