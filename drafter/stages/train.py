"""The `train` stage: the dump's hidden states -> an EAGLE-3 drafter (drafter.training does the work).

Output (`train/<fingerprint>/`, layout in drafter.formats): `drafter/config.json` +
`drafter/model.safetensors` (SGLang's layout, loadable with drafter.model.load_drafter),
`metrics.jsonl` (per-position loss / accuracy / conditional accuracy / simulated accept length on
train and held-out data) and `curves.png`; the manifest meta holds the final metrics, the vocab's
source, the checkpoint, the dump's fingerprint and the aux layer ids.

Checkpoints go to the store while training (`train.save_every_steps`, SIGTERM): a killed or
cancelled run resumes exactly where it stopped, because the checkpoints are keyed by this stage's
fingerprint. With `train.nproc_per_node > 1` the stage launches torchrun itself (this module is the
per-rank entry point) with the launch environment from the configuration.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from drafter.config import LifecycleConfig, fingerprint_fields, parse_config
from drafter.formats import DUMP, TRAIN_CURVES, TRAIN_METRICS, TRAINED_DRAFTER_FILES, download_export
from drafter.registry import CHAMPION
from drafter.formats import TRAIN as STAGE
from drafter.hashing import hash_file, short_hash
from drafter.launch_env import launch_overrides
from drafter.stage_output import Progress, StageOutput, StageResult
from drafter.stage_output import fingerprint as stage_fingerprint
from drafter.store import ObjectStore, open_store
from drafter.target_identity import target_fingerprint, target_identity
from drafter.training.errors import TrainingError

log = logging.getLogger(__name__)

RESULT_FILE = "train-result.json"  # what rank 0 of a torchrun launch hands back to the stage
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
    from drafter.registry import Registry

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
    with tempfile.TemporaryDirectory(prefix="drafter-train-") as work:
        champion = _champion(cfg, store) if cfg.train.init_from == CHAMPION else None
        if cfg.train.init_from == CHAMPION:  # fine-tune the champion's SGLang files (or start afresh)
            start = str(download_export(store, champion, Path(work) / "champion", "sglang")) if champion else None
            cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"init_from": start})})
        if cfg.train.nproc_per_node > 1:
            meta = _train_torchrun(cfg, upstream[DUMP], fp, Path(work), on_line)
        else:
            meta = _train_here(cfg, store, upstream[DUMP], fp, Path(work), progress)
        drafter_dir = Path(work) / "drafter"
        for name in TRAINED_DRAFTER_FILES:
            out.write_shard(name, drafter_dir / Path(name).name)
        out.write_shard(TRAIN_METRICS, Path(work) / TRAIN_METRICS)
        out.write_shard(TRAIN_CURVES, Path(work) / TRAIN_CURVES)
    out.commit({**meta, "dump_fingerprint": upstream[DUMP], "init_from_champion": champion})
    return _result(out, skipped=False)


def _train_here(cfg: LifecycleConfig, store: ObjectStore, dump_fp: str, fp: str, work: Path,
                progress: Progress | None) -> dict:
    from drafter.training.trainer import train_drafter

    result = train_drafter(cfg, store, dump_fp, run_fingerprint=fp, out_dir=work,
                           target_fingerprint=target_fingerprint(cfg.target.path, cfg.target.revision),
                           progress=progress)
    return result.meta


def _train_torchrun(cfg: LifecycleConfig, dump_fp: str, fp: str, work: Path, on_line) -> dict:
    """One process per GPU under torchrun, each running `main()` below; rank 0 writes the drafter,
    the metrics and RESULT_FILE into `work`. Its output lines reach `on_line` (the run log)."""
    from drafter.training.distributed import torchrun_command

    cfg_path = work / "config.json"
    cfg_path.write_text(cfg.model_dump_json())
    env = launch_overrides(cfg.serve.env)
    argv, full_env = torchrun_command(cfg.train.nproc_per_node, ["drafter.stages.train", str(cfg_path),
                                                                 dump_fp, fp, str(work)], env)
    log.info("train: %s", " ".join(argv))
    proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail = (tail + [line])[-40:]
            if on_line is not None:
                on_line(line)
        code = proc.wait()
    finally:
        if proc.poll() is None:  # cancelled (SIGTERM / Ctrl-C): the ranks checkpoint on SIGTERM
            proc.terminate()
            proc.wait(timeout=120)
    result = work / RESULT_FILE
    if code != 0 or not result.is_file():
        raise TorchrunFailed(f"torchrun with {cfg.train.nproc_per_node} processes exited with code {code}; "
                             "last lines:\n  " + "\n  ".join(tail))
    return json.loads(result.read_text())


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
