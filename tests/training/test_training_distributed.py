"""Two processes under torchrun (gloo, CPU) train what one process trains on the same global batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafter.store import FileStore
from drafter.training.distributed import torchrun_command
from tests.fixtures.net import free_port
from tests.fixtures.training_data import make_dump, make_target

REPO = Path(__file__).resolve().parents[2]


def _run(tmp: Path, target: Path, name: str, nproc: int, parallel: str) -> Path:
    spec = {"target": str(target), "store": str(tmp / "store"), "dump": "dump0001", "run": f"run-{name}",
            "out": str(tmp / name), "train": {"epochs": 2, "parallel": parallel}}
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    module = ["tests.fixtures.training_data", str(path)]
    env_extra = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        argv, env = [sys.executable, "-m", *module], {**os.environ, **env_extra}
    else:
        argv, env = torchrun_command(nproc, module, env_extra, master_port=free_port())
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return tmp / name


def test_torchrun_command_carries_the_launch_environment():
    argv, env = torchrun_command(4, ["drafter.some_module", "--x"], {"NCCL_PROTO": "LL"})
    assert argv[1:3] == ["-m", "torch.distributed.run"] and "--nproc_per_node=4" in argv
    assert argv[-3:] == ["-m", "drafter.some_module", "--x"]
    assert env["NCCL_PROTO"] == "LL" and "OMP_NUM_THREADS" in env


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one(tmp_path, parallel):
    """Same global batch (2 micro-batches per step): rank r takes micro-batch r. Float sums are
    reduced in another order, so weights agree to float32 rounding, not bit for bit."""
    target = make_target(tmp_path / "target")
    make_dump(FileStore(tmp_path / "store"), tmp_path)
    one = _run(tmp_path, target, "one", 1, parallel)
    two = _run(tmp_path, target, "two", 2, parallel)
    a = load_file(str(one / "drafter" / "model.safetensors"))
    b = load_file(str(two / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k
    ma = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    for ra, rb in zip(ma, mb):
        assert ra["mask_positions"] == rb["mask_positions"]
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4)
    meta = json.loads((two / "result.json").read_text())
    assert meta["world_size"] == 2 and meta["parallel"] == parallel
