"""The readiness gate: one loop for every engine.

Ready means a REAL 1-token generation succeeded, on top of /health answering 200 and the
model being listed (field note 1: a server with loaded weights, full GPU memory and an open
port can still be stuck for hours). While waiting, the gate watches the process: an exit or a
fatal log line is a crash (retryable), unless the log says the configuration cannot run on this
host (the engine's `config_error_patterns`, e.g. SGLang's "EAGLE is not supported in decode
attention backend torch_native" on a CPU): that is a ServerConfigError, which no retry fixes.
No log progress within the current phase's budget is a stall, and the overall deadline gives a
health-check timeout naming the check that still fails.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import httpx

from drafter.engines.base import Engine, LaunchSpec, generate_one_token
from drafter.server_errors import HealthCheckTimeout, ServerConfigError, ServerCrashed, ServerStalled
from drafter.serving.launcher import ServerProcess

CHECKS = ("health", "model listing", "generation")
PROMPT = "Hello"


@dataclass
class ReadyReport:
    engine: str
    base_url: str
    served_model_name: str
    seconds_to_ready: float
    phases: list[dict[str, Any]]
    settings: dict[str, Any]
    ready_line_seen: bool
    log_path: str
    sample: str | None = None          # what the 1-token generation returned
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def phase_budget(engine: Engine, phase: str, stall_timeout_s: float,
                 phase_budgets: Mapping[str, float] | None = None) -> float:
    """An explicit `phase_budgets[phase]` wins; otherwise the engine's default for the phase,
    capped by `stall_timeout_s` (the configured "no progress for this long = hung")."""
    if phase_budgets and phase in phase_budgets:
        return float(phase_budgets[phase])
    default = engine.phase_default(phase)
    return stall_timeout_s if default is None else min(default, stall_timeout_s)


def _reason(resp: httpx.Response) -> str:
    body = resp.text.strip().replace("\n", " ")
    return f"HTTP {resp.status_code}" + (f": {body[:160]}" if body else "")


def probe(client: httpx.Client, spec: LaunchSpec, generate_timeout_s: float = 30.0) -> tuple[dict[str, str], str | None]:
    """Run the three checks in order. Returns ({check: why it fails}, generated text).
    A refused connection is normal while the server loads: it just means "not yet"."""
    failing: dict[str, str] = {}
    try:
        resp = client.get(spec.health_url)
        if resp.status_code != 200:
            failing["health"] = _reason(resp)
    except httpx.ConnectError:
        failing["health"] = "connection refused (port not open yet)"
    except httpx.HTTPError as err:
        failing["health"] = f"{type(err).__name__}: {err}"
    if failing:
        return {**failing, "model listing": "not tried", "generation": "not tried"}, None

    try:
        resp = client.get(spec.models_path)
        if resp.status_code != 200:
            failing["model listing"] = _reason(resp)
        else:
            ids = [m.get("id") for m in (resp.json().get("data") or [])]
            if spec.served_model_name not in ids:
                failing["model listing"] = f"{spec.served_model_name!r} not in {ids}"
    except (httpx.HTTPError, ValueError, AttributeError) as err:
        failing["model listing"] = f"{type(err).__name__}: {err}"
    if failing:
        return {**failing, "generation": "not tried"}, None

    text = None
    try:
        ok, text, resp = generate_one_token(client, spec, PROMPT, generate_timeout_s)
        if not ok:
            failing["generation"] = _reason(resp)
    except (httpx.HTTPError, ValueError, AttributeError) as err:
        failing["generation"] = f"{type(err).__name__}: {err}"
    return failing, text


def make_client(spec: LaunchSpec, timeout_s: float = 3.0) -> httpx.Client:
    # trust_env=False: an HTTP(S)_PROXY in the environment must not capture loopback probes.
    return httpx.Client(base_url=spec.base_url, timeout=httpx.Timeout(timeout_s, connect=1.0),
                        trust_env=False)


def start_failure(server: ServerProcess, engine: Engine, message: str) -> ServerCrashed | ServerConfigError:
    """The error for a server that exited or logged a fatal line before it was ready: a
    ServerConfigError when its log says this configuration cannot run on this host
    (`engine.config_error`), else a ServerCrashed."""
    # Collect the rest of the traceback: until EOF, or until the log goes quiet (a live
    # process after a fatal line, or orphaned children still holding the pipe).
    if server.poll() is None:
        time.sleep(0.2)
    server.wait_output(2.0)
    fields = dict(engine=engine.name, phase=server.phase, exit_code=server.poll(),
                  seconds=round(time.monotonic() - server.started_at, 3), log_tail=server.log_tail(40))
    why = engine.config_error(server.log_text().splitlines()) if engine.config_error_patterns else None
    if why is not None:
        return ServerConfigError(f"{why} [{message}]", **fields)
    return ServerCrashed(message, **fields)


def wait_until_ready(server: ServerProcess, engine: Engine, spec: LaunchSpec, startup_timeout_s: float,
                     stall_timeout_s: float, phase_budgets: Mapping[str, float] | None = None,
                     poll_s: float = 0.5, generate_timeout_s: float = 30.0) -> ReadyReport:
    """Block until the server passes the gate, or raise ServerCrashed / ServerStalled /
    HealthCheckTimeout. The caller owns teardown (use `with launch(...)`)."""
    deadline = server.started_at + startup_timeout_s
    failing: dict[str, str] = dict.fromkeys(CHECKS, "not tried")
    http_up = False  # the HTTP server answered (any status): from then on only the deadline applies
    with make_client(spec) as client:
        while True:
            code = server.poll()
            if code is not None:
                raise start_failure(server, engine, f"{engine.name} exited with code {code} during {server.phase}")
            if server.fatal_line is not None:
                raise start_failure(server, engine, f"{engine.name} logged a fatal error during "
                                                    f"{server.phase}: {server.fatal_line.strip()}")
            now = time.monotonic()
            phase, quiet = server.phase, server.seconds_since_progress()
            budget = phase_budget(engine, phase, stall_timeout_s, phase_budgets)
            # Once the server logged its ready line, or its HTTP server answers (a 503 "not ready"
            # is an answer, not a hang), only the HTTP gate and its deadline remain.
            if quiet > budget and not server.ready_line_seen and not http_up:
                raise ServerStalled(
                    f"{engine.name} made no log progress for {quiet:.1f}s in phase {phase!r} "
                    f"(budget {budget:.1f}s); last line: {server.last_line.strip()[:200]!r}",
                    engine=engine.name, phase=phase, seconds=round(quiet, 3), budget_s=budget,
                    log_tail=server.log_tail(40))
            if now > deadline:
                summary = "; ".join(f"{k}: {v}" for k, v in failing.items())
                raise HealthCheckTimeout(
                    f"{engine.name} not ready after {startup_timeout_s:.0f}s (phase {phase!r}); "
                    f"still failing: {summary}", engine=engine.name, phase=phase,
                    seconds=round(now - server.started_at, 3),
                    failing=[k for k, v in failing.items() if v != "not tried"],
                    reasons=failing, log_tail=server.log_tail(40))

            failing, sample = probe(client, spec, generate_timeout_s)
            if not failing:
                break
            http_up |= "health" not in failing or failing["health"].startswith("HTTP ")
            time.sleep(poll_s)

        seconds = round(time.monotonic() - server.started_at, 3)
        try:
            settings = engine.read_settings(client, server.log_text())
        except Exception as err:  # the server is up; an unreadable setting is reported, not fatal
            settings = {"error": f"{type(err).__name__}: {err}"}
    notes = [] if server.ready_line_seen or not engine.ready_patterns else [
        "ready log line not seen (log level hides it?); readiness rests on the HTTP checks"]
    return ReadyReport(engine=engine.name, base_url=spec.base_url, served_model_name=spec.served_model_name,
                       seconds_to_ready=seconds, phases=list(server.phases_seen), settings=settings,
                       ready_line_seen=server.ready_line_seen, log_path=str(server.log_path),
                       sample=sample, notes=notes)
