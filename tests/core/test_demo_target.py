"""The locally built demo target: offline loading, chat template, determinism, skip-if-present,
the step budget and thread count as the recipe, the answer-diversity report and its gate."""
from __future__ import annotations

import itertools
import json
import types

import pytest
import torch
from safetensors.torch import load_file

from drafter import demo_target
from drafter.demo_target import (
    REPORT_FILE, DegenerateTargetError, DemoTargetError, answer_report, build_demo_target, build_tokenizer,
    check_answers, config_fingerprint, degenerate_reason, ensure_demo_target, held_out_prompts)
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


def _weights(path):
    return (path / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_training_is_deterministic_and_learns(tmp_path, tiny_conversations):
    # Same config -> same bytes, whatever torch's thread setting was before the build: the
    # configured thread count (2 here) is what trains, and the caller's setting is restored.
    cfg = tiny_target_config(max_steps=8, threads=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = build_demo_target(cfg, tmp_path / "a", conversations=tiny_conversations)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(3)
        b = build_demo_target(cfg, tmp_path / "b", conversations=tiny_conversations)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    assert a["torch_threads"] == b["torch_threads"] == 2
    assert _weights(tmp_path / "a") == _weights(tmp_path / "b")
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


def test_threads_used_are_the_configured_ones(tmp_path, tiny_conversations):
    seen = []
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        report = build_demo_target(tiny_target_config(max_steps=3, threads=1), tmp_path / "t",
                                   conversations=tiny_conversations,
                                   progress=lambda *a: seen.append(torch.get_num_threads()))
        assert torch.get_num_threads() == 2  # restored after the build
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1, 1] and report["torch_threads"] == 1
    # The thread count is part of the recipe, so it names what is built.
    data = "conversations:x"
    assert config_fingerprint(tiny_target_config(threads=1), data) != \
        config_fingerprint(tiny_target_config(threads=2), data)


def test_schedule_follows_steps_not_the_clock(tmp_path, tiny_conversations, monkeypatch):
    cfg = tiny_target_config(max_steps=6, train_seconds=None)  # no time limit at all
    build_demo_target(cfg, tmp_path / "a", conversations=tiny_conversations)
    # A clock that jumps 1000 s per reading (a very loaded machine): same steps, same bytes.
    ticks = itertools.count(0, 1000.0)
    monkeypatch.setattr(demo_target, "time", types.SimpleNamespace(monotonic=lambda: next(ticks)))
    slow = build_demo_target(cfg, tmp_path / "b", conversations=tiny_conversations)
    assert slow["steps"] == 6 and slow["train_seconds"] > 1000
    assert _weights(tmp_path / "a") == _weights(tmp_path / "b")


def test_time_limit_fails_loudly_and_saves_nothing(tmp_path, tiny_conversations, monkeypatch):
    ticks = itertools.count(0, 1000.0)
    monkeypatch.setattr(demo_target, "time", types.SimpleNamespace(monotonic=lambda: next(ticks)))
    cfg = tiny_target_config(max_steps=6, train_seconds=1500)
    with pytest.raises(DemoTargetError, match=r"exceeded train_seconds=1500 at step 2/6 \(2000 s\); nothing saved") as err:
        build_demo_target(cfg, tmp_path / "t", conversations=tiny_conversations)
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_answer_report_fields(tiny_target, tiny_conversations):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    answers = json.loads((tiny_target / REPORT_FILE).read_text())["answers"]
    assert answers["prompts"] == 8 and answers["max_new_tokens"] == 64  # 8 of 10 held-out prompts fit
    for key in ("mean_distinct_tokens", "top_token", "top_token_share", "mean_answer_tokens",
                "distinct_answers", "stopped_share", "degenerate", "samples"):
        assert key in answers
    # The figures are those of real greedy answers: redo the first one by hand.
    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    prompt = held_out_prompts(tiny_conversations[-10:])[0]
    x = tok.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**x, max_new_tokens=64, do_sample=False)[0, x["input_ids"].shape[1]:].tolist()
    eos = set(model.generation_config.eos_token_id)
    out = out[:-1] if out and out[-1] in eos else out
    assert answers["samples"][0] == {"prompt": prompt[-1]["content"][:80], "answer": tok.decode(out)[:200]}
    assert 0 < answers["mean_answer_tokens"] <= 64 and 1 <= answers["distinct_answers"] <= 8
    assert 0 < answers["top_token_share"] <= 1 and 1 <= answers["mean_distinct_tokens"] <= 64
    # The tiny test target is far too small to talk: its report says so (the fixture does not gate).
    assert answers["degenerate"] == degenerate_reason(answers) is not None


def test_degenerate_thresholds_are_exact():
    ok = {"prompts": 4, "mean_distinct_tokens": 3.0, "top_token": "a", "top_token_share": 0.8}
    assert degenerate_reason(ok) is None
    check_answers(ok)
    assert "< 3" in degenerate_reason({**ok, "mean_distinct_tokens": 2.99})
    assert "> 80%" in degenerate_reason({**ok, "top_token_share": 0.81})
    with pytest.raises(DegenerateTargetError, match="no held-out prompt fits"):
        check_answers({"prompts": 0})


def test_planted_one_token_model_is_refused(tiny_target, tiny_conversations):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    dot = tok.convert_tokens_to_ids(".")
    bias = torch.zeros(model.config.vocab_size)
    bias[dot] = 1e4  # every position now predicts "."
    model.lm_head.bias = torch.nn.Parameter(bias)
    gen = GenerationConfig.from_pretrained(tiny_target)
    answers = answer_report(model, tok, held_out_prompts(tiny_conversations[-10:]), gen, limit=4,
                            max_new_tokens=16, max_positions=512)
    assert answers["prompts"] == 4 and answers["mean_answer_tokens"] == 16
    assert answers["mean_distinct_tokens"] == 1.0 and answers["top_token"] == "." and answers["top_token_share"] == 1.0
    assert answers["samples"][0]["answer"] == "." * 16
    with pytest.raises(DegenerateTargetError) as err:
        check_answers(answers)
    msg = str(err.value)
    assert "\n" not in msg and "4 held-out prompts" in msg and "mean distinct tokens per answer 1.0 < 3" in msg


def test_degenerate_build_fails_and_keeps_the_previous_target(tmp_path, tiny_conversations):
    out = tmp_path / "t"
    first = ensure_demo_target(tiny_target_config(max_steps=3), out, conversations=tiny_conversations)
    assert first["answers"]["degenerate"]  # 3 steps: one repeated token, saved since not gated
    weights = _weights(out)
    gated = tiny_target_config(max_steps=3, fail_on_degenerate=True)
    with pytest.raises(DegenerateTargetError, match="demo target is degenerate"):
        ensure_demo_target(gated, out, conversations=tiny_conversations)
    # Nothing new saved: the previous target and its report are untouched, no temp dirs left.
    assert _weights(out) == weights and json.loads((out / REPORT_FILE).read_text())["fingerprint"] == first["fingerprint"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


_BUILD_IN_A_PROCESS = """
import hashlib, json, sys
import torch
junk = [torch.empty(int(n)) for n in sys.argv[2:]]  # another heap layout in each process
from drafter.demo_target import build_demo_target
from tests.fixtures.targets import tiny_target_config
cfg = tiny_target_config(max_steps=12, threads=1, collapse_whitespace=True, answer_prompts=2, answer_tokens=8)
report = build_demo_target(cfg, sys.argv[1])
print(json.dumps({"sha256": hashlib.sha256(open(sys.argv[1] + "/model.safetensors", "rb").read()).hexdigest(),
                  "loss": report["train_loss"]}))
"""


@pytest.mark.slow
def test_same_weights_in_separate_processes(tmp_path):
    # Two processes at once (each loads the other's core), other hash seeds, other heap layouts,
    # the data read from the package as `drafter demo-target` reads it: the same bytes.
    import hashlib
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD_IN_A_PROCESS, str(tmp_path / name), *junk],
                              cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed})
             for name, seed, junk in [("a", "1", []), ("b", "2", ["1000003", "77"])]]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    a, b = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert a == b
    assert a["sha256"] == hashlib.sha256((tmp_path / "b" / "model.safetensors").read_bytes()).hexdigest()


def test_demo_profile_recipe_is_gated_and_step_budgeted():
    from pathlib import Path

    import yaml

    from drafter.config import DemoTargetConfig

    root = Path(__file__).resolve().parents[2]
    demos = [yaml.safe_load((root / "profiles" / name).read_text())["target"]["demo"]
             for name in ("demo.yaml", "retrain-demo.yaml")]
    assert demos[0] == demos[1]  # one target for both profiles (same fingerprint)
    cfg = DemoTargetConfig(**demos[0])
    assert cfg.fail_on_degenerate and cfg.threads == 1 and cfg.train_seconds is None
    assert cfg.collapse_whitespace and cfg.max_steps <= 600
