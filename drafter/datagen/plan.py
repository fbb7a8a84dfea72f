"""What a datagen output is made of: per split, earlier shards referenced whole, then new shards
of the remaining conversations (answers found in earlier shards filled in); the counts of the
manifest; what the token ids say.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from drafter.config import LifecycleConfig
from drafter.contracts import reuse
from drafter.datagen.generate import Shard
from drafter.formats import SPLITS, gen_shard_name, load_prepared, split_prefix
from drafter.stage_output import EmptyOutput, ShardInfo, StageOutput
from drafter.store import ObjectStore

RETOKENIZE_WARN_BELOW = 0.95  # retokenize_agreement under this: the text would have trained wrong sequences


def counts(metas: list[dict]) -> dict[str, Any]:
    """Conversation, error, turn and token counts summed over shard markers."""
    total: Counter = Counter()
    errors_by_reason: Counter = Counter()
    finish_reasons: Counter = Counter()
    ids: Counter = Counter()
    for m in metas:
        total.update({k: m[k] for k in ("conversations", "generated", "errors", "turns",
                                        "prompt_tokens", "completion_tokens")})
        errors_by_reason.update(m["errors_by_reason"])
        finish_reasons.update(m["finish_reasons"])
        ids.update(m.get("token_ids") or {})  # shards written before ids were recorded have none
    measured = ids["measured_tokens"]
    return {**{k: total[k] for k in ("conversations", "generated", "errors", "turns", "prompt_tokens",
                                     "completion_tokens")},
            "errors_by_reason": dict(sorted(errors_by_reason.items())),
            "finish_reasons": dict(sorted(finish_reasons.items())),
            "token_ids": {"turns_with_ids": ids["turns_with_ids"],
                          "turns_without_ids": total["turns"] - ids["turns_with_ids"],
                          "measured_tokens": measured, "same_tokens": ids["same_tokens"]},
            "retokenize_agreement": round(ids["same_tokens"] / measured, 4) if measured else None}


def manifest_meta(cfg: LifecycleConfig, shards: dict[str, ShardInfo], plan: Mapping[str, Sequence[str]],
                   prepare_fp: str, resumed: int, this_run: dict[str, Any], reused: dict) -> dict[str, Any]:
    """Top-level counts describe the train split (what the drafter learns from); `eval` the
    held-out split (regenerated the same way, for held-out metrics)."""
    d = cfg.datagen
    return {
        "prepare_fingerprint": prepare_fp,
        **counts([shards[name].meta for name in plan["train"]]),
        "eval": counts([shards[name].meta for name in plan["eval"]]),
        "shards": len(plan["train"]), "eval_shards": len(plan["eval"]), "shard_size": d.shard_size,
        "resumed_shards": resumed,
        "reuse": reused,
        "generation": {"model": cfg.target.served_name, "target_path": cfg.target.path,
                       "temperature": d.temperature, "max_tokens": d.max_tokens,
                       "request_timeout_s": d.request_timeout_s, "max_retries": d.max_retries},
        "throughput": this_run,  # this run only: shards resumed from an earlier run are not timed
    }


def plan_shards(store: ObjectStore, cfg: LifecycleConfig, prepare_fp: str, earlier: list[StageOutput]
          ) -> tuple[list[Shard], list[tuple[str, reuse.Link]]]:
    """Per split: earlier shards referenced whole (named first), then new shards of the remaining
    conversations in corpus order, with answers found in earlier shards filled in."""
    size = cfg.datagen.shard_size
    shards: list[Shard] = []
    links: list[tuple[str, reuse.Link]] = []
    for split in SPLITS:
        conversations = load_prepared(store, prepare_fp, split)
        found = reuse.plan_datagen(earlier, conversations, f"{split_prefix(split)}gen-")
        links += [(gen_shard_name(i, split), link) for i, link in enumerate(found.links)]
        rest, first = found.remaining, len(found.links)
        for i in range(math.ceil(len(rest) / size)):
            shard = Shard(first + i, rest[i * size:(i + 1) * size], split)
            keys = [reuse.conversation_key(c) for c in shard.conversations]
            shard.digest = reuse.digest(keys)
            for position, k in enumerate(keys):
                if k in found.copies:
                    shard.finish(position, found.copies[k], None)
            shards.append(shard)
    return shards, links


def not_empty(cfg: LifecycleConfig, meta: dict[str, Any]) -> dict[str, Any]:
    """The manifest meta, unless no train conversation was generated (then nothing is committed:
    the error shards stay, so the reasons can be read and a re-run needs no server)."""
    if meta["generated"] == 0 and not cfg.datagen.allow_empty:
        raise EmptyOutput(f"datagen generated 0 of {meta['conversations']} train conversations "
                          f"(errors {meta['errors_by_reason']}); see the errors-*.jsonl shards, or set "
                          f"datagen.allow_empty: true")
    return meta


def token_id_warnings(meta: dict[str, Any]) -> list[str]:
    """What the train split's ids say about training on re-tokenised text (empty: nothing to warn)."""
    ids = meta.get("token_ids") or {"turns_with_ids": 0, "turns_without_ids": meta["turns"]}
    agreement = meta.get("retokenize_agreement")
    warnings = []
    if agreement is not None and agreement < RETOKENIZE_WARN_BELOW:
        warnings.append(f"re-tokenizing the answers' text reproduces only {agreement:.1%} of the "
                        f"{ids['measured_tokens']} answer tokens the target generated (below "
                        f"{RETOKENIZE_WARN_BELOW:.0%}): text alone would have been wrong; the dump trains on the "
                        f"returned token ids")
    if ids["turns_without_ids"]:
        warnings.append(f"{ids['turns_without_ids']} of {ids['turns_with_ids'] + ids['turns_without_ids']} answers "
                        f"came without token ids (the server returned none): the dump falls back to re-tokenizing "
                        f"their text, and the drafter will train on token sequences the target may not emit")
    return warnings


def token_id_line(meta: dict[str, Any]) -> str | None:
    ids, agreement = meta.get("token_ids") or {}, meta.get("retokenize_agreement")
    if not ids.get("turns_with_ids"):
        return None
    share = f"{agreement:.1%}" if agreement is not None else "not measured"
    return (f"token ids recorded for {ids['turns_with_ids']} of {ids['turns_with_ids'] + ids['turns_without_ids']} "
            f"answers; re-tokenization agreement {share}")

