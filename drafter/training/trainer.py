"""The training loop: `train_drafter(cfg, store, train_split, ...)` -> TrainResult.

Order of work: check the dump against the target (layer ids, convention, hidden size, target
fingerprint) and `init_from` against the target, before anything is loaded; draft vocab from the
drafter (init_from) or counted over the training split; resume from this run's newest checkpoint
that verifies; then steps of `micro_batches_per_step` packed micro-batches (split across ranks),
clipping, AdamW; metrics at intervals; held-out metrics at `eval_every_steps` and at the end;
checkpoints at `save_every_steps`, at the end, and on SIGTERM (then TrainingInterrupted).
"""
from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafter.config import LifecycleConfig, TrainConfig
from drafter.layers import LAYER_ID_CONVENTION
from drafter.model import (Eagle3Drafter, draft_config_for_target, load_drafter, read_target_config,
                           save_drafter, set_draft_vocab)
from drafter.stage_output import Manifest, guarded_progress
from drafter.store import ObjectStore
from drafter.training import checkpoint as ckpt
from drafter.training import distributed
from drafter.training.data import Cursor, DumpExpectation, DumpReader, DumpSplit, count_vocab, dump_splits, packer_for
from drafter.training.errors import DrafterIncompatible, TrainingError, TrainingInterrupted
from drafter.training.metrics import plot_png, served_figures, served_walk, summarize, to_jsonl
from drafter.training.optim import MasterAdamW, clip_gradients, lr_factor, peak_learning_rate
from drafter.training.static_step import GraphedTTT, plan_static
from drafter.training.teacher import TargetHead, load_target_head
from drafter.training.ttt import STATS, prepare, fast_ttt_loss
from drafter.training.vocab import ids_from_maps, select_draft_vocab

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
# Optimizer steps queued on the GPU at once: with 2, the host packs, plans and copies step n + 1
# while the GPU runs step n (pinned batches, no per-step sync), without running further ahead.
STEPS_IN_FLIGHT = 2
CURVES_FILE = "curves.png"


@dataclass
class TrainResult:
    drafter_dir: Path            # SGLang-format drafter (config.json + model.safetensors)
    checkpoint_uri: str          # the final checkpoint in the store
    metrics_path: Path           # metrics.jsonl (one row per log / eval point)
    curves_path: Path            # curves.png
    meta: dict = field(default_factory=dict)  # for the stage manifest (see `train_drafter`)


class TTTModule(torch.nn.Module):
    """The drafter with the fast TTT loss as its forward, so DDP / FSDP2 hooks see every step."""

    def __init__(self, drafter: Eagle3Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, si, decay: float, norm: float, attention: str = "auto", compile: bool = False,
                return_correct: bool = False):
        return fast_ttt_loss(self.drafter, si, decay, norm, attention, compile, return_correct)


def check_init_from(model: Eagle3Drafter, target: dict, aux_layer_ids: list[int], draft_vocab_size: int,
                    drafter: str = "eagle3") -> None:
    """Refuse a starting drafter that does not fit the target or `train.drafter`, naming each field."""
    c = model.config
    problems = []
    if c.drafter != drafter:  # eagle3 weights have no fc_norm; eagle3.1's were trained with post-norm feedback
        problems.append(f"drafter: {c.drafter}, train.drafter is {drafter} (train.drafter: {c.drafter} fine-tunes it)")
    for name, got, want in (("hidden_size", c.hidden_size, target["hidden_size"]),
                            ("target_hidden_size", c.target_hidden_size, target["hidden_size"]),
                            ("vocab_size", c.vocab_size, target["vocab_size"]),
                            ("draft_vocab_size", c.draft_vocab_size, draft_vocab_size)):
        if got != want:
            problems.append(f"{name}: drafter has {got}, expected {want}")
    ids = c.resolved_aux_layer_ids(target["num_hidden_layers"])
    if list(ids) != list(aux_layer_ids):
        problems.append(f"eagle_aux_hidden_state_layer_ids: drafter has {ids}, the dump / config use "
                        f"{list(aux_layer_ids)}")
    if c.layer_id_convention != LAYER_ID_CONVENTION:
        problems.append(f"layer_id_convention: drafter has {c.layer_id_convention!r}, expected "
                        f"{LAYER_ID_CONVENTION!r}")
    if problems:
        raise DrafterIncompatible("train.init_from does not fit the target: " + "; ".join(problems))


def _init_weights(model: Eagle3Drafter, seed: int, std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * std)


def _compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _rng_state() -> dict:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _Sigterm:
    """Turns SIGTERM into a flag the loop checks after each optimizer step."""

    def __init__(self) -> None:
        self.hit = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.hit = True

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)




def train_drafter(cfg: LifecycleConfig, store: ObjectStore, train_split: DumpSplit | Manifest | str, *,
                  run_fingerprint: str, out_dir: str | Path, eval_split: DumpSplit | Manifest | str | None = None,
                  target_fingerprint: str | None = None,
                  progress: Callable[..., None] | None = None) -> TrainResult:
    """Train (or resume training) a drafter; returns where its outputs are.

    train_split: a committed dump output (manifest or fingerprint: its `hs-*` shards train, its
    `eval-hs-*` shards evaluate unless eval_split is given) or a DumpSplit (output + shard names).
    eval_split: another dump output (its eval-hs-* shards, else all) or a DumpSplit. run_fingerprint: the train stage's fingerprint; checkpoints live at
    `train-checkpoints/<run_fingerprint>.step-N/` and a later call with the same one resumes.
    target_fingerprint: checked against the dump manifest's (None: not checked).
    progress(done_steps, total_steps, info): info has loss, accept_length, tokens_per_s.
    Under torchrun every rank calls this; rank 0 writes the drafter, metrics and checkpoints.
    """
    tc = cfg.train
    d = distributed.init(tc.device)
    if d.world > tc.micro_batches_per_step:
        raise TrainingError(f"{d.world} processes but train.micro_batches_per_step = "
                            f"{tc.micro_batches_per_step}: every process needs a micro-batch per step")
    if tc.threads:
        torch.set_num_threads(tc.threads)
    progress = guarded_progress(progress, "train") if d.is_main else None
    out_dir = Path(out_dir)
    target = read_target_config(cfg.target.path)
    aux_ids = cfg.aux_layer_ids()
    expect = DumpExpectation(aux_layer_ids=aux_ids, hidden_size=target["hidden_size"],
                             target_fingerprint=target_fingerprint)
    reader_kw = dict(max_length=tc.max_length, cache_shards=tc.cache_shards,
                     prefetch_shards=tc.prefetch_shards, cache_dir=tc.cache_dir)
    if not isinstance(train_split, DumpSplit):  # a whole dump output: its hs-* / eval-hs-* shards
        train_split, held_out = dump_splits(store, train_split)
        eval_split = held_out if eval_split is None else eval_split
    if eval_split is not None and not isinstance(eval_split, DumpSplit):
        eval_split = dump_splits(store, eval_split)[1] or DumpSplit(eval_split)
    train_reader = DumpReader(store, train_split, expect, seed=tc.seed, **reader_kw)
    eval_reader = (DumpReader(store, eval_split, expect, shuffle=False, **reader_kw)
                   if eval_split is not None else None)
    try:
        return _train(_Run(cfg, store, d, target, aux_ids, train_reader, eval_reader, run_fingerprint, out_dir,
                           progress))
    finally:
        train_reader.close()
        if eval_reader is not None:
            eval_reader.close()


def _build_model(cfg: LifecycleConfig, target: dict, aux_ids: list[int], train_reader: DumpReader):
    tc = cfg.train
    if tc.init_from:
        model = load_drafter(tc.init_from, dtype=torch.float32)
        check_init_from(model, target, aux_ids, tc.draft_vocab_size, tc.drafter)
        model.embed_tokens = None  # the target's embedding is used (frozen), as SGLang does
        return model.train(), "init_from"
    config = draft_config_for_target(target, aux_ids, tc.draft_vocab_size, tc.drafter)
    model = Eagle3Drafter(config)
    _init_weights(model, tc.seed, float(target.get("initializer_range", 0.02)))
    counts = count_vocab(train_reader, config.vocab_size)
    set_draft_vocab(model, select_draft_vocab(counts, config.draft_vocab_size))
    return model.train(), "counted"


@dataclass
class _Run:
    """Everything one training run works with, as `train_drafter` set it up."""

    cfg: LifecycleConfig
    store: ObjectStore
    d: distributed.Dist
    target: dict                    # the target's config.json (text model)
    aux_ids: list[int]
    train_reader: DumpReader
    eval_reader: DumpReader | None
    run: str                        # the train stage's fingerprint: names this run's checkpoints
    out_dir: Path
    progress: Callable[..., None] | None


@dataclass
class _Parts:
    """The drafter on the run's device and what trains it."""

    model: Eagle3Drafter
    vocab_source: str               # "init_from" or "counted"
    dtype: torch.dtype              # compute dtype
    embed: torch.Tensor             # the target's embedding, on the CPU: only the batch's rows travel
    head: TargetHead
    module: torch.nn.Module         # TTTModule, wrapped for DDP / FSDP2
    graphed: GraphedTTT | None
    opt: MasterAdamW


@dataclass
class _Schedule:
    per_step: int                   # tokens per optimizer step (the global batch)
    total: int                      # planned optimizer steps
    warmup: int
    peak_lr: float


@dataclass
class _State:
    """Where the loop is: what a checkpoint holds (step .. acc_tokens), then this process's own
    bookkeeping (last save, log interval)."""

    acc: torch.Tensor               # TTT stats summed since the last train row
    step: int = 0
    pending: list = field(default_factory=list)  # steps' stats still on the device (`_flush` adds them to acc)
    in_flight: deque = field(default_factory=deque)  # CUDA events of the steps the GPU may still be running
    cursor: Cursor = field(default_factory=Cursor)
    rows: list[dict] = field(default_factory=list)
    acc_tokens: int = 0
    resumed_from: int | None = None
    saved_at: int | None = None
    last_uri: str | None = None
    t_log: float = 0.0
    tok_log: int = 0


def _train(r: _Run) -> TrainResult:
    tc = r.cfg.train
    p = _set_up(r)
    sched = _schedule(tc, r.train_reader)
    st = _resume(r, p)
    packer = packer_for(r.d.device, tc.tokens_per_micro_batch, tc.max_length)
    batches = packer.batches(r.train_reader.samples(st.cursor, tc.epochs), Cursor(tc.epochs, 0, 0))
    st.t_log = time.perf_counter()
    # closing: the packer's thread is stopped and joined however the loop ends (an exception's
    # traceback would otherwise keep it packing while the process exits)
    with _Sigterm() as sigterm, closing(batches):
        while tc.max_steps is None or st.step < tc.max_steps:
            group = list(itertools.islice(batches, tc.micro_batches_per_step))
            if len(group) < tc.micro_batches_per_step:
                break  # the last incomplete global batch is dropped (same for any world size)
            _optimizer_step(r, p, sched, st, group)
            _at_intervals(r, p, st, sched.total)
            if r.d.any(sigterm.hit):
                if st.saved_at != st.step:
                    _save(r, p, st)
                raise TrainingInterrupted(f"SIGTERM at step {st.step}: checkpoint written, a re-run resumes from it")
    _flush(st)
    if st.acc_tokens:
        st.rows.append({"split": "train", "step": st.step, "tokens": st.acc_tokens, **summarize(st.acc)})
        st.acc.zero_()
        st.acc_tokens = 0
    if r.eval_reader is not None and not (st.rows and st.rows[-1]["split"] == "eval" and st.rows[-1]["step"] == st.step):
        st.rows.append({"split": "eval", "step": st.step, **_evaluate_run(r, p)})
    if st.saved_at != st.step or st.last_uri is None:
        st.last_uri = _save(r, p, st)
    result = _finish(r, p, st)
    result.meta.update(peak_lr=sched.peak_lr, tokens_per_step=sched.per_step, planned_steps=sched.total)
    return result


def _set_up(r: _Run) -> _Parts:
    """The drafter (from init_from or new, its draft vocab), the teacher head, the parallel wrapper
    and the optimizer; refuses settings that cannot run here."""
    tc, d = r.cfg.train, r.d
    model, vocab_source = _build_model(r.cfg, r.target, r.aux_ids, r.train_reader)
    log.info("draft vocab: %s (%d tokens)", "taken from init_from drafter " + str(tc.init_from)
             if vocab_source == "init_from" else "counted over the training dump", model.config.draft_vocab_size)
    dtype = _compute_dtype(tc.dtype, d.device)
    param_dtype = torch.float32 if (tc.parallel == "fsdp" and d.active) else dtype
    model.to(device=d.device, dtype=param_dtype)
    embed, lm_head = load_target_head(r.cfg.target.path)
    head = TargetHead(lm_head, model.t2d, d.device, dtype, tc.vocab_chunk)
    embed = embed.to(dtype)  # stays on the CPU: only the batch's rows travel
    del lm_head
    module = distributed.wrap(TTTModule(model), d, tc.parallel, dtype)
    if tc.optimizer_state_dtype != "float32" and tc.parallel == "fsdp" and d.active:
        raise TrainingError("train.optimizer_state_dtype other than float32 is not supported with parallel: fsdp")
    graphed = None
    if tc.cuda_graphs:
        if d.device.type != "cuda" or d.active:
            raise TrainingError(f"train.cuda_graphs needs one CUDA device without torchrun (device {d.device}, "
                                f"{d.world} processes): set it to false")
        graphed = GraphedTTT(model, head, compile=tc.compile, buckets=tc.cuda_graph_buckets)
    opt = MasterAdamW(list(model.parameters()), tc.learning_rate, tc.adam_betas, tc.adam_eps, tc.weight_decay,
                      state_dtype=getattr(torch, tc.optimizer_state_dtype), compile=tc.compile,
                      keep_grads=graphed is not None)
    return _Parts(model, vocab_source, dtype, embed, head, module, graphed, opt)


def _schedule(tc: TrainConfig, train_reader: DumpReader) -> _Schedule:
    per_step = tc.tokens_per_micro_batch * tc.micro_batches_per_step
    total = tc.max_steps or max(1, -(-tc.epochs * train_reader.num_tokens // per_step))
    warmup = int(tc.warmup_ratio * total)
    peak_lr = peak_learning_rate(tc.learning_rate, per_step, tc.lr_scaling)
    log.info("%d optimizer steps of %d tokens, peak lr %.3g (%s scaling), %d warm-up steps",
             total, per_step, peak_lr, tc.lr_scaling, warmup)
    return _Schedule(per_step, total, warmup, peak_lr)


def _resume(r: _Run, p: _Parts) -> _State:
    """The state of this run's newest checkpoint that verifies (model, optimizer and RNG restored),
    else a fresh start (seeded)."""
    tc = r.cfg.train
    st = _State(acc=torch.zeros(tc.ttt_length, len(STATS), dtype=torch.float64))
    state = ckpt.latest_checkpoint(r.store, r.run)
    if state is None:
        torch.manual_seed(tc.seed)
        return st
    _load_state(p.model, p.opt, state, r.d, tc)
    st.step, st.cursor, st.rows = state["step"], Cursor.from_json(state["cursor"]), list(state["metrics"])
    st.acc, st.acc_tokens = state["acc"].clone(), int(state["acc_tokens"])
    _set_rng_state(state["rng"])
    st.resumed_from = st.saved_at = st.step
    log.info("resumed from checkpoint step %d", st.step)
    return st


def _save(r: _Run, p: _Parts, st: _State) -> str:
    """Checkpoint the run at its current step; returns the checkpoint's URI."""
    tc = r.cfg.train
    _flush(st)
    snapshot = {"run": r.run, "step": st.step, "cursor": st.cursor.to_json(), "metrics": st.rows,
                "acc": st.acc.clone(), "acc_tokens": st.acc_tokens, "rng": _rng_state(),
                **_model_state(p.model, p.opt, r.d, tc)}  # every rank takes part in gathering FSDP2 shards
    uri = ckpt.save_checkpoint(r.store, r.run, st.step, snapshot, tc.keep_checkpoints) if r.d.is_main else ""
    r.d.barrier()
    return uri or ckpt.checkpoint_uri(r.store, r.run, st.step)


def _optimizer_step(r: _Run, p: _Parts, sched: _Schedule, st: _State, group: list) -> None:
    """One optimizer step over a global batch: this rank's share of its micro-batches (gradients
    all-reduced on the last one), clipping, AdamW; the step's stats added to `st`."""
    tc, d = r.cfg.train, r.d
    norm = float(sum(g[1].num_tokens for g in group))
    mine = group[d.rank::d.world]
    stats = torch.zeros(tc.ttt_length, len(STATS), dtype=torch.float64, device=d.device)
    for i, (_c, mb, _n) in enumerate(mine):
        mb = mb.decoded(d.device)  # fp8 states left encoded by the packer: decoded on the GPU
        if p.graphed is not None:  # one replay adds this micro-batch's gradients
            sb = plan_static(mb, tc.ttt_length, tc.ttt_decay, norm, tc.tokens_per_micro_batch, embed=p.embed,
                             buckets=p.graphed.buckets)
            stats += p.graphed(sb)[1]
            continue
        si = prepare(mb, p.embed, p.head, tc.ttt_length, d.device, p.dtype)
        sync = i == len(mine) - 1
        with _no_sync(p.module, d, tc.parallel, sync):
            loss, stat = p.module(si, tc.ttt_decay, norm, "auto", tc.compile)
            # DDP / FSDP2 average gradients over ranks; the loss is already a global sum.
            (loss * d.world).backward()
        stats += stat
    d.all_sum(stats)
    clip_gradients(list(p.model.parameters()), tc.max_grad_norm)
    p.opt.set_lr(sched.peak_lr * lr_factor(st.step, sched.warmup, sched.total, tc.min_lr_ratio))
    p.opt.step()
    p.opt.zero_grad()
    st.step += 1
    st.cursor = group[-1][2]
    st.pending.append(stats)  # read when logged or saved: no device sync per step
    st.acc_tokens += int(norm)
    st.tok_log += int(norm)
    if d.device.type == "cuda":  # the host prepares the next step while the GPU runs this one, no further
        st.in_flight.append(torch.cuda.Event())
        st.in_flight[-1].record()
        while len(st.in_flight) > STEPS_IN_FLIGHT:
            st.in_flight.popleft().synchronize()


def _flush(st: _State) -> None:
    """Add the device-side stats of the steps since the last flush to `acc` (one device sync)."""
    if st.pending:
        st.acc += torch.stack(st.pending).sum(0).cpu()
        st.pending.clear()


def _at_intervals(r: _Run, p: _Parts, st: _State, total: int) -> None:
    """After a step: train metrics + progress, held-out metrics, a checkpoint, each at its interval."""
    tc = r.cfg.train
    if st.step % tc.log_every_steps == 0:
        _flush(st)
        now = time.perf_counter()
        st.rows.append({"split": "train", "step": st.step, "tokens": st.acc_tokens, **summarize(st.acc)})
        info = {"loss": st.rows[-1]["loss"][0], "accept_length": st.rows[-1]["accept_length"],
                "tokens_per_s": st.tok_log / max(now - st.t_log, 1e-9)}
        st.acc.zero_()
        st.acc_tokens, st.t_log, st.tok_log = 0, now, 0
        if r.progress:
            r.progress(st.step, total, info)
    if r.eval_reader is not None and st.step % tc.eval_every_steps == 0:
        st.rows.append({"split": "eval", "step": st.step, **_evaluate_run(r, p)})
    if st.step % tc.save_every_steps == 0:
        st.last_uri, st.saved_at = _save(r, p, st), st.step


def _evaluate_run(r: _Run, p: _Parts) -> dict:
    return _evaluate(p.module, r.eval_reader, p.embed, p.head, r.d, r.cfg.train, p.dtype)


class _no_sync:
    """Skip the gradient all-reduce on all but the last micro-batch of a rank's share."""

    def __init__(self, module, d, parallel: str, sync: bool):
        self.module, self.active, self.parallel, self.sync = module, d.active, parallel, sync
        self._ctx = None

    def __enter__(self):
        if self.active and self.parallel == "fsdp":
            self.module.set_requires_gradient_sync(self.sync)
        elif self.active and not self.sync:
            self._ctx = self.module.no_sync()
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


@torch.no_grad()
def _evaluate(module, reader: DumpReader, embed, head, d, tc, dtype) -> dict:
    """Held-out metrics over the eval split (in manifest order, split across ranks)."""
    stats = torch.zeros(tc.ttt_length, len(STATS), dtype=torch.float64, device=d.device)
    walk = torch.zeros(tc.ttt_length, tc.ttt_length + 1, dtype=torch.float64, device=d.device)
    packer = packer_for(d.device, tc.tokens_per_micro_batch, tc.max_length)
    seen = 0
    drafter = module.module.drafter if hasattr(module, "module") else module.drafter
    with closing(packer.batches(reader.samples(Cursor(), 1), Cursor(1, 0, 0))) as batches:
        for i, (_c, mb, _n) in enumerate(batches):
            if tc.eval_max_tokens is not None and seen >= tc.eval_max_tokens:
                break
            seen += mb.num_tokens
            if i % d.world != d.rank:
                continue
            si = prepare(mb.decoded(d.device), embed, head, tc.ttt_length, d.device, dtype)
            if tc.parallel == "fsdp" and d.active:  # FSDP2 gathers the shards in forward
                _loss, st, correct = module(si, tc.ttt_decay, 1.0, return_correct=True)
            else:
                _loss, st, correct = fast_ttt_loss(drafter, si, tc.ttt_decay, 1.0, return_correct=True)
            stats += st
            walk += served_walk(correct.cpu(), si.lm[0].cpu()).to(walk.device)
    d.all_sum(stats)
    d.all_sum(walk)
    return {"tokens": seen, **summarize(stats), **served_figures(walk)}


def evaluate_drafter(cfg: LifecycleConfig, store: ObjectStore, drafter_dir: str | Path, dump: str,
                     device: str = "cpu") -> dict:
    """Held-out metrics (drafter.training.metrics) of any SGLang-format drafter on a dump's eval
    split, with this configuration's TTT depth and teacher: the figures a trained drafter's
    manifest holds, for a drafter trained elsewhere (a benchmark's second trainer)."""
    tc = cfg.train
    dev = torch.device(device)
    dtype = _compute_dtype(tc.dtype, dev)
    model = load_drafter(drafter_dir, device=dev, dtype=dtype).eval()
    target = read_target_config(cfg.target.path)
    _train_split, held_out = dump_splits(store, dump)
    if held_out is None:
        raise TrainingError(f"dump {dump} has no held-out (eval-hs-*) shards")
    reader = DumpReader(store, held_out, DumpExpectation(aux_layer_ids=cfg.aux_layer_ids(),
                                                         hidden_size=target["hidden_size"]),
                        shuffle=False, max_length=tc.max_length)
    embed, lm_head = load_target_head(cfg.target.path)
    head = TargetHead(lm_head, model.t2d, dev, dtype, tc.vocab_chunk)
    try:
        return _evaluate(TTTModule(model), reader, embed.to(dtype), head, distributed.init(device), tc, dtype)
    finally:
        reader.close()


def _model_state(model, opt: MasterAdamW, d, tc) -> dict:
    if d.active and tc.parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        o = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {"model": get_model_state_dict(model, options=o),
                "fsdp_optim": get_optimizer_state_dict(model, opt.opt, options=o)}
    return {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "optim": opt.state_dict()}


def _load_state(model, opt: MasterAdamW, state: dict, d, tc) -> None:
    if d.active and tc.parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        o = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, state["model"], options=o)
        set_optimizer_state_dict(model, opt.opt, state["fsdp_optim"], options=o)
        return
    missing = set(state["model"]) ^ set(model.state_dict())
    if missing:
        from drafter.training.errors import CheckpointError

        raise CheckpointError(f"checkpoint keys differ from the drafter's: {sorted(missing)}")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])


def _export_state(model, opt: MasterAdamW, d, tc) -> dict:
    """Full fp32 weights (the masters) + buffers, on the CPU."""
    if d.active and tc.parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for n, m in zip(names, opt.masters):
        sd[n] = m.detach().cpu()
    return sd


def _finish(r: _Run, p: _Parts, st: _State) -> TrainResult:
    """Write the trained drafter (SGLang format), metrics.jsonl and curves.png (rank 0); the
    manifest's meta."""
    model, d, tc, rows, out_dir, ckpt_uri = p.model, r.d, r.cfg.train, st.rows, r.out_dir, st.last_uri
    train_reader, eval_reader = r.train_reader, r.eval_reader
    sd = _export_state(model, p.opt, d, tc)
    drafter_dir = out_dir / "drafter"
    metrics_path, curves_path = out_dir / METRICS_FILE, out_dir / CURVES_FILE
    if d.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        export = Eagle3Drafter(model.config)
        export.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()})
        save_drafter(export.to(torch.bfloat16 if tc.dtype != "float32" and d.device.type == "cuda"
                               else torch.float32), drafter_dir)
        metrics_path.write_bytes(to_jsonl(rows))
        curves_path.write_bytes(plot_png(rows))
    d.barrier()
    last = lambda split: next((row for row in reversed(rows) if row["split"] == split), None)
    meta = {
        "steps": st.step, "resumed_from_step": st.resumed_from, "checkpoint": ckpt_uri,
        "vocab_source": p.vocab_source, "init_from": tc.init_from,
        "draft_vocab_size": model.config.draft_vocab_size,
        "draft_vocab_ids_head": ids_from_maps(model.d2t.cpu())[:8].tolist(),
        "aux_layer_ids": list(r.aux_ids), "layer_id_convention": LAYER_ID_CONVENTION,
        "train_dump": train_reader.manifest.fingerprint,
        "eval_dump": eval_reader.manifest.fingerprint if eval_reader else None,
        "world_size": d.world, "parallel": tc.parallel if d.active else "single",
        "final_train": last("train"), "final_eval": last("eval"),
        "reader": train_reader.stats(),  # bytes fetched and the share of time spent waiting for data
    }
    return TrainResult(drafter_dir=drafter_dir, checkpoint_uri=ckpt_uri, metrics_path=metrics_path,
                       curves_path=curves_path, meta=meta)
