"""`drafter serve`: the health check (`--check`) and foreground serving, both one ServerSession.

`check_server` never raises for a failed start: it returns one JSON-able dict whose `status`
says what happened (the CLI prints it; the serve stage turns it into retry-or-fail through the
error's `retryable`). `serve_forever` is the foreground mode of `drafter serve`.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping, Sequence

from drafter.config import LifecycleConfig
from drafter.server_errors import ServerStartError
from drafter.serving.launcher import OnLine, launch_file
from drafter.serving.session import ServerSession, serve_until_interrupted

log = logging.getLogger("drafter.serving")


def _result(session: ServerSession) -> dict[str, Any]:
    return {"engine": session.engine.name, "status": None, "seconds": None, "phases": [], "settings": {},
            "settings_mismatch": [], "message": "", "log_path": str(session.log_path),
            "launch_path": str(launch_file(session.log_path)), "base_url": None, "retryable": False,
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
    session = ServerSession(cfg, draft_path=draft_path, faults=faults, on_line=on_line, log_dir=log_dir,
                            phase_budgets=phase_budgets, poll_s=poll_s, grace_s=grace_s,
                            gpu_timeout_s=gpu_timeout_s, strict_settings=raise_on_failure,
                            check_teardown=False)
    result = _result(session)
    t0 = time.monotonic()
    failure: ServerStartError | None = None
    try:
        with session as served:
            result.update(status="ready", settings=served.settings, sample=served.sample,
                          seconds_to_ready=served.seconds_to_ready, settings_mismatch=served.settings_mismatch,
                          message=f"{served.engine} ready in {served.seconds_to_ready:.1f}s at {served.base_url}")
    except ServerStartError as err:
        failure = err
        result.update(status=err.status, message=err.message, retryable=err.retryable,
                      log_tail=err.log_tail, error=err.to_dict())
    result.update(base_url=session.base_url, notes=session.notes, phases=session.phases,
                  # the report's key since it was SGLang's alone (kept: records already written read it)
                  layer_ids=session.layer_ids, sglang_rules=session.engine_rules,
                  seconds=round(time.monotonic() - t0, 3))
    if session.teardown is not None:
        result["teardown"] = session.teardown.to_dict()
        if not session.teardown.ok:
            result["message"] += " | teardown incomplete: " + "; ".join(session.teardown.problems)
    if raise_on_failure and failure is not None:
        raise failure
    return result


def check_exit_code(report: Mapping[str, Any]) -> int:
    """The exit code of `drafter serve --check` (docs/operations.md, Exit codes): 0 ready; 2 a
    configuration error (bad settings, a missing model or drafter, a taken port: retrying cannot help);
    3 a start a retry may fix (crashed, stalled, health check timed out); 4 any other failure."""
    from drafter.errors import EXIT_CONFIG, EXIT_FAILED, EXIT_RETRYABLE

    if report["status"] == "ready":
        return 0
    if report["status"] == "config_error":
        return EXIT_CONFIG
    return EXIT_RETRYABLE if report.get("retryable") else EXIT_FAILED


def serve_forever(cfg: LifecycleConfig, draft_path: str | None = None, on_line: OnLine | None = None, *,
                  on_ready: Callable[[dict[str, Any]], None] | None = None,
                  log_dir: str | os.PathLike | None = None,
                  phase_budgets: Mapping[str, float] | None = None, poll_s: float = 1.0) -> dict[str, Any]:
    """Foreground mode: start, gate, then keep serving until interrupted (Ctrl-C / SIGTERM),
    and tear down. Start failures raise the typed ServerStartError; a server that dies while
    serving raises ServerCrashed. Returns the final state after an interrupt."""
    session = ServerSession(cfg, draft_path=draft_path, on_line=on_line, log_dir=log_dir,
                            phase_budgets=phase_budgets, poll_s=poll_s)
    result = _result(session)
    try:
        with session as served:
            result.update(status="ready", settings=served.settings, base_url=served.base_url,
                          seconds_to_ready=served.seconds_to_ready, settings_mismatch=served.settings_mismatch,
                          notes=session.notes, phases=session.phases)
            log.info("%s serving at %s (log %s); Ctrl-C to stop", served.engine, served.base_url, served.log_path)
            if on_ready is not None:
                on_ready(dict(result))
            serve_until_interrupted(served, poll_s)
    except KeyboardInterrupt as err:
        # The exit code of `drafter serve` says how it ended: 143 after SIGTERM, 130 after Ctrl-C.
        result.update(status="stopped", message="interrupted; server stopped",
                      exit_code=getattr(err, "exit_code", 130))
    finally:
        result["phases"] = session.phases
        if session.teardown is not None:
            result["teardown"] = session.teardown.to_dict()
    return result
