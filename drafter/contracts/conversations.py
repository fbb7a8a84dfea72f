"""The one conversation shape every prompt source is normalised to, and what reading a source yields.

A conversation is `{"id": str, "messages": [{"role": "system|user|assistant", "content": str}]}`:
what prepare writes, datagen answers, the dump tokenizes, the export judge and the bench prompt
from. `normalise_row` turns a raw row (normalised, ShareGPT-style or {prompt}) into one or raises
`RowError` with a short reason. Bad rows are never fatal: callers quarantine them and count the
reason. Source-level problems (a missing file, a directory that is not a dataset) raise `SourceError`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from drafter.errors import DrafterError

# Role names seen in ShareGPT dumps and OpenAI-style rows, mapped to the three chat roles.
ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant", "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


class RowError(ValueError):
    """A row that cannot become a conversation. `reason` is a short, countable key."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


class SourceError(DrafterError):
    """The source itself is unusable (not a row problem): fix the file or `data.sources`."""


@dataclass
class ReadStats:
    """What reading one source saw; `truncated_tail` means the file ended mid-row."""

    rows: int = 0
    truncated_tail: bool = False
    tail_note: str | None = None


@dataclass
class BadLine:
    """A JSONL line that is not JSON: carried to normalisation so it gets quarantined in order."""

    reason: str
    detail: str


def normalise_row(raw: Any, default_id: str) -> dict:
    """One raw row (normalised, ShareGPT-style or {prompt}) -> a conversation, or RowError."""
    if isinstance(raw, BadLine):
        raise RowError(raw.reason, raw.detail)
    if not isinstance(raw, dict):
        raise RowError("not_a_dict", type(raw).__name__)
    rid = raw.get("id")
    conv_id = str(rid) if rid not in (None, "") else default_id
    if raw.get("messages") is not None:
        turns = raw["messages"]
    elif raw.get("conversations") is not None:
        turns = raw["conversations"]
    elif raw.get("prompt") is not None:
        turns = [{"role": "user", "content": raw["prompt"]}]
    else:
        raise RowError("no_turns", "no messages, conversations or prompt")
    if not isinstance(turns, list) or not turns:
        raise RowError("no_turns", "empty or not a list")

    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise RowError("bad_turn", type(turn).__name__)
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        mapped = ROLES.get(role.strip().lower()) if isinstance(role, str) else None
        if mapped is None:
            raise RowError("unknown_role", repr(role)[:50])
        if not isinstance(content, str):
            raise RowError("bad_content", type(content).__name__)
        if not content.strip():
            raise RowError("empty_content", mapped)
        messages.append({"role": mapped, "content": content})
    for text in (conv_id, *(m["content"] for m in messages)):
        _check_encodable(text)
    return {"id": conv_id, "messages": _shape(messages)}


def _check_encodable(text: str) -> None:
    """JSON allows escapes such as a lone surrogate (\\ud800) that no UTF-8 file can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RowError("invalid_unicode", f"{err.reason} at position {err.start}") from None


def _shape(messages: list[dict]) -> list[dict]:
    """Check the turn order and cut the end so the conversation is usable for datagen."""
    system = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    if not turns or turns[0]["role"] != "user":
        raise RowError("first_turn_not_user")
    for i, turn in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if turn["role"] == "system":
            raise RowError("misplaced_system")
        if turn["role"] != expected:
            raise RowError("not_alternating", f"turn {i} is {turn['role']}")
    # End on an assistant turn, or keep a lone user prompt (datagen regenerates answers anyway).
    if len(turns) > 1 and turns[-1]["role"] == "user":
        turns = turns[:-1]
    return system + turns
