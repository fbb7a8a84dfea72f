"""The stage table is the only wiring: the flow, the CLI and the tasks read it; a new stage is one
module and one row; every stage has its deployment; every config field says whether it changes
its stage's output."""
import json
from pathlib import Path

import pytest
import yaml

from drafter.config import LifecycleConfig, is_output_field, parse_config
from drafter.stages import STAGES, TABLE, Stage, StageTable

ROOT = Path(__file__).resolve().parents[1]
# The config section each stage reads (the fields whose classification the fingerprints rely on).
STAGE_SECTIONS = ("data", "datagen", "dump", "train", "export", "serve", "bench", "retrain")


def corpus_config(tmp_path) -> LifecycleConfig:
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"q {i}?"}]}) + "\n"
                              for i in range(12)))
    return parse_config({"target": {"path": str(tmp_path / "no-target"), "num_hidden_layers": 8, "vocab_size": 100},
                         "train": {"draft_vocab_size": 50},
                         "data": {"sources": [{"kind": "jsonl", "path": str(corpus)}], "eval_fraction": 0.25},
                         "storage": {"root": f"file://{tmp_path}/store"}})


def test_every_stage_module_has_the_contract():
    for stage in STAGES:
        code = stage.code
        assert callable(code.fingerprint) and callable(code.run), stage.name
        assert stage.module == f"drafter.stages.{stage.name}"


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


def test_unknown_upstream_in_a_row_is_refused():
    with pytest.raises(ValueError, match="unknown upstream"):
        StageTable([Stage("b", "tests.fixtures.fake_stage", "b", upstream=("a",))])


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


def test_every_stage_has_a_deployment():
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    single = {d["name"]: d for d in spec["deployments"] if d.get("parameters", {}).get("stages")}
    assert set(single) == set(TABLE.names)
    for name, dep in single.items():
        assert dep["parameters"]["stages"] == [name]
        assert dep["entrypoint"] == "flows/lifecycle.py:drafter_lifecycle"


def test_a_new_stage_is_one_module_and_one_row(tmp_path, monkeypatch, tiny_target):
    """A fake stage added to a copy of the table runs through the real flow (a Prefect test
    server), reads its upstream's output by the fingerprint the table gives, and skips on a re-run."""
    from prefect.testing.utilities import prefect_test_harness

    from flows.lifecycle import lifecycle_flow
    from drafter.stages import prepare

    table = StageTable([*STAGES, Stage("count", "tests.fixtures.fake_stage", "count the prompts",
                                       upstream=("prepare",))])
    cfg = corpus_config(tmp_path)
    cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"path": str(tiny_target)})})
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.setenv("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(tmp_path / "prefect" / "results"))
    with prefect_test_harness(server_startup_timeout=60):
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
            messages = [entry.message for entry in client.read_logs()]
        assert any(m.startswith("count: error (ObjectNotFound): prepare is not committed") for m in messages), messages
    prepared = prepare.fingerprint(cfg)
    assert first["prepare"]["status"] == "done" and first["count"]["status"] == "done"
    assert first["count"]["meta"] == {"conversations": 9, "prepare": prepared}
    assert again["count"]["status"] == "skipped" and "prepare" not in again


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
