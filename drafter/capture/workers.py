"""The dump's workers: one thread per device, each with its own model copy, capturing its share of
the pending shards; per device a tokenizer thread works a shard ahead and upload threads stream
finished shards to the store (drafter.capture.pipeline). A shard's batches are settled in plan
order, so its bytes do not depend on the pipelining."""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from drafter import prefetch
from drafter.capture import backends, base, hf
from drafter.capture import pipeline as dump_pipeline
from drafter.capture.plan import DumpPlan
from drafter.capture.tokenized import TokenizedShard, tokenized_shards
from drafter.config import LAYER_ID_CONVENTION
from drafter.contracts import fp8
from drafter.contracts.shards import NUM_AUX, ShardWriter
from drafter.dtypes import dtype_name
from drafter.formats import DUMP as STAGE
from drafter.formats import hidden_state_shard_name as shard_name
from drafter.stage_output import Progress, StageOutput, guarded_progress


class ShardBuild:
    """A shard being captured: batches are settled (copy awaited, non-finite samples quarantined,
    the rest added to the writer) in plan order, so its bytes do not depend on the pipelining."""

    def __init__(self, cm: hf.CaptureModel, plan: DumpPlan, tok: TokenizedShard, spool_dir: Path | None):
        dump = plan.cfg.dump
        self.tok, self.plan, self.cm = tok, plan, cm
        self.name = shard_name(tok.index, tok.split)
        self.fp8 = dump.storage_dtype == "float8_e4m3"
        metadata = {"aux_layer_ids": plan.aux_layer_ids, "layer_id_convention": LAYER_ID_CONVENTION}
        if self.fp8:
            metadata["dtype"] = dtype_name(plan.dtype)  # what the fp8 states decode to
        self.writer = ShardWriter(spool_dir, metadata=metadata)
        self.batches = base.plan_batches([len(s[1]) for s in tok.samples], dump.tokens_per_batch)
        self.settled = self.loss_tokens = 0
        self.sample_tokens: list[int] = []  # per stored sample, in shard order: the export's length distribution

    @property
    def complete(self) -> bool:
        return self.settled == len(self.batches)

    def settle(self, batch: list[int], host: dump_pipeline.HostBatch) -> None:
        host.wait()
        for j, states, bad in host.rows():
            sid, ids, mask = self.tok.samples[batch[j]]
            if bad:
                self.tok.quarantined.append({"id": sid, "reason": "nonfinite"})
                continue
            self.writer.add(sid, ids, mask, **states)
            self.sample_tokens.append(len(ids))
            self.loss_tokens += sum(mask)
        self.settled += 1

    def meta(self) -> dict:
        dump = self.plan.cfg.dump
        return {"index": self.tok.index, "split": self.tok.split, "input_digest": self.tok.input_digest,
                "samples": len(self.writer),
                "tokens": self.writer.num_tokens, "loss_tokens": self.loss_tokens, "truncated": self.tok.truncated,
                "sample_tokens": self.sample_tokens,
                "from_token_ids": self.tok.from_token_ids,
                "quarantined": self.tok.quarantined, "batches": len(self.batches), "device": str(self.cm.device),
                "tokens_per_batch": dump.tokens_per_batch, "backend": getattr(self.cm, "backend", "hf")}

    def empty_like(self) -> dict:
        h = self.cm.hidden_size
        state = fp8.STORAGE_DTYPE if self.fp8 else self.cm.dtype
        shapes = {"input_ids": (torch.int64, ()), "loss_mask": (torch.uint8, ()),
                  "aux_hidden_states": (state, (NUM_AUX, h)), "hidden_states": (state, (h,))}
        if self.fp8:
            shapes.update(aux_scales=(torch.float32, (NUM_AUX,)), hidden_scales=(torch.float32, ()))
        return shapes



def _worker(plan: DumpPlan, device: torch.device, jobs: list[tuple[str, int]],
            records: dict[tuple[str, int], list[dict]],
            out: StageOutput, spool: Path | None, on_done: Callable[[str], None], stop: threading.Event) -> None:
    """One device: tokenise ahead (thread), capture batch after batch, settle each batch once the
    next one is queued on the device, hand finished shards to the upload threads."""
    cm = backends.open_capture(plan.cfg, device, plan.dtype, plan.aux_layer_ids)  # hf or vllm (dump.backend)
    try:
        _capture_shards(plan, cm, device, jobs, records, out, spool, on_done, stop)
    finally:
        backends.close_capture(cm)


def _capture_shards(plan: DumpPlan, cm, device: torch.device, jobs: list[tuple[str, int]],
                    records: dict[tuple[str, int], list[dict]], out: StageOutput, spool: Path | None,
                    on_done: Callable[[str], None], stop: threading.Event) -> None:
    dump = plan.cfg.dump
    to_host = dump_pipeline.DeviceToHost(cm.device, dump.storage_dtype)
    uploader = dump_pipeline.ShardUploader(out, on_done, dump.upload_queue, dump.upload_threads)
    # The tokenizer thread owns cm.tokenizer (HF fast tokenizers are not thread-safe).
    tokenized = prefetch.Prefetch(tokenized_shards(plan, cm.tokenizer, jobs, records),
                                  depth=1, name=f"dump-tokenize-{device}")
    in_flight: list[tuple[ShardBuild, list[int], dump_pipeline.HostBatch]] = []

    def settle(keep: int) -> None:
        while len(in_flight) > keep:
            build, batch, host = in_flight.pop(0)
            build.settle(batch, host)
            if build.complete:
                uploader.put(build.name, build.writer, build.meta(), build.empty_like())

    try:
        try:
            for tok in tokenized:
                if stop.is_set():
                    break
                build = ShardBuild(cm, plan, tok, spool)
                if build.complete:  # every sample quarantined before capture
                    uploader.put(build.name, build.writer, build.meta(), build.empty_like())
                for batch in build.batches:
                    captured = backends.capture_batch(cm, [tok.samples[j][1] for j in batch])
                    in_flight.append((build, batch, to_host(captured)))
                    del captured
                    settle(keep=1)  # the batch before this one: its copy ran behind this forward
        finally:
            tokenized.close()
        settle(keep=0)
    except BaseException:
        try:
            settle(keep=0)  # shards whose batches all made it to the host are worth keeping
        except BaseException:
            pass
        uploader.close(raise_error=False)  # the compute error is the one to report
        raise
    uploader.close()


def _spool_dir(root: str | None, fp: str) -> Path:
    """A private spool directory; spools of killed runs of this output (dead pid) are removed."""
    base = Path(root or tempfile.gettempdir()).expanduser()
    base.mkdir(parents=True, exist_ok=True)
    for stale in base.glob(f"drafter-dump-{fp}-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    path = base / f"drafter-dump-{fp}-{os.getpid()}"
    path.mkdir(exist_ok=True)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_workers(plan: DumpPlan, out: StageOutput, pending: list[tuple[str, int]],
                 records: dict[tuple[str, int], list[dict]],
                 progress: Progress | None, done_before: int, total: int) -> None:
    devices = plan.devices[:len(pending)]  # no model load for a device without work
    lock, done = threading.Lock(), [done_before]
    progress = guarded_progress(progress, STAGE)

    def on_done(name: str) -> None:
        with lock:
            done[0] += 1
            if progress is not None:
                progress(done[0], total)

    if progress is not None and done_before:
        progress(done_before, total)  # a resumed run starts where the last one stopped
    stop = threading.Event()
    errors: list[BaseException] = []
    spool = _spool_dir(plan.cfg.dump.spool_dir, plan.fingerprint) if plan.cfg.dump.spool_dir else None

    def run(k: int, device: torch.device) -> None:
        try:
            _worker(plan, device, pending[k::len(devices)], records, out, spool, on_done, stop)
        except BaseException as e:
            errors.append(e)
            stop.set()  # the other workers finish their current shard and stop

    threads_before = torch.get_num_threads()
    if devices[0].type == "cpu" and len(devices) > 1:
        # CPU workers share the cores: oversubscribed OpenMP pools spin against each other and run
        # many times slower than one pool (measured 13x on 2 cores).
        torch.set_num_threads(max(1, threads_before // len(devices)))
    for device in devices:
        hf.warm_up_device(device, plan.dtype)
    try:
        if len(devices) == 1:  # no thread: tracebacks and debuggers stay simple
            run(0, devices[0])
        else:
            threads = [prefetch.thread(lambda k=k, d=d: run(k, d), f"dump-{d}")
                       for k, d in enumerate(devices)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        torch.set_num_threads(threads_before)
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)
    if errors:
        raise errors[0]
