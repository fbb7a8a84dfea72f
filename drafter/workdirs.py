"""Local scratch folders that a dead run does not leave behind, and one run per output per host.

A stage's scratch folder is named after the stage, its output fingerprint and its owner (pid and
start time): `<tmp>/drafter-<stage>-<fp>-<pid>.<ticks>-*`. `kill -9` skips the cleanup, so the next
run of the same output removes the folders whose owner is gone (never a live run's), and says so.

The output lock (`OutputLock`, `output_lock`): a run of output `<stage>/<fp>` holds an flock on
`<tmp>/drafter-<stage>-<fp>.lock` (beside its scratch folders) from before it plans to its commit.
The rule, once for every stage that takes it (the skeleton for datagen and dump, waiting;
drafter.training.workdir for train, refusing):
- a second run of the same output on this host either waits for the holder (`wait=True`: it then
  finds the output committed and skips it, or, if the holder failed, resumes after its shards) or
  is refused at once (`OutputBusy`, naming the holder's pid, host and the lock file);
- the kernel releases an flock when every holder is gone, even by kill -9: a dead run never blocks;
- the lock file is opened with O_CREAT | O_NOFOLLOW, mode 0600, and used only when it is a plain
  file of ours with one link: a symlink, FIFO, hard link or another user's file planted at its name
  in the shared temp directory is refused by name (`UnsafeLockFile`), never followed, truncated or
  written. The file stays after the run (a few bytes): removing it could let two runs lock two
  different files of the same name.
Limits: per host and per temp directory (TMPDIR): runs on two machines sharing a store are not
serialised (the skeleton then reports the loser's output as complete, drafter.stages.base).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from drafter.errors import DrafterError
from drafter import procs

log = logging.getLogger(__name__)


def _prefix(stage: str, fp: str) -> str:
    return f"drafter-{stage}-{fp}-"


def remove_dead_runs_dirs(stage: str, fp: str, root: str | None = None) -> list[Path]:
    """Remove the scratch folders of `stage`/`fp` whose owning process is gone."""
    removed = []
    owner = re.compile(re.escape(_prefix(stage, fp)) + r"(\d+)\.(\d+)-")
    for path in sorted(Path(root or tempfile.gettempdir()).glob(_prefix(stage, fp) + "*")):
        m = owner.match(path.name)
        if m and path.is_dir() and not procs.alive(int(m[1]), int(m[2])):
            shutil.rmtree(path, ignore_errors=True)
            log.warning("removed %s: the scratch folder of a %s run of %s that died", path, stage, fp)
            removed.append(path)
    return removed


@contextmanager
def scratch_dir(stage: str, fp: str, root: str | None = None) -> Iterator[Path]:
    """A scratch folder for one run of `stage`/`fp`, removed afterwards; dead runs' folders first."""
    remove_dead_runs_dirs(stage, fp, root)
    me = f"{os.getpid()}.{procs.start_ticks(os.getpid())}"
    with tempfile.TemporaryDirectory(prefix=f"{_prefix(stage, fp)}{me}-", dir=root) as path:
        yield Path(path)


# ------------------------------------------------------------------------------- the output lock


class UnsafeLockFile(DrafterError):
    """The lock file's name is taken by something that is not a plain file of ours (a symlink, a
    FIFO, a hard link, another user's file), or cannot be opened: refused, never followed. A person
    must look (it may have been planted): not retried."""


class OutputBusy(DrafterError):
    """Another live run on this host holds the output's lock (the refusing mode). A later attempt
    finds the output committed (and skips it) or the lock free."""

    retryable = True

    def __init__(self, message: str, path: Path, holder: dict):
        super().__init__(message)
        self.path, self.holder = path, holder

    def __reduce__(self):
        return (type(self), (str(self), self.path, self.holder), self.__dict__)


def lock_path(stage: str, fp: str, root: str | None = None) -> Path:
    return Path(root or tempfile.gettempdir()) / f"drafter-{stage}-{fp}.lock"


def open_lock_file(path: Path) -> int:
    """Open (create, mode 0600) the lock file `path` for reading and writing without following a
    symlink or blocking on a FIFO; refuse anything but a plain file of ours with one link."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafeLockFile(f"lock file {path} is a symbolic link (to {_link_target(path)}): refusing to follow "
                                 f"it; remove the link (it may have been planted) and run again") from None
        raise UnsafeLockFile(f"cannot open lock file {path}: {err.strerror or err} (another user's file, or an "
                             f"unwritable temp directory: remove it, or set TMPDIR)") from None
    try:
        st = os.fstat(fd)
        what = ("not a regular file" if not stat.S_ISREG(st.st_mode)
                else f"owned by uid {st.st_uid}, not by us (uid {os.geteuid()})" if st.st_uid != os.geteuid()
                else f"a file with {st.st_nlink} hard links" if st.st_nlink != 1 else None)
        if what:
            raise UnsafeLockFile(f"lock file {path} is {what}: refusing to use it; remove it (it may have been "
                                 f"planted) and run again")
        if stat.S_IMODE(st.st_mode) != 0o600:  # ours, made wider by someone: narrow it back
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def read_holder(fd: int) -> dict:
    """What the holder wrote about itself (empty: it has not written yet, or an older format)."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (ValueError, OSError):
        return {}
    return holder if isinstance(holder, dict) else {}


def describe_holder(holder: dict) -> str:
    """`pid 123 on host since 2026-...` (or `another process` when it has not said who it is)."""
    pid = holder.get("pid")
    return f"pid {pid} on {holder.get('host')} since {holder.get('since')}" if pid else "another process"


class OutputLock:
    """The lock of one output (`<stage>/<fp>`) on this host. `acquire` returns its fd (a child
    process handed it keeps the lock held: torchrun's ranks); `release` lets it go."""

    REMIND_EVERY_S = 600.0  # a waiting run repeats its line this often (and when the holder changes)

    def __init__(self, stage: str, fp: str, root: str | None = None):
        self.stage, self.fp = stage, fp
        self.path = lock_path(stage, fp, root)
        self.fd: int | None = None

    def acquire(self, wait: bool, on_wait: Callable[[dict, Path, float], None] | None = None,
                poll_s: float = 0.5) -> int:
        """Take the lock. Held by a live run: with `wait`, poll until it is free, calling
        `on_wait(holder, path, waited_s)` first and whenever the holder changes (and every
        REMIND_EVERY_S); without, raise OutputBusy naming the holder."""
        fd = open_lock_file(self.path)
        try:
            started, told, told_at = time.monotonic(), None, 0.0
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holder = read_holder(fd)
                    if not wait:
                        raise OutputBusy(f"{self.stage} output {self.fp} is being computed by "
                                         f"{describe_holder(holder)} (lock {self.path})", self.path, holder) from None
                    now = time.monotonic()
                    who = (holder.get("pid"), holder.get("start_ticks"))
                    if on_wait is not None and (told is None or who != told or now - told_at >= self.REMIND_EVERY_S):
                        if who != (None, None) or now - started > 2.0:  # give a new holder time to say who it is
                            on_wait(holder, self.path, now - started)
                            told, told_at = who, now
                    time.sleep(poll_s)
            me = {"pid": os.getpid(), "start_ticks": procs.start_ticks(os.getpid()), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stage": self.stage, "fingerprint": self.fp}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return fd

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)  # releases the lock (unless a child process still holds the descriptor)


@contextmanager
def output_lock(stage: str, fp: str, *, wait: bool, on_wait: Callable[[dict, Path, float], None] | None = None,
                root: str | None = None, poll_s: float = 0.5) -> Iterator[int]:
    """Hold the lock of output `stage`/`fp` (yields its fd); see OutputLock.acquire."""
    lock = OutputLock(stage, fp, root)
    fd = lock.acquire(wait, on_wait, poll_s)
    try:
        yield fd
    finally:
        lock.release()
