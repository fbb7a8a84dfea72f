"""One train run per output at a time on this host, and no temp dirs left by dead runs.

A run of train output `<fp>` holds the output lock (drafter.workdirs: an flock on
`<tmp>/drafter-train-<fp>.lock`, the same rule and the same safe lock file as every stage that
locks its output) while it trains and commits; its local work dir is `<tmp>/drafter-train-<fp>-*`.
A second run of the same output is refused by name (pid, host, since when, what to do) instead of
training it all again (train does not wait: a training run takes hours, and stopping it with
SIGTERM writes a checkpoint the next run resumes from). The kernel releases an flock when every
holder is gone, even by kill -9, so a dead run never blocks: the next run takes the lock, and since
it holds it, every other work dir of `<fp>` belongs to a dead run and is removed. torchrun inherits
the lock (drafter.stages.train), so it stays held until the ranks of a killed launcher are gone too.

Limits: the lock is per host and per temp directory (TMPDIR): runs on two machines sharing a store
are not serialised. The lock file itself stays (a few bytes): removing it could let two runs lock
two different files of the same name.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from drafter import workdirs
from drafter import procs
from drafter.training.errors import TrainingError

log = logging.getLogger(__name__)


class TrainInProgress(TrainingError):
    """Another live run is training the same output; a later attempt finds it done or resumes."""

    retryable = True


def work_prefix(fp: str) -> str:
    return f"drafter-train-{fp}-"


def lock_path(fp: str) -> Path:
    return workdirs.lock_path("train", fp)


@contextmanager
def train_lock(fp: str) -> Iterator[int]:
    """Hold the lock of output `fp` (yields its fd, to hand to child processes) or refuse."""
    lock = workdirs.OutputLock("train", fp)
    try:
        fd = lock.acquire(wait=False)
    except workdirs.OutputBusy as busy:
        raise TrainInProgress(_refusal(fp, busy.path, busy.holder)) from None
    try:
        yield fd
    finally:
        lock.release()  # releases the lock (unless a child still holds it)


def _refusal(fp: str, path: Path, holder: dict) -> str:
    pid = holder.get("pid")
    who = workdirs.describe_holder(holder)
    if pid and not procs.alive(pid, holder.get("start_ticks")):
        return (f"train output {fp} is locked by {path}: its run ({who}) is gone and its trainer processes "
                "are still being stopped by its watchdog; re-run in a minute (it resumes from the checkpoints)")
    stop = f"`kill {pid}`" if pid else "it"
    return (f"train output {fp} is being trained by {who} (lock {path}): wait for it to end (a re-run then "
            f"skips the committed output), or stop {stop} (SIGTERM writes a checkpoint) and re-run to resume")


def remove_stale_work_dirs(fp: str, keep: Path | None = None) -> list[Path]:
    """Remove the work dirs of output `fp` other than `keep`. Only call it holding `train_lock(fp)`:
    then their owners are dead."""
    removed = []
    for path in sorted(Path(tempfile.gettempdir()).glob(work_prefix(fp) + "*")):
        if path.is_dir() and path != keep:
            shutil.rmtree(path, ignore_errors=True)
            log.warning("removed %s: the work dir of a train run of %s that died (its lock was free)", path, fp)
            removed.append(path)
    return removed
