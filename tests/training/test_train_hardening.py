"""Issue 21, the train stage: no orphaned trainers after kill -9 of `drafter train`, one run per
output, no temp dirs left by dead runs, resume past a corrupt checkpoint, SIGTERM exits 143.

The runs under test are real `drafter train` processes (drafter.cli.main, gloo on CPU for two
ranks): `python -m tests.training.test_train_hardening SPEC.json` below, whose only change is that the tiny
test dump is the train stage's upstream. The tests wait for events (a checkpoint in the store, a
process gone), with generous deadlines; nothing asserts on speed.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from drafter.config import config_to_yaml
from drafter.errors import DrafterError
from drafter import procs
from drafter.stages import TABLE, train
from drafter.store import FileStore
from drafter.target_identity import target_fingerprint
from drafter.training import checkpoint as ckpt
from drafter.training.errors import CheckpointError
from drafter.training.trainer import train_drafter
from tests.fixtures.training_data import make_cfg, make_dump, make_target

REPO = Path(__file__).resolve().parents[2]
FOREVER = 100_000  # max_steps of a run that only a test ends
GONE_WITHIN_S = 180  # the watchdog's grace for the ranks' checkpoint (train.TRAINERS_GRACE_S, 60 s), and more


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A tiny target and dump, and a temp dir of our own for this process and the children (the
    locks and work dirs of drafter.training.workdir live there)."""
    target = make_target(tmp_path / "target")
    store = FileStore(tmp_path / "store")
    dump_fp = make_dump(store, tmp_path, target_fp=target_fingerprint(target))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return target, store, dump_fp, tmp_path


class Run:
    """A `drafter train` child; `trainers` is its process tree (pid -> start ticks) when last looked."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.trainers = proc, [], {}
        self._reader = threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True)
        self._reader.start()

    def output(self) -> str:
        self._reader.join(timeout=10)
        return "".join(self.lines)

    def wait_for_checkpoint(self, store, fp: str, timeout: float = 240) -> int:
        deadline = time.monotonic() + timeout
        while not ckpt.list_checkpoints(store, fp):
            assert self.proc.poll() is None, "the run ended before its first checkpoint:\n" + self.output()
            assert time.monotonic() < deadline, "no checkpoint in time:\n" + "".join(self.lines)
            time.sleep(0.1)
        self.trainers = _tree(self.proc.pid)
        return ckpt.list_checkpoints(store, fp)[-1]

    def left(self) -> list[int]:
        return [pid for pid, ticks in self.trainers.items() if procs.alive(pid, ticks)]


def _tree(root: int) -> dict[int, int]:
    """The descendants of `root` (pid -> start ticks), from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        st = procs.proc_stat(int(entry)) if entry.isdigit() else None
        if st:
            parent[int(entry)] = int(st[1])
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in found:
                found[child] = procs.start_ticks(child)
                todo.append(child)
    return {pid: ticks for pid, ticks in found.items() if ticks is not None}


@pytest.fixture
def launch(env):
    """Start `drafter train` children; whatever of them is still alive at the end is killed (by pid)."""
    target, store, dump_fp, tmp = env
    runs: list[Run] = []

    def start(cfg, delay_s: float = 0.0) -> Run:
        n = len(runs)
        (tmp / f"cfg{n}.yaml").write_text(config_to_yaml(cfg))
        spec = tmp / f"spec{n}.json"
        spec.write_text(json.dumps({"config": str(tmp / f"cfg{n}.yaml"), "dump": dump_fp, "delay_s": delay_s}))
        child_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp / "tmp")}
        proc = subprocess.Popen([sys.executable, "-m", "tests.training.test_train_hardening", str(spec)], cwd=REPO,
                                env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        runs.append(Run(proc))
        return runs[-1]

    yield start
    for run in runs:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        for pid in run.left():
            os.kill(pid, signal.SIGKILL)


def _cfg(env, **train_fields):
    """Epochs enough for max_steps: a run stops at whichever comes first."""
    target, _store, _dump, tmp = env
    return make_cfg(target, f"file://{tmp}/store", epochs=FOREVER, **train_fields)


def _wait_gone(run: Run, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while run.left() and time.monotonic() < deadline:
        time.sleep(0.2)
    return run.left()


# ---- 1. kill -9 of the launcher ends torchrun and its ranks


def test_kill_9_of_drafter_train_ends_torchrun_and_its_ranks(env, launch):
    _target, store, dump_fp, _tmp = env
    cfg = _cfg(env, max_steps=FOREVER, save_every_steps=2, nproc_per_node=2, parallel="ddp")
    run = launch(cfg)
    run.wait_for_checkpoint(store, TABLE.fingerprint("train", cfg, {"dump": dump_fp}))
    argvs = [" ".join(procs.cmdline(pid) or []) for pid in run.trainers]
    assert sum("torch.distributed.run" in a for a in argvs) == 1, argvs
    assert sum("drafter.stages.train" in a and "torch.distributed.run" not in a for a in argvs) == 2, argvs

    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait(30)
    left = _wait_gone(run, timeout=GONE_WITHIN_S)  # the watchdog: SIGTERM, its grace, SIGKILL
    assert not left, [procs.describe_pid(pid) for pid in left]
    assert "drafter watchdog: launcher gone" in run.output()


# ---- 2. one run per output fingerprint


def test_a_second_run_of_the_same_output_is_refused_by_name(env, launch):
    _target, store, dump_fp, tmp = env
    cfg = _cfg(env, max_steps=400, save_every_steps=2)
    fp = TABLE.fingerprint("train", cfg, {"dump": dump_fp})
    first = launch(cfg, delay_s=0.5)
    first.wait_for_checkpoint(store, fp)

    with pytest.raises(DrafterError) as err:
        TABLE.run("train", cfg, store, upstream={"dump": dump_fp})
    message = str(err.value)
    pid = first.proc.pid
    assert f"pid {pid} on {socket.gethostname()}" in message and f"kill {pid}" in message, message
    assert str(tmp / "tmp" / f"drafter-train-{fp}.lock") in message, message
    assert err.value.retryable  # later, the output is committed (a re-run skips) or the lock is free
    assert first.proc.poll() is None  # the first run trains on

    from drafter.training.workdir import train_lock

    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(30)
    with train_lock(fp):  # the kernel released the dead holder's lock: nothing blocks
        pass


# ---- 3. temp dirs of dead runs


def test_a_rerun_removes_the_temp_dirs_of_dead_runs_and_says_so(env, launch, caplog):
    _target, store, dump_fp, tmp = env
    cfg = _cfg(env, max_steps=12, save_every_steps=4)
    fp = TABLE.fingerprint("train", cfg, {"dump": dump_fp})
    dead = launch(cfg, delay_s=1.0)
    step = dead.wait_for_checkpoint(store, fp)
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait(30)
    stale = [p for p in (tmp / "tmp").glob("drafter-train-*") if p.is_dir()]
    assert stale  # what kill -9 leaves

    caplog.set_level("WARNING")
    result = TABLE.run("train", cfg, store, upstream={"dump": dump_fp})
    assert result.status == "done" and result.manifest.meta["resumed_from_step"] >= step
    assert not [p for p in stale if p.exists()]
    for path in stale:
        assert any(str(path) in r.getMessage() and "died" in r.getMessage() for r in caplog.records), caplog.text
    assert not [p for p in (tmp / "tmp").glob("drafter-train-*") if p.is_dir()]  # nor ours


# ---- 4. a corrupt latest checkpoint


def _corrupt(store: FileStore, run: str, step: int) -> None:
    """Flip bytes in the middle of a committed checkpoint: same size, so it still looks complete."""
    path = Path(ckpt.checkpoint_uri(store, run, step)[len("file://"):]) / ckpt.STATE_FILE
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 8] = bytes(b ^ 0xFF for b in data[mid:mid + 8])
    path.write_bytes(bytes(data))


def _train(env, steps: int, out: str):
    target, store, dump_fp, tmp = env
    return train_drafter(make_cfg(target, "file:///x", max_steps=steps, epochs=10, save_every_steps=4), store, dump_fp,
                         run_fingerprint="bad-ckpt", out_dir=tmp / out, target_fingerprint=target_fingerprint(target))


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(env, caplog):
    store = env[1]
    _train(env, 8, "first")
    assert ckpt.list_checkpoints(store, "bad-ckpt") == [4, 8]
    _corrupt(store, "bad-ckpt", 8)

    caplog.set_level("WARNING")
    res = _train(env, 12, "again")
    assert res.meta["resumed_from_step"] == 4 and res.meta["steps"] == 12
    assert "skipping checkpoint step 8 of run bad-ckpt" in caplog.text
    assert "state.pt does not match its recorded size / sha256" in caplog.text
    assert "resuming run bad-ckpt from step 4" in caplog.text
    assert ckpt.list_checkpoints(store, "bad-ckpt") == [8, 12]
    assert ckpt.load_checkpoint(store, "bad-ckpt", 8)["step"] == 8  # the bad one was written again


def test_no_checkpoint_verifies_the_refusal_names_the_command_that_fixes_it(env):
    store = env[1]
    _train(env, 8, "first")
    for step in (4, 8):
        _corrupt(store, "bad-ckpt", step)
    with pytest.raises(CheckpointError, match="no checkpoint of train run bad-ckpt verifies") as err:
        _train(env, 8, "again")
    message = str(err.value)
    fix = message.split("re-run: ", 1)[1]
    assert fix.startswith("rm -r ") and "step 8: " in message and "does not match its recorded" in message, message
    subprocess.run(["bash", "-c", fix], check=True)  # the command it names
    assert _train(env, 8, "fixed").meta["resumed_from_step"] is None  # from step 0


# ---- 5. SIGTERM of `drafter train`


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_of_drafter_train_exits_143_after_a_checkpoint(env, launch, nproc):
    _target, store, dump_fp, _tmp = env
    cfg = _cfg(env, max_steps=FOREVER, save_every_steps=2, nproc_per_node=nproc,
               **({"parallel": "ddp"} if nproc > 1 else {}))
    run = launch(cfg)
    fp = TABLE.fingerprint("train", cfg, {"dump": dump_fp})
    first = run.wait_for_checkpoint(store, fp)
    run.proc.send_signal(signal.SIGTERM)  # the trainer's handler is in place once a checkpoint exists
    code = run.proc.wait(timeout=180)
    out = run.output()
    assert code == 143, out  # SIGTERM's exit code (docs/operations.md, Exit codes), not 4 ("a retry will not fix")
    assert "TrainingInterrupted" in out and "re-run resumes" in out, out
    # it checkpointed where it stopped: that may be the checkpoint the test saw, when the signal
    # arrived in the step that wrote it (a loaded machine did that: 4 == 4), never an older one
    newest = ckpt.list_checkpoints(store, fp)[-1]
    assert newest >= first
    stopped = re.findall(r"SIGTERM at step (\d+)", out)
    assert not stopped or newest == int(stopped[-1]), (newest, stopped)
    assert not _wait_gone(run, timeout=60)  # no trainer left behind


def main(spec_file: str) -> None:
    """`drafter train --config CFG` with the test dump as its upstream; `delay_s` slows each
    progress report (so a test can act while it trains)."""
    from drafter import cli
    from drafter.stages import TABLE

    spec = json.loads(Path(spec_file).read_text())
    fingerprints = TABLE.fingerprints
    TABLE.fingerprints = lambda cfg, known=None, store=None: fingerprints(cfg, {"dump": spec["dump"]}, store)
    if spec["delay_s"]:
        bar = cli._progress_bar

        def slow_bar(desc, unit="it"):
            b = bar(desc, unit)
            update = b.update_to
            b.update_to = lambda *a: (update(*a), time.sleep(spec["delay_s"]))
            return b

        cli._progress_bar = slow_bar
    sys.argv = ["drafter", "train", "--config", spec["config"]]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1])
