"""The export stage's second judge: real vLLM (CPU build) serving our vLLM export on the held-out
prompts the reference judge used, agreeing with it within export.judge_agreement_tolerance; a planted
off-by-one layer id is caught by both judges; an EAGLE 3.1 export served with both of its parts. Three
vLLM launches (~40 s each here)."""
from __future__ import annotations

import json

import pytest

from drafter.config import parse_config
from drafter.contracts.prompts import prompts_from_conversations
from drafter.export.judge import JudgedTooLow, check, judge_export
from drafter.export.vllm_judge import EnginesDisagree, agreement, judge_with_vllm
from drafter.stages import export
from drafter.store import FileStore
from drafter.target import HFTarget
from tests.fixtures.export_upstreams import RATE, commit_upstreams
from tests.fixtures.layered import AUX, export_pair, layered_pair, layered_pair31  # noqa: F401  (fixtures)
from tests.fixtures.net import free_port
from tests.fixtures.vllm_env import vllm_py, vllm_serve_section  # noqa: F401  (fixture)
from drafter.stages import TABLE

JUDGE = dict(eval_prompts=4, judge_max_new_tokens=40, judge_num_steps=3, device="cpu", judge_bucket_edges=[8, 16, 32])


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _cfg(target, python, tmp, **export_section):
    return parse_config({
        "target": {"path": str(target), "dtype": "float32"}, "dump": {"aux_layer_ids": AUX},
        "train": {"draft_vocab_size": 256},
        "export": {**JUDGE, "vllm_judge": vllm_serve_section(python, free_port(), tmp / "logs"), **export_section},
        "storage": {"root": f"file://{tmp}/store"}})


def test_export_stage_judges_with_vllm_and_both_judges_agree(layered_pair, tiny_conversations, vllm_py, tmp_path):
    target, draft = layered_pair
    store = FileStore(tmp_path / "store")
    upstream = commit_upstreams(store, tmp_path, target, draft, tiny_conversations[200:], aux=AUX)
    cfg = _cfg(target, vllm_py, tmp_path)
    result = TABLE.run("export", cfg, store, upstream=upstream)
    judge = result.meta["judge"]
    ref, vllm = judge, judge["vllm"]
    # the crafted pair: one draft accepted per verify on x+1 runs, identically in both engines
    assert ref["accept_length"] == pytest.approx(2.0) and ref["per_position"] == [1.0, 0.0, 0.0]
    assert vllm["accept_length"] == pytest.approx(ref["accept_length"], abs=0.1)
    assert vllm["per_position"] == pytest.approx(ref["per_position"], abs=0.1)
    assert vllm["engine_version"] == "0.32.0" and vllm["prompts"] == ref["prompts"] == 4
    assert vllm["drafts"] > 0 and vllm["verdict"]["passed"]
    assert judge["agreement"]["agree"] and judge["agreement"]["tolerance"] == 0.1
    assert any(s.startswith("vLLM judge (vllm 0.32.0): accept length 2.000") for s in result.summary)
    assert vllm["layer_ids"]["ids"] == [2, 3, 4]
    # the judge's port and interpreter are operational: same fingerprint
    assert TABLE.fingerprint("export", _cfg(target, "/other/python", tmp_path), upstream) == result.fingerprint
    assert TABLE.fingerprint("export", _cfg(target, vllm_py, tmp_path, judge_agreement_tolerance=0.2), upstream) \
        != result.fingerprint


def test_an_eagle31_export_is_served_by_vllm_as_the_reference_judge_drafts_it(layered_pair31, tiny_conversations,
                                                                             vllm_py, tmp_path):
    """EAGLE 3.1 through the export stage: the speculators config carries fc_norm and norm_output (what
    vLLM 0.32.0 reads, transformers_utils/configs/speculators/algos.py into llama_eagle3.py) and vLLM
    drafts as the reference does. The crafted 3.1 drafter accepts two drafts per verify only with both
    parts honored: one without the post-norm hidden fed on, ~0 without the per-state norms' weights."""
    target, draft = layered_pair31
    store = FileStore(tmp_path / "store")
    upstream = commit_upstreams(store, tmp_path, target, draft, tiny_conversations[200:], aux=AUX)
    result = TABLE.run("export", _cfg(target, vllm_py, tmp_path), store, upstream=upstream)
    paths = export.write_local(store, result.fingerprint, tmp_path / "out")
    sglang_config = json.loads((paths["sglang"] / "config.json").read_text())
    vllm_config = json.loads((paths["vllm"] / "config.json").read_text())
    assert (sglang_config["fc_norm"], sglang_config["norm_output"]) == (True, True)
    assert {k: vllm_config[k] for k in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")} == {
        "fc_norm": True, "norm_output": True, "norm_before_fc": False, "norm_before_residual": False}
    judge = result.meta["judge"]
    ref, vllm = judge, judge["vllm"]
    assert ref["accept_length"] == pytest.approx(3.0) and ref["per_position"] == [1.0, 1.0, 0.0]
    assert vllm["accept_length"] > 1 and vllm["drafts"] > 0 and vllm["verdict"]["passed"]
    assert vllm["accept_length"] == pytest.approx(ref["accept_length"], abs=0.1)
    assert vllm["per_position"] == pytest.approx(ref["per_position"], abs=0.1)
    assert judge["agreement"]["agree"] and vllm["prompts"] == ref["prompts"] == 4
    assert any(s.startswith("vLLM judge (vllm 0.32.0): accept length 3.000") for s in result.summary)


def test_a_planted_off_by_one_layer_id_is_caught_by_both_judges(layered_pair, tiny_conversations, vllm_py, tmp_path):
    """Ids one layer early in both exports (and in their records, so no file check can see it):
    the reference judge and real vLLM each measure the collapse."""
    target, draft = layered_pair
    sglang_dir, vllm_dir = export_pair(target, draft, tmp_path / "export")
    early = [i - 1 for i in AUX]
    for directory, key in ((sglang_dir, "eagle_config"), (vllm_dir, None)):
        data = json.loads((directory / "config.json").read_text())
        (data[key] if key else data)["eagle_aux_hidden_state_layer_ids"] = (
            early if key else [i + 1 for i in early])
        data["drafter_lifecycle"]["aux_layer_ids"] = early
        (directory / "config.json").write_text(json.dumps(data))
    cfg = _cfg(target, vllm_py, tmp_path)
    hf = HFTarget(str(target), device="cpu", dtype="float32")
    prompts, _ = prompts_from_conversations(hf.tokenizer, tiny_conversations[200:], 4, 400)

    reference = judge_export(sglang_dir, hf, prompts, num_steps=3, max_new_tokens=40, bucket_edges=[8, 16, 32],
                             prediction={"accept_rate": RATE})
    with pytest.raises(JudgedTooLow, match="min_accept_length"):
        check(reference, cfg.export.min_accept_length, cfg.export.min_accept_ratio)
    served = judge_with_vllm(cfg, vllm_dir, prompts, num_steps=3, max_new_tokens=40)
    assert served["layer_ids"]["ids"] == [1, 2, 3]   # what vLLM was given: the output of layer 0 for aux[0]
    with pytest.raises(JudgedTooLow, match="min_accept_length"):
        check(served, cfg.export.min_accept_length, cfg.export.min_accept_ratio)
    assert served["accept_length"] < 1.2 and reference["accept_length"] < 1.2


def test_agreement_tolerance_is_enforced():
    ref = {"accept_length": 2.0, "per_position": [1.0, 0.0, 0.0]}
    assert agreement(ref, {"accept_length": 1.95, "per_position": [0.95, 0.0, 0.0]}, 0.1)["agree"]
    with pytest.raises(EnginesDisagree, match=r"reference 2.000 vs vLLM 1.500"):
        agreement(ref, {"accept_length": 1.5, "per_position": [0.5, 0.0, 0.0]}, 0.1)
