"""The processes of a server (or of torchrun and its ranks): find them, signal them, and end them
when their launcher dies.

Standard library only: the watchdog (`python -m drafter.serving.procs watch ...`) runs this module
alone, so it starts in a few milliseconds and never imports the project's heavy dependencies.

A server's processes are its process group, its session, and every process whose environment
carries the server's tag (`DRAFTER_SERVER_TAG`, set at launch and inherited by every descendant):
the tag finds a child that left the session (`setsid -f`, a daemonising script), which a
process-group kill would miss. A process that clears its environment escapes it (a documented
limit).

The watchdog: the launcher starts it next to the server with the read end of a pipe whose write
end only the launcher holds. When the launcher dies, by any signal including SIGKILL, the kernel
closes the write end, the watchdog reads EOF and ends the server (SIGTERM, a grace period,
SIGKILL). A normal teardown closes the pipe after the server is gone, and the watchdog finds
nothing to do. `Watchdog` starts one (the train stage's torchrun launch uses it). Limit: a child
the launcher forks without exec (multiprocessing's fork) holds a copy of the write end, so the
watchdog fires only once that child is gone too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

TAG_VAR = "DRAFTER_SERVER_TAG"


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0], ppid [1], pgrp [2],
    session [3], starttime [19]); None when the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()


def start_ticks(pid: int) -> int | None:
    st = proc_stat(pid)
    return int(st[19]) if st else None


def alive(pid: int | None, ticks: int | None) -> bool:
    """Is `pid` still the process that started at `ticks` (not a reused pid, not a zombie)?"""
    if not pid:
        return False
    st = proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return ticks is None or int(st[19]) == ticks


def cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0")[:-1]]


def _has_tag(pid: int, tag: bytes) -> bool:
    try:
        return tag in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # another user's process, or gone
        return False


def members(pgid: int, sid: int | None = None, tag: str | None = None) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`, session `sid`, or carrying `tag`.
    Zombies hold no memory or ports, so they do not count as left behind."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    marker = f"{TAG_VAR}={tag}".encode() if tag else None
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        st = proc_stat(pid)
        if st is None or st[0] in ("Z", "X"):
            continue
        if int(st[2]) == pgid or (sid is not None and int(st[3]) == sid) or (marker and _has_tag(pid, marker)):
            out.append(pid)
    return sorted(out)


def signal_all(pgid: int, pids: list[int], sig: int) -> None:
    """`sig` to group `pgid` (when > 1: never the whole system) and to each of `pids`."""
    if pgid > 1:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:  # members that left the group
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def terminate(pgid: int, sid: int | None, grace_s: float, kill_wait_s: float, tag: str | None = None,
              reap_leader: Callable[[], None] = lambda: None) -> tuple[list[str], list[int]]:
    """SIGTERM every member, wait `grace_s`, SIGKILL what is left, wait `kill_wait_s`.
    Returns (signals sent, pids still alive)."""
    sent: list[str] = []

    def wait(seconds: float) -> list[int]:
        deadline = time.monotonic() + seconds
        while True:
            reap_leader()
            left = members(pgid, sid, tag)
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)

    left = members(pgid, sid, tag)
    if not left:
        return sent, []
    try:
        signal_all(pgid, left, signal.SIGTERM)
        sent.append("SIGTERM")
        left = wait(grace_s)
    finally:
        # Even when interrupted (a second Ctrl-C) nothing of the server may survive.
        if left:
            signal_all(pgid, members(pgid, sid, tag), signal.SIGKILL)
            sent.append("SIGKILL")
    if "SIGKILL" in sent:
        left = wait(kill_wait_s)
    return sent, left


# ---- who holds a TCP port (Linux /proc/net/tcp*)

def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            # local_address is HEXIP:HEXPORT; state 0A = LISTEN
            if len(parts) > 9 and int(parts[1].rsplit(":", 1)[1], 16) == port and parts[3] == "0A":
                inodes.add(parts[9])
    return inodes


def port_holders(port: int) -> list[int]:
    """Pids of this user's processes listening on `port` ([] when unknown, e.g. another user's)."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port)}
    if not inodes:
        return []
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                    out.append(int(entry))
                    break
            except OSError:
                continue
    return sorted(out)


def describe_pid(pid: int) -> str:
    argv = cmdline(pid) or []
    shown = " ".join(argv)[:120]
    return f"pid {pid} ({shown})" if shown else f"pid {pid}"


# ---- the watchdog

def watch(fd: int, pgid: int, sid: int | None, tag: str | None, grace_s: float,
          pid_file: str | None = None) -> None:
    """Block until the launcher's end of the pipe closes, then end whatever is left of the server
    and, once nothing is left, remove its pid file (nothing for a hook to reap)."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    left = members(pgid, sid, tag)
    if left:
        _say(f"drafter watchdog: launcher gone, stopping server processes {left}")
        _, left = terminate(pgid, sid, grace_s, 5.0, tag)
        if not left and pid_file:
            Path(pid_file).unlink(missing_ok=True)


def _say(line: str) -> None:
    """Best effort: our stderr is the launcher's, often a pipe to a process that died with it (a
    stopped Prefect worker). A write there raises BrokenPipeError, which must not stop the watchdog
    before it ends the server."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


class Watchdog:
    """The launcher's side: starts `watch` for group `pgid` / session `sid` / `tag` right after
    those processes started; `close()` once they are gone (a normal end: nothing left to do)."""

    def __init__(self, pgid: int, sid: int, tag: str, grace_s: float = 10.0, pid_file: str = ""):
        self.grace_s = grace_s
        read_fd, write_fd = os.pipe()  # both non-inheritable; pass_fds hands the read end over
        try:
            # Its own session: whatever ends the launcher's group (Prefect, a terminal) spares it.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "drafter.serving.procs", "watch", str(read_fd), str(pgid),
                 str(sid), tag, str(grace_s), pid_file],
                pass_fds=(read_fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True, cwd=Path(__file__).resolve().parents[2])
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self._fd: int | None = write_fd

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self, wait_s: float | None = None) -> None:
        """EOF to the watchdog; wait while it ends what is left (default: its grace, then SIGKILL)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            self.proc.wait(timeout=self.grace_s + 15 if wait_s is None else wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Watchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str]) -> int:
    if len(argv) != 7 or argv[0] != "watch":
        print("usage: python -m drafter.serving.procs watch FD PGID SID TAG GRACE_S PID_FILE "
              "(PID_FILE '': none)", file=sys.stderr)
        return 2
    _, fd, pgid, sid, tag, grace, pid_file = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the launcher is not for us
    watch(int(fd), int(pgid), int(sid), tag, float(grace), pid_file)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
