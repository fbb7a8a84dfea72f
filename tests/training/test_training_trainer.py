"""train_drafter on a tiny target and dump: outputs, exact resume after SIGKILL, SIGTERM, refusals."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafter.model import init_random_drafter, load_drafter
from drafter.store import FileStore
from drafter.training import checkpoint as ckpt
from drafter.training.errors import DrafterIncompatible, DumpIncompatible
from drafter.training.trainer import train_drafter
from tests.fixtures.training_data import AUX, TARGET_FP, make_cfg, make_dump, make_target

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def env(tmp_path):
    target = make_target(tmp_path / "target")
    store = FileStore(tmp_path / "store")
    make_dump(store, tmp_path)
    return tmp_path, target, store


def test_trains_and_writes_a_loadable_drafter_with_metrics(env):
    tmp, target, store = env
    res = train_drafter(make_cfg(target, "file:///x", epochs=2), store, "dump0001", run_fingerprint="r1",
                        out_dir=tmp / "out", target_fingerprint=TARGET_FP)
    drafter = load_drafter(res.drafter_dir)  # SGLang layout, checked key by key
    assert drafter.config.aux_layer_ids == AUX and drafter.config.draft_vocab_size == 40
    # 2 epochs of 24 samples, packed across the epoch boundary into 2 x 96-token micro-batches per step
    steps = res.meta["steps"]
    assert res.meta["vocab_source"] == "counted" and 8 <= steps <= 10
    rows = [json.loads(line) for line in res.metrics_path.read_text().splitlines()]
    assert {r["split"] for r in rows} == {"train", "eval"}
    assert all(len(r["acc"]) == 3 and r["accept_length"] >= 1 for r in rows)
    assert res.curves_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ckpt.list_checkpoints(store, "r1") == sorted({4 * (steps // 4), steps})  # keep_checkpoints=2
    first, last = rows[0], [r for r in rows if r["split"] == "train"][-1]
    assert last["loss"][0] < first["loss"][0]  # it learns something even here
    # The vocab = the 40 most frequent answer tokens of the train shards (plain Counter here),
    # lower id first on ties, padded with unseen ids, sorted.
    from collections import Counter

    from tests.fixtures.training_data import make_samples

    c = Counter()
    for seed in (100, 101, 102):
        for smp in make_samples(8, seed):
            c.update(smp["input_ids"][smp["loss_mask"].bool()].tolist())
    ranked = sorted(range(97), key=lambda t: (-c[t], t))[:40]
    assert drafter.t2d.nonzero().flatten().tolist() == sorted(ranked)


def test_init_from_takes_the_drafters_vocab(env):
    tmp, target, store = env
    src = init_random_drafter(target, tmp / "init", aux_layer_ids=AUX, draft_vocab_size=40, seed=3, drafter="eagle3.1")
    res = train_drafter(make_cfg(target, "file:///x", init_from=str(src), max_steps=2), store, "dump0001",
                        run_fingerprint="r2", out_dir=tmp / "out", target_fingerprint=TARGET_FP)
    assert res.meta["vocab_source"] == "init_from"
    assert torch.equal(load_drafter(res.drafter_dir).d2t, load_drafter(src).d2t)  # never recounted


@pytest.mark.parametrize("change, field", [({"aux_layer_ids": [0, 1, 1]}, "eagle_aux_hidden_state_layer_ids"),
                                           ({"draft_vocab_size": 30}, "draft_vocab_size")])
def test_init_from_mismatched_drafter_is_refused_by_name(env, change, field):
    tmp, target, store = env
    kw = {"aux_layer_ids": AUX, "draft_vocab_size": 40, "drafter": "eagle3.1", **change}  # the default variant
    src = init_random_drafter(target, tmp / "bad", **kw)
    with pytest.raises(DrafterIncompatible, match=field) as err:
        train_drafter(make_cfg(target, "file:///x", init_from=str(src)), store, "dump0001", run_fingerprint="r3",
                      out_dir=tmp / "out", target_fingerprint=TARGET_FP)
    assert err.value.retryable is False


def test_init_from_with_another_hidden_size_is_refused(env):
    tmp, target, store = env
    other = make_target(tmp / "other", hidden=48)
    src = init_random_drafter(other, tmp / "wide", aux_layer_ids=AUX, draft_vocab_size=40, drafter="eagle3.1")
    with pytest.raises(DrafterIncompatible, match="hidden_size: drafter has 48, expected 32"):
        train_drafter(make_cfg(target, "file:///x", init_from=str(src)), store, "dump0001", run_fingerprint="r4",
                      out_dir=tmp / "out", target_fingerprint=TARGET_FP)


def test_dump_with_other_layer_ids_is_refused(env):
    tmp, target, store = env
    make_dump(store, tmp, fp="dump0002", aux=[0, 1, 3] if False else [1, 2, 0])
    with pytest.raises(DumpIncompatible, match=r"aux_layer_ids: dump has \[1, 2, 0\], expected \[0, 1, 2\]"):
        train_drafter(make_cfg(target, "file:///x"), store, "dump0002", run_fingerprint="r5", out_dir=tmp / "o",
                      target_fingerprint=TARGET_FP)


def test_dump_of_another_target_is_refused(env):
    tmp, target, store = env
    with pytest.raises(DumpIncompatible, match="target_fingerprint"):
        train_drafter(make_cfg(target, "file:///x"), store, "dump0001", run_fingerprint="r6", out_dir=tmp / "o",
                      target_fingerprint="some-other-target")


# ---- exact resume


def _spec(tmp: Path, target: Path, name: str, **extra) -> Path:
    spec = {"target": str(target), "store": str(tmp / "store"), "dump": "dump0001", "run": "resume-run",
            "out": str(tmp / name), "train": {"epochs": 6}, **extra}
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    return path


def _child(spec: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "tests.fixtures.training_data", str(spec)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_checkpoint(store, run: str, proc: subprocess.Popen, timeout: float = 120) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        steps = ckpt.list_checkpoints(store, run)
        if steps:
            return steps[-1]
        if proc.poll() is not None:
            raise AssertionError("child ended before its first checkpoint:\n" + proc.stdout.read())
        time.sleep(0.05)
    raise AssertionError("no checkpoint in time")


@pytest.mark.slow
def test_killed_run_resumes_exactly(tmp_path):
    """SIGKILL after a checkpoint, resume: the same final weights, optimizer-driven masters and
    metrics as an uninterrupted run (CPU float32, same thread count: bit for bit; tolerance 0)."""
    target = make_target(tmp_path / "target")
    ref_store = FileStore(tmp_path / "ref" / "store")
    make_dump(ref_store, tmp_path / "ref")
    store = FileStore(tmp_path / "store")
    make_dump(store, tmp_path)

    killed = _child(_spec(tmp_path, target, "killed", delay_per_log_s=0.3))
    step = _wait_for_checkpoint(store, "resume-run", killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    assert killed.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    resumed = _child(_spec(tmp_path, target, "resumed"))
    assert resumed.wait(180) == 0, resumed.stdout.read()
    meta = json.loads((tmp_path / "resumed" / "result.json").read_text())
    assert meta["resumed_from_step"] is not None and meta["resumed_from_step"] >= step

    (tmp_path / "ref").mkdir(exist_ok=True)
    ref = _child(_spec(tmp_path / "ref", target, "full"))
    assert ref.wait(180) == 0, ref.stdout.read()
    a = load_file(str(tmp_path / "resumed" / "drafter" / "model.safetensors"))
    b = load_file(str(tmp_path / "ref" / "full" / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ra = (tmp_path / "resumed" / "metrics.jsonl").read_text()
    rb = (tmp_path / "ref" / "full" / "metrics.jsonl").read_text()
    assert ra == rb
    fa, fb = ckpt.latest_checkpoint(store, "resume-run"), ckpt.latest_checkpoint(ref_store, "resume-run")
    assert fa["step"] == fb["step"] == meta["steps"] > step
    for x, y in zip(fa["optim"]["masters"], fb["optim"]["masters"]):
        assert torch.equal(x, y)


def test_sigterm_writes_a_checkpoint_and_stops(tmp_path):
    target = make_target(tmp_path / "target")
    store = FileStore(tmp_path / "store")
    make_dump(store, tmp_path)
    proc = _child(_spec(tmp_path, target, "term", delay_per_log_s=0.3, train={"epochs": 6, "save_every_steps": 1000}))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.time() + 120  # imports and the vocab count take long on a busy machine
    while not any(ln.startswith("progress ") for ln in list(lines)):
        assert proc.poll() is None and time.time() < deadline, "".join(lines)
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # training has logged a step: the handler is installed
    proc.wait(timeout=60)
    reader.join(timeout=10)
    out = "".join(lines)
    assert proc.returncode != 0 and "TrainingInterrupted" in out, out
    steps = ckpt.list_checkpoints(store, "resume-run")
    assert len(steps) == 1 and 0 < steps[0]  # written at the step it stopped (no periodic save)
    state = ckpt.load_checkpoint(store, "resume-run", steps[0])
    assert state["cursor"]["epoch"] < 6  # mid-run


def test_cuda_graphs_without_a_cuda_device_is_refused_clearly(env):
    from drafter.training.errors import TrainingError

    tmp, target, store = env
    with pytest.raises(TrainingError, match="train.cuda_graphs needs one CUDA device"):
        train_drafter(make_cfg(target, "file:///x", cuda_graphs=True), store, "dump0001", run_fingerprint="r7",
                      out_dir=tmp / "o", target_fingerprint=TARGET_FP)


def test_fp8_states_decoded_on_the_training_device_train_the_same_drafter(tmp_path, monkeypatch):
    """A CUDA trainer's packer leaves fp8 states encoded and each micro-batch is decoded on the
    device (MicroBatch.decoded); here that path is forced on the CPU: the same drafter, bit for bit,
    as the packer's own decode (the CPU trainer's path)."""
    from drafter.training import trainer
    from drafter.training.data import Packer
    from drafter.training.ttt import MicroBatch

    target = make_target(tmp_path / "target")
    store = FileStore(tmp_path / "store")
    make_dump(store, tmp_path, fp8_states=True)
    cfg = make_cfg(target, "file:///x", epochs=1)
    ref = train_drafter(cfg, store, "dump0001", run_fingerprint="packer", out_dir=tmp_path / "a",
                        target_fingerprint=TARGET_FP)
    decoded = []
    real_decoded = MicroBatch.decoded
    monkeypatch.setattr(MicroBatch, "decoded", lambda mb, device: decoded.append(mb.aux_scales is not None)
                        or real_decoded(mb, device))
    monkeypatch.setattr(trainer, "packer_for", lambda device, budget, max_length: Packer(budget, max_length,
                                                                                         decode=False))
    dev = train_drafter(cfg, store, "dump0001", run_fingerprint="device", out_dir=tmp_path / "b",
                        target_fingerprint=TARGET_FP)
    assert decoded and all(decoded)  # every micro-batch reached the step encoded
    a = load_file(str(ref.drafter_dir / "model.safetensors"))
    b = load_file(str(dev.drafter_dir / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ref.metrics_path.read_text() == dev.metrics_path.read_text()
