"""Real batches for benchmarks/bench_train.py: a committed dump read through the training reader.

- `sharegpt_masks`: the token lengths and loss masks of ShareGPT conversations, estimated without
  a tokenizer (Llama-3 chat template: 1 BOS token, 4 header tokens + content + 1 <|eot_id|> per
  message, content at `chars_per_token` UTF-8 bytes per token; loss on the assistant turns'
  content and <|eot_id|>), cut to max_length as the dump does.
- `write_synthetic_dump`: a committed dump with those lengths and masks, random token ids and
  random states (a tiled pool of rows: every byte is still written, hashed and read) in the real
  shard format, bf16 or fp8 + per-token scales. Reused when already committed.
- `open_dump`: a store (directory, file://DIR or s3://BUCKET/PREFIX) and its one dump (or the named one).
- `batches`: the training path's micro-batches (DumpReader in the seeded order, Packer to
  train.tokens_per_micro_batch on its background thread, fp8 decoded there), and `BatchDigests`:
  what a consumer trained on, so two processes can show they got the same batches.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch

from drafter.contracts import fp8
from drafter.contracts.shards import ShardWriter
from drafter.layers import LAYER_ID_CONVENTION
from drafter.stage_output import MANIFEST_NAME, StageOutput
from drafter.store import FileStore, ObjectStore
from drafter.training.data import DUMP_STAGE, Cursor, DumpExpectation, DumpReader, dump_splits, packer_for
from drafter.training.ttt import MicroBatch

AUX = [1, 15, 28]  # Llama-3.1-8B's EAGLE-3 layers (any three ids would do for synthetic states)
HEADER_TOKENS, EOT_TOKENS, BOS_TOKENS = 4, 1, 1


def sharegpt_masks(conversations, max_length: int, chars_per_token: float = 4.0,
                   max_tokens: int | None = None) -> list[torch.Tensor]:
    """One uint8 loss mask per conversation (its length is the sample's token count), in order,
    until `max_tokens` tokens; conversations of fewer than 2 tokens are left out."""
    out, total = [], 0
    for conv in conversations:
        parts = [torch.zeros(BOS_TOKENS, dtype=torch.uint8)]
        for m in conv.get("messages", []):
            n = int(-(-len(str(m.get("content", "")).encode()) // chars_per_token))
            answer = m.get("role") in ("assistant", "gpt")
            parts += [torch.zeros(HEADER_TOKENS, dtype=torch.uint8),
                      torch.full((n + EOT_TOKENS,), int(answer), dtype=torch.uint8)]
        mask = torch.cat(parts)[:max_length]
        if mask.numel() < 2:
            continue
        out.append(mask)
        total += mask.numel()
        if max_tokens is not None and total >= max_tokens:
            break
    return out


def lengths_digest(masks: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for m in masks:
        h.update(m.numpy().tobytes() + b"|")
    return h.hexdigest()[:12]


def write_synthetic_dump(store: ObjectStore, masks: list[torch.Tensor], hidden: int, storage: str, vocab: int,
                         shard_tokens: int = 65536, seed: int = 0) -> tuple[str, dict]:
    """Commit a dump of `masks`' samples (random ids < vocab, random states, bf16 or fp8 storage):
    (fingerprint, facts). A dump of the same lengths, shape and storage already committed is reused."""
    fp = f"sharegpt-h{hidden}-v{vocab}-{storage.replace('_', '')}-{lengths_digest(masks)}-s{seed}"
    out = StageOutput(store, DUMP_STAGE, fp)
    tokens = sum(m.numel() for m in masks)
    if store.exists(out.key(MANIFEST_NAME)):
        return fp, {"reused": True, "samples": len(masks), "tokens": tokens}
    out.reset()  # a half-written earlier attempt
    g = torch.Generator().manual_seed(seed)
    pool = 2 * max(m.numel() for m in masks)
    aux_pool = torch.randn(pool, 3, hidden, generator=g).to(torch.bfloat16)
    fin_pool = torch.randn(pool, hidden, generator=g).to(torch.bfloat16)
    if storage == "float8_e4m3":
        (aq, asc), (fq, fsc) = fp8.encode(aux_pool), fp8.encode(fin_pool)
    meta = {"aux_layer_ids": AUX, "layer_id_convention": LAYER_ID_CONVENTION}
    if storage == "float8_e4m3":
        meta["dtype"] = "bfloat16"  # the dtype fp8 states decode to
    k = shard = 0
    while k < len(masks):
        w = ShardWriter(metadata=meta)
        n = 0
        while k < len(masks) and (n == 0 or n + masks[k].numel() <= shard_tokens):
            L = masks[k].numel()
            a = int(torch.randint(0, pool - L + 1, (1,), generator=g))
            ids = torch.randint(0, vocab, (L,), generator=g)
            if storage == "float8_e4m3":
                w.add(f"c{k}", ids, masks[k], aq[a:a + L], fq[a:a + L], aux_scales=asc[a:a + L],
                      hidden_scales=fsc[a:a + L])
            else:
                w.add(f"c{k}", ids, masks[k], aux_pool[a:a + L], fin_pool[a:a + L])
            n += L
            k += 1
        out.write_shard(f"hs-{shard:05d}.safetensors", w.chunks(), meta={"samples": len(w), "tokens": n})
        w.discard()
        shard += 1
    manifest = out.commit({**meta, "hidden_size": hidden, "target_fingerprint": "bench-synthetic",
                           "dtype": "bfloat16", "storage_dtype": storage})
    return fp, {"reused": False, "samples": len(masks), "tokens": tokens, "shards": shard,
                "bytes": manifest.total_bytes}


def open_dump(where: str, fingerprint: str | None = None) -> tuple[ObjectStore, str]:
    """(store, dump fingerprint): `where` is a directory, file://DIR or s3://BUCKET[/PREFIX]
    (endpoint from AWS_ENDPOINT_URL); without `fingerprint` the store must hold exactly one dump."""
    if where.startswith("s3://"):
        from drafter.config.sections import StorageConfig
        from drafter.store import open_store

        store = open_store(StorageConfig(root=where, endpoint_url=os.environ.get("AWS_ENDPOINT_URL")), create=False)
    else:
        store = FileStore(where.removeprefix("file://"), create=False)
    if fingerprint is None:
        found = sorted(k.split("/")[1] for k in store.list(f"{DUMP_STAGE}/") if k.endswith("/" + MANIFEST_NAME))
        if len(found) != 1:
            raise SystemExit(f"{where}: {len(found)} committed dumps ({', '.join(found) or 'none'}): name one with --dump")
        fingerprint = found[0]
    return store, fingerprint


def open_reader(store: ObjectStore, fingerprint: str, max_length: int, seed: int = 0,
                cache_shards: int = 2, prefetch_shards: int = 1) -> DumpReader:
    """The train split's reader, expecting what the dump says it holds (no target to check against)."""
    split = dump_splits(store, fingerprint)[0]
    meta = StageOutput.committed(store, DUMP_STAGE, fingerprint).manifest.meta
    expect = DumpExpectation(aux_layer_ids=list(meta["aux_layer_ids"]), hidden_size=int(meta["hidden_size"]))
    return DumpReader(store, split, expect, seed=seed, max_length=max_length, cache_shards=cache_shards,
                      prefetch_shards=prefetch_shards)


def batches(reader: DumpReader, tokens_per_micro_batch: int, max_length: int, epochs: int, device: str = "cpu"):
    """The trainer's stream for a `device` trainer, packed as the trainer packs: (cursor,
    micro-batch, next cursor), ahead on the packer's thread (fp8 states decoded there for the CPU;
    for CUDA left for `MicroBatch.decoded`, in page-locked memory)."""
    packer = packer_for(device, tokens_per_micro_batch, max_length)
    return packer.batches(reader.samples(Cursor(), epochs), Cursor(epochs, 0, 0))


class BatchDigests:
    """A short sha256 of every micro-batch a consumer trained on (sample ids, document lengths, token
    ids, loss masks and every 61st row of the states: the rest of each row comes from the same
    verified shard bytes), cheap enough for the timed loop. Two runs got the same batches when
    their lists agree."""

    def __init__(self) -> None:
        self.digests: list[str] = []

    def add(self, mb: MicroBatch) -> None:
        h = hashlib.sha256(json.dumps([mb.sample_ids, mb.doc_lens]).encode())
        for t in (mb.input_ids, mb.loss_mask, mb.aux[::61], mb.final[::61]):
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        self.digests.append(h.hexdigest()[:16])


def same_batches(a: list[str], b: list[str]) -> dict:
    """Do two runs' digests agree over the micro-batches both trained on?"""
    n = min(len(a), len(b))
    return {"compared_micro_batches": n, "same": bool(n) and a[:n] == b[:n]}
