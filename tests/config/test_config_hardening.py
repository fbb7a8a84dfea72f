"""`config validate` refuses what a later stage would refuse after the expensive ones (issue 32):
registry names the registry cannot store, server ports past 65535; and a serve-only profile of a
shallow target needs no dump fields, as docs/manual.md (Configuration) says."""
from __future__ import annotations

import pytest

from drafter.config import ConfigError, parse_config
from drafter.config.registry_names import registry_name_problem
from drafter.retrain.registry import Registry, RegistryError
from drafter.store import FileStore
from tests.fixtures.cli import drafter, profile


def base(**sections):
    data = {"target": {"path": "/models/t", "num_hidden_layers": 32, "vocab_size": 128000}}
    data.update(sections)
    return data


def problems(data) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    return err.value.problems


# ---- registry names: one rule, asked by the configuration and by the registry


@pytest.mark.parametrize("field, data", [
    ("name", {"name": "my drafter"}),
    ("name", {"name": "../../evil"}),
    ("retrain.drafter_name", {"retrain": {"drafter_name": "../x"}}),
    ("retrain.drafter_name", {"name": "fine", "retrain": {"drafter_name": "a/b"}}),
    ("retrain.drafter_name", {"retrain": {"drafter_name": "x" * 101}}),
])
def test_a_name_the_registry_refuses_is_refused_by_config_validate(tmp_path, field, data):
    found = problems(base(**data))
    assert [f for f, _ in found] == [field], found
    assert "cannot name a registry entry" in found[0][1]
    name = data.get("retrain", {}).get("drafter_name") or data["name"]
    with pytest.raises(RegistryError, match="cannot name a registry entry"):  # the same rule, the same words
        Registry(FileStore(tmp_path / "store"), "t0", name)


def test_config_validate_names_the_bad_name(tmp_path, monkeypatch, capsys):
    path = profile(tmp_path, name="my drafter")
    code, err = drafter(monkeypatch, capsys, "config", "validate", "--offline", path)
    assert code == 1 and "Traceback" not in err
    assert "name: drafter name 'my drafter' cannot name a registry entry" in err
    assert "unless retrain.drafter_name is set" in err


def test_a_good_drafter_name_overrides_a_bad_profile_name(tmp_path):
    cfg = parse_config(base(name="my run", retrain={"drafter_name": "my-run"}))
    assert cfg.registry_name() == "my-run"
    assert Registry.for_config(cfg.model_copy(update={"target": cfg.target.model_copy(
        update={"revision": "r1"})}), FileStore(tmp_path / "store")).name == "my-run"
    assert registry_name_problem("demo") is None and registry_name_problem("v1.2_x-y") is None


# ---- ports past 65535


def test_fan_out_children_past_the_last_port_are_refused():
    found = problems(base(serve={"port": 65530}, datagen={"workers": 8}))
    assert found == [("serve.port", "datagen.workers=8 children serve on serve.port + their range index, up to "
                                    "65537 > 65535: set serve.port <= 65528")]
    found = problems(base(serve={"port": 65535}, dump={"workers": 2}))
    assert found[0][0] == "serve.port" and "dump.workers=2" in found[0][1]
    parse_config(base(serve={"port": 65528}, datagen={"workers": 8}))  # the last one is 65535: fine


def test_a_fan_out_childs_configuration_is_not_refused_for_its_parents_ports():
    """A child's configuration is the parent's on serve.port + its index, with the parent's workers:
    the flow parameter is validated as a model again, and must pass (the parent checked the ports)."""
    from drafter.config import LifecycleConfig
    from drafter.fanout import ShardRange, child_config

    parent = parse_config(base(serve={"port": 65528}, datagen={"workers": 8}))
    child = child_config(parent, ShardRange(7, 70, 80, "s70", "s79"))
    assert child.serve.port == 65535
    assert LifecycleConfig.model_validate(child.model_dump(mode="json")).serve.port == 65535


def test_the_bench_servers_past_the_last_port_are_refused():
    """The concurrent interleave (the reference engine on CPU) serves every server at once on
    serve.port + its index: baseline + 2 settings + 2 settings x 2 curve points = 7 servers."""
    bench = {"speculative": [{"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 2},
                             {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4},
                             {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}],  # a duplicate: one server
             "accept_curve": [1.5, 2.0]}
    serve = {"engine": "reference", "device": "cpu", "port": 65530}
    found = problems(base(serve=serve, bench=bench))
    assert found == [("serve.port", "the bench's concurrent interleave serves up to 7 servers on consecutive ports "
                                    "from serve.port=65530, up to 65536 > 65535: set serve.port <= 65529 (or "
                                    "bench.interleave: relaunch)")]
    parse_config(base(serve={**serve, "port": 65529}, bench=bench))
    parse_config(base(serve=serve, bench={**bench, "interleave": "relaunch"}))  # one server at a time: one port
    # head to head (retrain.bench): challenger and champion at each setting, 9 servers
    found = problems(base(serve={**serve, "port": 65528}, bench=bench, retrain={"bench": True}))
    assert "up to 9 servers" in found[0][1]


def test_config_validate_prints_the_port_problem(tmp_path, monkeypatch, capsys):
    path = profile(tmp_path, serve={"port": 65535, "log_dir": str(tmp_path / "logs")}, datagen={"workers": 2})
    code, err = drafter(monkeypatch, capsys, "config", "validate", "--offline", path)
    assert code == 1 and "serve.port: datagen.workers=2 children serve on serve.port" in err


# ---- a serve-only profile of a shallow target


@pytest.mark.parametrize("layers", [4, 5, 6])
def test_a_serve_only_profile_of_a_shallow_target_needs_no_dump_fields(tmp_path, monkeypatch, capsys, layers):
    """docs/manual.md (Configuration): a serve-only profile (target, serve, storage) needs no train or
    dump fields. A target under 7 layers has no default aux ids (they are not three distinct layers):
    that is an error only where a stage needs them (dump, train, export), naming the field."""
    draft = tmp_path / "drafter"
    draft.mkdir()
    data = {"target": {"path": str(tmp_path / "target"), "num_hidden_layers": layers, "vocab_size": 1000},
            "serve": {"engine": "reference", "device": "cpu", "draft_path": str(draft),
                      "log_dir": str(tmp_path / "logs")},
            "storage": {"root": f"file://{tmp_path}/store"}}
    cfg = parse_config(data)
    with pytest.raises(ConfigError, match=r"dump.aux_layer_ids: the default \[.*\] for a \d-layer target is not "
                                          r"three distinct layers; set them explicitly") as err:
        cfg.aux_layer_ids()
    assert err.value.exit_code == 2
    path = profile(tmp_path, **data)
    code, out = drafter(monkeypatch, capsys, "config", "validate", "--offline", path)
    assert code == 0, out
    # the serve command gets as far as the server's own preflight (no model here), never to the aux ids
    code, out = drafter(monkeypatch, capsys, "serve", "--check", "-c", path)
    assert code == 2 and "aux_layer_ids" not in out and "Traceback" not in out
    assert out.strip().splitlines()[-1].startswith("error (config_error): preflight failed: model path does not exist")
    parse_config({**data, "dump": {"aux_layer_ids": [0, 1, 2]}}).aux_layer_ids()  # set: fine


def test_a_yaml_syntax_error_names_line_and_column_and_quotes_nothing_of_the_file(tmp_path):
    from drafter.config import ConfigError, load_config

    path = tmp_path / "bad.yaml"
    path.write_text('target:\n  path: x\nserve:\n  secrets: {A: "env:TOK\n  extra_args: ["--api-key", "S3CR3T"]\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert "line " in text and "column " in text and "not valid YAML" in text
    assert "S3CR3T" not in text and "api-key" not in text and "env:TOK" not in text
