"""A dump shard's records as token sequences: the engine's recorded ids where a record has them,
else its text through the chat template (drafter.tokenize); bad records, template errors and
answerless samples quarantined. Here or in tokenizer processes, a few shards ahead."""
from __future__ import annotations

import logging
import multiprocessing
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from drafter.capture.plan import DumpPlan
from drafter.contracts import reuse
from drafter.formats import split_prefix
from drafter.tokenize import TOKEN_IDS, conversation_tokens, end_of_turn_ids, valid_token_ids

log = logging.getLogger(__name__)


def _check_record(rec) -> str | None:
    """None if usable, else the quarantine reason."""
    if not isinstance(rec, dict) or not isinstance(rec.get("id"), (str, int)):
        return "bad_record"
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            and (TOKEN_IDS not in m or valid_token_ids(m[TOKEN_IDS])) for m in msgs):
        return "bad_record"
    return None


# ---- one shard


@dataclass
class TokenizedShard:
    """A shard's samples ready for the device: (id, input_ids, loss_mask), in upstream order."""

    index: int
    split: str
    samples: list[tuple[str, list[int], list[int]]]
    quarantined: list[dict]
    truncated: int
    input_digest: str = ""  # drafter.contracts.reuse.records_digest of the records (what a later dump can reference)
    from_token_ids: int = 0  # samples built from the engine's recorded ids (the others re-tokenised)


def tokenize_shard(tokenizer, max_length: int, index: int, records: list[dict],
                   split: str = "train") -> TokenizedShard:
    """Tokenise one shard's records (cut to `max_length`): the engine's recorded ids where a record
    has them, else its text (drafter.tokenize); bad records, template errors and answerless samples
    are quarantined."""
    samples, quarantined, truncated, exact = [], [], 0, 0
    eot_ids = end_of_turn_ids(tokenizer)  # once per shard, not per sample
    for pos, rec in enumerate(records):
        reason = _check_record(rec)
        if reason is None:
            try:
                ids, mask, from_ids = conversation_tokens(tokenizer, rec["messages"], eot_ids)
            except Exception as e:  # a template that rejects this conversation (roles, order)
                log.warning("sample %s: chat template failed: %s", rec.get("id"), e)
                reason = "template_error"
        if reason is None:
            truncated += len(ids) > max_length
            ids, mask = ids[:max_length], mask[:max_length]
            reason = None if any(mask) else "no_loss_tokens"
        if reason is not None:
            rid = rec.get("id") if isinstance(rec, dict) else None
            where = f"{split_prefix(split)}{index}.{pos}"
            quarantined.append({"id": str(rid) if rid is not None else f"#{where}", "reason": reason})
            continue
        samples.append((str(rec["id"]), ids, mask))
        exact += from_ids
    return TokenizedShard(index, split, samples, quarantined, truncated, reuse.records_digest(records), exact)


_PROCESS_TOKENIZER = None  # a tokenizer process's own copy


def _load_process_tokenizer(path: str, trust_remote_code: bool) -> None:
    global _PROCESS_TOKENIZER
    from transformers import AutoTokenizer

    _PROCESS_TOKENIZER = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def _tokenize_in_process(max_length: int, index: int, records: list[dict], split: str) -> TokenizedShard:
    return tokenize_shard(_PROCESS_TOKENIZER, max_length, index, records, split)


def tokenized_shards(plan: DumpPlan, tokenizer, jobs: list[tuple[str, int]],
                      records: dict[tuple[str, int], list[dict]]) -> Iterator[TokenizedShard]:
    """The jobs' shards tokenised in order: here (the caller's thread), or by
    dump.tokenize_processes processes, each a shard at a time, a few shards ahead."""
    dump = plan.cfg.dump
    if not dump.tokenize_processes:
        for split, i in jobs:
            yield tokenize_shard(tokenizer, dump.max_length, i, records.pop((split, i)), split)
        return
    ctx = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA state
    with ProcessPoolExecutor(dump.tokenize_processes, mp_context=ctx, initializer=_load_process_tokenizer,
                             initargs=(plan.cfg.target.path, plan.cfg.target.trust_remote_code)) as pool:
        ahead: deque = deque()
        for split, i in jobs:
            ahead.append(pool.submit(_tokenize_in_process, dump.max_length, i, records.pop((split, i)), split))
            if len(ahead) > dump.tokenize_processes:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()
