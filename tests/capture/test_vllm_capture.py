"""The `vllm` capture backend against the `hf` one, on the same samples of a random target (every
layer different, a non-trivial final norm): same shards (names, samples, tokens, masks, structure,
verified in the store) and the same hidden states within float32 rounding (atol = rtol = 1e-3;
measured here: aux states at most 2.9e-4 apart on values up to 113, i.e. 3e-6 relative; final
states 2.4e-5 on values up to 6).
One vLLM load (~40 s here)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from drafter.config import parse_config
from drafter.contracts.shards import TENSORS, HiddenStateShard
from drafter.stage_output import StageOutput, to_jsonl
from drafter.stages import TABLE
from drafter.stages import dump
from drafter.store import FileStore
from tests.fixtures.vllm_env import VLLM_CPU_ENV, vllm_py  # noqa: F401  (fixture)

AUX = [0, 1, 2]          # ours; vLLM is given [1, 2, 3] + [4] (the last layer, normalised by us)
TOLERANCE = dict(atol=1e-3, rtol=1e-3)


@pytest.fixture(scope="module")
def random_target(tiny_target, tmp_path_factory) -> Path:
    """The tiny target's tokenizer with a random 4-layer model shaped for vLLM's CPU attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("vllm-capture") / "target"
    shutil.copytree(tiny_target, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    base = LlamaConfig.from_pretrained(tiny_target)
    config = LlamaConfig(**{**base.to_dict(), "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
                            "head_dim": 64, "intermediate_size": 256, "num_hidden_layers": 4, "dtype": "float32",
                            "initializer_range": 0.2})
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))  # the final norm must really be applied
    model.save_pretrained(out)
    return out


def _run(target, store_root: Path, conversations, python: str, **dump_section):
    store = FileStore(store_root)
    out = StageOutput(store, "prepare", "prep0000")
    out.write_shard("train.jsonl", to_jsonl(conversations[:5]))
    out.write_shard("eval.jsonl", to_jsonl(conversations[5:7]))
    out.commit({})
    cfg = parse_config({
        "target": {"path": str(target), "dtype": "float32"},
        "dump": {"aux_layer_ids": AUX, "max_length": 160, "samples_per_shard": 3, "devices": ["cpu"],
                 "upstream": "prepare", "python": python, "storage_dtype": "model", **dump_section},
        "serve": {"env": VLLM_CPU_ENV}, "train": {"draft_vocab_size": 256}, "storage": {"root": f"file://{store_root}"}})
    return store, TABLE.run("dump", cfg, store, upstream={"prepare": "prep0000"})


def test_vllm_backend_shards_match_the_hf_backend(random_target, tiny_conversations, vllm_py, tmp_path):
    convs = tiny_conversations[:7]
    hf_store, hf = _run(random_target, tmp_path / "hf", convs, vllm_py, backend="hf")
    vl_store, vl = _run(random_target, tmp_path / "vllm", convs, vllm_py, backend="vllm")
    assert vl.fingerprint == hf.fingerprint          # the backend does not change what the shards mean
    names = sorted(s.name for s in hf.manifest.shards)
    assert names == sorted(s.name for s in vl.manifest.shards) and len(names) == 3  # 2 train + 1 eval shard
    assert {s.name: s.meta["backend"] for s in vl.manifest.shards} == {n: "vllm" for n in names}
    for key in ("num_samples", "num_tokens", "num_loss_tokens", "aux_layer_ids", "layer_id_convention",
                "hidden_size", "dtype", "quarantined"):
        assert vl.meta[key] == hf.meta[key], key
    worst = {}
    for name in names:
        a = HiddenStateShard(StageOutput(hf_store, "dump", hf.fingerprint).download_shard(name, tmp_path / f"hf-{name}"))
        b = HiddenStateShard(StageOutput(vl_store, "dump", vl.fingerprint).download_shard(name, tmp_path / f"vl-{name}"))
        assert a.sample_ids == b.sample_ids and a.offsets == b.offsets and a.metadata == b.metadata
        for t in TENSORS:
            x, y = a.tensors[t], b.tensors[t]
            assert x.dtype == y.dtype and x.shape == y.shape, t
            if x.is_floating_point() and x.numel():
                torch.testing.assert_close(y, x, **TOLERANCE, msg=lambda m, t=t: f"{name} {t}: {m}")
                worst[t] = max(worst.get(t, 0.0), float((y - x).abs().max()))
                worst[t + " magnitude"] = max(worst.get(t + " magnitude", 0.0), float(x.abs().max()))
            else:
                assert torch.equal(x, y), t
    print("max |vllm - hf|:", json.dumps(worst))
