"""The stage table is the only wiring: the flow, the CLI and the tasks read it; a new stage is one
module and one row; one deployment runs any stage; every config field says whether it changes
its stage's output."""
import json
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from drafter.config import LifecycleConfig, is_output_field, parse_config
from drafter.stages import STAGES, TABLE, Stage, StageTable

ROOT = Path(__file__).resolve().parents[2]
# The config sections stages read: every section of LifecycleConfig except the shared ones, so a new
# stage's section is checked without a list to edit. `target` and `storage` are every stage's: the
# target enters fingerprints through target_identity, the storage never.
SHARED_SECTIONS = ("target", "storage")
STAGE_SECTIONS = tuple(name for name, info in LifecycleConfig.model_fields.items()
                       if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
                       and name not in SHARED_SECTIONS)


def all_log_messages(client) -> list[str]:
    """Every log line the server holds, oldest first: the log worker drained first (logs are sent in
    batches), then read page by page (one read returns at most the server's default limit)."""
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    messages: list[str] = []
    while True:
        page = client.read_logs(offset=len(messages), sort=LogSort.TIMESTAMP_ASC)
        messages += [entry.message for entry in page]
        if not page:
            return messages


def corpus_config(tmp_path) -> LifecycleConfig:
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"q {i}?"}]}) + "\n"
                              for i in range(12)))
    return parse_config({"target": {"path": str(tmp_path / "no-target"), "num_hidden_layers": 8, "vocab_size": 100},
                         "train": {"draft_vocab_size": 50},
                         "data": {"sources": [{"kind": "jsonl", "path": str(corpus)}], "eval_fraction": 0.25},
                         "storage": {"root": f"file://{tmp_path}/store"}})


def test_every_stage_module_has_the_contract():
    """The four parts (drafter.stages.base) and what it needs; the skeleton is the table's alone."""
    for stage in STAGES:
        code = stage.code
        stores = code.fingerprint.__annotations__.get("return") != "None"  # serve: no stored output
        # a stage that fans out plans its shards (`plan`, `compute`, `finish`); the skeleton builds from that plan
        work = ("plan", "compute", "finish") if stage.fans_out else ("build",)
        for part in ("needs", "inputs", "fingerprint", *work, *(("summarize",) if stores else ())):
            assert callable(getattr(code, part, None)), (stage.name, part)
        assert not hasattr(code, "build" if stage.fans_out else "plan"), stage.name
        if stage.fans_out:
            assert "workers" in LifecycleConfig.model_fields[stage.name].annotation.model_fields, stage.name
        assert not hasattr(code, "run"), f"{stage.name}: the table runs the skeleton, not the module"
        assert stage.module == f"drafter.stages.{stage.name}"
        assert (stage.verdict is not None) == stage.gate


def test_upstream_wiring_comes_from_the_table(tmp_path):
    cfg = corpus_config(tmp_path)
    fps = TABLE.fingerprints(cfg)
    assert fps.upstream("datagen") == {"prepare": fps["prepare"]}
    assert fps.upstream("dump") == {"datagen": fps["datagen"]}  # dump.upstream: datagen (default)
    as_corpus = cfg.model_copy(update={"dump": cfg.dump.model_copy(update={"upstream": "prepare"})})
    assert TABLE.fingerprints(as_corpus).upstream("dump") == {"prepare": fps["prepare"]}
    assert fps["serve"] is None  # a server is not a stored output
    with pytest.raises(KeyError, match="no stage"):
        TABLE.in_order(["prepare", "nope"])


def test_a_stage_needing_an_unknown_stage_is_refused(tmp_path):
    table = StageTable([Stage("count", "tests.fixtures.fake_stage", "count")])  # needs prepare, not in this table
    with pytest.raises(KeyError, match="needs unknown stages \\['prepare'\\]"):
        table.run("count", corpus_config(tmp_path), upstream={})
    with pytest.raises(ValueError, match="share a name"):
        StageTable([*STAGES, STAGES[0]])


@pytest.mark.parametrize("section", STAGE_SECTIONS)
def test_every_stage_config_field_is_classified(section):
    """OutputField (in the fingerprint) or OperationalField (not): a new field nobody classified
    could silently fail to invalidate old outputs, so it fails here first."""
    model = LifecycleConfig.model_fields[section].annotation
    unclassified = [name for name, info in model.model_fields.items() if is_output_field(info) is None]
    assert not unclassified, f"{section}: declare {unclassified} with OutputField or OperationalField"


def test_operational_fields_leave_fingerprints_alone(tmp_path):
    cfg = corpus_config(tmp_path)
    fps = TABLE.fingerprints(cfg)
    faster = cfg.model_copy(update={"datagen": cfg.datagen.model_copy(update={"concurrency_per_server": 64})})
    assert TABLE.fingerprints(faster)["datagen"] == fps["datagen"]
    hotter = cfg.model_copy(update={"datagen": cfg.datagen.model_copy(update={"temperature": 0.9})})
    assert TABLE.fingerprints(hotter)["datagen"] != fps["datagen"]


def test_one_deployment_runs_any_stage_of_the_table():
    """The `stage` deployment's choices are the flow's `stages` parameter, generated from the table."""
    from flows.lifecycle import drafter_lifecycle

    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    (single,) = [d for d in spec["deployments"] if d.get("parameters", {}).get("stages")]
    assert single["name"] == "stage" and single["entrypoint"] == "flows/lifecycle.py:drafter_lifecycle"
    schema = drafter_lifecycle.parameters.model_dump()
    assert schema["properties"]["stages"]["items"]["enum"] == TABLE.names


def test_a_new_stage_is_one_module_and_one_row(tmp_path, tiny_target, prefect_server):
    """A fake stage added to a copy of the table runs through the real flow (a Prefect test
    server), reads its upstream's output by the fingerprint the table gives, and skips on a re-run."""
    from flows.lifecycle import lifecycle_flow
    from drafter.stages import prepare

    table = StageTable([*STAGES, Stage("count", "tests.fixtures.fake_stage", "count the prompts")])
    cfg = corpus_config(tmp_path)
    cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"path": str(tiny_target)})})
    run = lifecycle_flow(table)
    assert "count" in run.parameters.model_dump()["properties"]["stages"]["items"]["enum"]
    first = run(config=cfg, stages=["count", "prepare"])  # run in table order whatever the order given
    again = run(config=cfg, stages=["count"])
    # an expected failure is the CLI's one line in the run log too
    other = cfg.model_copy(update={"data": cfg.data.model_copy(update={"seed": 7})})
    with pytest.raises(Exception):
        run(config=other, stages=["count"])
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        messages = all_log_messages(client)
    assert any(m.startswith("count: error (ObjectNotFound): prepare is not committed") for m in messages), messages
    prepared = TABLE.fingerprint("prepare", cfg)
    assert first["prepare"]["status"] == "done" and first["count"]["status"] == "done"
    assert first["count"]["meta"] == {"conversations": 9, "prepare": prepared}
    assert again["count"]["status"] == "skipped" and "prepare" not in again


def _latest(items):
    return max(items, key=lambda x: x.created)


def test_a_refusing_gate_ends_the_run_failed_with_its_reason(tmp_path, tiny_target, prefect_server):
    """A gate that refuses ends the flow run Failed with the stage's one line (and where to look)
    as the run's state message; the summary artifact lists the refused stage and the one not run;
    the verdict is a markdown artifact of its task run; a re-run's skipped stage says so in its
    task run's state message; the stage's own lines are not marked as a server's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterKey, FlowFilter, FlowFilterName,
                                                FlowRunFilter, FlowRunFilterId)

    from flows.lifecycle import NOT_RUN, lifecycle_flow

    table = StageTable([*STAGES, Stage("gate", "tests.fixtures.gate_stage", "let enough prompts through", gate=True),
                        Stage("count", "tests.fixtures.fake_stage", "count the prompts")])
    cfg = corpus_config(tmp_path)
    cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"path": str(tiny_target)})})
    strict = cfg.model_copy(update={"export": cfg.export.model_copy(update={"min_accept_length": 100.0})})
    run = lifecycle_flow(table)
    stages = ["prepare", "gate", "count"]
    with pytest.raises(Exception, match="stage gate refused"):
        run(config=strict, stages=stages)

    def artifact(client, key):
        return _latest(client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))))

    with get_client(sync_client=True) as client:
        parent = _latest(client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["drafter-lifecycle"]))))
        gate_run = _latest(client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["gate"]))))
        assert parent.state.is_failed() and gate_run.state.is_failed()
        reason = "stage gate refused: error (TooFew): 9 training conversations < export.min_accept_length 100.0"
        assert parent.state.message.startswith(reason + " (see "), parent.state.message
        assert parent.state.message.endswith(f"/runs/flow-run/{gate_run.id})"), parent.state.message
        summary = artifact(client, "lifecycle-summary")
        assert summary.flow_run_id == parent.id
        rows = {r["stage"]: r for r in json.loads(summary.data)}
        assert [rows[s]["state"] for s in stages] == [rows["prepare"]["state"], "refused", NOT_RUN]
        assert rows["prepare"]["state"] == "done" and rows["gate"]["reason"].startswith("error (TooFew): 9 ")
        verdict = artifact(client, "gate-verdict")
        (gate_task,) = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[gate_run.id])))
        assert verdict.type == "markdown" and verdict.task_run_id == gate_task.id
        assert verdict.data.startswith("## gate: refused\n\n9 training conversations")
        messages = all_log_messages(client)
        assert "gate: 9 conversations, at least 100.0 needed" in messages  # the stage's own line, unmarked
        assert not any(m.startswith("[server]") for m in messages)
        assert reason in "\n".join(messages)  # the parent run's log says it too (what --watch streams)

    passed = run(config=cfg, stages=stages)  # prepare is complete now: skipped
    assert passed["prepare"]["status"] == "skipped" and passed["gate"]["status"] == "done"
    with get_client(sync_client=True) as client:
        prepare_runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["prepare"])))
        prepare_tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(
            any_=[r.id for r in prepare_runs])))
        first, again = sorted(prepare_tasks, key=lambda t: t.created)[-2:]
        assert again.state.is_completed()
        assert again.state.message.startswith(f"skipped: output already complete at {passed['prepare']['uri']} "
                                              f"(written by run ")  # the failed run's prepare wrote it
        assert not (first.state.message or "").startswith("skipped")  # the run that wrote it
        assert _latest(prepare_runs).state.message == again.state.message  # the stage's subflow says it too
        assert artifact(client, "gate-verdict").data.startswith("## gate: passed")
        rows = json.loads(artifact(client, "lifecycle-summary").data)
        assert [r["state"] for r in rows] == ["skipped (output already complete)", "done", "done"]


@pytest.mark.slow
def test_cli_runs_a_stage_from_the_table_and_names_a_missing_upstream(tmp_path, tiny_target):
    """`drafter <stage>` resolves the upstream from the table; an expected failure is its message
    and exit code 1, not a traceback."""
    import subprocess
    import sys

    cfg = corpus_config(tmp_path)
    profile = tmp_path / "p.yaml"
    data = cfg.model_dump(mode="json")
    data["target"] = {"path": str(tiny_target)}
    data["dump"].update(aux_layer_ids=[0, 1, 2], devices=["cpu"], upstream="prepare")
    profile.write_text(yaml.safe_dump(data))
    run = lambda *args: subprocess.run([sys.executable, "-m", "drafter.cli", *args, "--config", str(profile)],
                                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    missing = run("dump")
    assert missing.returncode == 4 and "Traceback" not in missing.stderr  # not retryable: run prepare first
    assert "error (ObjectNotFound): prepare is not committed" in missing.stderr
    done = run("prepare")
    assert done.returncode == 0, done.stderr
    assert f"stage prepare: done file://{tmp_path}/store/prepare/" in done.stdout
    assert "stage prepare: skipped (output already complete)" in run("prepare").stdout
    generic = run("run", "prepare")  # the one entry for any stage of the table
    assert generic.returncode == 0 and "stage prepare: skipped (output already complete)" in generic.stdout
    unknown = run("run", "prepair")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert "no stage 'prepair'; stages: prepare, datagen, dump, train" in unknown.stderr
