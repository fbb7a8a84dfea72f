"""The bench's prompts: the held-out conversations' first user turns, through the target's chat
template when it has one, less those that leave no room for `bench.max_tokens` in its context."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from drafter.bench import BenchError
from drafter.config import LifecycleConfig


def target_context(cfg: LifecycleConfig) -> int | None:
    """The target's context length: `max_position_embeddings` of its config.json (the text model's);
    None when there is no config.json here or it does not say."""
    if not (Path(cfg.target.path) / "config.json").is_file():
        return None
    from drafter.model import read_target_config

    return read_target_config(cfg.target.path).get("max_position_embeddings")


@dataclass(frozen=True)
class BenchPrompts:
    prompts: list
    format: str
    dropped: int = 0              # too long for the target's context with bench.max_tokens new tokens
    context: int | None = None    # the target's context length; None: not checked


def _tokenizer(cfg: LifecycleConfig):
    path = Path(cfg.target.path)
    if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.target.trust_remote_code)
    return None


def build_prompts(cfg: LifecycleConfig, conversations: list[dict]) -> BenchPrompts:
    """Token ids through the target's chat template when it has one (what a chat request sends),
    without the prompts that leave no room for `bench.max_tokens` new tokens in the target's context
    (every configuration would fail on them); the rule and the rendering are the export judge's
    (`prompts_from_conversations`). Else the first user turn's text, unchecked (the server
    tokenizes it)."""
    tok = _tokenizer(cfg)
    if tok is not None and tok.chat_template:
        from drafter.contracts.prompts import prompts_from_conversations

        context = target_context(cfg)
        room = context - cfg.bench.max_tokens if context is not None else sys.maxsize
        prompts, skipped = prompts_from_conversations(tok, conversations, len(conversations), room)
        if not prompts and skipped["too_long"]:
            every, _ = prompts_from_conversations(tok, conversations, len(conversations), sys.maxsize)
            shortest = min(len(p) for p in every)
            raise BenchError(
                f"no held-out prompt fits the target's context: all {skipped['too_long']} need more than "
                f"max_position_embeddings {context} ({cfg.target.path}/config.json) with bench.max_tokens "
                f"{cfg.bench.max_tokens} new tokens (the shortest has {shortest} tokens); set bench.max_tokens "
                f"to at most {context - shortest}, or bench on prompts that fit")
        return BenchPrompts(prompts, "chat template token ids", skipped["too_long"], context)
    firsts = []
    for conv in conversations:
        msgs = conv["messages"]
        upto = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        if upto is not None:
            firsts.append(msgs[:upto + 1])
    return BenchPrompts([m[-1]["content"] for m in firsts],
                        "first user turn, raw text (the target has no chat template)")
