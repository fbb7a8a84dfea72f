"""The `dump` stage: conversations -> the target's hidden states, as shards in object storage.

Output (`dump/<fingerprint>/`): `hs-00000.safetensors`, ... (format: drafter.capture.shards) and a manifest
whose meta records what a reader must agree with: target fingerprint, tokenizer and chat-template
hashes, dtype, `aux_layer_ids` + `layer_id_convention`, hidden size, counts, bytes per token, the
storage projection and the quarantined samples.

Shards follow the upstream's shards: each datagen shard (the prepare split, for `dump.upstream:
prepare`) is cut into pieces of S samples (S = dump.samples_per_shard) in order, and shard i holds
piece i, minus quarantined ones (bad record, template error, no assistant token, NaN/Inf states). Inside a shard
the batches are a pure function of the token lengths and dump.tokens_per_batch, so a resumed run
recomputes only the shards that were not verified yet, with the same float operations: the files
are byte-identical to an uninterrupted run's (tested on CPU; seen on 2 x H200 for the same GPU
model, see hf.warm_up_device).

Tokens: a datagen record whose answers carry `token_ids` (the ids the engine generated) is fed
exactly those ids after the template's prompt for each turn; a record without them (older
generations, servers that return none, `dump.upstream: prepare`) is re-tokenised from its text, as
before (drafter.tokenize). Each shard's marker counts its samples `from_token_ids`; the manifest
sums them (`samples_from_token_ids`).

Fingerprint: what determines the bytes' meaning (upstream, target, tokenizer, chat template, aux
ids + convention, resolved dtype, max_length, samples_per_shard, format version). Left out on
purpose: devices, tokens_per_batch, spool_dir, upload_queue, upload_threads, tokenize_processes. tokens_per_batch and
the GPU model can change the last bits of the floats (batch shapes pick kernels), never what they
mean, and re-dumping terabytes because a resume runs on other GPUs would be the wrong trade. Each
shard's marker records the device and tokens_per_batch that computed it. (The fields declare this
themselves: OperationalField in drafter.config.)

Incremental (drafter.retrain.reuse): each shard's marker records the digest of the records it was computed
from; a piece that an earlier dump of the same target and settings already computed is referenced
from that dump, not recomputed, so a retrain on a grown corpus computes only the new pieces.

The reader of this output (drafter.formats.iter_dump_samples) refuses a dump whose layer ids or
convention differ from what it expects.

Workers: one thread per device, each owning every n-th pending shard with its own model copy; per
device a tokenizer thread works a shard ahead and upload threads behind a bounded queue stream
finished shards to the store, so the device computes while earlier shards are copied, hashed and
written (drafter.capture.pipeline).

Storage: `dump.storage_dtype: model` stores the states in the capture dtype (format_version 1);
`float8_e4m3` stores them in fp8 with a float32 scale per token and state (drafter.capture.fp8, ~half the
bytes, format_version 2), encoded on the device; readers decode to the capture dtype.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from drafter import prefetch
from drafter.capture import backends, base, fp8, hf
from drafter.capture import pipeline as dump_pipeline
from drafter.retrain import reuse
from drafter.config import LAYER_ID_CONVENTION, ConfigError, LifecycleConfig, fingerprint_fields
from drafter.dtypes import dtype_name
from drafter.errors import DrafterError
from drafter.formats import DATAGEN, PREPARE, SPLITS, split_prefix
from drafter.formats import DUMP as STAGE
from drafter.formats import hidden_state_shard_name as shard_name
from drafter.layers import check_aux_layer_ids
from drafter.capture.shards import (FINAL_HIDDEN, FORMAT, NUM_AUX, ShardWriter, bytes_per_token, format_version,
                            storage_label, storage_projection)
from drafter.stage_output import Progress, ShardInfo, StageOutput, StageResult, guarded_progress
from drafter.stage_output import fingerprint as stage_fingerprint
from drafter.store import ObjectStore
from drafter.target_identity import target_fingerprint
from drafter.tokenize import TOKEN_IDS, conversation_tokens, end_of_turn_ids, template_hash, tokenizer_hash, valid_token_ids

log = logging.getLogger(__name__)

UPSTREAM_STAGES = (PREPARE, DATAGEN)


@dataclass
class DumpPlan:
    """Everything decided before a model is loaded (so a complete stage skips without one)."""

    cfg: LifecycleConfig
    upstream_stage: str
    upstream_fingerprint: str
    devices: list[torch.device]
    dtype: torch.dtype
    aux_layer_ids: list[int]
    num_layers: int
    hidden_size: int
    tokenizer: object           # for the fingerprint; workers tokenise with their own copies
    target_fingerprint: str
    tokenizer_hash: str
    template_hash: str

    @property
    def settings(self) -> dict:
        """Everything that determines the bytes except the upstream (outputs with equal settings
        can share shards computed from equal records: drafter.retrain.reuse)."""
        dump = fingerprint_fields(self.cfg.dump)
        del dump["aux_layer_ids"], dump["dtype"]  # in their resolved form below
        storage = dump.pop("storage_dtype")  # the default leaves earlier dumps' fingerprints as they were
        if storage != "model":
            dump["storage_dtype"] = storage
        return {"dump": dump, "dtype": dtype_name(self.dtype), "target": self.target_fingerprint,
                "tokenizer": self.tokenizer_hash, "chat_template": self.template_hash,
                "aux_layer_ids": self.aux_layer_ids, "layer_id_convention": LAYER_ID_CONVENTION,
                "shard_format": [FORMAT, format_version(storage)], "upstream_stage": self.upstream_stage}

    @property
    def fingerprint(self) -> str:
        return stage_fingerprint(STAGE, self.settings, [self.upstream_fingerprint])


def plan_dump(cfg: LifecycleConfig, upstream: Mapping[str, str]) -> DumpPlan:
    """Everything the fingerprint needs (tokenizer, target identity, resolved dtype and ids)
    without loading the model. The upstream is `dump.upstream`'s output."""
    from transformers import AutoTokenizer

    upstream_stage = cfg.dump.upstream
    if upstream_stage not in UPSTREAM_STAGES:
        raise ValueError(f"dump reads the output of {UPSTREAM_STAGES}, not {upstream_stage!r}")
    upstream_fingerprint = upstream[upstream_stage]
    try:
        # backend vllm: one worker; vLLM places the target itself (dump.tp_size GPUs), tensors come back on the CPU
        devs = base.resolve_devices(cfg.dump.devices) if cfg.dump.backend == "hf" else [torch.device("cpu")]
    except ValueError as e:
        raise ConfigError([("dump.devices", str(e))]) from None
    shape = cfg.target.resolved_shape()
    num_layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    if num_layers is None or hidden is None:
        raise ConfigError([("target.path", f"{cfg.target.path}: no config.json with num_hidden_layers "
                                           f"and hidden_size")])
    try:
        ids = check_aux_layer_ids(cfg.aux_layer_ids(), num_layers)
    except ValueError as e:
        raise ConfigError([("dump.aux_layer_ids", str(e))]) from None
    tok = AutoTokenizer.from_pretrained(cfg.target.path, trust_remote_code=cfg.target.trust_remote_code)
    return DumpPlan(cfg=cfg, upstream_stage=upstream_stage, upstream_fingerprint=upstream_fingerprint,
                    devices=devs, dtype=base.resolve_dtype(
                        cfg.dump.dtype, cfg.target.dtype,
                        torch.device("cuda") if cfg.dump.backend == "vllm" and torch.cuda.is_available() else devs[0]),
                    aux_layer_ids=ids, num_layers=num_layers, hidden_size=hidden, tokenizer=tok,
                    target_fingerprint=target_fingerprint(cfg.target.path, cfg.target.revision),
                    tokenizer_hash=tokenizer_hash(tok), template_hash=template_hash(tok))


def fingerprint(cfg: LifecycleConfig, upstream: Mapping[str, str]) -> str:
    return plan_dump(cfg, upstream).fingerprint


# ---- upstream


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
    input_digest: str = ""  # drafter.retrain.reuse.records_digest of the records (what a later dump can reference)
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


def _tokenized_shards(plan: DumpPlan, tokenizer, jobs: list[tuple[str, int]],
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
            self.loss_tokens += sum(mask)
        self.settled += 1

    def meta(self) -> dict:
        dump = self.plan.cfg.dump
        return {"index": self.tok.index, "split": self.tok.split, "input_digest": self.tok.input_digest,
                "samples": len(self.writer),
                "tokens": self.writer.num_tokens, "loss_tokens": self.loss_tokens, "truncated": self.tok.truncated,
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


# ---- workers


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
    tokenized = prefetch.Prefetch(_tokenized_shards(plan, cm.tokenizer, jobs, records),
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


def _run_workers(plan: DumpPlan, out: StageOutput, pending: list[tuple[str, int]],
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


# ---- the stage


def run(cfg: LifecycleConfig, store: ObjectStore, *, upstream: Mapping[str, str],
        progress: Progress | None = None, on_line=None) -> StageResult:
    """Capture the hidden states of `dump.upstream`'s conversations on `dump.devices`; skip when
    the output is complete; resume at the first unverified shard."""
    plan = plan_dump(cfg, upstream)
    out = StageOutput(store, STAGE, plan.fingerprint)
    if out.is_complete():
        return _result(out, skipped=True)
    upstream_stage, upstream_fingerprint = plan.upstream_stage, plan.upstream_fingerprint
    # Train shards first, then the (small) held-out split the trainer evaluates on.
    pieces = {split: reuse.dump_pieces(store, upstream_stage, upstream_fingerprint, split,
                                       cfg.dump.samples_per_shard) for split in SPLITS}
    if not pieces["train"]:
        raise EmptyUpstream(f"{upstream_stage}/{upstream_fingerprint} holds no conversations")
    jobs = [(split, i) for split in SPLITS for i in range(len(pieces[split]))]
    names = {split: [shard_name(i, split) for s, i in jobs if s == split] for split in SPLITS}
    digests = {(split, i): reuse.records_digest(pieces[split][i]) for split, i in jobs}
    done = out.completed_shards()
    for name in set(done) - {shard_name(i, split) for split, i in jobs}:
        out.drop_shard(name)  # a killed attempt planned with other pieces: never commit it
    # A shard counts as done only when it was computed from this plan's records.
    pending = [(split, i) for split, i in jobs
               if shard_name(i, split) not in done
               or done[shard_name(i, split)].meta.get("input_digest") != digests[(split, i)]]
    key = reuse.reuse_key(STAGE, plan.settings)
    earlier = reuse.earlier_outputs(store, STAGE, key, out.fingerprint)
    found = reuse.dump_index(earlier)
    linked = [j for j in pending if digests[j] in found]
    for split, i in linked:
        out.link_shard(shard_name(i, split), *found[digests[(split, i)]])
    pending = [j for j in pending if digests[j] not in found]
    records = {j: pieces[j[0]][j[1]] for j in pending}
    del pieces
    if pending:
        log.info("dump %s: %d of %d shards to compute on %s", out.uri, len(pending), len(jobs),
                 ", ".join(map(str, plan.devices[:len(pending)])))
        _run_workers(plan, out, pending, records, progress, len(jobs) - len(pending), len(jobs))
    out.commit(lambda shards: {**summarize(plan, [shards[n] for n in names["train"]],
                                           [shards[n] for n in names["eval"]]),
                               "reuse": reuse.dump_reuse_meta(earlier, shards.values())},
               expect=[shard_name(i, split) for split, i in jobs])
    reuse.register(out, key)
    return _result(out, skipped=False)


class EmptyUpstream(DrafterError, ValueError):
    """The upstream output is committed but holds nothing to dump: re-running will not help."""


def _result(out: StageOutput, skipped: bool) -> StageResult:
    meta = out.manifest.meta
    q = meta["quarantined"]
    summary = [f"{meta['num_samples']} samples, {meta['num_tokens']} tokens ({meta['num_loss_tokens']} with loss), "
               f"{q['total']} quarantined {q['by_reason'] or ''}; {meta['bytes_per_token']:.0f} bytes/token; "
               f"storage: {meta['storage_projection']}"]
    if "samples_from_token_ids" in meta:
        summary.append(f"{meta['samples_from_token_ids']} samples from the target's own token ids, the others "
                       f"re-tokenized from text")
    r = meta.get("reuse") or {}
    if r.get("linked_shards"):
        summary.append(f"reused from earlier dumps: {r['linked_shards']} shards referenced ({r['linked_records']} "
                       f"records); computed {r['computed_shards']} shards ({r['computed_records']} records)")
    if meta.get("eval"):
        summary.append(f"held out (eval split): {meta['eval']['num_samples']} samples, "
                       f"{meta['eval']['num_tokens']} tokens in {meta['eval']['num_shards']} shards")
    table = [
        {"metric": "target", "value": f"{meta['target_fingerprint']} ({meta['dtype']}, hidden {meta['hidden_size']})"},
        {"metric": "aux layers", "value": f"{meta['aux_layer_ids']} ({meta['layer_id_convention']}) + final"},
        {"metric": "samples", "value": f"{meta['num_samples']} in {meta['num_shards']} shards"},
        {"metric": "tokens", "value": f"{meta['num_tokens']} ({meta['num_loss_tokens']} with loss), "
                                      f"{meta['truncated']} truncated"},
        {"metric": "quarantined", "value": f"{q['total']} {q['by_reason'] or ''}"},
        {"metric": "bytes", "value": f"{meta['bytes']} ({meta['bytes_per_token']:.0f} bytes/token)"},
        {"metric": "storage projection", "value": str(meta["storage_projection"])}]
    # The per-sample quarantine list stays in the manifest: a task result must stay small.
    meta = {**meta, "quarantined": {k: v for k, v in q.items() if k != "samples"}}
    return StageResult(stage=STAGE, status="skipped" if skipped else "done", uri=out.uri,
                       fingerprint=out.fingerprint, meta=meta, manifest=out.manifest, summary=tuple(summary),
                       table=tuple(table))


def summarize(plan: DumpPlan, shards: list[ShardInfo], eval_shards: list[ShardInfo] = ()) -> dict:
    """Manifest meta from the shard markers (so a resumed run counts shards it did not compute).
    Counts describe the train split; `eval` the held-out split's shards."""
    tokens = sum(s.meta["tokens"] for s in shards)
    total_bytes = sum(s.size for s in shards)
    quarantined = [q for s in shards for q in s.meta["quarantined"]]
    dtype = dtype_name(plan.dtype)
    storage = plan.cfg.dump.storage_dtype
    bpt = total_bytes / tokens if tokens else 0.0
    return {
        "upstream": {"stage": plan.upstream_stage, "fingerprint": plan.upstream_fingerprint},
        "target_path": plan.cfg.target.path,
        "target_fingerprint": plan.target_fingerprint,
        "tokenizer_hash": plan.tokenizer_hash,
        "chat_template_hash": plan.template_hash,
        "dtype": dtype,
        "storage_dtype": storage if storage != "model" else dtype,
        "aux_layer_ids": plan.aux_layer_ids,
        "layer_id_convention": LAYER_ID_CONVENTION,
        "final_hidden_state": FINAL_HIDDEN,
        "hidden_size": plan.hidden_size,
        "num_hidden_layers": plan.num_layers,
        "max_length": plan.cfg.dump.max_length,
        "samples_per_shard": plan.cfg.dump.samples_per_shard,
        "shard_format": {"name": FORMAT, "version": format_version(storage)},
        "num_shards": len(shards),
        "num_samples": sum(s.meta["samples"] for s in shards),
        "num_tokens": tokens,
        "num_loss_tokens": sum(s.meta["loss_tokens"] for s in shards),
        "truncated": sum(s.meta["truncated"] for s in shards),
        # samples tokenised from the engine's recorded ids; the rest re-tokenised from text (records
        # without ids; shards computed before ids were recorded count none)
        "samples_from_token_ids": sum(s.meta.get("from_token_ids", 0) for s in shards),
        "bytes": total_bytes,
        "bytes_per_token": round(bpt, 2),
        "payload_bytes_per_token": bytes_per_token(plan.hidden_size, dtype, storage_dtype=storage),
        "storage_projection": storage_projection(bpt, tokens, plan.hidden_size, storage_label(dtype, storage)),
        "quarantined": {"total": len(quarantined),
                        "by_reason": dict(sorted(Counter(q["reason"] for q in quarantined).items())),
                        "samples": quarantined},
        "eval": {"num_shards": len(eval_shards), "num_samples": sum(s.meta["samples"] for s in eval_shards),
                 "num_tokens": sum(s.meta["tokens"] for s in eval_shards),
                 "num_loss_tokens": sum(s.meta["loss_tokens"] for s in eval_shards),
                 "quarantined": sum(len(s.meta["quarantined"]) for s in eval_shards)},
    }
