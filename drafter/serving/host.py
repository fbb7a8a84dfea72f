"""What this host says about a server's resources: can a port be bound, what GPU memory is used and by
which compute processes (nvidia-smi), and waiting for a stopped server to give a port and its GPU
memory back (field note 1: one GPU kept 76 GB after kill -9)."""
from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import time
from typing import Any, Mapping


def port_free(host: str, port: int) -> bool:
    """Can a server bind host:port? SO_REUSEADDR like uvicorn, so TIME_WAIT does not count."""
    bind_host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _nvidia_smi(*query: str, timeout: float = 20.0) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        res = subprocess.run([exe, *query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def _mib(text: str) -> float | None:
    text = text.strip().removesuffix("MiB").strip()
    try:
        return float(text)
    except ValueError:  # "[N/A]" on some drivers
        return None


def parse_compute_apps(text: str) -> list[dict[str, Any]]:
    """Rows of `nvidia-smi --query-compute-apps=pid,used_memory[,gpu_uuid] --format=csv,noheader`."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        rows.append({"pid": int(parts[0]), "used_mib": _mib(parts[1]),
                     "gpu_uuid": parts[2] if len(parts) > 2 else None})
    return rows


def parse_gpu_memory(text: str) -> dict[str, dict[str, Any]]:
    """`--query-gpu=index,uuid,memory.used` -> {index: {"uuid", "used_mib"}}."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            out[parts[0]] = {"uuid": parts[1], "used_mib": _mib(parts[2])}
    return out


def _visible_gpus(env: Mapping[str, str], gpus: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The GPUs the server will see (CUDA_VISIBLE_DEVICES holds indices or UUIDs)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() == "":
        return gpus if visible is None else {}
    wanted = {v.strip() for v in visible.split(",") if v.strip()}
    return {i: g for i, g in gpus.items() if i in wanted or g["uuid"] in wanted}


def gpu_state(env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """Memory per visible GPU and the compute processes on them; None without nvidia-smi."""
    mem = _nvidia_smi("--query-gpu=index,uuid,memory.used")
    if mem is None:
        return None
    gpus = _visible_gpus(env if env is not None else os.environ, parse_gpu_memory(mem))
    uuids = {g["uuid"] for g in gpus.values()}
    apps_text = _nvidia_smi("--query-compute-apps=pid,used_memory,gpu_uuid") or ""
    apps = [a for a in parse_compute_apps(apps_text) if a["gpu_uuid"] is None or a["gpu_uuid"] in uuids]
    return {"gpus": gpus, "apps": apps}


def wait_port_free(host: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if port_free(host, port):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def wait_gpu_release(baseline: dict[str, Any] | None, env: Mapping[str, str], timeout_s: float,
                     tolerance_mib: float = 1024.0) -> tuple[bool | None, str | None]:
    """Wait until every visible GPU's used memory is back within `tolerance_mib` of the
    baseline taken before launch. Memory, not the process list: a killed process can vanish
    from nvidia-smi while its memory stays held (field note 1). (None, None) if not measurable."""
    if baseline is None:
        return None, None
    deadline = time.monotonic() + timeout_s
    while True:
        now = gpu_state(env)
        if now is None:
            return None, None
        held = {}
        for index, gpu in now["gpus"].items():
            before = baseline["gpus"].get(index, {}).get("used_mib")
            used = gpu["used_mib"]
            if before is not None and used is not None and used > before + tolerance_mib:
                held[index] = (used, before)
        if not held:
            return True, None
        if time.monotonic() >= deadline:
            detail = ", ".join(f"GPU {i}: {u:.0f} MiB used (was {b:.0f} MiB before launch)"
                               for i, (u, b) in sorted(held.items()))
            return False, f"GPU memory not released {timeout_s:.0f}s after stop: {detail}"
        time.sleep(1.0)
