"""The sweep driver: launch the planned servers through `ServerSession`, measure every
(configuration, batch size) in interleaved rounds, commit each measurement as it completes.

Store layout inside the bench stage's output (one small JSON shard each):
    m/<server key>/bs<B>/r<round>.json   one measurement (drafter.bench.measure.measure + identity)
    launches/<server key>-<n>.json       what a launch ran: settings read back, engine version,
                                         saved launch environment, log, seconds to ready
    failed/<server key>.json             a configuration that failed to start or to measure: its
                                         failure kind (FIXES), whether a retry may fix it, what to
                                         change, the message and evidence (log path, HTTP answer)

Resume: a measurement whose shard is committed is never repeated, a server with nothing left to
measure is never launched. A recorded failure stands for the rest of the run that recorded it
(the sweep goes on without it); the next run re-checks it (launches and measures it again), so a
cause that went away or was fixed is never repeated from the record; the record is dropped once
the configuration measures again, and replaced (attempts counted) if it fails again. Interleaving
(see drafter.bench.plan): `concurrent` keeps every server alive and visits them round-robin, one
measured at a time; `relaunch` starts one server per (configuration, round) in the same order.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx

from drafter.bench.measure import ClientApi, MeasurementError, Prompt, measure
from drafter.bench.plan import ServerPlan, SweepPlan, server_config
from drafter.config import LifecycleConfig
from drafter.engine_registry import make_engine
from drafter.errors import is_retryable
from drafter.secrets import Redactor, redact_obj
from drafter.server_errors import ServerConfigError, ServerStartError
from drafter.serving.host import port_free
from drafter.serving.session import ServedServer, ServerSession
from drafter.stage_output import Progress, StageOutput, guarded_progress

log = logging.getLogger(__name__)


def measurement_name(key: str, batch_size: int, round_index: int) -> str:
    return f"m/{key}/bs{batch_size:04d}/r{round_index:03d}.json"


def failure_name(key: str) -> str:
    return f"failed/{key}.json"


def launch_name(key: str, n: int) -> str:
    return f"launches/{key}-{n:03d}.json"


# Failure kinds and what a person does about each. Whether a retry may fix a failure is the error's
# own (`retryable`, drafter.errors), decided where it is caught (start_failure / measure_failure).
# Either way the next run re-checks the failure instead of repeating its record.
FIXES: dict[str, str] = {
    "port_taken": "free the port (the message names its holder) or set serve.port to another base port; "
                       "the next run retries it",
    "crashed": "a retry may fix it (the next run launches it again); if it keeps crashing, read the server log",
    "stalled": "a retry may fix it (the next run launches it again); if it keeps stalling, read the server "
                       "log and raise serve.stall_timeout_s only if the phase is just slow",
    "health_timeout": "a retry may fix it (the next run launches it again); if it keeps timing out, read the "
                       "server log and raise serve.startup_timeout_s only if the start is just slow",
    "config_error": "change what the message names (serve settings, paths, GPUs in use); the next run "
                       "launches it again to check",
    "crashed_while_measuring": "the server died while measuring: the next run launches it again; if it "
                       "keeps dying, read the server log",
    "measurement_failed": "a request failed (timeout, connection, server error): the next run measures it "
                       "again; bench.request_timeout_s is the per-request limit",
    "request_refused": "the server refused the request: change what its answer names (bench.max_tokens, "
                       "the prompts: bench.num_prompts or the prepared eval split, the serve settings); "
                       "the next run measures it again to check",
    "error": "read the message and the server log; the next run launches it again to check",
    "bad_answer": "the server answered what the bench cannot read: check that serve.engine is the engine "
                       "that runs; the next run measures it again to check",
}


def start_failure(err: ServerStartError, host: str, port: int) -> tuple[str, bool]:
    """(kind, retryable) of a start: the error's own. A preflight whose only problem is a port still
    held by another process is `port_taken`: the holder's doing, not the configuration's, so a
    later run can pass."""
    problems = getattr(err, "problems", None) or []
    if isinstance(err, ServerConfigError) and err.phase == "preflight" and len(problems) == 1 \
            and not port_free(host, port):
        return "port_taken", True
    return err.status, is_retryable(err)


def measure_failure(err: Exception, server_dead: bool) -> tuple[str, bool]:
    """(kind, retryable) of a measurement: a dead server may start next time; otherwise the error's
    own (a refused request is refused again; an HTTP transport error may pass)."""
    if server_dead:
        return "crashed_while_measuring", True
    if isinstance(err, MeasurementError):
        return ("measurement_failed" if err.retryable else "request_refused"), err.retryable
    if isinstance(err, ValueError):  # an answer that is not the JSON the API promises
        return "bad_answer", False
    return "measurement_failed", True  # httpx transport errors: timeouts, resets


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True, default=str)


# ----------------------------------------------------------------------------- what runs where

def hardware() -> dict[str, Any]:
    """CPU model and count, memory, GPUs (nvidia-smi where present), OS and Python."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu_count": os.cpu_count(), "cpu_model": platform.processor() or None}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            info["memory_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    info["gpus"] = None
    if shutil.which("nvidia-smi"):
        try:
            done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                   "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            if done.returncode == 0:
                info["gpus"] = [line.strip() for line in done.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


def client_api(cfg: LifecycleConfig, served: ServedServer) -> ClientApi:
    """SGLang's /generate for engines that have it (and a command server that answered SGLang's
    /get_server_info), OpenAI completions otherwise; streaming where the engine streams."""
    engine = make_engine(cfg.serve.engine)
    return ClientApi(style=engine.client_style(served.settings), stream=engine.streams,
                     flush_cache=engine.flush_cache if cfg.bench.flush_cache else False,
                     served_model_name=cfg.target.served_name, counters=engine.reports_counters)


def _engine_version(cfg: LifecycleConfig, served: ServedServer) -> str | None:
    version = served.settings.get("version")
    if version is None:
        version = make_engine(cfg.serve.engine).probe_version(served.base_url)
    return str(version) if version is not None else None


# ----------------------------------------------------------------------------- the sweep

@dataclass
class SweepOutcome:
    measurements: list[dict] = field(default_factory=list)
    failures: dict[str, dict] = field(default_factory=dict)
    cleared: dict[str, dict] = field(default_factory=dict)  # earlier runs' failures measured past now
    launches: list[dict] = field(default_factory=list)
    measured_now: int = 0
    launched_now: int = 0


class Sweep:
    """One sweep over `plan`, writing into `out`. `session_options` go to every ServerSession
    (tests shorten poll intervals); `on_line` receives every server log line."""

    def __init__(self, cfg: LifecycleConfig, out: StageOutput, plan: SweepPlan, prompts: Sequence[Prompt], *,
                 on_line: Callable[[str], None] | None = None, progress: Progress | None = None,
                 session_options: dict | None = None):
        self.cfg, self.out, self.plan, self.prompts = cfg, out, plan, list(prompts)
        self.on_line = on_line
        self.progress = guarded_progress(progress, "bench")
        self.session_options = dict(session_options or {})
        done = out.completed_shards()
        self.done = set(done)
        self.failures: dict[str, dict] = {}  # this run's: they stand until the run ends
        self.earlier: dict[str, dict] = {}   # earlier runs': re-checked by this one
        for name in done:
            if name.startswith("failed/"):
                record = json.loads(out.read_shard(name))
                fix = FIXES.get(record.get("kind"), FIXES["error"])  # records without a fix
                self.earlier[name[len("failed/"):-len(".json")]] = {"retryable": False, "fix": fix, **record}
        self.cleared: dict[str, dict] = {}   # earlier failures this run measured past
        self.launch_counts: dict[str, int] = {}
        for name in done:
            if name.startswith("launches/"):
                key = name[len("launches/"):-len(".json")].rsplit("-", 1)[0]
                self.launch_counts[key] = self.launch_counts.get(key, 0) + 1
        self.total = len(plan.servers) * len(plan.batch_sizes) * plan.rounds
        self.measured_now = self.launched_now = 0

    # ---- bookkeeping
    def pending(self, server: ServerPlan, round_index: int | None = None) -> list[tuple[int, int]]:
        """(round, batch size) pairs still to measure on `server` (in one round, or all)."""
        if server.key in self.failures:
            return []
        rounds = range(self.plan.rounds) if round_index is None else [round_index]
        return [(r, bs) for r in rounds for bs in self.plan.batch_sizes
                if measurement_name(server.key, bs, r) not in self.done]

    def _report_progress(self) -> None:
        if self.progress:
            finished = sum(1 for n in self.done if n.startswith("m/"))
            self.progress(finished, self.total, f"{len(self.failures)} failed")

    def _port(self, server: ServerPlan) -> int:
        if self.plan.interleave == "concurrent":
            return self.cfg.serve.port + self.plan.servers.index(server)
        return self.cfg.serve.port

    def _record_failure(self, server: ServerPlan, kind: str, retryable: bool, message: str,
                        detail: dict | None = None, redact: Callable[[str], str] | None = None) -> None:
        fix = FIXES.get(kind, FIXES["error"])
        earlier = self.earlier.pop(server.key, None)
        # The record is committed to the shared store: the launch's secret values (and URL
        # credentials) are masked wherever they stand in the message and its evidence.
        redact = redact or Redactor()
        message, detail = redact(message), redact_obj(detail or {}, redact)
        record = {"key": server.key, "config": server.label, "kind": kind, "retryable": retryable, "fix": fix,
                  "message": message, "detail": detail, "at": time.time(),
                  "attempts": earlier.get("attempts", 1) + 1 if earlier else 1}
        log.warning("bench: %s failed (%s): %s; %s", server.label, kind,
                    message.splitlines()[0] if message else "", fix)
        self.out.write_shard(failure_name(server.key), _dumps(record), meta={"key": server.key, "kind": kind})
        self.done.add(failure_name(server.key))
        self.failures[server.key] = record
        self._report_progress()

    # ---- launching
    def launch(self, server: ServerPlan, stack: ExitStack) -> tuple[ServedServer, ClientApi, str] | None:
        """Start `server` inside `stack`; None (failure recorded) when it does not start."""
        cfg = server_config(self.cfg, server, self._port(server))
        session = ServerSession(cfg, draft_path=cfg.serve.draft_path,
                                target_only=server.is_baseline, strict_settings=True, on_line=self.on_line,
                                forced_accept_length=server.forced_accept_length, **self.session_options)
        started = time.time()
        try:
            served = stack.enter_context(session)
        except ServerStartError as err:
            detail = err.to_dict()
            detail["log_path"] = str(session.log_path)
            kind, retryable = start_failure(err, cfg.serve.host, cfg.serve.port)
            self._record_failure(server, kind, retryable, err.message, detail, redact=session.redact)
            return None
        n = self.launch_counts.get(server.key, 0)
        self.launch_counts[server.key] = n + 1
        try:
            launch_env = json.loads(served.launch_path.read_text())
        except (OSError, ValueError):
            launch_env = None
        api = client_api(cfg, served)
        record = {"key": server.key, "config": server.label, "drafter": server.drafter or None,
                  "forced_accept_length": server.forced_accept_length,
                  "draft_path": cfg.serve.draft_path, "launch": n, "port": cfg.serve.port,
                  "started_at": started, "seconds_to_ready": served.seconds_to_ready,
                  "settings": served.settings, "settings_mismatch": served.settings_mismatch,
                  "engine": served.engine, "engine_version": _engine_version(cfg, served),
                  "log_path": str(served.log_path), "launch_path": str(served.launch_path),
                  "launch_environment": launch_env, "phases": session.phases, "notes": served.notes,
                  "client_api": api.to_dict()}
        name = launch_name(server.key, n)
        self.out.write_shard(name, _dumps(record), meta={"key": server.key})
        self.done.add(name)
        self.launched_now += 1
        return served, api, name

    # ---- measuring
    def measure_one(self, server: ServerPlan, served: ServedServer, api: ClientApi, launch: str,
                    round_index: int, batch_size: int) -> bool:
        """Measure and commit one (server, batch size, round); False (failure recorded) if it failed."""
        b = self.cfg.bench
        try:
            result = measure(served.base_url, api, self.prompts, batch_size=batch_size, max_tokens=b.max_tokens,
                             ignore_eos=b.ignore_eos, warmup_requests=b.warmup_requests, flush=b.flush_cache,
                             engine=served.process.engine if served.process else None,
                             timeout_s=b.request_timeout_s)
        except (MeasurementError, httpx.HTTPError, ValueError) as err:
            dead = served.process is not None and served.process.poll() is not None
            self._record_failure(server, *measure_failure(err, dead), str(err),
                                 {"round": round_index, "batch_size": batch_size, "log_path": str(served.log_path),
                                  "http_status": getattr(err, "status", None)},
                                 redact=served.process.redact if served.process else None)
            return False
        if server.key in self.earlier:
            # measured where an earlier run failed: its record goes first (a kill in between
            # only means this measurement is taken again)
            self.out.drop_shard(failure_name(server.key))
            self.done.discard(failure_name(server.key))
            self.cleared[server.key] = self.earlier.pop(server.key)
            log.info("bench: %s measured; its earlier failure (%s) is cleared", server.label,
                     self.cleared[server.key]["kind"])
        record = {"key": server.key, "config": server.label, "baseline": server.is_baseline,
                  "drafter": server.drafter or None, "forced_accept_length": server.forced_accept_length,
                  "round": round_index, "launch": launch, **result}
        name = measurement_name(server.key, batch_size, round_index)
        self.out.write_shard(name, _dumps(record), meta={"key": server.key, "batch_size": batch_size,
                                                         "round": round_index})
        self.done.add(name)
        self.measured_now += 1
        self._report_progress()
        return True

    def run(self) -> None:
        self._report_progress()
        if self.plan.interleave == "concurrent":
            self._run_concurrent()
        else:
            self._run_relaunch()

    def _run_concurrent(self) -> None:
        with ExitStack() as outer:
            live: dict[str, tuple[ServedServer, ClientApi, str, ExitStack]] = {}
            for server in self.plan.servers:
                if not self.pending(server):
                    continue
                own = ExitStack()
                outer.callback(own.close)  # later servers close first; a failed one closes early
                started = self.launch(server, own)
                if started is not None:
                    live[server.key] = (*started, own)
            for r in range(self.plan.rounds):
                for server in self.plan.order(r):
                    if server.key not in live:
                        continue
                    served, api, launch, own = live[server.key]
                    for _, bs in self.pending(server, r):
                        if not self.measure_one(server, served, api, launch, r, bs):
                            live.pop(server.key)
                            own.close()
                            break

    def _run_relaunch(self) -> None:
        for r in range(self.plan.rounds):
            for server in self.plan.order(r):
                todo = self.pending(server, r)
                if not todo:
                    continue
                with ExitStack() as own:
                    started = self.launch(server, own)
                    if started is None:
                        continue
                    served, api, launch = started
                    for _, bs in todo:
                        if not self.measure_one(server, served, api, launch, r, bs):
                            break

    # ---- reading back
    def outcome(self) -> SweepOutcome:
        """Every committed measurement and launch (this run's and earlier runs'), the failures that
        stand (this run's; an earlier one only if this run never got to re-check it)."""
        shards = self.out.completed_shards()
        out = SweepOutcome(failures={**self.earlier, **self.failures}, cleared=dict(self.cleared),
                           measured_now=self.measured_now, launched_now=self.launched_now)
        for name in shards:
            if name.startswith("m/"):
                out.measurements.append(json.loads(self.out.read_shard(name)))
            elif name.startswith("launches/"):
                out.launches.append(json.loads(self.out.read_shard(name)))
        return out
