"""Streaming the dump's hidden states from the store, and packing them into micro-batches.

Shards are downloaded (sha256-verified, by StageOutput) into a bounded local cache, `prefetch`
shards ahead of the reader, and deleted once read: the corpus never has to fit on local disk or
in memory. The order is a pure function of (seed, epoch): shards permuted per epoch, samples
permuted per shard. A `Cursor` (epoch, shard position, sample position) names the next sample to
read, so a resumed run continues with exactly the batches an uninterrupted one would have seen.

Packing: samples (cut to max_length and to the budget) are concatenated greedily into micro-batches
of at most `tokens_per_micro_batch` tokens; a sample that does not fit starts the next one. No
padding is computed: the TTT attention keeps documents apart.

Splits: a `DumpSplit` is one committed dump output, optionally restricted to some of its shards,
so held-out features can be a separate dump output or eval shards inside the training dump.
"""
from __future__ import annotations

import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

# The two imports of the dump format (repoint here if the format module moves).
from drafter.formats import DumpMismatch, check_dump_manifest, shards_of_split
from drafter.shards import HiddenStateShard
from drafter.layers import LAYER_ID_CONVENTION
from drafter.stage_output import Manifest, StageOutput
from drafter.store import ObjectStore
from drafter.training.errors import DumpIncompatible
from drafter.training.ttt import MicroBatch

DUMP_STAGE = "dump"


@dataclass(frozen=True)
class DumpSplit:
    """A committed dump output (manifest or fingerprint), optionally only some of its shards."""

    manifest: Manifest | str
    shards: tuple[str, ...] | None = None


def dump_splits(store: ObjectStore, dump: Manifest | str) -> tuple[DumpSplit, DumpSplit | None]:
    """(train, eval or None) of one dump output: `hs-*` shards train, `eval-hs-*` shards evaluate."""
    manifest = StageOutput.committed(store, DUMP_STAGE, dump).manifest
    train = shards_of_split(manifest, "hs", "train")
    held_out = shards_of_split(manifest, "hs", "eval")
    return (DumpSplit(manifest, tuple(train)), DumpSplit(manifest, tuple(held_out)) if held_out else None)


@dataclass(frozen=True)
class DumpExpectation:
    """What the drafter / target expect of the hidden states (checked before any shard is read)."""

    aux_layer_ids: list[int]
    hidden_size: int
    target_fingerprint: str | None = None  # None: not checked (no identity known)
    layer_id_convention: str = LAYER_ID_CONVENTION


def check_dump(manifest: Manifest, expect: DumpExpectation) -> None:
    """Refuse hidden states that do not match, naming every field that differs."""
    problems = []
    try:
        check_dump_manifest(manifest, expect.aux_layer_ids, expect.layer_id_convention)
    except DumpMismatch as e:
        problems.append(str(e))
    meta = manifest.meta
    if meta.get("hidden_size") != expect.hidden_size:
        problems.append(f"hidden_size: dump has {meta.get('hidden_size')}, expected {expect.hidden_size}")
    if expect.target_fingerprint is not None and meta.get("target_fingerprint") != expect.target_fingerprint:
        problems.append(f"target_fingerprint: dump has {meta.get('target_fingerprint')!r}, expected "
                        f"{expect.target_fingerprint!r} (hidden states of another target)")
    if problems:
        raise DumpIncompatible(f"dump {manifest.stage}/{manifest.fingerprint} cannot train this drafter: "
                               + "; ".join(problems))


@dataclass(frozen=True)
class Cursor:
    """The next sample to read: epoch, position in the epoch's shard order, position in the shard."""

    epoch: int = 0
    shard: int = 0
    sample: int = 0

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "shard": self.shard, "sample": self.sample}

    @classmethod
    def from_json(cls, d: dict) -> "Cursor":
        return cls(int(d["epoch"]), int(d["shard"]), int(d["sample"]))


class ShardCache:
    """Verified local copies of dump shards: at most `capacity` on disk, `prefetch` fetched ahead
    in a background thread."""

    def __init__(self, out: StageOutput, capacity: int = 2, prefetch: int = 1, cache_dir: str | None = None):
        self.out = out
        self.capacity = max(capacity, prefetch + 1)
        self.prefetch = prefetch
        self.dir = Path(tempfile.mkdtemp(prefix="drafter-train-cache-", dir=cache_dir))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dump-prefetch")
        self._files: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()

    def _fetch(self, name: str) -> Future:
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)  # least recently asked for goes first
            else:
                while len(self._files) >= self.capacity:  # evict the oldest (already read)
                    old, fut = self._files.popitem(last=False)
                    fut.add_done_callback(lambda f, n=old: (self.dir / n).unlink(missing_ok=True))
                self._files[name] = self._pool.submit(self.out.download_shard, name, self.dir / name)
            return self._files[name]

    def open(self, name: str, upcoming: list[str]) -> HiddenStateShard:
        # Open (memory-map) before prefetching: an eviction may unlink the file, the mapping stays.
        shard = HiddenStateShard(self._fetch(name).result())
        for nxt in upcoming[:self.prefetch]:
            if nxt != name:
                self._fetch(nxt)
        return shard

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.dir, ignore_errors=True)


class DumpReader:
    """Samples of one split in the seeded order, from a cursor on."""

    def __init__(self, store: ObjectStore, split: DumpSplit, expect: DumpExpectation, *, seed: int = 0,
                 max_length: int | None = None, shuffle: bool = True, cache_shards: int = 2,
                 prefetch_shards: int = 1, cache_dir: str | None = None):
        self.out = StageOutput.committed(store, DUMP_STAGE, split.manifest)
        self.manifest = self.out.manifest
        check_dump(self.manifest, expect)
        listed = {s.name: s for s in self.manifest.shards}
        names = list(split.shards) if split.shards is not None else list(listed)
        unknown = [n for n in names if n not in listed]
        if unknown:
            raise DumpIncompatible(f"shards {unknown} are not in dump {self.manifest.fingerprint}")
        self.names = names
        self.shard_info = [listed[n] for n in names]
        self.seed, self.max_length, self.shuffle = seed, max_length, shuffle
        self.expect = expect
        self.cache = ShardCache(self.out, cache_shards, prefetch_shards, cache_dir)

    @property
    def num_tokens(self) -> int:
        return sum(int(s.meta.get("tokens", 0)) for s in self.shard_info)

    def shard_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.names)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.names), generator=g).tolist()

    def sample_order(self, epoch: int, shard: int, n: int) -> list[int]:
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 7919 + shard)
        return torch.randperm(n, generator=g).tolist()

    def samples(self, cursor: Cursor, epochs: int) -> Iterator[tuple[Cursor, dict]]:
        """(cursor of this sample, sample) pairs from `cursor` to the end of the last epoch."""
        epoch, spos, kpos = cursor.epoch, cursor.shard, cursor.sample
        while epoch < epochs:
            order = self.shard_order(epoch)
            while spos < len(order):
                upcoming = [self.names[i] for i in order[spos + 1:]]
                if epoch + 1 < epochs:
                    upcoming += [self.names[i] for i in self.shard_order(epoch + 1)]
                shard = self.cache.open(self.names[order[spos]], upcoming)
                if shard.aux_layer_ids != list(self.expect.aux_layer_ids):
                    raise DumpIncompatible(f"{shard.path.name}: aux_layer_ids {shard.aux_layer_ids}, "
                                           f"expected {list(self.expect.aux_layer_ids)}")
                sorder = self.sample_order(epoch, order[spos], len(shard))
                while kpos < len(sorder):
                    yield Cursor(epoch, spos, kpos), shard.sample(sorder[kpos])
                    kpos += 1
                spos, kpos = spos + 1, 0
            epoch, spos = epoch + 1, 0

    def close(self) -> None:
        self.cache.close()


def _cut(sample: dict, limit: int) -> dict:
    n = min(int(sample["input_ids"].shape[0]), limit)
    return {"id": sample["id"], **{k: sample[k][:n] for k in ("input_ids", "loss_mask", "aux_hidden_states",
                                                             "hidden_states")}}


def pack(samples: list[dict]) -> MicroBatch:
    """Concatenate samples (already cut to fit) into one micro-batch (copies out of the mmap)."""
    cat = lambda key: torch.cat([s[key] for s in samples])
    return MicroBatch(input_ids=cat("input_ids").to(torch.int64), loss_mask=cat("loss_mask").bool(),
                      aux=cat("aux_hidden_states").clone(), final=cat("hidden_states").clone(),
                      doc_lens=[int(s["input_ids"].shape[0]) for s in samples],
                      sample_ids=[s["id"] for s in samples])


@dataclass
class Packer:
    """Greedy packing of a sample stream into micro-batches of at most `budget` tokens."""

    budget: int
    max_length: int

    def batches(self, stream: Iterator[tuple[Cursor, dict]], end: Cursor
                ) -> Iterator[tuple[Cursor, MicroBatch, Cursor]]:
        """(cursor of the batch's first sample, batch, cursor of the next batch's first sample).
        A sample with fewer than 2 tokens carries no teacher and is skipped."""
        buf: list[dict] = []
        used = 0
        first: Cursor | None = None
        for cur, s in stream:
            s = _cut(s, min(self.max_length, self.budget))
            n = int(s["input_ids"].shape[0])
            if n < 2:
                continue
            if buf and used + n > self.budget:
                yield first, pack(buf), cur
                buf, used = [], 0
            if not buf:
                first = cur
            buf.append(s)
            used += n
        if buf:
            yield first, pack(buf), end


def count_vocab(reader: DumpReader, vocab_size: int) -> torch.Tensor:
    """Loss-masked token counts over one pass of the split (ids only: aux states are not read)."""
    from drafter.training.vocab import count_loss_tokens

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for _cur, s in reader.samples(Cursor(), 1):
        counts += count_loss_tokens([_cut(s, reader.max_length or 1 << 62)], vocab_size)
    return counts
