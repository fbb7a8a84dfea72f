"""The corpus preparation itself: read every source, normalise, filter, deduplicate, split into
train and eval (a hash of the id, so a grown corpus keeps every earlier split), in memory.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

from drafter.config import DataConfig
from drafter.formats import PREPARE as STAGE
from drafter.hashing import sha256_hex
from drafter.contracts.conversations import ReadStats, RowError, normalise_row
from drafter.prepare.sources import read_source, truncate_turns
from drafter.stage_output import Progress, guarded_progress


@dataclass
class Prepared:
    """The in-memory result of preparation, before it is written anywhere."""

    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    quarantine: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


def _printable(text: str) -> str:
    """Text a UTF-8 quarantine file can hold (a lone surrogate becomes its escape)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def source_labels(data: DataConfig) -> list[str]:
    """A short name per source: its kind, numbered only when a kind repeats."""
    kinds = Counter(s.kind for s in data.sources)
    return [s.kind if kinds[s.kind] == 1 else f"{s.kind}{i}" for i, s in enumerate(data.sources)]


def user_key(messages: list[dict]) -> str:
    """Dedupe key: the user turns only (answers get regenerated, so they do not make a prompt new)."""
    users = [m["content"].strip() for m in messages if m["role"] == "user"]
    return sha256_hex(json.dumps(users, ensure_ascii=False))


def _filter_reason(messages: list[dict], data: DataConfig) -> str | None:
    first_user = next(m["content"] for m in messages if m["role"] == "user")
    if len(first_user.strip()) < data.min_chars:
        return "too_short"
    if sum(len(m["content"]) for m in messages) > data.max_chars:
        return "too_long"
    return None


def _unique_id(conv_id: str, label: str, taken: set[str]) -> str:
    """Keep the id if free; else prefix the source; else count up."""
    candidate, n = conv_id, 1
    if candidate in taken:
        candidate = f"{label}/{conv_id}"
    while candidate in taken:
        n += 1
        candidate = f"{label}/{conv_id}#{n}"
    taken.add(candidate)
    return candidate


def split_score(conv_id: str, seed: int) -> float:
    """Deterministic, order-independent position of an id in [0, 1)."""
    digest = hashlib.sha256(f"{seed}:{conv_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_train_eval(kept: list[dict], data: DataConfig) -> tuple[list[dict], list[dict]]:
    """Eval = ids scoring below eval_fraction, capped at max_eval (lowest scores win).

    If the fraction selects nobody from a small corpus, the lowest-scoring conversation is still
    held out (when there are at least two): later stages need some eval prompts.
    """
    scores = {c["id"]: split_score(c["id"], data.seed) for c in kept}
    chosen = sorted((c["id"] for c in kept if scores[c["id"]] < data.eval_fraction), key=scores.get)
    if not chosen and data.eval_fraction > 0 and len(kept) >= 2:
        chosen = [min(scores, key=scores.get)]
    if data.max_eval is not None:
        chosen = chosen[:data.max_eval]
    held_out = set(chosen)
    return ([c for c in kept if c["id"] not in held_out], [c for c in kept if c["id"] in held_out])


def prepare_conversations(data: DataConfig, progress: Progress | None = None) -> Prepared:
    """Read every source in order; normalise, quarantine, truncate, filter, dedupe, limit, split."""
    progress = guarded_progress(progress, STAGE)
    out = Prepared()
    quarantined, filtered = Counter(), Counter()
    seen_keys: set[str] = set()
    taken_ids: set[str] = set()
    kept: list[dict] = []
    duplicates = read = 0
    sources_meta = []
    limit_reached = False
    for src, label in zip(data.sources, source_labels(data)):
        stats = ReadStats()
        kept_before = len(kept)
        for row_index, raw in enumerate(read_source(src, stats)):
            read += 1
            if progress is not None and read % 1000 == 0:
                progress(read, None)
            try:
                conv = normalise_row(raw, default_id=f"{label}-{row_index}")
            except (RowError, ValueError, TypeError, RecursionError) as err:
                # Any failure of one row quarantines that row, with its reason; never the stage.
                reason = err.reason if isinstance(err, RowError) else f"unreadable_{type(err).__name__}"
                row = {"source": label, "row_index": row_index, "reason": reason,
                       "detail": _printable(str(err)[:200])}
                if isinstance(raw, dict) and raw.get("id") not in (None, ""):
                    row["id"] = _printable(str(raw["id"]))
                out.quarantine.append(row)
                quarantined[reason] += 1
                continue
            messages = conv["messages"]
            if data.max_turns is not None:
                messages = truncate_turns(messages, data.max_turns)
            reason = _filter_reason(messages, data)
            if reason is not None:
                filtered[reason] += 1
                continue
            key = user_key(messages)
            if key in seen_keys:
                duplicates += 1
                continue
            seen_keys.add(key)
            kept.append({"id": _unique_id(conv["id"], label, taken_ids), "messages": messages})
            if data.limit is not None and len(kept) >= data.limit:
                limit_reached = True
                break
        sources_meta.append({"label": label, "kind": src.kind, "path": src.path, "rows_read": stats.rows,
                             "kept": len(kept) - kept_before, "truncated_tail": stats.truncated_tail,
                             "tail_note": stats.tail_note})
        if limit_reached:
            break  # later sources are not read at all
    out.train, out.eval = split_train_eval(kept, data)
    out.meta = {
        "read": read, "kept": len(kept), "train": len(out.train), "eval": len(out.eval),
        "duplicates": duplicates, "filtered": dict(sorted(filtered.items())),
        "quarantined": dict(sorted(quarantined.items())), "quarantined_total": len(out.quarantine),
        "truncated_tail": any(s["truncated_tail"] for s in sources_meta),
        "limit_reached": limit_reached, "sources": sources_meta,
    }
    if progress is not None:
        progress(read, read)
    return out
