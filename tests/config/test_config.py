import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from drafter.cli import app
from drafter.config import ConfigError, default_aux_layer_ids, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
PROFILES = sorted((ROOT / "profiles").glob("*.yaml"))
runner = CliRunner()


def base(**sections):
    data = {"target": {"path": "/models/t", "num_hidden_layers": 32, "vocab_size": 128000}}
    data.update(sections)
    return data


def write(tmp_path, data) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def validate(tmp_path, data):
    return runner.invoke(app, ["config", "validate", "--offline", str(write(tmp_path, data))])


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_shipped_profiles_are_valid(profile):
    cfg = load_config(profile)
    assert len(set(cfg.aux_layer_ids())) == 3


def test_the_vllm_demo_profile_differs_from_the_demo_only_in_serving_and_bench():
    """`make demo-vllm` reuses `make demo`'s outputs up to the export: every section that feeds those
    stages' fingerprints must be the demo's (a train setting changed in one file only re-trains)."""
    demo, vllm = load_config(ROOT / "profiles" / "demo.yaml"), load_config(ROOT / "profiles" / "demo-vllm.yaml")
    differs = [name for name in type(demo).model_fields if getattr(demo, name) != getattr(vllm, name)]
    assert differs == ["serve", "bench"]


def test_kimi_profile_carries_the_field_notes_deployment():
    cfg = load_config(ROOT / "profiles" / "kimi-k2.5-8xpcie.yaml")
    assert cfg.serve.tp_size == 8 and cfg.serve.disable_custom_all_reduce
    assert cfg.target.num_hidden_layers == 61 and cfg.target.hidden_size == 7168
    assert cfg.serve.env["NCCL_PROTO"] == "LL" and cfg.serve.env["NCCL_ALGO"] == "Ring"
    spec = cfg.serve.speculative
    assert (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens) == (2, 1, 3)


@pytest.mark.parametrize("spec, field, words", [
    ({"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 5}, "serve.speculative",
     "num_draft_tokens = num_steps + 1"),
    ({"num_steps": 3}, "serve.speculative", "set all three"),
    ({"eagle_topk": 4, "num_draft_tokens": 8}, "serve.speculative", "set all three"),
    ({"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 8}, "serve.speculative", "< num_draft_tokens"),
])
def test_speculative_rules_are_sglangs(tmp_path, spec, field, words):
    result = validate(tmp_path, base(serve={"speculative": spec}))
    assert result.exit_code == 1
    assert f"{field}: " in result.output and words in result.output


def test_sweep_entries_use_the_same_rules(tmp_path):
    bad = {"speculative": [{"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}, {"num_steps": 2}]}
    result = validate(tmp_path, base(bench=bad))
    assert result.exit_code == 1 and "bench.speculative.1: set all three" in result.output


def test_valid_speculative_settings_pass(tmp_path):
    for spec in ({}, {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4},
                 {"num_steps": 5, "eagle_topk": 4, "num_draft_tokens": 8}):
        assert validate(tmp_path, base(serve={"speculative": spec})).exit_code == 0


def test_aux_layer_id_out_of_range_names_the_field(tmp_path):
    result = validate(tmp_path, base(dump={"aux_layer_ids": [2, 16, 32]}))
    assert result.exit_code == 1
    assert "dump.aux_layer_ids" in result.output and "[32] out of range" in result.output


def test_last_layer_cannot_feed_the_drafter(tmp_path):
    result = validate(tmp_path, base(dump={"aux_layer_ids": [2, 16, 31]}))
    assert result.exit_code == 1 and "dump.aux_layer_ids: [31] out of range" in result.output


def test_aux_layer_ids_checked_against_the_models_config_json(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "vocab_size": 500}))
    data = {"target": {"path": str(model)}, "dump": {"aux_layer_ids": [1, 2, 4]}}
    result = validate(tmp_path, data)
    assert result.exit_code == 1 and "dump.aux_layer_ids: [4] out of range" in result.output


def test_duplicate_aux_layer_ids_rejected(tmp_path):
    result = validate(tmp_path, base(dump={"aux_layer_ids": [2, 2, 3]}))
    assert result.exit_code == 1 and "dump.aux_layer_ids: [2, 2, 3] must be three distinct" in result.output


def test_cross_field_problems_are_all_named(tmp_path):
    data = base(dump={"aux_layer_ids": [1, 2, 40]}, train={"draft_vocab_size": 200000})
    result = validate(tmp_path, data)
    assert "dump.aux_layer_ids: [40] out of range" in result.output
    assert "train.draft_vocab_size: 200000 exceeds the target vocab (128000)" in result.output


def test_unknown_field_names_the_field(tmp_path):
    result = validate(tmp_path, base(serve={"speculatve": {"num_steps": 3}}))
    assert result.exit_code == 1 and "serve.speculatve: unknown field" in result.output


def test_every_problem_is_printed(tmp_path):
    data = base(serve={"port": 0, "typo": 1}, storage={"root": "/no/scheme"})
    result = validate(tmp_path, data)
    assert result.exit_code == 1
    for field in ("serve.port", "serve.typo", "storage.root"):
        assert field in result.output


def test_launch_environment_is_configuration(tmp_path):
    result = validate(tmp_path, base(serve={"env": {"BAD=NAME": "1"}}))
    assert result.exit_code == 1 and "invalid variable name" in result.output
    cfg = parse_config(base(serve={"env": {"NCCL_ALGO": "Ring"}}))
    assert cfg.serve.env == {"NCCL_ALGO": "Ring"}


def test_missing_file_and_bad_yaml(tmp_path):
    assert runner.invoke(app, ["config", "validate", str(tmp_path / "nope.yaml")]).exit_code == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: [unclosed")
    result = runner.invoke(app, ["config", "validate", str(bad)])
    assert result.exit_code == 1 and "<yaml>" in result.output


def test_show_prints_resolved_defaults(tmp_path):
    result = runner.invoke(app, ["config", "show", str(write(tmp_path, base()))])
    assert result.exit_code == 0
    shown = yaml.safe_load(result.output)
    assert shown["storage"]["root"] == "file://runs/store"
    assert shown["serve"]["engine"] == "reference"
    assert parse_config(shown) == parse_config(base())


def test_default_aux_layer_ids_follow_specforge():
    assert default_aux_layer_ids(32) == [1, 15, 28]
    assert default_aux_layer_ids(61) == [1, 29, 57]
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        parse_config({"target": {"path": "/nowhere"}}).aux_layer_ids()


def test_console_script_exit_codes(tmp_path):
    good = write(tmp_path, base())
    drafter = Path(sys.executable).parent / "drafter"
    ok = subprocess.run([str(drafter), "config", "validate", "--offline", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(base(serve={"speculative": {"num_steps": 1}})))
    failed = subprocess.run([str(drafter), "config", "validate", str(bad)], capture_output=True, text=True)
    assert failed.returncode == 1 and "serve.speculative" in failed.stderr


def test_more_train_processes_than_micro_batches_is_refused():
    with pytest.raises(ConfigError, match="train.nproc_per_node.*micro_batches_per_step >= 4"):
        parse_config({"target": {"path": "/x", "num_hidden_layers": 8, "vocab_size": 100},
                      "train": {"draft_vocab_size": 50, "nproc_per_node": 4, "micro_batches_per_step": 2}})


def test_cuda_graph_buckets_default_and_bounds():
    target = {"path": "/x", "num_hidden_layers": 8, "vocab_size": 100}
    # the default is the measurement's (benchmarks/RESULTS.md: 4 buckets, 8 keys on real lengths)
    assert parse_config({"target": target, "train": {"draft_vocab_size": 50}}).train.cuda_graph_buckets == 4
    assert parse_config({"target": target, "train": {"draft_vocab_size": 50, "cuda_graph_buckets": 0}}
                        ).train.cuda_graph_buckets == 0
    with pytest.raises(ConfigError, match="train.cuda_graph_buckets"):
        parse_config({"target": target, "train": {"draft_vocab_size": 50, "cuda_graph_buckets": -1}})
