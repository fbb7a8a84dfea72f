"""`drafter lineage OUTPUT` and the lifecycle run's lineage artifact, on a small chain committed
through StageOutput's own API with the manifests the stages write (prepare -> datagen -> dump ->
train -> export, a bench that measured the export, a registry event naming it)."""
from __future__ import annotations

import json
import sys

import pytest

from drafter.config import StorageConfig, load_config
from drafter.retrain.registry import Registry
from drafter.stage_output import StageOutput
from drafter.store import open_store
from drafter import cli
from tests.fixtures.cli import profile

PLANTED = "planted-secret-value-0123456789"
TARGET_FP = "77b7d6f89caa68d7"
STAGES = ("prepare", "datagen", "dump", "train", "export")


def drafter(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """`drafter ARGV...` through the console entry point: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["drafter", *argv])
    with pytest.raises(SystemExit) as done:
        cli.main()
    captured = capsys.readouterr()
    return done.value.code, captured.out, captured.err


def _commit(store, stage: str, upstream: list[str], meta: dict, shards: dict[str, bytes]) -> StageOutput:
    out = StageOutput.for_inputs(store, stage, {"stage": stage, "test": True}, upstream)
    for name, data in shards.items():
        out.write_shard(name, data)
    out.commit(meta)
    return out


def build_chain(root) -> dict[str, StageOutput]:
    store = open_store(StorageConfig(root=f"file://{root}"))
    prep = _commit(store, "prepare", [], {
        "read": 12, "kept": 10, "train": 8, "eval": 2,
        "sources": [{"label": "sharegpt", "kind": "sharegpt", "path": "data/sharegpt.jsonl", "rows_read": 12,
                     "kept": 10, "truncated_tail": False, "tail_note": None}]},
        {"train.jsonl": b'{"messages": []}\n', "eval.jsonl": b'{"messages": [1]}\n'})
    gen = _commit(store, "datagen", [prep.fingerprint], {
        "prepare_fingerprint": prep.fingerprint, "conversations": 8,
        # a profile secret that leaked into a recorded setting is still never printed
        "generation": {"model": "demo-target", "target_path": ".cache/demo-target", "temperature": 0.0,
                       "max_tokens": 64, "note": f"token {PLANTED}"}}, {"gen-00000.jsonl": b"{}\n"})
    dump = _commit(store, "dump", [gen.fingerprint], {
        "upstream": {"stage": "datagen", "fingerprint": gen.fingerprint}, "target_path": ".cache/demo-target",
        "target_fingerprint": TARGET_FP, "tokenizer_hash": "e45fe640bc3c1ae4", "chat_template_hash": "94c995164bc1660c",
        "dtype": "float32", "storage_dtype": "float8_e4m3", "aux_layer_ids": [1, 7, 12],
        "layer_id_convention": "output-of-layer-0-based", "num_samples": 8}, {"hs-00000.safetensors": b"x" * 16})
    train = _commit(store, "train", [dump.fingerprint], {
        "steps": 20, "peak_lr": 0.0006, "tokens_per_step": 2048, "aux_layer_ids": [1, 7, 12],
        "train_dump": dump.fingerprint, "eval_dump": dump.fingerprint, "dump_fingerprint": dump.fingerprint},
        {"drafter/model.safetensors": b"w" * 8})
    export = _commit(store, "export", [train.fingerprint], {
        "export": {"format_version": 1, "dtype": "float32", "train_fingerprint": train.fingerprint,
                   "dump_fingerprint": dump.fingerprint, "prepare_fingerprint": prep.fingerprint,
                   "target": {"fingerprint": TARGET_FP, "architecture": "LlamaForCausalLM", "num_hidden_layers": 16},
                   "layer_ids": {"sglang": {"eagle_aux_hidden_state_layer_ids": [1, 7, 12], "engine_version": "0.5.23"},
                                 "vllm": {"eagle_aux_hidden_state_layer_ids": [2, 8, 13], "engine_version": "0.32.0"}}},
        "judge": {"accept_length": 2.5, "num_steps": 3, "prompts": 16, "by_output_length": [{"accept_length": 2.1}]}},
        {"export.json": b"{}", "judge.json": b"{}"})
    bench = _commit(store, "bench", [prep.fingerprint], {
        "engine": "vllm", "verdicts": {"eagle3-s3-k1-d4@1": "faster"}, "engine_versions": ["0.32.0"],
        "recommendation": {"1": {"key": "eagle3-s3-k1-d4", "text": "EAGLE3 3/1/4 (1.43x, significantly faster)"}}},
        {"report.json": json.dumps({"drafters": {"export": export.fingerprint}}).encode()})
    Registry(store, TARGET_FP, "demo").promote(export.fingerprint, "manual promote")
    return {"prepare": prep, "datagen": gen, "dump": dump, "train": train, "export": export, "bench": bench}


@pytest.fixture
def chain(tmp_path):
    outputs = build_chain(tmp_path / "store")
    cfg = profile(tmp_path, serve={"log_dir": str(tmp_path / "logs"), "env": {"WANDB_API_KEY": PLANTED},
                                   "secrets": {"HF_TOKEN": "env:LINEAGE_TEST_NEVER_SET"}})
    return outputs, cfg


def test_lineage_prints_the_whole_chain_with_no_secret(chain, monkeypatch, capsys):
    outputs, cfg = chain
    monkeypatch.delenv("LINEAGE_TEST_NEVER_SET", raising=False)  # a reference is never resolved
    export = outputs["export"]
    code, text, err = drafter(monkeypatch, capsys, "lineage", f"export/{export.fingerprint}", "--config", cfg)
    assert code == 0, err
    # every stage's fingerprint, in chain order
    where = [text.index(f"{s}/{outputs[s].fingerprint}  ") for s in STAGES]
    assert where == sorted(where)
    prep = outputs["prepare"].manifest
    assert f"train.jsonl sha256 {prep.shard('train.jsonl').sha256}" in text
    assert "data/sharegpt.jsonl" in text and TARGET_FP in text
    assert "storage_dtype: float8_e4m3" in text and "peak_lr: 0.0006" in text
    for s in STAGES:
        assert f"drafter run {s} --config {cfg}" in text
    assert (f"prefect deployment run drafter-lifecycle/stage --param profile={cfg} "
            f"--param 'stages={json.dumps(list(STAGES))}'") in text
    # engine versions recorded by the export and the bench; the judgement, verdict, registry event
    assert "export.layer_ids.vllm.engine_version: 0.32.0" in text and "0.5.23" in text
    assert '"accept_length": 2.5' in text and "by_output_length" not in text
    assert f"bench/{outputs['bench'].fingerprint} (vllm, engine versions 0.32.0)" in text
    assert "significantly faster" in text
    assert f"registry {TARGET_FP}/demo #0 promote {export.fingerprint}" in text
    assert "drafter-lifecycle 0.1.0, git " in text
    assert PLANTED not in text and PLANTED not in err and "<masked>" in text


def test_a_prefix_finds_the_output_and_json_round_trips(chain, monkeypatch, capsys):
    outputs, cfg = chain
    train = outputs["train"]
    code, out, err = drafter(monkeypatch, capsys, "lineage", train.fingerprint[:8], "--config", cfg, "--json")
    assert code == 0, err
    record = json.loads(out)
    assert record["output"] == f"train/{train.fingerprint}"
    assert [n["stage"] for n in record["chain"]] == list(STAGES[:4])
    assert record["drafter"]["exports"] == [outputs["export"].fingerprint]
    assert record["drafter"]["bench"][0]["verdicts"] == {"eagle3-s3-k1-d4@1": "faster"}
    assert json.loads(json.dumps(record)) == record
    assert PLANTED not in json.dumps(record)


@pytest.mark.parametrize("ref", ["0000000000000000", "export/ffffffffffffffff", "../etc", ""])
def test_a_bad_output_is_one_line_exit_2(chain, monkeypatch, capsys, ref):
    _, cfg = chain
    code, _, err = drafter(monkeypatch, capsys, "lineage", ref, "--config", cfg)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error (LineageError): ")
    assert "Traceback" not in err


def test_an_ambiguous_prefix_names_the_candidates(chain, monkeypatch, capsys):
    outputs, cfg = chain
    for fp in ("aaaa000000000001", "aaaa000000000002"):
        out = StageOutput(outputs["export"].store, "export", fp)
        out.write_shard("a.json", b"{}")
        out.commit({"export": {}})
    code, _, err = drafter(monkeypatch, capsys, "lineage", "aaaa", "--config", cfg)
    assert code == 2 and "ambiguous" in err and "export/aaaa000000000002" in err
    code, out, err = drafter(monkeypatch, capsys, "lineage", "export/aaaa000000000001", "--config", cfg)
    assert code == 0, err
    assert out.startswith("lineage of export/aaaa000000000001")


def test_the_run_artifact_is_the_last_outputs_lineage(chain):
    from tasks.lineage import last_output, lineage_markdown

    outputs, cfg_path = chain
    cfg = load_config(cfg_path)
    results = {"target": {"fingerprint": None}, **{s: o and {"stage": s, "fingerprint": outputs[s].fingerprint}
                                                    for s, o in outputs.items()}, "serve": {"fingerprint": None}}
    order = [*STAGES, "bench", "serve"]
    assert last_output(results, order) == ("bench", outputs["bench"].fingerprint)
    assert last_output(results, order[:5]) == ("export", outputs["export"].fingerprint)
    markdown = lineage_markdown(cfg, "export", outputs["export"].fingerprint, profile="profiles/demo.yaml")
    assert markdown.startswith(f"## lineage of export/{outputs['export'].fingerprint}")
    for s in STAGES:
        assert f"`{s}/{outputs[s].fingerprint}`" in markdown
    assert "```\ndrafter run prepare --config profiles/demo.yaml\n" in markdown
    assert PLANTED not in markdown


def test_a_lifecycle_run_publishes_its_last_outputs_lineage(tmp_path, tiny_target, prefect_server):
    """The real flow (a Prefect test server): the run's `lineage` markdown artifact is the record of
    the last output it reached, with the profile the run was given in its re-run commands."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from drafter.stages import STAGES, StageTable
    from flows.lifecycle import lifecycle_flow

    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"q {i}?"}]}) + "\n"
                              for i in range(12)))
    path = tmp_path / "lineage.yaml"
    path.write_text(json.dumps({
        "target": {"path": str(tiny_target), "num_hidden_layers": 4, "vocab_size": 512},
        "data": {"sources": [{"kind": "jsonl", "path": str(corpus)}], "eval_fraction": 0.25},
        "storage": {"root": f"file://{tmp_path}/store"},
        "serve": {"log_dir": str(tmp_path / "logs"), "env": {"WANDB_API_KEY": PLANTED}}}))
    run = lifecycle_flow(StageTable(STAGES))
    result = run(profile=str(path), stages=["prepare"])
    fp = result["prepare"]["fingerprint"]
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["lineage"])))
    assert artifact.type == "markdown"
    assert artifact.data.startswith(f"## lineage of prepare/{fp}")
    assert f"drafter run prepare --config {path}" in artifact.data
    assert f"prefect deployment run drafter-lifecycle/stage --param profile={path}" in artifact.data
    assert PLANTED not in artifact.data


def test_a_store_that_does_not_exist_is_one_line_and_is_not_created(tmp_path, monkeypatch, capsys):
    path = profile(tmp_path, storage={"root": f"file://{tmp_path}/nothere"})
    code, out, err = drafter(monkeypatch, capsys, "lineage", "abcd", "--config", path)
    assert code == 4 and out == "" and err.strip() == (f"error (ObjectNotFound): no store at "
                                                       f"file://{tmp_path}/nothere: the directory does not exist")
    assert not (tmp_path / "nothere").exists()
