"""The locally built demo target: offline loading, chat template, determinism, skip-if-present."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from drafter.demo_target import REPORT_FILE, build_demo_target, build_tokenizer, ensure_demo_target
from tests.fixtures.targets import tiny_target_config

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there, how are you?"},
    {"role": "assistant", "content": "Fine, thanks! Ünïcödé ok."},
]


def test_loads_offline_with_auto_classes(tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, local_files_only=True)
    assert model.config.model_type == "llama"
    assert model.config.num_hidden_layers == 4 and model.config.hidden_size == 64
    assert (tiny_target / "model.safetensors").is_file()
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert tok.eos_token == "<|eot_id|>" and tok.pad_token and tok.bos_token == "<|begin_of_text|>"
    assert eot in model.generation_config.eos_token_id
    report = json.loads((tiny_target / REPORT_FILE).read_text())
    assert report["steps"] == 30 and report["parameters"] == sum(p.numel() for p in model.parameters())
    assert not list(tiny_target.parent.glob("*.tmp-*"))  # the atomic build left nothing behind


def test_chat_template_renders_and_round_trips(tiny_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.")
    assert text.endswith("Fine, thanks! Ünïcödé ok.<|eot_id|>")
    prompt = tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE: lossless
    enc = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)
    assert enc["input_ids"] == ids  # special tokens are single tokens, no second BOS
    # The template marks assistant tokens (loss masks for the dump stage).
    enc = tok.apply_chat_template(MESSAGES, return_dict=True, return_assistant_tokens_mask=True)
    answer = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(answer) == "Fine, thanks! Ünïcödé ok.<|eot_id|>"
    with pytest.raises(Exception):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_generation_stops_at_eot(tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    # Force the first generated token to be <|eot_id|>: generation must stop right there.
    enc = tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    bias = torch.zeros(model.config.vocab_size)
    bias[eot] = 1e4
    model.lm_head.bias = torch.nn.Parameter(bias)
    out = model.generate(**enc, max_new_tokens=10)
    assert out[0, -1].item() == eot and out.shape[1] == enc["input_ids"].shape[1] + 1


def test_tokenizer_special_tokens_are_atomic():
    tok = build_tokenizer(["hello world"] * 50 + ["some other text here"] * 50, vocab_size=300)
    ids = tok("<|start_header_id|>user<|end_header_id|>", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens([ids[0], ids[-1]]) == ["<|start_header_id|>", "<|end_header_id|>"]
    assert tok("hi")["input_ids"][0] == tok.bos_token_id  # plain encodes get BOS, like Llama 3


def test_training_is_deterministic_and_learns(tmp_path, tiny_conversations):
    cfg = tiny_target_config(max_steps=8)
    a = build_demo_target(cfg, tmp_path / "a", conversations=tiny_conversations)
    b = build_demo_target(cfg, tmp_path / "b", conversations=tiny_conversations)
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["train_loss"] == b["train_loss"] and a["fingerprint"] == b["fingerprint"]
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    build_demo_target(tiny_target_config(max_steps=8, seed=1), tmp_path / "c",
                      conversations=tiny_conversations)
    wc = load_file(tmp_path / "c" / "model.safetensors")
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])


def test_loss_decreases(tiny_target):
    report = json.loads((tiny_target / REPORT_FILE).read_text())
    assert report["eval_loss"] < report["eval_loss_initial"] - 0.3
    assert report["train_loss"] < report["train_loss_first"] - 0.3


def test_ensure_skips_when_present_and_rebuilds_on_change(tmp_path, tiny_conversations):
    cfg = tiny_target_config(max_steps=3)
    out = tmp_path / "t"
    calls = []
    first = ensure_demo_target(cfg, out, conversations=tiny_conversations,
                               progress=lambda *a: calls.append(a))
    assert len(calls) == 3 and calls[-1][:2] == (3, 3) and "skipped" not in first
    again = ensure_demo_target(cfg, out, conversations=tiny_conversations,
                               progress=lambda *a: calls.append(a))
    assert again["skipped"] is True and len(calls) == 3 and again["fingerprint"] == first["fingerprint"]
    changed = ensure_demo_target(tiny_target_config(max_steps=4), out, conversations=tiny_conversations)
    assert "skipped" not in changed and changed["steps"] == 4
    assert json.loads((out / REPORT_FILE).read_text())["steps"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]  # old copy swapped out and removed
