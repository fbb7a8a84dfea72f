"""What the lifecycle flows make of their parameters (flows/parameters.py): a profile the run cannot
use, or no stage selected, is one line naming the file and the line, with nothing of the file's
content. Through a real Prefect server and worker: tests/core/test_e2e_prefect.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.parameters import Refused, config_or_refuse, resolve, stages_or_refuse

SECRETISH = "hf_SeCrEtToKeN_0123456789"
NAMES = ["prepare", "datagen", "dump"]


def test_no_stage_selected_is_refused_naming_the_choices():
    with pytest.raises(Refused) as refused:
        stages_or_refuse([], NAMES)
    assert str(refused.value) == ("no stages selected: parameter stages is empty; choose one or more of "
                                  "prepare, datagen, dump")
    assert stages_or_refuse(["dump"], NAMES) == ["dump"]


def test_a_yaml_syntax_error_names_file_line_and_column_and_quotes_nothing(tmp_path):
    profile = tmp_path / "broken.yaml"
    profile.write_text(f"name: broken\nserve:\n  env:\n    HF_TOKEN: {SECRETISH}: oops\n")
    with pytest.raises(yaml.YAMLError) as raw:  # what PyYAML itself says: the line, quoted
        yaml.safe_load(profile.read_text())
    assert SECRETISH in str(raw.value)
    with pytest.raises(Refused) as refused:
        config_or_refuse(str(profile), None)
    line = str(refused.value)
    assert line == (f"bad profile {profile}: line 4, column 40: not valid YAML: mapping values are not allowed "
                    f"here (the file's content is not shown)")
    assert "\n" not in line and SECRETISH not in line and "oops" not in line


def test_a_quoted_fragment_in_yamls_own_problem_is_left_out(tmp_path):
    profile = tmp_path / "alias.yaml"
    profile.write_text(f"name: *{SECRETISH}\n")
    with pytest.raises(Refused) as refused:
        config_or_refuse(str(profile), None)
    assert "line 1, column 7: not valid YAML: found undefined alias '...'" in str(refused.value)
    assert SECRETISH not in str(refused.value)


def test_a_field_that_does_not_validate_is_named_with_its_line(tmp_path):
    profile = tmp_path / "fields.yaml"
    profile.write_text("name: fields\ntarget: {path: /models/target}\n\nserve:\n  engine: reference\n"
                       "  port: not-a-port\n  colour: blue\n")
    with pytest.raises(Refused) as refused:
        config_or_refuse(str(profile), None)
    line = str(refused.value)
    assert line.startswith(f"bad profile {profile}: ") and "\n" not in line
    assert "line 6: serve.port: " in line and "line 7: serve.colour: unknown field" in line


def test_a_missing_profile_names_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Refused) as refused:
        config_or_refuse("profiles/nope.yaml", None)
    assert str(refused.value) == f"bad profile profiles/nope.yaml (in {tmp_path}): no such file: profiles/nope.yaml"


def test_a_valid_profile_and_a_config_pass(tmp_path):
    profile = tmp_path / "ok.yaml"
    profile.write_text("name: ok\ntarget: {path: /models/target}\n")
    cfg, stages = resolve(str(profile), None, ["prepare"], NAMES)
    assert cfg.name == "ok" and stages == ["prepare"]
    assert resolve("does/not/matter.yaml", cfg, ["dump"], NAMES) == (cfg, ["dump"])
    assert isinstance(resolve(str(profile), None, [], NAMES), Refused)


def test_the_repositorys_profiles_load():
    root = Path(__file__).resolve().parents[2]
    for path in sorted((root / "profiles").glob("*.yaml")):
        assert not isinstance(resolve(str(path), None, ["prepare"], NAMES), Refused), path
