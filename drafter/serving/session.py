"""One server session: preflight -> launch in its own process group -> readiness gate -> settings
read back -> teardown, on every exit path (errors, Ctrl-C, Prefect's SIGTERM).

Every user of a running server goes through `ServerSession`: `drafter serve` (foreground and
`--check`), datagen's own target server, and the stages that serve (the offline judge, the bench
sweep). The sequence exists once, so a fix to it (a new preflight check, a teardown detail) reaches
every caller.

    with ServerSession(cfg, on_line=print) as served:
        requests.post(served.base_url + "/generate", ...)
    session.teardown   # what teardown found (processes left, port held, GPU memory kept)
"""
from __future__ import annotations

import datetime as dt
import logging
import os
import secrets
import signal
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from drafter.config import LifecycleConfig
from drafter.secrets import Redactor, expand_placeholders, redact_obj, resolve_all, secret_looking_env
from drafter.engine_registry import make_engine
from drafter.engines.base import check_speculative_settings, engine_python
from drafter.server_errors import ServerConfigError, ServerStartError, TeardownError
from drafter.serving.gate import wait_until_ready
from drafter.serving.launcher import OnLine, ServerProcess, launch_file, preflight
from drafter.serving.ownership import TeardownReport, reap_stale

log = logging.getLogger("drafter.serving")


def new_log_path(log_dir: str | os.PathLike, engine: str, port: int | None = None) -> Path:
    """runs/logs/<engine>-<UTC time>-<port>-<random>.log: unique per launch, so servers started in
    the same second (fan-out children on one host) never share a log, launch record or pid file,
    and a name nobody can guess in advance (the files are created O_EXCL anyway: launcher)."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    port_part = f"-{port}" if port is not None else ""
    return Path(log_dir) / f"{engine}-{stamp}{port_part}-{secrets.token_hex(4)}.log"


class Terminated(KeyboardInterrupt):
    """SIGTERM (Prefect's cancellation, `kill`) turned into an interrupt; `exit_code` 143.
    `seen` stays true once one was raised: the CLI exits 143 whatever a stage made of the interrupt."""

    exit_code = 128 + signal.SIGTERM
    seen = False

    def __init__(self, *args):
        super().__init__(*args)
        Terminated.seen = True


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM's default action skips `finally`: turn it into a KeyboardInterrupt so the server is
    torn down. Only the default is replaced: a handler already installed raises its own exception,
    which unwinds as well, and must keep its meaning (Prefect's engine reads a cancellation from its
    TerminationSignal: replaced, a cancelled run would end Crashed). Only possible in the main thread."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def handler(signum, frame):
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class ServedServer:
    """A server that passed the gate: where it serves and what it says it runs."""

    engine: str
    base_url: str
    log_path: Path
    seconds_to_ready: float
    settings: dict[str, Any]
    settings_mismatch: list[str]
    sample: str | None
    notes: list[str] = field(default_factory=list)
    process: ServerProcess | None = None

    @property
    def launch_path(self) -> Path:
        return launch_file(self.log_path)


class ServerSession:
    """Context manager around one server launch; see the module docstring.

    `target_only`: serve the target alone (no drafter, no speculative flags), as datagen does:
    speculation cannot change greedy answers and only adds start-up risk. `strict_settings`: a
    server that does not use the requested speculative settings fails the session with
    ServerConfigError (field note 3) instead of being handed out. `check_teardown`: an incomplete
    teardown raises TeardownError (when nothing else failed); without it the caller reads
    `session.teardown`. `forced_accept_length`: the engine's forced acceptance (timing only: the
    bench's accept-length curve). A failed start raises its typed ServerStartError after the teardown."""

    def __init__(self, cfg: LifecycleConfig, *, draft_path: str | None = None, target_only: bool = False,
                 faults: Sequence[str] = (), on_line: OnLine | None = None,
                 log_dir: str | os.PathLike | None = None, phase_budgets: Mapping[str, float] | None = None,
                 poll_s: float = 0.5, grace_s: float = 10.0, gpu_timeout_s: float = 60.0,
                 strict_settings: bool = False, check_teardown: bool = True,
                 forced_accept_length: float | None = None):
        if target_only:
            serve = cfg.serve.model_copy(update={"speculative": None, "draft_path": None})
            cfg, draft_path = cfg.model_copy(update={"serve": serve}), None
        elif draft_path is None:
            draft_path = cfg.serve.draft_path
        self.cfg, self.draft_path, self.faults, self.on_line = cfg, draft_path, tuple(faults), on_line
        self.forced_accept_length = forced_accept_length
        self.engine = make_engine(cfg.serve.engine)
        self.log_path = new_log_path(log_dir or cfg.serve.log_dir, self.engine.name, cfg.serve.port)
        self.phase_budgets, self.poll_s = phase_budgets, poll_s
        self.grace_s, self.gpu_timeout_s = grace_s, gpu_timeout_s
        self.strict_settings, self.check_teardown = strict_settings, check_teardown
        self.base_url: str | None = None
        self.notes: list[str] = []
        self.layer_ids: dict[str, Any] = {}   # what the layer-id check saw (engine version, ids, rule)
        self.engine_rules: dict[str, Any] = {}  # who decided how the engine reads our flags (Engine.launch_rules)
        self.process: ServerProcess | None = None
        self.teardown: TeardownReport | None = None
        self.redact = Redactor()  # the resolved secrets' values, once resolved: for our messages
        self._stack: ExitStack | None = None

    @property
    def phases(self) -> list[dict[str, Any]]:
        return list(self.process.phases_seen) if self.process is not None else []

    def __enter__(self) -> ServedServer:
        cfg, engine = self.cfg, self.engine
        self._stack = stack = ExitStack()
        try:
            stack.enter_context(sigterm_as_interrupt())  # a cancelled run (SIGTERM) still tears down
            spec = engine.build_launch(cfg, self.draft_path, self.log_path.parent, faults=self.faults,
                                       forced_accept_length=self.forced_accept_length)
            # Secrets are resolved here, in the launching process, and only handed to the server.
            resolved = resolve_all(cfg.serve.secrets)
            self.redact = Redactor(resolved.values())
            spec.env.update(resolved)
            spec.env_overrides.update(resolved)
            spec.argv = expand_placeholders(spec.argv, resolved)
            self.base_url = spec.base_url
            # A server of ours whose run died (pid file, launcher gone) would hold the port.
            stale = reap_stale(spec.log_dir, spec.port)
            for note in stale:
                log.warning("%s", note)
            self.notes = stale + preflight(spec, cfg, engine=engine)
            for warning in secret_looking_env(cfg.serve.env):  # stored with the run: say so where it runs
                log.warning("%s", warning)
            # the draft's layer ids against the rule of the engine version installed (field note 4)
            self.layer_ids = engine.check_layer_ids(self.draft_path, cfg.target.path, engine_python(cfg))
            if self.layer_ids.get("engine_version"):
                self.notes.append(f"{engine.name} {self.layer_ids['engine_version']} "
                                  f"({self.layer_ids['version_source']}): layer ids "
                                  + (f"{self.layer_ids['ids']} capture our {self.layer_ids['aux_layer_ids']}"
                                     if self.layer_ids.get("checked") else f"not checked: {self.layer_ids['why']}"))
            # the installed engine, where it can be asked, decides how it reads our flags and ids
            self.engine_rules = engine.launch_rules(cfg, spec.argv, spec.env, engine_python(cfg), self.layer_ids,
                                                    speculating=self.draft_path is not None)
            if self.engine_rules:
                self.notes.append(f"{engine.name} rules: {self.engine_rules['source']}")
            for note in self.notes:
                log.info("%s preflight: %s", engine.name, note)
            self.process = ServerProcess(spec, engine, self.log_path, self.on_line,
                                         secrets=resolved.values()).start()
            stack.callback(self._stop)
            report = wait_until_ready(self.process, engine, spec, cfg.serve.startup_timeout_s,
                                      cfg.serve.stall_timeout_s, self.phase_budgets, self.poll_s)
            mismatch = check_speculative_settings(cfg.serve.speculative, report.settings, self.draft_path)
            if mismatch and self.strict_settings:
                raise ServerConfigError("the server does not use the requested speculative settings: "
                                        + "; ".join(mismatch), engine=engine.name)
            for problem in mismatch:
                log.warning("speculative settings differ from the request: %s", problem)
            self.notes += report.notes
            return ServedServer(engine=engine.name, base_url=spec.base_url, log_path=self.log_path,
                                seconds_to_ready=report.seconds_to_ready, settings=report.settings,
                                settings_mismatch=mismatch, sample=report.sample, notes=list(self.notes),
                                process=self.process)
        except BaseException as err:
            if self.process is not None and isinstance(err, Exception):
                err.add_note(f"server log: {self.log_path}")
            if isinstance(err, ServerStartError):
                _redact_error(err, self.redact)
            self._close(err)
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close(exc)

    def _stop(self) -> None:
        self.teardown = self.process.stop(grace_s=self.grace_s, gpu_timeout_s=self.gpu_timeout_s)

    def _close(self, exc: BaseException | None) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        stack.close()
        if self.teardown is None or self.teardown.ok or not self.check_teardown:
            return
        if exc is None:
            raise TeardownError(self.teardown.problems)
        exc.add_note("teardown incomplete: " + "; ".join(self.teardown.problems))


def _redact_error(err: ServerStartError, redact: Redactor) -> None:
    """A start failure's message travels far (Prefect state messages, the bench's committed
    failure records): the resolved secrets' values are masked in it wherever they stand."""
    err.message = redact(err.message)
    err.args = (err.message, *err.args[1:])
    err.log_tail = [redact(line) for line in err.log_tail]
    for key, value in list(err._extra.items()):
        err._extra[key] = redact_obj(value, redact)
        setattr(err, key, err._extra[key])


def serve_until_interrupted(served: ServedServer, poll_s: float = 1.0) -> None:
    """Block while the server runs; raise ServerCrashed when it exits or logs a fatal line
    (a scheduler can die while the HTTP parent lives on). Ctrl-C / SIGTERM interrupt it."""
    from drafter.server_errors import ServerCrashed

    server = served.process
    while (code := server.poll()) is None and server.fatal_line is None:
        time.sleep(poll_s)
    what = f"exited with code {code}" if code is not None else f"logged {server.fatal_line.strip()!r}"
    raise ServerCrashed(f"{served.engine} {what} while serving", engine=served.engine, phase="serving",
                        exit_code=code, log_tail=server.log_tail(40))
