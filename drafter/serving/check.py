"""Server health check and foreground serving: preflight + launch + gate + read-back + teardown.

`check_server` never raises for a failed start: it returns one JSON-able dict whose `status`
says what happened (the CLI prints it, the Prefect task turns it into retry-or-fail with
`retryable`). `serve_forever` is the foreground mode of `drafter serve`.
"""
from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from drafter.config import LifecycleConfig
from drafter.serving.engines import check_speculative_settings, make_engine
from drafter.serving.errors import ServerConfigError, ServerCrashed, ServerStartError, is_retryable
from drafter.serving.gate import wait_until_ready
from drafter.serving.launcher import OnLine, ServerProcess, launch_file, preflight

log = logging.getLogger("drafter.serving")


def new_log_path(log_dir: str | os.PathLike, engine: str) -> Path:
    """runs/logs/<engine>-<UTC time>.log, never reusing an existing name."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = Path(log_dir) / f"{engine}-{stamp}"
    path, n = base.with_suffix(".log"), 1
    while path.exists():
        n += 1
        path = Path(f"{base}-{n}.log")
    return path


def _result(engine: str, log_path: Path) -> dict[str, Any]:
    return {"engine": engine, "status": None, "seconds": None, "phases": [], "settings": {},
            "settings_mismatch": [], "message": "", "log_path": str(log_path),
            "launch_path": str(launch_file(log_path)), "base_url": None, "retryable": False,
            "notes": [], "teardown": None}


def check_server(cfg: LifecycleConfig, draft_path: str | None = None, faults: Sequence[str] = (),
                 on_line: OnLine | None = None, *, log_dir: str | os.PathLike | None = None,
                 phase_budgets: Mapping[str, float] | None = None, poll_s: float = 0.5,
                 grace_s: float = 10.0, gpu_timeout_s: float = 60.0,
                 raise_on_failure: bool = False) -> dict[str, Any]:
    """Start the configured server, wait until it really serves, read back the speculative
    settings it uses, and stop it. Returns
    {engine, status: ready|crashed|stalled|health_timeout|config_error, seconds, phases,
     settings, settings_mismatch, message, log_path, ...}.
    With `raise_on_failure`, a failed start re-raises its typed error after teardown, and
    settings the server rewrote raise ServerConfigError (the pipeline must not go on with them)."""
    engine = make_engine(cfg.serve.engine)
    draft = draft_path if draft_path is not None else cfg.serve.draft_path
    log_path = new_log_path(log_dir or cfg.serve.log_dir, engine.name)
    result = _result(engine.name, log_path)
    t0 = time.monotonic()
    server: ServerProcess | None = None
    stack = ExitStack()
    failure: ServerStartError | None = None
    try:
        stack.enter_context(_sigterm_as_interrupt())  # a cancelled run (SIGTERM) still tears down
        spec = engine.build_launch(cfg, draft, log_path.parent, faults=faults)
        result["base_url"] = spec.base_url
        result["notes"] = preflight(spec, cfg)
        server = ServerProcess(spec, engine, log_path, on_line).start()
        report = wait_until_ready(server, engine, spec, cfg.serve.startup_timeout_s,
                                  cfg.serve.stall_timeout_s, phase_budgets, poll_s)
        result.update(status="ready", settings=report.settings, sample=report.sample,
                      seconds_to_ready=report.seconds_to_ready,
                      settings_mismatch=check_speculative_settings(cfg.serve.speculative, report.settings, draft),
                      message=f"{engine.name} ready in {report.seconds_to_ready:.1f}s at {spec.base_url}")
        result["notes"] += report.notes
    except ServerStartError as err:
        failure = err
        result.update(status=err.status, message=err.message, retryable=is_retryable(err),
                      log_tail=err.log_tail, error=err.to_dict())
    finally:
        if server is not None:
            result["phases"] = list(server.phases_seen)
            teardown = server.stop(grace_s=grace_s, gpu_timeout_s=gpu_timeout_s)
            result["teardown"] = teardown.to_dict()
            if not teardown.ok:
                result["message"] += " | teardown incomplete: " + "; ".join(teardown.problems)
        stack.close()
        result["seconds"] = round(time.monotonic() - t0, 3)
    if raise_on_failure:
        if failure is not None:
            raise failure
        if result["settings_mismatch"]:
            raise ServerConfigError("the server does not use the requested speculative settings: "
                                    + "; ".join(result["settings_mismatch"]), engine=engine.name)
    return result


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Prefect cancels by SIGTERM, whose default action skips `finally`: turn it into a
    KeyboardInterrupt so the server is torn down. Only possible in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve_forever(cfg: LifecycleConfig, draft_path: str | None = None, on_line: OnLine | None = None, *,
                  on_ready: Callable[[dict[str, Any]], None] | None = None,
                  log_dir: str | os.PathLike | None = None,
                  phase_budgets: Mapping[str, float] | None = None, poll_s: float = 1.0) -> dict[str, Any]:
    """Foreground mode: start, gate, then keep serving until interrupted (Ctrl-C / SIGTERM),
    and tear down. Start failures raise the typed ServerStartError; a server that dies while
    serving raises ServerCrashed. Returns the final state after an interrupt."""
    engine = make_engine(cfg.serve.engine)
    draft = draft_path if draft_path is not None else cfg.serve.draft_path
    log_path = new_log_path(log_dir or cfg.serve.log_dir, engine.name)
    result = _result(engine.name, log_path)
    spec = engine.build_launch(cfg, draft, log_path.parent)
    result["base_url"] = spec.base_url
    result["notes"] = preflight(spec, cfg)
    with _sigterm_as_interrupt():
        server = ServerProcess(spec, engine, log_path, on_line)
        try:
            with server:
                report = wait_until_ready(server, engine, spec, cfg.serve.startup_timeout_s,
                                          cfg.serve.stall_timeout_s, phase_budgets)
                result.update(status="ready", settings=report.settings, phases=report.phases,
                              seconds_to_ready=report.seconds_to_ready,
                              settings_mismatch=check_speculative_settings(
                                  cfg.serve.speculative, report.settings, draft))
                for problem in result["settings_mismatch"]:
                    log.warning("speculative settings differ from the request: %s", problem)
                log.info("%s serving at %s (log %s); Ctrl-C to stop", engine.name, spec.base_url, log_path)
                if on_ready is not None:
                    on_ready(dict(result))
                # A scheduler can die while the HTTP parent lives on: a fatal line ends serving too.
                while (code := server.poll()) is None and server.fatal_line is None:
                    time.sleep(poll_s)
                what = f"exited with code {code}" if code is not None else f"logged {server.fatal_line.strip()!r}"
                raise ServerCrashed(f"{engine.name} {what} while serving", engine=engine.name,
                                    phase="serving", exit_code=code, log_tail=server.log_tail(40))
        except KeyboardInterrupt:
            result.update(status="stopped", message="interrupted; server stopped")
        finally:
            result["phases"] = list(server.phases_seen)
            if server.teardown is not None:
                result["teardown"] = server.teardown.to_dict()
    return result
