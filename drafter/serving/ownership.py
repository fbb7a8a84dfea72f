"""Which server processes are ours and who launched them: pid files (written by the launcher next to
the log, read from any process), the run that owns a server (`owned_by`, `owns`), whether a pid
still names the process we started (`really_ours`), and reaping: killing a server left behind by a
cancelled or dead run (`reap`, `reap_stale`) and verifying what it still holds (`TeardownReport`,
`verify_released`, shared with `ServerProcess.stop`)."""
from __future__ import annotations

import contextvars
import hashlib
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from drafter import procs
from drafter.serving.host import wait_gpu_release, wait_port_free

if TYPE_CHECKING:
    from drafter.engines import LaunchSpec


def pid_file(log_path: str | os.PathLike) -> Path:
    p = Path(log_path)
    return p.with_name(p.stem + ".pid.json")


def group_members(pgid: int, sid: int | None = None, tag: str | None = None) -> list[int]:
    """Live processes of a server: its group, its session, or carrying its tag (procs.members)."""
    return procs.members(pgid, sid, tag)


# Who launched the servers started in this context: the Prefect tasks set the flow run
# (`owned_by`), so the flows' hooks reap only their own run's servers; otherwise this process.
_owner: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("drafter_run_owner", default=None)


@contextmanager
def owned_by(**owner: Any) -> Iterator[None]:
    token = _owner.set({k: (str(v) if v is not None else None) for k, v in owner.items()})
    try:
        yield
    finally:
        _owner.reset(token)


def current_owner() -> dict[str, Any]:
    return _owner.get() or {"kind": "process", "pid": str(os.getpid())}


def owns(owner: Mapping[str, Any] | None, run_id: str) -> bool:
    """Does the run `run_id` own a server whose pid file records `owner`? (a stage's subflow run,
    or the lifecycle run it belongs to)."""
    owner = owner or {}
    return run_id in (owner.get("flow_run_id"), owner.get("root_flow_run_id"))


def port_in_use(spec: LaunchSpec) -> str:
    """Say who holds the port: one of our servers (its pid file, its run, how to reap it) or
    another process (its pid and name: never its command line, which may carry its secrets)."""
    msg = f"port {spec.port} on {spec.host} is already in use"
    for path, info in pid_files(spec.log_dir, spec.port):
        if verified_leader(info) is not None:  # a forged file does not make a process "ours"
            return (f"{msg} by our {info.get('engine')} server pid {info['pid']}, launched by "
                    f"{_owner_text(info)} (pid file {path}; stop it with "
                    f"`python -m drafter.serving.launcher reap {path}`)")
    holders = procs.port_holders(spec.port)
    if holders:
        return f"{msg} by " + ", ".join(procs.describe_pid(p) for p in holders)
    return f"{msg} (by a process of another user, or outside this machine's /proc)"


def _owner_text(info: Mapping[str, Any]) -> str:
    owner = info.get("owner") or {}
    if owner.get("flow_run_id"):
        return f"flow run {owner['flow_run_id']}"
    running = procs.alive(info.get("launcher_pid"), info.get("launcher_start_ticks"))
    return f"pid {info.get('launcher_pid')} ({'running' if running else 'gone'})"


def pid_files(log_dir: str | os.PathLike | None, port: int | None = None) -> list[tuple[Path, dict]]:
    """Our pid files in `log_dir` (for `port` only, if given), parsed; unusable ones skipped."""
    out = []
    for path in sorted(Path(log_dir or ".").glob("*.pid.json")):
        info = procs.read_pid_file(path)
        if info is not None and (port is None or info.get("port") == port):
            out.append((path, info))
    return out


def argv_digest(argv: list[str]) -> str:
    return hashlib.sha256("\0".join(argv).encode("utf-8", "surrogateescape")).hexdigest()


def really_ours(info: Mapping[str, Any]) -> bool:
    """Is the process a pid file names still the one we launched: same pid, same start time,
    same command line? (a pid the kernel handed to someone else is never touched)."""
    pid = info.get("pid")
    if not isinstance(pid, int) or info.get("start_ticks") is None or not procs.alive(pid, info.get("start_ticks")):
        return False
    argv = procs.cmdline(pid)
    return argv is not None and argv_digest(argv) == info.get("argv_sha256")


def verified_leader(info: Mapping[str, Any]) -> tuple[int, int] | None:
    """(pgid, sid) of a pid file's server as the KERNEL reports them, when its leader is verified:
    really ours (pid, start time, command line: all of which anyone can read in /proc, so they
    prove nothing alone), carrying the file's tag in its environment (owner-only, random, never on
    a command line) and in the group and session the file names. None otherwise: the file's own
    pgid / sid are never signalled on its word (a forged file named a decoy and a victim's session)."""
    tag = info.get("tag")
    if not really_ours(info) or not procs.carries_tag(info["pid"], tag):
        return None
    st = procs.proc_stat(info["pid"])
    if st is None:
        return None
    pgid, sid = int(st[2]), int(st[3])
    return (pgid, sid) if (pgid, sid) == (info.get("pgid"), info.get("sid")) else None


def reap_stale(log_dir: str | os.PathLike | None, port: int) -> list[str]:
    """Before a launch on `port`: pid files of ours whose launcher is gone. A server whose leader
    verifies (`verified_leader`) is reaped; a file whose leader is gone is reaped (what is left of it
    that carries its tag) and removed. A server whose launcher still runs, and a live process that
    does not verify, are left alone (preflight names the port's holder). Returns what was done, one
    line each."""
    notes = []
    for path, info in pid_files(log_dir, port):
        if procs.alive(info.get("launcher_pid"), info.get("launcher_start_ticks")):
            continue
        if verified_leader(info) is not None:
            result = reap(path)
            notes.append(f"reaped a server left by a dead run on port {port}: pid {info['pid']} "
                         f"({_owner_text(info)}), pid file {path}"
                         + ("" if not result.get("problems") else f"; problems: {'; '.join(result['problems'])}"))
        elif not procs.alive(info.get("pid"), info.get("start_ticks")):
            # Its leader is gone: reap stops only what still carries its tag in its group or
            # session (an orphaned child), and removes the file once nothing is left.
            result = reap(path)
            if result.get("reaped"):
                notes.append(f"reaped what was left of a server of a dead run on port {port} (leader pid "
                             f"{info.get('pid')} gone), pid file {path}"
                             + ("" if not result.get("problems") else f"; problems: {'; '.join(result['problems'])}"))
            elif not path.exists():
                notes.append(f"removed a stale pid file (server pid {info.get('pid')} gone): {path}")
        # else: the pid is alive but not verified as ours: left alone (preflight names the holder)
    return notes


@dataclass
class TeardownReport:
    signals: list[str] = field(default_factory=list)
    exit_code: int | None = None
    remaining_pids: list[int] = field(default_factory=list)
    port_released: bool | None = None
    gpu_released: bool | None = None     # None: not measurable (no nvidia-smi)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify_released(report: TeardownReport, host: str, port: int, port_timeout_s: float,
                    gpu_baseline: dict[str, Any] | None, env: Mapping[str, str], gpu_timeout_s: float,
                    gpu_tolerance_mib: float = 1024.0) -> None:
    """After the kill: record in `report` what the server still holds (processes, port, GPU memory)."""
    if report.remaining_pids:
        report.problems.append(f"processes still alive after SIGKILL: {report.remaining_pids}")
    report.port_released = wait_port_free(host, port, port_timeout_s)
    if not report.port_released:
        holders = procs.port_holders(port)
        by = (" by " + ", ".join(procs.describe_pid(p) for p in holders)) if holders else ""
        report.problems.append(f"port {port} still in use{by} {port_timeout_s:.0f}s after stop")
    report.gpu_released, gpu_problem = wait_gpu_release(gpu_baseline, env, gpu_timeout_s, gpu_tolerance_mib)
    if gpu_problem:
        report.problems.append(gpu_problem)


def reap(pid_path: str | os.PathLike, grace_s: float = 10.0, kill_wait_s: float = 5.0,
         port_timeout_s: float = 10.0, gpu_timeout_s: float = 60.0) -> dict[str, Any]:
    """Kill a server left behind by a cancelled run, from any process (e.g. Prefect's
    on_cancellation hook, which runs elsewhere). Safe to call twice or on a stale file."""
    t0 = time.monotonic()
    path = Path(pid_path)
    info = procs.read_pid_file(path)
    try:
        pid, port = int(info["pid"]), int(info["port"])
        recorded_pgid, recorded_sid = int(info["pgid"]), int(info["sid"])
    except (TypeError, KeyError, ValueError):
        return {"reaped": False, "reason": f"no usable pid file: {path} (missing, not a regular file of this "
                                           f"user, or not a pid file of ours)"}
    tag = info.get("tag")
    # Only processes verified as this server's are ever signalled, never on the file's word:
    kernel = verified_leader(info)
    if kernel is not None:
        # the leader is ours: its group and session as the kernel has them, and the tag it carries
        pgid, sid, tagged_only = *kernel, False
    elif procs.alive(pid, info.get("start_ticks")):
        # a live process that is not what the file says: a forged file, or a server that rewrote its
        # command line or environment. Nothing is signalled; a person decides.
        return {"reaped": False, "reason": f"pid {pid} is alive but is not the server this pid file "
                                           f"describes (start time, command line, tag, group or session "
                                           f"differ): nothing signalled",
                "problems": [f"pid file {path} does not match pid {pid}: left alone"]}
    else:
        # the leader is gone (its pid may be reused): only processes carrying the tag AND in the
        # recorded group or session (a pid is not reused while it names a group or session)
        pgid, sid, tagged_only = recorded_pgid, recorded_sid, True
    left_now = procs.members(pgid, sid, tag, tagged_only=tagged_only)
    if not left_now:
        holders = procs.port_holders(port)
        if holders:  # nothing of ours found, yet something listens: say so, never "gone"
            return {"reaped": False, "reason": f"no process of this server found, but port {port} is "
                                               f"held by " + ", ".join(procs.describe_pid(p) for p in holders),
                    "problems": [f"port {port} still in use"]}
        procs.remove_pid_file(path, tag)
        return {"reaped": False, "reason": "server already gone"}
    signals, left = procs.terminate(pgid, sid, grace_s, kill_wait_s, tag, tagged_only=tagged_only)
    report = TeardownReport(signals=signals, remaining_pids=left)
    env = dict(os.environ)
    if info.get("cuda_visible_devices") is not None:
        env["CUDA_VISIBLE_DEVICES"] = info["cuda_visible_devices"]
    verify_released(report, info.get("host", "127.0.0.1"), port, port_timeout_s,
                    info.get("gpu_baseline"), env, gpu_timeout_s)
    report.seconds = round(time.monotonic() - t0, 3)
    if report.ok:
        procs.remove_pid_file(path, tag)
    return {"reaped": True, **report.to_dict()}
