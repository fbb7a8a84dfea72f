"""The dump's data plane: captured states -> host memory -> verified shard uploads, overlapped so
the device never waits for the host.

Per device, three kinds of threads work on different shards at once:
- a tokenizer thread prepares the next shard's samples (drafter.prefetch.Prefetch);
- the device worker launches each batch's forward, packs the captured states on the device
  (padding removed, fp8-encoded there when asked, a non-finite flag per token) and starts their
  copy into pinned host memory on a side stream (`DeviceToHost`); it only waits for a batch's copy
  after the next batch's forward is queued, so the GPU always has work;
- upload threads stream finished shards to the store, hashing while writing (`ShardUploader`).
Host memory is bounded by the upload queue: at most upload_queue + upload_threads + 1 shards per
device are held (or spooled, with dump.spool_dir).
"""
from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from drafter.contracts import fp8
from drafter.contracts.shards import ShardWriter
from drafter.prefetch import thread
from drafter.stage_output import StageOutput


@dataclass
class HostBatch:
    """One captured batch in host memory: per-token tensors of all its sequences, concatenated
    (`bad`: a non-finite value in the token's states), ready once `wait()` returns."""

    lengths: list[int]
    tensors: dict[str, torch.Tensor]
    event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()  # releases the GIL while it waits

    def rows(self) -> Iterator[tuple[int, dict[str, torch.Tensor], bool]]:
        """(position in the batch, the sequence's state tensors as views, any non-finite value)."""
        bad = self.tensors["bad"]
        states = {k: v for k, v in self.tensors.items() if k != "bad"}
        pos = 0
        for j, n in enumerate(self.lengths):
            yield j, {k: v[pos:pos + n] for k, v in states.items()}, bool(bad[pos:pos + n].any())
            pos += n


class DeviceToHost:
    """Pack a captured batch on its device and copy it to host memory without blocking the caller."""

    def __init__(self, device: torch.device, storage_dtype: str):
        self.device = device
        self.fp8 = storage_dtype == "float8_e4m3"
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, captured: list[tuple[torch.Tensor, torch.Tensor]]) -> HostBatch:
        """`captured`: per sequence (aux [n, 3, H], final [n, H]) as capture.capture_batch returns."""
        lengths = [int(aux.shape[0]) for aux, _ in captured]
        aux = torch.cat([a for a, _ in captured])
        final = torch.cat([f for _, f in captured])
        bad = ~(torch.isfinite(aux).flatten(1).all(1) & torch.isfinite(final).all(1))
        if self.fp8:
            (qa, sa), (qf, sf) = fp8.encode(aux), fp8.encode(final)
            tensors = {"aux_hidden_states": qa, "hidden_states": qf, "aux_scales": sa, "hidden_scales": sf}
        else:
            tensors = {"aux_hidden_states": aux, "hidden_states": final}
        tensors["bad"] = bad
        if self.stream is None:
            return HostBatch(lengths, tensors)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        host = {}
        with torch.cuda.stream(self.stream):
            for name, t in tensors.items():
                host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host[name].copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # the allocator must not reuse it before the copy ran
            event = torch.cuda.Event()
            event.record(self.stream)
        return HostBatch(lengths, host, event)


class ShardUploader:
    """Streams finished shards to the store from background threads, behind a bounded queue: the
    producer blocks when uploads fall behind, which bounds the shards held in host memory."""

    def __init__(self, out: StageOutput, on_done: Callable[[str], None], depth: int, threads: int):
        self.out, self.on_done = out, on_done
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._threads = [thread(self._loop, f"dump-upload-{k}", daemon=True) for k in range(threads)]
        for t in self._threads:
            t.start()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            name, writer, meta, empty_like = item
            try:
                if self.error is None:  # after a failure: only drain and clean up
                    self.out.write_shard(name, writer.chunks(empty_like), meta=meta)
                    self.on_done(name)
            except BaseException as e:
                self.error = e
            finally:
                writer.discard()

    def put(self, name: str, writer: ShardWriter, meta: dict, empty_like: dict) -> None:
        if self.error is not None:
            writer.discard()
            raise self.error
        self._queue.put((name, writer, meta, empty_like))

    def close(self, raise_error: bool = True) -> None:
        """Wait for the queued shards (finished work is worth keeping), then report a failure."""
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        if raise_error and self.error is not None:
            raise self.error
