"""Start a server process, watch its log, and tear it down completely.

- `preflight` refuses a launch that cannot work (port taken, model missing, disk full, GPUs busy)
  before the 5-20 minute start is paid (field note 7).
- `launch` starts the server in its own session (so a cancelled flow's process-group kill does
  not reach it, and ours does), streams every log line to a file and a callback, tracks start-up
  phases, and saves the launch spec (argv, env diff, cwd) next to the log (field note 2) plus a
  pid file that `reap` can use from another process (Prefect's on_cancellation hook).
- `ServerProcess.stop` SIGTERMs the whole group, SIGKILLs what is left, and then VERIFIES:
  no process of the group/session, the port free again, GPU memory back near where it was
  (field note 1: one GPU kept 76 GB after kill -9).

Pid files, run ownership and reaping are drafter.serving.ownership; port and GPU state are
drafter.serving.host. `python -m drafter.serving.launcher reap PIDFILE` stays here for shells and hooks.
"""
from __future__ import annotations

import collections
import datetime as dt
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from drafter.config import LifecycleConfig
from drafter.secrets import Redactor, mask_env, redact_argv, redact_obj, secret_values
from drafter import procs
from drafter.engine_registry import make_engine
from drafter.engines.base import Engine, LaunchSpec
from drafter.server_errors import ServerConfigError, TeardownError
from drafter.serving.host import gpu_state, port_free
from drafter.serving.ownership import (TeardownReport, argv_digest, current_owner, pid_file, port_in_use, reap,
                                       verify_released)

OnLine = Callable[[str], None]


class ServerLine(str):
    """A line the server process wrote, as `on_line` receives it: a caller that mixes it with its
    own lines (the Prefect stage task) can tell them apart and mark only the server's."""
_MAX_LINE = 1 << 20



def ensure_log_dir(path: str | os.PathLike) -> Path:
    """The log directory, created owner-only (0700) when missing. An existing one is used as it
    is, a link to it included (`runs/logs` -> a bigger disk is the user's choice): safety in a
    shared directory comes from how each file is created (`create_private`) and read
    (`procs.read_pid_file`), not from the directory."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    return Path(path)


def create_private(path: Path) -> int:
    """Create a NEW file only its owner can read (launch details, pid files, server logs) and
    return its descriptor. O_EXCL|O_NOFOLLOW: a name that already exists (a file, or a link planted
    in a shared log directory to make us overwrite and re-mode a file elsewhere) is an error, never
    reused or followed."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        raise ServerConfigError(f"cannot create {path}: {err.strerror} (server logs, launch records and pid "
                                f"files are always new files, never reused or followed through a link)",
                                phase="launch") from None
    os.fchmod(fd, 0o600)  # exactly owner-only whatever the umask
    return fd


def launch_file(log_path: str | os.PathLike) -> Path:
    p = Path(log_path)
    return p.with_name(p.stem + ".launch.json")


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


_start_ticks = procs.start_ticks  # recorded in the pid file


# --------------------------------------------------------------------------------------------
# Preflight
# --------------------------------------------------------------------------------------------

def _looks_local(path: str) -> bool:
    """A local path rather than a hub id like `org/name`: absolute, ./ or ~, or its parent
    directory exists here (`runs/target` is local, `meta-llama/Llama-3.1-8B` is not)."""
    if path.startswith(("/", ".", "~")) or os.path.exists(path):
        return True
    parent = os.path.dirname(path)
    return parent != "" and os.path.isdir(parent)


# Locates `pkg.sub.mod` without importing anything (an engine's __init__ alone can take seconds):
# the top level through the normal finders (editable installs use their own), the rest by path.
_FIND_MODULE = """
import importlib.machinery, importlib.util, sys
top, *subs = sys.argv[1].split(".")
spec = importlib.util.find_spec(top)
for name in subs:
    if spec is None or not spec.submodule_search_locations:
        sys.exit(1)
    spec = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
sys.exit(0 if spec is not None else 1)
"""


def _python_module_missing(spec: LaunchSpec) -> str | None:
    """For `python -m pkg.mod ...`: can that interpreter find the module?"""
    argv = spec.argv
    if len(argv) < 3 or argv[1] != "-m":
        return None
    try:
        res = subprocess.run([argv[0], "-c", _FIND_MODULE, argv[2]], env=spec.env, cwd=spec.cwd,
                             capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"cannot run {argv[0]}: {err}"
    return None if res.returncode == 0 else f"python module {argv[2]!r} not found for {argv[0]}"


def _not_a_drafter(path: Path) -> str | None:
    """Why `path` cannot be a drafter directory (config.json and safetensors weights), or None."""
    if not path.is_dir():
        return f"draft path is not a directory: {path}"
    if not (path / "config.json").is_file():
        return f"draft path {path} is not a drafter: it has no config.json"
    if not any(path.glob("*.safetensors")):
        return f"draft path {path} is not a drafter: it has no *.safetensors weights"
    return None


def preflight(spec: LaunchSpec, cfg: LifecycleConfig | None = None, *, min_free_disk_gb: float = 1.0,
              check_gpus: bool | None = None, engine: Engine | None = None) -> list[str]:
    """Checks that fail in seconds instead of after a 20-minute start. Raises ONE
    ServerConfigError listing every problem (`.problems`); returns informational notes. The
    engine's own rules come from `engine` (default: the registry's engine named by the spec)."""
    engine = engine if engine is not None else make_engine(spec.engine)
    problems: list[str] = []
    notes: list[str] = []

    if not port_free(spec.host, spec.port):
        problems.append(port_in_use(spec))

    for what, path in (("model path", spec.model_path), ("draft path", spec.draft_path)):
        if path and _looks_local(path) and not os.path.exists(os.path.expanduser(path)):
            problems.append(f"{what} does not exist: {path}")
    local_draft = spec.draft_path and _looks_local(spec.draft_path) and os.path.exists(os.path.expanduser(spec.draft_path))
    if local_draft and engine.checks_draft_dir:  # a user's own server may take another draft format
        if (problem := _not_a_drafter(Path(spec.draft_path).expanduser())) is not None:
            problems.append(problem)

    exe = spec.argv[0] if spec.argv else ""
    if not exe or shutil.which(exe, path=spec.env.get("PATH")) is None:
        problems.append(f"executable not found: {exe!r}")
    else:
        missing = _python_module_missing(spec)
        if missing:
            problems.append(missing)

    log_dir = Path(spec.log_dir or ".")
    try:
        ensure_log_dir(log_dir)
        free_gb = shutil.disk_usage(log_dir).free / 2**30
        if free_gb < min_free_disk_gb:
            problems.append(f"only {free_gb:.2f} GB free in {log_dir} (need {min_free_disk_gb} GB for logs)")
    except OSError as err:
        problems.append(f"log directory {log_dir} is not usable: {err}")

    on_cpu = cfg is not None and engine.runs_without_gpu(cfg.serve)
    if check_gpus is None:
        check_gpus = not on_cpu
    if check_gpus:
        state = gpu_state(spec.env)
        if state is None:
            notes.append("nvidia-smi not available: GPU occupancy not checked")
        else:
            # This process itself may hold GPU memory (train / export ran earlier in the same flow
            # run): that is the launcher, not a competing server.
            me = [a for a in state["apps"] if a["pid"] == os.getpid()]
            others = [a for a in state["apps"] if a["pid"] != os.getpid()]
            if me:
                notes.append(f"this process (pid {os.getpid()}) holds GPU memory: "
                             f"{sum(a['used_mib'] or 0 for a in me):.0f} MiB (earlier in-process stages)")
            if others:
                busy = ", ".join(f"pid {a['pid']} ({a['used_mib']:.0f} MiB)" if a["used_mib"] is not None
                                 else f"pid {a['pid']}" for a in others)
                problems.append(f"GPUs are in use by other compute processes: {busy}")

    if problems:
        raise ServerConfigError("preflight failed: " + "; ".join(problems), engine=spec.engine,
                                phase="preflight", problems=problems)
    return notes


# --------------------------------------------------------------------------------------------
# The server process
# --------------------------------------------------------------------------------------------

def launch_record(spec: LaunchSpec, base_env: Mapping[str, str] | None = None,
                  redact: Redactor | None = None) -> dict[str, Any]:
    """The launch as saved with the run: argv, env diff against our own environment, cwd.
    `redact`: the resolved secrets' values, masked wherever they stand (`--header=Bearer X`,
    `--extra-x X`: the flag-name rule alone misses a secret after a harmless-looking flag)."""
    base = os.environ if base_env is None else base_env
    redact = redact or Redactor()
    changed = {k: v for k, v in spec.env.items() if base.get(k) != v}
    removed = sorted(k for k in base if k not in spec.env)
    # Masked by allow-list (drafter.secrets): only harmless variables keep their values.
    return {"engine": spec.engine, "argv": redact_argv(spec.argv, redact), "cwd": spec.cwd,
            "env": redact_obj(mask_env(changed), redact), "env_removed": removed,
            "env_from_config": redact_obj(mask_env(spec.env_overrides), redact),
            "base_url": spec.base_url, "health_url": spec.health_url,
            "served_model_name": spec.served_model_name, "model_path": spec.model_path,
            "draft_path": spec.draft_path, "python": sys.executable,
            "hostname": socket.gethostname(), "saved_at": _now_iso()}


class ServerProcess:
    """One running server. Use `with launch(...) as server:` so teardown always happens."""

    def __init__(self, spec: LaunchSpec, engine: Engine, log_path: str | os.PathLike,
                 on_line: OnLine | None = None, tail_lines: int = 200, secrets: Iterable[str] = ()):
        self.spec, self.engine, self.on_line = spec, engine, on_line
        # The resolved serve.secrets values: masked by value in every record and log line we write.
        self.secrets = [v for v in secrets if v]
        self.log_path = Path(log_path)
        self.launch_path, self.pid_path = launch_file(self.log_path), pid_file(self.log_path)
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None
        self.started_at = 0.0                  # time.monotonic() at start
        self.phase = "launch"
        self.phases_seen: list[dict[str, Any]] = []
        self.last_progress = 0.0
        self.last_line = ""
        self._last_line_at = 0.0
        self.ready_line_seen = False
        self.fatal_line: str | None = None
        self.gpu_baseline: dict[str, Any] | None = None
        self.teardown: TeardownReport | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._lock = threading.Lock()
        self._eof = threading.Event()
        self._reader: threading.Thread | None = None
        self._log = None
        self.tag = uuid.uuid4().hex
        self.redact = Redactor(self.secrets)
        self._pid_file_id: tuple[int, int] | None = None  # (device, inode) of the pid file we created
        self.owner = current_owner()
        self._watchdog: procs.Watchdog | None = None

    def _start_watchdog(self, grace_s: float = 10.0) -> None:
        """A process outside the server's session that ends the server when this process dies,
        even by SIGKILL (it reads EOF on a pipe only we hold open; drafter.procs)."""
        self._watchdog = procs.Watchdog(self.pgid, self.pgid, self.tag, grace_s, str(self.pid_path))

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close(wait_s=10)  # EOF: the watchdog finds nothing left and exits

    # ---- start ---------------------------------------------------------------------------
    def start(self) -> "ServerProcess":
        if self.proc is not None:
            return self
        ensure_log_dir(self.log_path.parent)
        record_redact = Redactor(self.secrets)  # only the secrets: the record stays reproducible
        self.redact = Redactor(secret_values(self.spec.env_overrides, self.spec.argv) | set(self.secrets))
        # Every file is created new (create_private): a name taken (a file, a planted link) fails
        # the launch with one line, and no write lands anywhere else.
        with os.fdopen(create_private(self.launch_path), "w", encoding="utf-8") as f:
            f.write(json.dumps(launch_record(self.spec, redact=record_redact), indent=2))
        try:
            self._log = os.fdopen(create_private(self.log_path), "a", encoding="utf-8", buffering=1)
        except ServerConfigError:
            self.launch_path.unlink(missing_ok=True)
            raise
        self.gpu_baseline = gpu_state(self.spec.env)
        # Every descendant inherits the tag: teardown finds a child that left the session.
        self.spec.env = {**self.spec.env, procs.TAG_VAR: self.tag}
        try:
            # Own session: Prefect's worker kills the run's process group on cancellation, and a
            # server outside it survives; we kill it ourselves (finally / reap via the pid file).
            self.proc = subprocess.Popen(
                self.spec.argv, cwd=self.spec.cwd, env=self.spec.env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as err:
            self._log.close()
            raise ServerConfigError(self.redact(f"cannot start {self.spec.argv[0]!r}: {err}"),
                                    engine=self.spec.engine, phase="launch") from None
        self.pgid = self.proc.pid  # session leader == group leader
        self.started_at = self.last_progress = time.monotonic()
        self._enter("launch")
        self._reader = threading.Thread(target=self._read, name=f"{self.spec.engine}-log", daemon=True)
        self._reader.start()
        try:
            self._start_watchdog()
            self._write_pid_file(record_redact)
        except BaseException:
            # No caller holds this object yet (start() raised), so no `with` would stop the
            # server, and it runs in its own session: stop it here.
            self.stop()
            raise
        return self

    def _write_pid_file(self, redact: Redactor) -> None:
        """Created new (create_private) with its content at once: other processes poll for it.
        Its (device, inode) says later that the name is still our file (`_remove_own_pid_file`)."""
        text = json.dumps(self._pid_record(redact), indent=2)
        fd = create_private(self.pid_path)
        st = os.fstat(fd)
        self._pid_file_id = (st.st_dev, st.st_ino)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)

    def _pid_record(self, redact: Redactor) -> dict[str, Any]:
        return {"pid": self.proc.pid, "pgid": self.pgid, "sid": self.proc.pid, "tag": self.tag,
                "start_ticks": _start_ticks(self.proc.pid), "argv": redact_argv(self.spec.argv, redact),
                "argv_sha256": argv_digest(self.spec.argv),
                "started_at": _now_iso(), "engine": self.spec.engine, "host": self.spec.host,
                "port": self.spec.port, "log_path": str(self.log_path), "launcher_pid": os.getpid(),
                "launcher_start_ticks": _start_ticks(os.getpid()), "owner": self.owner,
                "watchdog_pid": self._watchdog.pid if self._watchdog else None,
                "gpu_baseline": self.gpu_baseline,
                "cuda_visible_devices": self.spec.env.get("CUDA_VISIBLE_DEVICES")}

    def _remove_own_pid_file(self) -> None:
        """Remove the pid file only if that name still is the file this launch created (another
        server's pid file is never deleted by our teardown)."""
        try:
            st = os.lstat(self.pid_path)
        except OSError:
            return
        if (st.st_dev, st.st_ino) == self._pid_file_id:
            self.pid_path.unlink(missing_ok=True)

    # ---- log reading -----------------------------------------------------------------------
    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        fd, buf = self.proc.stdout.fileno(), b""
        try:
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                # Progress bars redraw with \r: each redraw is progress, so it is a line too.
                *lines, buf = re.split(rb"\r\n|\r|\n", buf + chunk)
                if len(buf) > _MAX_LINE:  # output without newlines must not grow without bound
                    lines.append(buf)
                    buf = b""
                for raw in lines:
                    self._handle(raw.decode("utf-8", "replace"))
            if buf:
                self._handle(buf.decode("utf-8", "replace"))
        except OSError:
            pass
        finally:
            self._eof.set()

    def _handle(self, line: str) -> None:
        if not line.strip():
            return
        line = self.redact(line)  # a server may print its arguments or environment (SGLang does)
        phase, ready, fatal, noise = self.engine.classify(line)
        with self._lock:
            self._last_line_at = time.monotonic()
            if self._log is not None and not self._log.closed:
                self._log.write(line + "\n")
            self._tail.append(line)
            if not noise:
                self.last_progress = time.monotonic()
                self.last_line = line
            if phase is not None:
                self._enter(phase)
            self.ready_line_seen |= ready
            if fatal and self.fatal_line is None:
                self.fatal_line = line
        if self.on_line is not None:
            try:
                self.on_line(ServerLine(line))
            except Exception:  # a broken callback must not stop the log (and the watchdog)
                pass

    def _enter(self, phase: str) -> None:
        now = time.monotonic()
        if self.phases_seen and self.phases_seen[-1]["phase"] == phase:
            return
        self.phase = phase
        self.last_progress = now
        self.phases_seen.append({"phase": phase, "at": _now_iso(),
                                 "t": round(now - self.started_at, 3)})

    # ---- state -------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def seconds_since_progress(self) -> float:
        return time.monotonic() - self.last_progress

    def log_tail(self, n: int = 40) -> list[str]:
        with self._lock:
            return list(self._tail)[-n:]

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "\n".join(self.log_tail(10_000))

    def wait_output(self, timeout: float = 2.0, quiet_s: float = 0.3) -> bool:
        """After the process exited: wait for its last lines. Returns at EOF, or once no line
        came for `quiet_s` (a surviving child can hold the pipe open), or after `timeout`."""
        deadline = time.monotonic() + timeout
        while not self._eof.wait(0.05):
            now = time.monotonic()
            if now >= deadline or now - self._last_line_at >= quiet_s:
                return False
        return True

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {"phase": self.phase, "phases": list(self.phases_seen),
                    "seconds_since_progress": round(self.seconds_since_progress(), 3),
                    "ready_line_seen": self.ready_line_seen, "fatal_line": self.fatal_line,
                    "exit_code": self.poll(), "pid": self.pid}

    # ---- teardown ------------------------------------------------------------------------------
    def stop(self, grace_s: float = 10.0, kill_wait_s: float = 5.0, port_timeout_s: float = 10.0,
             gpu_timeout_s: float = 60.0, gpu_tolerance_mib: float = 1024.0) -> TeardownReport:
        """Stop everything the server started and verify it. Idempotent."""
        if self.teardown is not None:
            return self.teardown
        if self.proc is None:
            self.teardown = TeardownReport()
            return self.teardown
        t0 = time.monotonic()
        report = TeardownReport()
        try:
            report.signals, report.remaining_pids = procs.terminate(
                self.pgid, self.pgid, grace_s, kill_wait_s, self.tag, reap_leader=self.proc.poll)
        finally:
            try:
                self.proc.wait(timeout=kill_wait_s)
            except subprocess.TimeoutExpired:
                pass
            report.exit_code = self.proc.poll()
            # Every writer of the pipe died with the group, so the reader sees EOF. Close the
            # pipe only then: closing under a blocked reader could hand its fd number to a new file.
            if self._eof.wait(2.0) and self.proc.stdout is not None:
                self.proc.stdout.close()
            with self._lock:
                if self._log is not None:
                    self._log.close()
            if not report.remaining_pids:
                self._stop_watchdog()
        verify_released(report, self.spec.host, self.spec.port, port_timeout_s,
                        self.gpu_baseline, self.spec.env, gpu_timeout_s, gpu_tolerance_mib)
        report.seconds = round(time.monotonic() - t0, 3)
        if report.ok:
            self._remove_own_pid_file()  # kept on failure: reap() can try again
        self.teardown = report
        return report

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        report = self.stop()
        if report.ok:
            return
        if exc is None:
            raise TeardownError(report.problems)
        exc.add_note("teardown incomplete: " + "; ".join(report.problems))



def launch(spec: LaunchSpec, engine: Engine, log_path: str | os.PathLike,
           on_line: OnLine | None = None, secrets: Iterable[str] = ()) -> ServerProcess:
    """Start the server now; use as `with launch(...) as server:`."""
    return ServerProcess(spec, engine, log_path, on_line, secrets=secrets).start()



def main(argv: list[str] | None = None) -> int:
    """`python -m drafter.serving.launcher reap PIDFILE [--grace S]` for shells and hooks."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m drafter.serving.launcher")
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reap", help="kill a server left behind by a cancelled run")
    r.add_argument("pid_file")
    r.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    args = parser.parse_args(argv)
    result = reap(args.pid_file, grace_s=args.grace)
    print(json.dumps(result, indent=2))
    return 0 if not result.get("problems") else 1


if __name__ == "__main__":
    sys.exit(main())
