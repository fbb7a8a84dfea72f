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
watchdog (drafter.serving.procs): torchrun and its ranks end when this process dies, even by kill -9.
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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from drafter.config import LifecycleConfig, fingerprint_fields, parse_config
from drafter.formats import DUMP, TRAIN_CURVES, TRAIN_METRICS, TRAINED_DRAFTER_FILES, download_export
from drafter.retrain.registry import CHAMPION
from drafter.formats import TRAIN as STAGE
from drafter.hashing import hash_file, short_hash
from drafter.serving.launch_env import launch_overrides
from drafter.stage_output import Progress, StageOutput, StageResult
from drafter.stage_output import fingerprint as stage_fingerprint
from drafter.store import ObjectStore, open_store
from drafter.serving import procs
from drafter.target_identity import target_fingerprint, target_identity
from drafter.training.errors import TrainingError, TrainingInterrupted
from drafter.training.workdir import remove_stale_work_dirs, train_lock, work_prefix

log = logging.getLogger(__name__)

RESULT_FILE = "train-result.json"  # what rank 0 of a torchrun launch hands back to the stage
TRAINERS_GRACE_S = 60.0  # the watchdog's SIGTERM -> SIGKILL wait: the ranks write a checkpoint first
# Bump when what a train output holds changes for the same configuration: 2 = the chain metrics
# (accept_rate_k; drafter.training.metrics), so outputs with the old figures are not reused.
TRAIN_RECIPE = 3  # 3: held-out rows carry the served walk (drafter.training.metrics.served_walk)


def _init_from_identity(path: str | None) -> str | None:
    """A content hash of the drafter fine-tuning starts from (a path alone could change under us)."""
    if not path:
        return None
    files = [Path(path) / name for name in ("config.json", "model.safetensors")]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        from drafter.config import ConfigError

        raise ConfigError([("train.init_from", f"not an SGLang-format drafter directory: missing {missing}")])
    return short_hash("".join(f"{f.name}:{hash_file(f)[1]}\n" for f in files))


def _champion(cfg: LifecycleConfig, store: ObjectStore | None = None) -> str | None:
    """`train.init_from: champion`: the registry's champion export now (None: none yet, so the
    first retrain trains from scratch)."""
    from drafter.retrain.registry import Registry

    return Registry.for_config(cfg, store or open_store(cfg.storage)).champion_export()


def fingerprint(cfg: LifecycleConfig, upstream: Mapping[str, str]) -> str:
    """The train section's output fields, the aux layer ids, the target, the starting drafter and
    the dump (the hidden states it learns from)."""
    section = fingerprint_fields(cfg.train)
    if cfg.train.init_from == CHAMPION:
        champion = _champion(cfg)
        section["init_from"] = {"champion_export": champion} if champion else None
    else:
        section["init_from"] = _init_from_identity(cfg.train.init_from)
    return stage_fingerprint(STAGE, {"train": section, "aux_layer_ids": cfg.aux_layer_ids(),
                                     "target": target_identity(cfg.target), "recipe": TRAIN_RECIPE},
                             [upstream[DUMP]])


def run(cfg: LifecycleConfig, store: ObjectStore, *, upstream: Mapping[str, str],
        progress: Progress | None = None, on_line=None) -> StageResult:
    """Train (or resume training) the drafter on `upstream["dump"]`; skip when the output is complete."""
    fp = fingerprint(cfg, upstream)
    out = StageOutput(store, STAGE, fp)
    if out.is_complete():
        return _result(out, skipped=True)
    StageOutput.committed(store, DUMP, upstream[DUMP])  # a missing dump fails here, naming it
    with train_lock(fp) as lock_fd:  # held until the commit; another live run of `fp`: refused by name
        if out.is_complete():  # committed by the run that held the lock before us
            return _result(out, skipped=True)
        remove_stale_work_dirs(fp)  # we hold the lock: their owners are dead
        with tempfile.TemporaryDirectory(prefix=work_prefix(fp)) as work:
            meta = _train_into(out, cfg, store, upstream[DUMP], fp, Path(work), progress, on_line, lock_fd)
        out.commit(meta)
    return _result(out, skipped=False)


def _train_into(out: StageOutput, cfg: LifecycleConfig, store: ObjectStore, dump_fp: str, fp: str, work: Path,
                progress: Progress | None, on_line, lock_fd: int) -> dict:
    """Train in `work` and upload the drafter and its metrics to `out`; returns the manifest meta."""
    if cfg.train.cache_dir is None:  # the shard cache goes with the work dir, also a dead run's
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"cache_dir": str(work)})})
    champion = _champion(cfg, store) if cfg.train.init_from == CHAMPION else None
    if cfg.train.init_from == CHAMPION:  # fine-tune the champion's SGLang files (or start afresh)
        start = str(download_export(store, champion, work / "champion", "sglang")) if champion else None
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"init_from": start})})
    if cfg.train.nproc_per_node > 1:
        meta = _train_torchrun(cfg, dump_fp, fp, work, on_line, lock_fd)
    else:
        meta = _train_here(cfg, store, dump_fp, fp, work, progress)
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


def _result(out: StageOutput, skipped: bool) -> StageResult:
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
    return StageResult.committed(out.manifest, out.uri, skipped, summary, table)


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
