"""Streaming the dump's hidden states from the store, and packing them into micro-batches.

Shards are fetched `prefetch` shards ahead of the reader, in parallel, and verified (size + sha256,
hashed as the bytes arrive): from a remote store (S3) with parallel range reads into a bounded local
cache (deleted once read), from a local store (file://) in place, read once to hash and then
memory-mapped, never copied. The corpus never has to fit on local disk or in memory.

Packing runs ahead of the trainer on a background thread (`Packer.prefetch` micro-batches): fp8
shards are decoded there, to the dump's capture dtype, when training on the CPU; for a CUDA trainer
micro-batches are packed into page-locked memory (their copies to the GPU overlap the previous
step) and fp8 is decoded on the GPU instead (`Packer.decode=False`, `MicroBatch.decoded`: on the CPU the decode
delivered 12-17k tokens/s at hidden 4096, slower than an 8B-shape step consumes). The time the
trainer spends waiting for its next micro-batch is the reader's data wait (`DumpReader.stats()`,
logged when the reader closes).

The order is a pure function of (seed, epoch): shards permuted per epoch, samples
permuted per shard. A `Cursor` (epoch, shard position, sample position) names the next sample to
read, so a resumed run continues with exactly the batches an uninterrupted one would have seen.

Packing: samples (cut to max_length) are concatenated greedily into micro-batches of at most
`tokens_per_micro_batch` tokens; a sample that does not fit starts the next one, and a sample longer
than the budget is a micro-batch of its own (never cut at the budget: the drafter must see long
contexts whatever the batch size). No padding is computed: the TTT attention keeps documents apart.

Splits: a `DumpSplit` is one committed dump output, optionally restricted to some of its shards,
so held-out features can be a separate dump output or eval shards inside the training dump.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The two imports of the dump format (repoint here if the format module moves).
from drafter.contracts.shards import HiddenStateShard, decode_states
from drafter.formats import DumpMismatch, check_dump_manifest, shards_of_split
from drafter.hashing import hash_file
from drafter.layers import LAYER_ID_CONVENTION
from drafter.prefetch import Prefetch
from drafter.stage_output import Manifest, StageOutput
from drafter.store import CorruptObject, ObjectNotFound, ObjectStore
from drafter.training.errors import DumpIncompatible
from drafter.training.ttt import MicroBatch

DUMP_STAGE = "dump"
log = logging.getLogger(__name__)


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


@dataclass
class ReadStats:
    """What the reader did: bytes fetched and verified, and the consumer's data wait."""

    fetched_bytes: int = 0
    fetch_s: float = 0.0     # summed over fetch threads
    wait_s: float = 0.0      # the trainer blocked on its next micro-batch
    active_s: float = 0.0    # the trainer iterating (first request to the end of its stream)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_fetch(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.fetched_bytes += nbytes
            self.fetch_s += seconds

    def to_dict(self) -> dict:
        share = self.wait_s / self.active_s if self.active_s else 0.0
        return {"fetched_bytes": self.fetched_bytes, "fetch_s": round(self.fetch_s, 3),
                "wait_s": round(self.wait_s, 3), "active_s": round(self.active_s, 3),
                "data_wait_share": round(share, 4)}


def fetch_verified(out: StageOutput, name: str, dest: Path) -> Path:
    """A committed shard as a local file, its size and sha256 checked: a local store's own file
    (read once to hash it), else `dest`, downloaded by parallel range reads (the store's
    read_concurrency x read_range_bytes) and hashed in order as the ranges arrive (no second
    pass). Raises CorruptObject naming the object."""
    info = out.manifest.shard(name)
    key = out.data_key(info)  # a referenced shard (an incremental dump): where its bytes are
    local = out.store.local_path(key)
    if local is not None:
        try:
            size, sha = hash_file(local)
        except FileNotFoundError:
            raise ObjectNotFound(f"get: no such object {out.store.uri(key)}") from None
        _check(out, key, info, size, sha)
        return local
    actual = out.store.size(key)
    if actual is None:
        raise ObjectNotFound(f"get: no such object {out.store.uri(key)}")
    if actual != info.size:
        _check(out, key, info, actual, "")
    h, got = hashlib.sha256(), 0
    threads, span = max(1, out.store.read_concurrency), max(1, out.store.read_range_bytes)
    tmp = dest.with_name(f".{dest.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.truncate(info.size)
            fd = f.fileno()

            def get(start: int) -> bytes:
                data = out.store.get_range(key, start, min(start + span, info.size))
                os.pwrite(fd, data, start)
                return data

            with ThreadPoolExecutor(threads, thread_name_prefix="dump-range") as pool:
                window: deque[Future] = deque()
                for start in range(0, info.size, span):
                    window.append(pool.submit(get, start))
                    while len(window) > threads:  # bounded memory: threads + 1 ranges at most
                        got += _hash_next(h, window)
                while window:
                    got += _hash_next(h, window)
        _check(out, key, info, got, h.hexdigest())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _hash_next(h, window: deque) -> int:
    data = window.popleft().result()
    h.update(data)
    return len(data)


def _check(out: StageOutput, key: str, info, size: int, sha: str) -> None:
    uri = out.store.uri(key)
    if size != info.size:
        hint = " (truncated)" if 0 <= size < info.size else ""
        raise CorruptObject(key, f"size mismatch on read: expected {info.size} bytes, got {size}{hint}", uri)
    if sha != info.sha256:
        raise CorruptObject(key, f"sha256 mismatch on read: expected {info.sha256}, got {sha}", uri)


class ShardCache:
    """Verified local copies of dump shards: at most `capacity` on disk (a local store's files are
    used in place and cost no cache), `prefetch` fetched ahead, in parallel."""

    def __init__(self, out: StageOutput, capacity: int = 2, prefetch: int = 1, cache_dir: str | None = None,
                 stats: ReadStats | None = None):
        self.out = out
        self.capacity = max(capacity, prefetch + 1)
        self.prefetch = prefetch
        self.stats = stats or ReadStats()
        self.dir = Path(tempfile.mkdtemp(prefix="drafter-train-cache-", dir=cache_dir))
        self._pool = ThreadPoolExecutor(max_workers=max(1, prefetch), thread_name_prefix="dump-prefetch")
        self._files: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()

    def _download(self, name: str) -> Path:
        t = time.perf_counter()
        path = fetch_verified(self.out, name, self.dir / name)
        self.stats.add_fetch(self.out.manifest.shard(name).size, time.perf_counter() - t)
        return path

    def _evict(self, name: str, fut: Future) -> None:
        path = self.dir / name
        fut.add_done_callback(lambda f: path.unlink(missing_ok=True))  # never the store's own file

    def _fetch(self, name: str) -> Future:
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)  # least recently asked for goes first
            else:
                while len(self._files) >= self.capacity:  # evict the oldest (already read)
                    self._evict(*self._files.popitem(last=False))
                self._files[name] = self._pool.submit(self._download, name)
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


class SampleStream:
    """`DumpReader.samples`: an iterator of (cursor, sample) that knows its reader (the packer
    charges its data wait to it)."""

    def __init__(self, reader: "DumpReader", samples: Iterator[tuple["Cursor", dict]]):
        self.reader, self._samples = reader, samples

    def __iter__(self) -> "SampleStream":
        return self

    def __next__(self) -> tuple["Cursor", dict]:
        return next(self._samples)


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
        self.read_stats = ReadStats()
        self.cache = ShardCache(self.out, cache_shards, prefetch_shards, cache_dir, self.read_stats)

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

    def samples(self, cursor: Cursor, epochs: int) -> SampleStream:
        """(cursor of this sample, sample) pairs from `cursor` to the end of the last epoch. fp8
        samples come as stored (states + scales, decoded when packed)."""
        return SampleStream(self, self._samples(cursor, epochs))

    def stats(self) -> dict:
        """Bytes fetched, fetch time, and the trainer's data wait: its share of the time the trainer
        iterated that it spent waiting for micro-batches."""
        return self.read_stats.to_dict()

    def _samples(self, cursor: Cursor, epochs: int) -> Iterator[tuple[Cursor, dict]]:
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
                    yield Cursor(epoch, spos, kpos), shard.sample(sorder[kpos], decode=False)
                    kpos += 1
                spos, kpos = spos + 1, 0
            epoch, spos = epoch + 1, 0

    def close(self) -> None:
        self.cache.close()
        s = self.read_stats.to_dict()
        if s["active_s"]:
            log.info("dump reader %s: data wait %.1f%% (%.1f s of %.1f s), %.2f GB fetched and verified",
                     self.manifest.fingerprint, 100 * s["data_wait_share"], s["wait_s"], s["active_s"],
                     s["fetched_bytes"] / 1e9)


def _cut(sample: dict, limit: int) -> dict:
    n = min(int(sample["input_ids"].shape[0]), limit)
    return {k: v[:n] if isinstance(v, torch.Tensor) else v for k, v in sample.items()}


def pack(samples: list[dict], decode: bool = True, pin: bool = False) -> MicroBatch:
    """Concatenate samples (already cut to fit) into one micro-batch (copies out of the mmap).
    fp8 states are decoded to their capture dtype on the way, or with `decode=False` kept encoded
    for `MicroBatch.decoded` on the training device. `pin`: into page-locked memory (a CUDA
    trainer's copies to the GPU then run asynchronously, beside the previous step)."""
    def cat(key: str) -> torch.Tensor:
        parts = [s[key] for s in samples]
        if not pin:
            return torch.cat(parts)
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        return torch.cat(parts, out=torch.empty(shape, dtype=parts[0].dtype, pin_memory=True))

    states = {"aux_hidden_states": cat("aux_hidden_states"), "hidden_states": cat("hidden_states")}
    fp8_states = "aux_scales" in samples[0]
    if fp8_states:
        states.update(aux_scales=cat("aux_scales"), hidden_scales=cat("hidden_scales"))
        if decode:
            decode_states(states, samples[0]["decode_dtype"])
    encoded = fp8_states and not decode
    return MicroBatch(input_ids=cat("input_ids").to(torch.int64), loss_mask=cat("loss_mask").bool(),
                      aux=states["aux_hidden_states"], final=states["hidden_states"],
                      doc_lens=[int(s["input_ids"].shape[0]) for s in samples],
                      sample_ids=[s["id"] for s in samples],
                      aux_scales=states["aux_scales"] if encoded else None,
                      final_scales=states["hidden_scales"] if encoded else None,
                      decode_dtype=samples[0]["decode_dtype"] if encoded else None)


@dataclass
class Packer:
    """Greedy packing of a sample stream into micro-batches of at most `budget` tokens, `prefetch`
    micro-batches ahead of the consumer on a background thread (0: packed on the caller's). With
    `decode=False` fp8 states stay encoded: the consumer decodes them on its device
    (`MicroBatch.decoded`), where the CPU thread's decode would be the slowest part of the path."""

    budget: int
    max_length: int
    prefetch: int = 4
    decode: bool = True
    pin: bool = False  # page-locked micro-batches, for a CUDA consumer

    def batches(self, stream: Iterator[tuple[Cursor, dict]], end: Cursor
                ) -> Iterator[tuple[Cursor, MicroBatch, Cursor]]:
        """(cursor of the batch's first sample, batch, cursor of the next batch's first sample).
        A sample with fewer than 2 tokens carries no teacher and is skipped."""
        if self.prefetch < 1:
            yield from self._batches(stream, end)
            return
        ahead = Prefetch(self._batches(stream, end), self.prefetch, "dump-packer")
        try:
            yield from ahead
        finally:
            ahead.close()
            stats = getattr(getattr(stream, "reader", None), "read_stats", None)
            if stats is not None:
                stats.wait_s += ahead.wait_s
                stats.active_s += ahead.active_s

    def _batches(self, stream: Iterator[tuple[Cursor, dict]], end: Cursor
                 ) -> Iterator[tuple[Cursor, MicroBatch, Cursor]]:
        buf: list[dict] = []
        used = 0
        first: Cursor | None = None
        for cur, s in stream:
            s = _cut(s, self.max_length)
            n = int(s["input_ids"].shape[0])
            if n < 2:
                continue
            if buf and used + n > self.budget:
                yield first, pack(buf, self.decode, self.pin), cur
                buf, used = [], 0
            if not buf:
                first = cur
            buf.append(s)
            used += n
        if buf:
            yield first, pack(buf, self.decode, self.pin), end


def packer_for(device: torch.device | str, budget: int, max_length: int) -> Packer:
    """How a trainer on `device` packs: on the CPU fp8 is decoded on the packer's thread; on CUDA it
    stays encoded for `MicroBatch.decoded` and micro-batches are page-locked."""
    kind = torch.device(device).type
    return Packer(budget, max_length, decode=kind == "cpu", pin=kind == "cuda")


def count_vocab(reader: DumpReader, vocab_size: int) -> torch.Tensor:
    """Loss-masked token counts over one pass of the split (ids only: aux states are not read)."""
    from drafter.training.vocab import count_loss_tokens

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for _cur, s in reader.samples(Cursor(), 1):
        counts += count_loss_tokens([_cut(s, reader.max_length or 1 << 62)], vocab_size)
    return counts
