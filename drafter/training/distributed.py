"""One process, or several under torchrun: DDP (replicas) or FSDP2 (sharded parameters).

Ranks split each optimizer step's micro-batches (rank r takes r, r + W, ...), so the global batch
and the trained result do not depend on the number of processes. gloo on CPU (CI runs two
processes), NCCL on GPU. `torchrun_command` builds the launch for `train.nproc_per_node > 1`.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.active:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def any(self, flag: bool) -> bool:
        if not self.active:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.active:
            dist.barrier()


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device(f"cuda:{local_rank}")
    return dev


def init(device_name: str = "auto") -> Dist:
    """Join the torchrun group when WORLD_SIZE > 1 (env://), else a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend)
    if world > 1:
        return Dist(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local, device=device)
    return Dist(device=device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, d: Dist, parallel: str, compute_dtype: torch.dtype) -> torch.nn.Module:
    """DDP or FSDP2 around the drafter (unchanged in a single process)."""
    if not d.active:
        return model
    if parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        fully_shard(model, mp_policy=mp)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [d.device.index] if d.device.type == "cuda" else None
    # find_unused_parameters: a rank whose micro-batch has no loss at some step leaves lm_head unused
    return DDP(model, device_ids=ids, find_unused_parameters=True)


def torchrun_command(nproc_per_node: int, module_argv: list[str], env: dict[str, str] | None = None,
                     master_port: int | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that run `python -m <module_argv...>` on `nproc_per_node` local
    processes. The environment is the current one plus `env` (the configuration's launch
    variables, e.g. NCCL_*), and OMP_NUM_THREADS split across the processes unless given."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}"]
    if master_port is not None:
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc_per_node}",
                "--master_addr=127.0.0.1", f"--master_port={master_port}"]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    full_env.update(env or {})
    return argv + ["-m", *module_argv] if module_argv and module_argv[0] != "-m" else argv + module_argv, full_env
