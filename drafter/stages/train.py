"""The `train` stage: the dump's hidden states -> an EAGLE-3 drafter (drafter.training does the work).

Output (`train/<fingerprint>/`, layout in drafter.formats): `drafter/config.json` +
`drafter/model.safetensors` (SGLang's layout, loadable with drafter.model.load_drafter),
`metrics.jsonl` (per-position loss / accuracy / conditional accuracy / simulated accept length on
train and held-out data) and `curves.png`; the manifest meta holds the final metrics, the vocab's
source, the checkpoint, the dump's fingerprint and the aux layer ids.

Checkpoints go to the store while training (`train.save_every_steps`, SIGTERM): a killed or
cancelled run resumes exactly where it stopped, because the checkpoints are keyed by this stage's
fingerprint. With `train.nproc_per_node > 1` the stage launches torchrun itself (this module is the
per-rank entry point) with the launch environment from the configuration, in its own session with a
watchdog (drafter.procs): torchrun and its ranks end when this process dies, even by kill -9.
SIGTERM is handed on to them (they checkpoint) and ends the stage as TrainingInterrupted (exit 143).
One run per output at a time (drafter.training.workdir): a second is refused by name, and a re-run
removes the temp dirs of dead runs.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from drafter.config import LifecycleConfig, fingerprint_fields, parse_config
from drafter.formats import DUMP, TRAIN_CURVES, TRAIN_METRICS, TRAINED_DRAFTER_FILES, download_export
from drafter.formats import TRAIN as STAGE
from drafter.retrain.registry import CHAMPION
from drafter import procs
from drafter.launch_env import launch_overrides
from drafter.stage_output import Progress, StageOutput
from drafter.stage_output import fingerprint as stage_fingerprint
from drafter.stages.base import Built, StageContext, Summary
from drafter.stages.drafters import Drafters, resolve_drafter
from drafter.store import ObjectStore, open_store
from drafter.target_identity import target_fingerprint, target_identity
from drafter.training.errors import TrainingError, TrainingInterrupted
from drafter.training.workdir import remove_stale_work_dirs, train_lock, work_prefix

log = logging.getLogger(__name__)

RESULT_FILE = "train-result.json"  # what rank 0 of a torchrun launch hands back to the stage
TRAINERS_GRACE_S = 60.0  # the watchdog's SIGTERM -> SIGKILL wait: the ranks write a checkpoint first
# Bump when what a train output holds changes for the same configuration: 2 = the chain metrics
# (accept_rate_k; drafter.training.metrics), so outputs with the old figures are not reused.
TRAIN_RECIPE = 3  # 3: held-out rows carry the served walk (drafter.training.metrics.served_walk)


def needs(cfg: LifecycleConfig) -> tuple[str, ...]:
    return (DUMP,)


@dataclass
class Inputs:
    ctx: StageContext
    start: Drafters  # the drafter fine-tuning starts from (none: from scratch)
    lock_fd: int | None = None  # the output's lock while `exclusive` holds it (torchrun inherits it)


def inputs(ctx: StageContext) -> Inputs:
    """`train.init_from`: a drafter directory, or `champion` (the registry's champion export now;
    none yet: the first retrain trains from scratch)."""
    return Inputs(ctx, resolve_drafter(ctx.cfg, ctx.store, {}, source=ctx.cfg.train.init_from,
                                       source_field="train.init_from", required=False))


def fingerprint(inputs: Inputs) -> str:
    """The train section's output fields, the aux layer ids, the target, the starting drafter and
    the dump (the hidden states it learns from)."""
    cfg = inputs.ctx.cfg
    section = fingerprint_fields(cfg.train)
    if section["drafter"] == "eagle3":  # left out: outputs from before train.drafter keep their fingerprints
        del section["drafter"]
    if cfg.train.init_from == CHAMPION:
        section["init_from"] = {"champion_export": inputs.start.export} if inputs.start.export else None
    else:
        section["init_from"] = inputs.start.local_identity
    return stage_fingerprint(STAGE, {"train": section, "aux_layer_ids": cfg.aux_layer_ids(),
                                     "target": target_identity(cfg.target), "recipe": TRAIN_RECIPE},
                             [inputs.ctx.upstream[DUMP]])


@contextmanager
def exclusive(inputs: Inputs, out: StageOutput) -> Iterator[None]:
    """One run per output: held until the commit; another live run of it is refused by name."""
    StageOutput.committed(inputs.ctx.store, DUMP, inputs.ctx.upstream[DUMP])  # a missing dump fails here, naming it
    with train_lock(out.fingerprint) as lock_fd:
        remove_stale_work_dirs(out.fingerprint)  # we hold the lock: their owners are dead
        inputs.lock_fd = lock_fd
        try:
            yield
        finally:
            inputs.lock_fd = None


def build(inputs: Inputs, out: StageOutput) -> Built:
    """Train (or resume training) the drafter on the dump."""
    with tempfile.TemporaryDirectory(prefix=work_prefix(out.fingerprint)) as work:
        meta = _train_into(out, inputs, Path(work), inputs.lock_fd)
    return Built(meta)


def _train_into(out: StageOutput, inputs: Inputs, work: Path, lock_fd: int) -> dict:
    """Train in `work` and upload the drafter and its metrics to `out`; returns the manifest meta."""
    cfg, store, dump_fp, fp = inputs.ctx.cfg, inputs.ctx.store, inputs.ctx.upstream[DUMP], out.fingerprint
    if cfg.train.cache_dir is None:  # the shard cache goes with the work dir, also a dead run's
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"cache_dir": str(work)})})
    champion = inputs.start.export if cfg.train.init_from == CHAMPION else None
    if cfg.train.init_from == CHAMPION:  # fine-tune the champion's SGLang files (or start afresh)
        start = str(download_export(store, champion, work / "champion", "sglang")) if champion else None
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"init_from": start})})
    if cfg.train.nproc_per_node > 1:
        meta = _train_torchrun(cfg, dump_fp, fp, work, inputs.ctx.on_line, lock_fd)
    else:
        meta = _train_here(cfg, store, dump_fp, fp, work, inputs.ctx.progress)
    for name in TRAINED_DRAFTER_FILES:
        out.write_shard(name, work / "drafter" / Path(name).name)
    out.write_shard(TRAIN_METRICS, work / TRAIN_METRICS)
    out.write_shard(TRAIN_CURVES, work / TRAIN_CURVES)
    return {**meta, "dump_fingerprint": dump_fp, "init_from_champion": champion}


def _train_here(cfg: LifecycleConfig, store: ObjectStore, dump_fp: str, fp: str, work: Path,
                progress: Progress | None) -> dict:
    from drafter.training.trainer import train_drafter

    result = train_drafter(cfg, store, dump_fp, run_fingerprint=fp, out_dir=work,
                           target_fingerprint=target_fingerprint(cfg.target.path, cfg.target.revision),
                           progress=progress)
    return result.meta


def _train_torchrun(cfg: LifecycleConfig, dump_fp: str, fp: str, work: Path, on_line, lock_fd: int) -> dict:
    """One process per GPU under torchrun, each running `main()` below; rank 0 writes the drafter,
    the metrics and RESULT_FILE into `work`. Its output lines reach `on_line` (the run log).
    torchrun inherits `lock_fd`: the output stays locked until it is gone."""
    from drafter.training.distributed import torchrun_command

    cfg_path = work / "config.json"
    cfg_path.write_text(cfg.model_dump_json())
    env = launch_overrides(cfg.serve.env)
    argv, full_env = torchrun_command(cfg.train.nproc_per_node, ["drafter.stages.train", str(cfg_path),
                                                                 dump_fp, fp, str(work)], env)
    # torchrun starts each rank in a session of its own: the tag, inherited by every rank, finds them.
    tag = uuid.uuid4().hex
    full_env[procs.TAG_VAR] = tag
    log.info("train: %s", " ".join(argv))
    # Own session and group, so the watchdog can end exactly torchrun's processes.
    proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, pass_fds=(lock_fd,))
    try:
        watchdog = procs.Watchdog(proc.pid, proc.pid, tag, TRAINERS_GRACE_S)
    except BaseException:
        proc.kill()
        raise
    with watchdog, _forward_sigterm(proc) as sigterm:
        code, tail = _follow(proc, on_line)
    result = work / RESULT_FILE
    if sigterm:
        raise TrainingInterrupted(f"SIGTERM: handed on to torchrun and its {cfg.train.nproc_per_node} ranks "
                                  f"(exit code {code}), which checkpoint on SIGTERM; a re-run resumes from "
                                  "the newest checkpoint")
    if code != 0 or not result.is_file():
        raise TorchrunFailed(f"torchrun with {cfg.train.nproc_per_node} processes exited with code {code}; "
                             "last lines:\n  " + "\n  ".join(tail))
    return json.loads(result.read_text())


def _follow(proc: subprocess.Popen, on_line) -> tuple[int, list[str]]:
    """Hand torchrun's output lines to `on_line` until it exits: (exit code, last 40 lines)."""
    tail: list[str] = []
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail = (tail + [line])[-40:]
            if on_line is not None:
                on_line(line)
        return proc.wait(), tail
    finally:
        if proc.poll() is None:  # Ctrl-C (torchrun's own session does not get it): the ranks checkpoint on SIGTERM
            proc.terminate()
            proc.wait(timeout=120)


@contextmanager
def _forward_sigterm(proc: subprocess.Popen) -> Iterator[list[int]]:
    """SIGTERM (Prefect's cancellation, `kill`) goes on to torchrun, which hands it to the ranks;
    torchrun then exits and the caller sees the list non-empty. Main thread only (signals)."""
    hit: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield hit
        return

    def handler(signum, frame):
        hit.append(signum)
        proc.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield hit
    finally:
        signal.signal(signal.SIGTERM, previous)


class TorchrunFailed(TrainingError):
    """A rank died (often out of memory or a lost peer); the checkpoints let a retry resume."""

    retryable = True


def summarize(inputs: Inputs, out: StageOutput) -> Summary:
    meta = out.manifest.meta
    summary, table = [], []
    for split in ("train", "eval"):
        row = meta.get(f"final_{split}") or {}
        if not row:
            continue
        fmt = lambda values: "[" + ", ".join("-" if v is None else f"{v:.3f}" for v in values) + "]"
        # Rows of outputs trained before accept_rate existed show what they have.
        chain = (f", accepted at position k {fmt(row['accept_rate'])}" if "accept_rate" in row else "")
        served = (f", served walk accept length {row['served_accept_length'][-1]:.3f}"
                  if row.get("served_accept_length") else "")
        summary.append(f"{split} (step {row['step']}): acc per position {fmt(row['acc'])}{chain}, conditional "
                       f"{fmt(row['cond_acc'])}, simulated accept length {row['accept_length']:.3f}{served}")
        table += [{"metric": f"{split}.{k}", "value": fmt(v) if isinstance(v, list) else str(v)}
                  for k, v in row.items() if k in ("step", "loss", "acc", "accept_rate", "cond_acc", "accept_length",
                                                   "served_accept_length")]
    summary.append(f"{meta.get('steps')} steps, vocab from {meta.get('vocab_source')}, "
                   f"aux layers {meta.get('aux_layer_ids')}")
    return Summary(summary, table)


def main(argv: list[str] | None = None) -> int:
    """Per-rank entry point under torchrun: `python -m drafter.stages.train CFG DUMP_FP RUN_FP WORK`."""
    cfg_path, dump_fp, fp, work = argv or sys.argv[1:]
    cfg = parse_config(json.loads(Path(cfg_path).read_text()))
    meta = _train_here(cfg, open_store(cfg.storage), dump_fp, fp, Path(work), progress=None)
    if int(os.environ.get("RANK", "0")) == 0:
        (Path(work) / RESULT_FILE).write_text(json.dumps(meta, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
