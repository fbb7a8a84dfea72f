"""What a stage's runs show in Prefect (a Prefect test server): the run that wrote an output is
tagged so, a skipped stage names it and shows the figures it skipped with, is visibly skipped in the
run list and the graph (state name, run names, tag), and the parent run ends with the stage's
headline and the run that wrote it. A table artifact keeps the stage's column order."""
import json

from drafter.config import parse_config
from drafter.stages import Stage, StageTable
from tests.stages.test_stage_table import all_log_messages

HEADLINE = "faster on engine fake at batch 1: EAGLE3 3/1/4 at 1.45x [1.21, 1.73]"


def test_a_skipped_stage_names_the_run_that_wrote_it_and_shows_its_figures(tmp_path, prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterKey, FlowFilter, FlowFilterName,
                                                FlowRunFilter, FlowRunFilterId)

    from flows.lifecycle import lifecycle_flow
    from tasks.stage import SKIPPED, SKIPPED_STATE, WROTE, skipped_message

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    cfg = parse_config({"target": {"path": str(tmp_path / "target"), "num_hidden_layers": 8, "vocab_size": 100},
                        "train": {"draft_vocab_size": 50}, "storage": {"root": f"file://{tmp_path}/store"}})
    run = lifecycle_flow(StageTable([Stage("tally", "tests.fixtures.headline_stage", "tally the settings")]))
    first = run(config=cfg, stages=["tally"])["tally"]
    again = run(config=cfg, stages=["tally"])["tally"]
    assert first["status"] == "done" and again["status"] == "skipped" and first["headline"] == HEADLINE

    with get_client(sync_client=True) as client:
        wrote, skipped = sorted(client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["tally"]))),
                                key=lambda r: r.created)
        writer = first["written_by"]
        assert str(wrote.id) in writer and again["written_by"] == writer
        assert f"{WROTE}tally/{first['fingerprint']}" in wrote.tags and SKIPPED not in wrote.tags
        # the run list: its state's badge and its tag; the graph: its run's name (flow / run)
        assert skipped.state.is_completed() and skipped.state.name == SKIPPED_STATE
        assert skipped.name == "tally (skipped)" and SKIPPED in skipped.tags and wrote.name != "tally (skipped)"
        tasks = {r.flow_run_id: r for r in client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[wrote.id, skipped.id])))}
        assert tasks[wrote.id].state.message == HEADLINE and tasks[wrote.id].state.name == "Completed"
        task = tasks[skipped.id]
        assert task.name == "tally (skipped)" and task.state.name == SKIPPED_STATE
        assert task.state.message == skipped_message(again["uri"], writer, HEADLINE)
        assert task.state.message.startswith(f"skipped: output already complete at {again['uri']} (written by run ")
        assert skipped.state.message == task.state.message
        # the figures on both runs' pages, as columns in the stage's own order (not sorted)
        tables = sorted(client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            any_=["tally-summary"]))), key=lambda a: a.created)
        assert [t.flow_run_id for t in tables] == [wrote.id, skipped.id]
        for table in tables:
            assert json.loads(table.data) == {"config": ["EAGLE3 3/1/4"], "speedup [CI]": ["1.45x [1.21, 1.73]"],
                                              "verdict": ["faster"], "ITL ms": ["2.00"]}
            assert list(json.loads(table.data)) == ["config", "speedup [CI]", "verdict", "ITL ms"]
        assert f"the figures of the run that wrote it ({writer})" in tables[1].description
        messages = all_log_messages(client)
    # the parent run's last lines: the skipped stage with its writer, then the headline with it
    assert f"stage tally: skipped (output already complete) {again['uri']} (written by run {writer})" in messages
    answers = [m for m in messages if m.startswith("answer: ")]
    assert answers == [f"answer: {HEADLINE}; from run {writer}"] * 2
