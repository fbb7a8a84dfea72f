"""The processes of a server (or of torchrun and its ranks): find them, signal them, and end them
when their launcher dies.

Standard library only: the watchdog (`python -m drafter.procs watch ...`) runs this module
alone, so it starts in a few milliseconds and never imports the project's heavy dependencies.

A server's processes are its process group, its session, and every process whose environment
carries the server's tag (`DRAFTER_SERVER_TAG`, set at launch and inherited by every descendant):
the tag finds a child that left the session (`setsid -f`, a daemonising script), which a
process-group kill would miss. A process that clears its environment escapes it (a documented
limit). The tag is also what proves a process is ours (`carries_tag`, ownership.reap): it is
random and only where its owner can read it (environments, 0600 pid files), never on a command line.

The watchdog: the launcher starts it next to the server with the read end of a pipe whose write
end only the launcher holds. When the launcher dies, by any signal including SIGKILL, the kernel
closes the write end, the watchdog reads EOF and ends the server (SIGTERM, a grace period,
SIGKILL). A normal teardown closes the pipe after the server is gone, and the watchdog finds
nothing to do. `Watchdog` starts one (the train stage's torchrun launch uses it). Limit: a child
the launcher forks without exec (multiprocessing's fork) holds a copy of the write end, so the
watchdog fires only once that child is gone too.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

TAG_VAR = "DRAFTER_SERVER_TAG"
_WATCH_TAG_VAR = "DRAFTER_WATCH_TAG"  # how the watchdog gets the tag (not TAG_VAR: it would find itself)


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


def carries_tag(pid: int, tag: str | None) -> bool:
    """Does `pid` really carry our server tag in its environment? /proc/<pid>/environ is readable
    by the process's owner only, and the tag is random and never on a command line, so another
    user can neither read it nor plant it in a process of ours."""
    return bool(tag) and _has_tag(pid, f"{TAG_VAR}={tag}".encode())


def members(pgid: int, sid: int | None = None, tag: str | None = None, *, tagged_only: bool = False) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`, session `sid`, or carrying `tag`.
    Zombies hold no memory or ports, so they do not count as left behind. `tagged_only`: only
    processes that carry `tag` AND are in the group or session (what a pid file whose leader is
    gone may name: the file's group and session alone prove nothing)."""
    if tagged_only and not tag:
        return []
    if not os.path.isdir("/proc"):
        if tagged_only:  # no environ to check the tag in: nothing is provably ours
            return []
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
        in_server = int(st[2]) == pgid or (sid is not None and int(st[3]) == sid)
        if tagged_only:
            if in_server and _has_tag(pid, marker):
                out.append(pid)
        elif in_server or (marker and _has_tag(pid, marker)):
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
              reap_leader: Callable[[], None] = lambda: None, *,
              tagged_only: bool = False) -> tuple[list[str], list[int]]:
    """SIGTERM every member, wait `grace_s`, SIGKILL what is left, wait `kill_wait_s`.
    Returns (signals sent, pids still alive). `tagged_only` (see `members`): each verified pid is
    signalled on its own, never the whole group (which may hold processes that are not ours)."""
    sent: list[str] = []
    group = -1 if tagged_only else pgid

    def find() -> list[int]:
        return members(pgid, sid, tag, tagged_only=tagged_only)

    def wait(seconds: float) -> list[int]:
        deadline = time.monotonic() + seconds
        while True:
            reap_leader()
            left = find()
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)

    left = find()
    if not left:
        return sent, []
    try:
        signal_all(group, left, signal.SIGTERM)
        sent.append("SIGTERM")
        left = wait(grace_s)
    finally:
        # Even when interrupted (a second Ctrl-C) nothing of the server may survive.
        if left:
            signal_all(group, find(), signal.SIGKILL)
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
    """`pid N (name)`: the kernel's short name of the process, never its command line. A holder's
    arguments may carry its secrets (`--api-key ...`, a token as a plain argument) and this text
    ends up in error messages, Prefect state messages and the bench's committed failure records;
    `ps -o args= -p N` shows the rest to whoever may see it."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        name = ""
    return f"pid {pid} ({name})" if name else f"pid {pid}"


def read_pid_file(path: str | os.PathLike) -> dict | None:
    """A pid file's content, or None unless it is a regular file of this user, read without
    following a link: anyone who can write into a shared log directory could plant the rest.
    Even then its content is a claim, checked against the kernel before anything is signalled
    (drafter.serving.ownership.verified_leader)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                return None
            info = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def remove_pid_file(path: str | os.PathLike, tag: str | None) -> bool:
    """Remove a server's pid file only if it still is that server's (`read_pid_file` of it names
    `tag`): a teardown never deletes another server's pid file."""
    info = read_pid_file(path)
    if not tag or info is None or info.get("tag") != tag:
        return False
    Path(path).unlink(missing_ok=True)
    return True


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
            remove_pid_file(pid_file, tag)


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
            # The tag goes in its environment (owner-only), never its command line (world-readable
            # in /proc): the tag is what proves a process is our server (ownership.reap).
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "drafter.procs", "watch", str(read_fd), str(pgid),
                 str(sid), str(grace_s), pid_file],
                pass_fds=(read_fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                env={**os.environ, _WATCH_TAG_VAR: tag},
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
    if len(argv) != 6 or argv[0] != "watch":
        print("usage: DRAFTER_WATCH_TAG=TAG python -m drafter.procs watch FD PGID SID GRACE_S PID_FILE "
              "(PID_FILE '': none)", file=sys.stderr)
        return 2
    _, fd, pgid, sid, grace, pid_file = argv
    tag = os.environ.pop(_WATCH_TAG_VAR, "") or None
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the launcher is not for us
    watch(int(fd), int(pgid), int(sid), tag, float(grace), pid_file)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
