"""The `drafter-lifecycle` flow: the stages in order, each one a subflow that may be run alone."""
from __future__ import annotations

from typing import Literal, Optional, get_args

from prefect import flow
from prefect.artifacts import create_table_artifact

from drafter.config import LifecycleConfig, load_config
from drafter.datagen import datagen_fingerprint
from drafter.prepare import prepare_fingerprint
from tasks.datagen import datagen_task
from tasks.dump import dump_task
from tasks.prepare import prepare_task
from tasks.serve import reap_left_servers, serve_task
from tasks.target import ensure_target_task

# Only stages that exist are offered (the UI shows this as a multi-select).
Stage = Literal["prepare", "datagen", "dump", "serve"]
ALL_STAGES: list[str] = list(get_args(Stage))


@flow(name="prepare", log_prints=True)
def prepare_flow(cfg: LifecycleConfig) -> dict:
    return prepare_task(cfg)


REAP = dict(on_cancellation=[reap_left_servers], on_crashed=[reap_left_servers])


@flow(name="datagen", log_prints=True, **REAP)
def datagen_flow(cfg: LifecycleConfig, prepare_fp: str) -> dict:
    """Regenerate the answers of the prepared prompts with the target (starts it when no URL is given)."""
    return datagen_task(cfg, prepare_fp)


@flow(name="dump", log_prints=True)
def dump_flow(cfg: LifecycleConfig, upstream_stage: str, upstream_fp: str) -> dict:
    """Capture the target's aux + final hidden states into object storage."""
    return dump_task(cfg, upstream_stage, upstream_fp)


@flow(name="serve", log_prints=True, **REAP)
def serve_flow(cfg: LifecycleConfig) -> dict:
    """Start, gate and tear down the configured server (the drafter comes from serve.draft_path)."""
    return serve_task(cfg, cfg.serve.draft_path)


@flow(name="drafter-lifecycle", log_prints=True, **REAP)
def drafter_lifecycle(profile: str = "profiles/demo.yaml",
                      config: Optional[LifecycleConfig] = None,
                      stages: list[Stage] = ALL_STAGES) -> dict:
    """Run the selected stages in lifecycle order. `config` wins over `profile` when given.

    A stage that is not selected is not run, but its fingerprint still names the output the next
    stage reads (fingerprints are pure functions of the configuration), so a single stage can be
    started alone once its upstream outputs exist; if they do not, it fails naming what is missing.
    """
    cfg = config if config is not None else load_config(profile)
    results: dict[str, dict] = {"target": ensure_target_task(cfg)}
    prepare_fp = prepare_fingerprint(cfg.data)
    if "prepare" in stages:
        results["prepare"] = prepare_flow(cfg)
        prepare_fp = results["prepare"]["fingerprint"]
    datagen_fp = datagen_fingerprint(cfg, prepare_fp)
    if "datagen" in stages:
        results["datagen"] = datagen_flow(cfg, prepare_fp)
        datagen_fp = results["datagen"]["fingerprint"]
    if "dump" in stages:
        upstream = {"datagen": datagen_fp, "prepare": prepare_fp}
        results["dump"] = dump_flow(cfg, cfg.dump.upstream, upstream[cfg.dump.upstream])
    if "serve" in stages:
        results["serve"] = serve_flow(cfg)
    _summarise(results)
    return results


def _summarise(results: dict[str, dict]) -> None:
    """One line per stage in the parent run's log (what `make demo` prints) and a table artifact."""
    rows = []
    for stage, result in results.items():
        if stage == "target":
            continue
        if "skipped" in result:
            state = "skipped (output already complete)" if result["skipped"] else "done"
        else:
            state = result.get("status", "done")
        where = result.get("uri") or result.get("base_url") or ""
        print(f"stage {stage}: {state} {where}")
        rows.append({"stage": stage, "state": state, "where": where})
    create_table_artifact(key="lifecycle-summary", table=rows, description="drafter-lifecycle stages")


if __name__ == "__main__":
    drafter_lifecycle()
