"""Incremental stages: reuse what earlier outputs of the same stage computed for the same inputs.

A retrain on a grown corpus gets a new prepare fingerprint, so datagen and dump get new outputs.
Their work must grow with the new data, not the whole corpus. Each output of datagen and dump
records a `reuse_key` (its fingerprint's configuration WITHOUT the upstream: same target, same
settings) in a small index (`_reuse/<stage>/<reuse_key>/<fingerprint>.json`); a later output with
the same key looks there for work already done:

- datagen, per conversation (content-addressed by its id and its system + user turns): an earlier
  generated shard whose conversations are all in the new corpus is referenced whole (no byte is
  copied); a conversation answered in an earlier shard that cannot be referenced whole is copied
  from it (sample granularity); only the rest is sent to the target.
- dump, per shard (content-addressed by the records that go into it): an earlier dump shard made
  from exactly the same records is referenced (`StageOutput.link_shard`); the others are computed.
  Dump shards follow the upstream's shards (a piece never spans two datagen shards; the pieces are
  cut by drafter.formats.dump_pieces), so the shards a datagen output referenced produce the same
  pieces again.

References are checked like our own shards (size on completeness, sha256 on every read), so
deleting an earlier output makes the later one incomplete, and a re-run recomputes what is missing.
Reuse never changes what a fingerprint names: the same conversations and the same hidden states,
possibly grouped and ordered differently than a from-scratch run would (records are identical
because generation is keyed by the target's identity and the generation settings).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from drafter.hashing import canonical_json, short_hash
from drafter.stage_output import ObjectNotFound, ShardInfo, StageOutput
from drafter.stage_output import fingerprint as stage_fingerprint
from drafter.store import ObjectStore, StoreError

log = logging.getLogger(__name__)

INDEX_ROOT = "_reuse"
KEYS_SHARD = "conversation-keys.jsonl"   # datagen: {"shard", "keys"} per generated shard


def reuse_key(stage: str, config: dict) -> str:
    """What makes outputs of `stage` interchangeable for the same input: its configuration
    without the upstream fingerprints."""
    return stage_fingerprint(stage, config, [])


def register(out: StageOutput, key: str) -> None:
    """Make a committed output findable by later outputs with the same reuse key."""
    out.store.put_bytes(f"{INDEX_ROOT}/{out.stage}/{key}/{out.fingerprint}.json",
                        json.dumps({"fingerprint": out.fingerprint}).encode())


def earlier_outputs(store: ObjectStore, stage: str, key: str, exclude: str) -> list[StageOutput]:
    """Committed outputs of `stage` with this reuse key, newest first (never `exclude`, ours)."""
    found = []
    for index_key in store.list(f"{INDEX_ROOT}/{stage}/{key}/"):
        fp = index_key.rsplit("/", 1)[-1].removesuffix(".json")
        if fp == exclude:
            continue
        try:
            found.append(StageOutput.committed(store, stage, fp))
        except (ObjectNotFound, StoreError) as err:  # deleted, or never finished: nothing to reuse
            log.info("reuse: skipping %s/%s (%s)", stage, fp, err)
    return sorted(found, key=lambda o: o.manifest.created_at, reverse=True)


def digest(keys: Iterable[str]) -> str:
    return short_hash("\n".join(keys))


# ---- datagen


def conversation_key(conversation: dict) -> str:
    """What a generated answer depends on besides the settings: the id and the non-assistant turns
    (the target writes every answer itself). A datagen record has the same key as its input."""
    turns = [{"role": m["role"], "content": m["content"]} for m in conversation["messages"]
             if m["role"] != "assistant"]
    return short_hash(canonical_json({"id": conversation["id"], "turns": turns}))


@dataclass
class Link:
    """An earlier output's shard referenced under a new name."""

    source: StageOutput
    source_name: str
    keys: list[str]


@dataclass
class DatagenReuse:
    """For one split: earlier shards to reference whole (in order), records to copy by key, and the
    conversations left for the target (in corpus order)."""

    links: list[Link] = field(default_factory=list)
    copies: dict[str, dict] = field(default_factory=dict)
    remaining: list[dict] = field(default_factory=list)


def _datagen_index(out: StageOutput) -> dict[str, list[str]]:
    try:
        rows = out.read_jsonl(KEYS_SHARD)
    except ObjectNotFound:  # an output made before reuse existed: nothing to look up
        return {}
    return {r["shard"]: r["keys"] for r in rows}


def plan_datagen(earlier: list[StageOutput], conversations: list[dict], gen_prefix: str) -> DatagenReuse:
    """Reuse for the conversations of one split; `gen_prefix` names that split's generated shards."""
    keys = [conversation_key(c) for c in conversations]
    wanted = dict(zip(keys, conversations))
    plan, covered = DatagenReuse(), set()
    indexes = [(out, _datagen_index(out)) for out in earlier]
    for out, index in indexes:
        for shard in (s.name for s in out.manifest.shards if s.name.startswith(gen_prefix)):
            shard_keys = index.get(shard)
            if shard_keys and all(k in wanted and k not in covered for k in shard_keys):
                plan.links.append(Link(out, shard, shard_keys))
                covered.update(shard_keys)
    missing = {k for k in keys if k not in covered}
    for out, index in indexes:  # sample granularity: answers in shards that could not be linked whole
        for shard, shard_keys in index.items():
            if missing and shard.startswith(gen_prefix) and missing.intersection(shard_keys):
                for record in out.read_jsonl(shard):
                    k = conversation_key(record)
                    if k in missing:
                        plan.copies[k] = record
                        missing.discard(k)
    plan.remaining = [c for k, c in zip(keys, conversations) if k not in covered]
    return plan


def linked_meta(meta: dict) -> dict:
    """A referenced generated shard's counts: its errors are not part of the new output (those
    conversations are asked again), so they are not counted."""
    return {**meta, "conversations": meta["generated"], "errors": 0, "errors_by_reason": {}}


# ---- dump


def records_digest(records: list[dict]) -> str:
    """A dump piece's content address: exactly the records its hidden states are computed from."""
    return short_hash(canonical_json(records))


def dump_reuse_meta(earlier: list[StageOutput], shards: Iterable[ShardInfo]) -> dict:
    """What an output reused, from its committed shards (a resumed run reports what an
    uninterrupted one would): referenced vs computed shards and their input records."""
    counts = {"linked_shards": 0, "linked_records": 0, "computed_shards": 0, "computed_records": 0}
    for s in shards:
        kind = "linked" if s.source else "computed"
        counts[f"{kind}_shards"] += 1
        counts[f"{kind}_records"] += s.meta["samples"] + len(s.meta["quarantined"])
    return {"earlier_outputs": [o.fingerprint for o in earlier], **counts}


def dump_index(earlier: list[StageOutput]) -> dict[str, tuple[StageOutput, str]]:
    """input digest -> (earlier dump output, shard name), newest output first wins."""
    found: dict[str, tuple[StageOutput, str]] = {}
    for out in reversed(earlier):
        for shard in out.manifest.shards:
            d = shard.meta.get("input_digest")
            if d:
                found[d] = (out, shard.name)
    return found
