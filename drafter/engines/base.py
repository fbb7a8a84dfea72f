"""The Engine interface and what every engine shares.

An `Engine` knows four things about a server program: how to launch it from a validated
`LifecycleConfig` (`build_launch`), what its start-up log looks like (`phases`, `ready_patterns`,
`fatal_patterns`, used by the stall watchdog, and `config_error_patterns`: the lines that mean
"this configuration cannot run on this host", a failed start that no retry will fix), how to ask a
running server which speculative settings it ACTUALLY uses (`read_settings`; field note 3: a flag
can be quietly rewritten), how to read its acceptance counters (`metrics_snapshot` /
`accept_length`), how to make it accept a set number of drafts whatever the drafter proposes
(`forced_acceptance`: the bench's accept-length curve), and how it is configured with a setting
per batch size (`per_batch_size`: the bench's deployable settings).

This module holds the base class, the launch spec (`LaunchSpec`), start-up phases, the helpers the
engines' command lines share (SGLang-style speculative flags, option tables, the launch
environment), and `check_speculative_settings`, which compares what was asked for with what any
engine reports. It knows no engine: each one lives in its own module next to it and imports this.
"""
from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, NamedTuple, Sequence

import httpx

from drafter.config import LifecycleConfig, SpeculativeConfig
from drafter.server_errors import ServerConfigError

GenerateStyle = Literal["sglang", "openai"]


# ServeConfig field -> engine flag tables (sglang.SGLANG_OPTION_FLAGS, vllm.VLLM_OPTION_FLAGS). Booleans
# become bare flags when true; other values are passed when set. One table per engine keeps the two
# command lines from drifting apart.
def _option_flags(serve, flags: dict[str, str]) -> list[str]:
    argv: list[str] = []
    for field, flag in flags.items():
        value = getattr(serve, field)
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv


class Phase(NamedTuple):
    """A start-up phase, entered when a log line matches `pattern`.

    `budget_s` is how long the phase may go without log progress before it counts as hung;
    None means "use the caller's stall timeout". A budget never exceeds the caller's stall
    timeout unless the caller names the phase in `phase_budgets` (see gate.phase_budget).
    """

    name: str
    pattern: re.Pattern | None
    budget_s: float | None = None


def _rx(*alternatives: str, flags: int = 0) -> re.Pattern:
    return re.compile("|".join(f"(?:{a})" for a in alternatives), flags)


class ConfigErrorLine(NamedTuple):
    """A log line saying the configuration cannot run on this host (an unsupported backend, a missing
    kernel): the start fails for good, so the gate raises ServerConfigError (not retryable) instead of
    ServerCrashed. `explain` is `str.format`ted with the match's named groups and `line` (the line)."""

    pattern: re.Pattern
    explain: str


@dataclass
class LaunchSpec:
    """Everything needed to start one server, and to save with the run (field note 2)."""

    engine: str
    argv: list[str]
    env: dict[str, str]                 # the full environment given to the process
    env_overrides: dict[str, str]       # what the configuration added on top of os.environ
    cwd: str
    host: str
    port: int
    base_url: str                       # where probes go (loopback when host is a wildcard)
    health_url: str
    served_model_name: str
    generate_style: GenerateStyle = "openai"
    models_path: str = "/v1/models"
    model_path: str | None = None       # checked by preflight when it is a local path
    draft_path: str | None = None
    log_dir: str | None = None

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path


@dataclass(frozen=True)
class ForcedAcceptance:
    """What one engine is given to accept `accept_length` tokens per verify on average (bonus
    included: 1 + accepted drafts / verifies) whatever the drafter proposes, so a cycle costs what a
    real one with that acceptance costs. Timing only: the output is not the target's. `source`
    names the engine code that reads the knob."""

    accept_length: float
    args: tuple[str, ...] = ()                                      # command-line flags to add
    env: Mapping[str, str] = field(default_factory=dict)            # launch environment to add
    speculative_config: Mapping[str, Any] = field(default_factory=dict)  # vLLM: --speculative-config keys
    source: str = ""


@dataclass(frozen=True)
class BatchSetting:
    """What to serve at one batch size: a speculative setting with its drafter, or nothing
    (`speculative` and `draft_path` None: no speculation)."""

    batch_size: int
    speculative: SpeculativeConfig | None = None
    draft_path: str | None = None


@dataclass(frozen=True)
class PerBatchConfig:
    """An engine's own configuration for a setting per batch size: `one_server`, the arguments of one
    server that picks the setting by batch size itself, or (None) `per_batch`, the speculative
    arguments of one server per batch size (an engine that takes one setting per server). `note`:
    how the engine reads it, and what was not measured."""

    one_server: tuple[str, ...] | None
    per_batch: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"one_server": list(self.one_server) if self.one_server is not None else None,
                "per_batch": {str(bs): list(args) for bs, args in sorted(self.per_batch.items())},
                "note": self.note}


# --------------------------------------------------------------------------------------------
# Engine base
# --------------------------------------------------------------------------------------------

# Our own readiness probes show up in access logs; they are not the server making progress.
_PROBE_ACCESS = re.compile(
    r'"(?:GET|POST) /(?:health|health_generate|v1/models|generate|v1/completions|get_server_info'
    r'|server_info|metrics)\S* HTTP/')
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class Engine:
    name: str = "engine"
    generate_style: GenerateStyle = "openai"
    phases: tuple[Phase, ...] = (Phase("launch", None),)
    ready_patterns: tuple[re.Pattern, ...] = ()
    fatal_patterns: tuple[re.Pattern, ...] = ()
    config_error_patterns: tuple[ConfigErrorLine, ...] = ()
    noise_patterns: tuple[re.Pattern, ...] = (_PROBE_ACCESS,)

    # ---- launching -------------------------------------------------------------------------
    def build_launch(self, cfg: LifecycleConfig, draft_path: str | None = None,
                     log_dir: str | os.PathLike | None = None, *, faults: Sequence[str] = (),
                     forced_accept_length: float | None = None) -> LaunchSpec:
        """`forced_accept_length`: serve with `forced_acceptance` (the settings must be explicit)."""
        raise NotImplementedError

    def forced_acceptance(self, accept_length: float, num_steps: int) -> ForcedAcceptance:
        """How this engine is made to accept `accept_length` tokens per verify at `num_steps` draft
        steps; ServerConfigError when it has no way."""
        raise ServerConfigError(f"engine {self.name!r} has no known way to force an accept length")

    # ---- deploying a setting per batch size -------------------------------------------------
    # How this engine takes its speculative setting: one per server (SGLang's server arguments).
    per_batch_note: str = ("One speculative setting per server: launch one server per batch size, or the one for "
                           "the batch size it will serve.")

    def speculative_args(self, spec: SpeculativeConfig | None, draft_path: str | None) -> list[str]:
        """The launch arguments that serve `spec` with the drafter at `draft_path` (none: no
        speculation), as `build_launch` writes them."""
        return speculative_flags(spec, draft_path)

    def per_batch_size(self, settings: Sequence[BatchSetting]) -> PerBatchConfig:
        """This engine's configuration for `settings` (one per batch size). Here: an engine that
        takes one setting per server, so the speculative arguments of one server per batch size."""
        return PerBatchConfig(None, {s.batch_size: tuple(self.speculative_args(s.speculative, s.draft_path))
                                     for s in settings}, self.per_batch_note)

    # ---- log classification ----------------------------------------------------------------
    def classify(self, line: str) -> tuple[str | None, bool, bool, bool]:
        """(phase entered or None, is ready line, is fatal line, is noise) for one log line."""
        clean = _ANSI.sub("", line)
        noise = any(p.search(clean) for p in self.noise_patterns)
        phase = None
        for ph in self.phases:
            if ph.pattern is not None and ph.pattern.search(clean):
                phase = ph.name  # the last matching phase wins: patterns are listed in start-up order
        ready = any(p.search(clean) for p in self.ready_patterns)
        fatal = any(p.search(clean) for p in self.fatal_patterns)
        return phase, ready, fatal, noise

    def config_error(self, lines: Iterable[str]) -> str | None:
        """Why this configuration cannot run on this host, from the first of `lines` (a failed start's
        log) matching `config_error_patterns`; None when none does (then the failure is a crash)."""
        for line in lines:
            clean = _ANSI.sub("", line).strip()
            for known in self.config_error_patterns:
                m = known.pattern.search(clean)
                if m:
                    groups = {k: v for k, v in m.groupdict().items() if v is not None}
                    return known.explain.format(**{"line": clean, **groups})
        return None

    def phase_default(self, name: str) -> float | None:
        for ph in self.phases:
            if ph.name == name:
                return ph.budget_s
        return None

    def _host_port_spec(self, cfg: LifecycleConfig, argv: list[str], draft_path: str | None,
                        log_dir: str | os.PathLike | None) -> LaunchSpec:
        """The spec of a server that listens on serve.host:serve.port with SGLang/vLLM paths."""
        s, t = cfg.serve, cfg.target
        env, overrides = _launch_env(cfg)
        base = f"http://{_probe_host(s.host)}:{s.port}"
        return LaunchSpec(
            engine=self.name, argv=argv, env=env, env_overrides=overrides, cwd=os.getcwd(),
            host=s.host, port=s.port, base_url=base, health_url=base + "/health",
            served_model_name=t.served_name, generate_style=self.generate_style,
            model_path=t.path, draft_path=draft_path, log_dir=str(log_dir) if log_dir else None)

    # ---- reading the running server --------------------------------------------------------
    def read_settings(self, client: httpx.Client, log_text: str = "") -> dict[str, Any]:
        """The speculative settings the running server uses, normalized to SpeculativeConfig names:
        algorithm (None = speculation off), num_steps, eagle_topk, num_draft_tokens, draft_path.
        `client` is an httpx.Client whose base_url is the server; `log_text` its log so far."""
        return {}

    def metrics_snapshot(self, client: httpx.Client) -> dict[str, Any]:
        return {}

    def accept_length(self, before: Mapping[str, Any] | None, after: Mapping[str, Any],
                      responses: Sequence[Mapping[str, Any]] = ()) -> float | None:
        return None

    def probe_version(self, base_url: str) -> str | None:
        """The running server's version when its settings did not report one (None: unknown)."""
        return None

    # ---- what the stages ask of an engine ----------------------------------------------------
    # The export layout this engine loads (drafter.export: "sglang", or "vllm" whose layer ids are
    # one higher).
    export_format: str = "sglang"
    # Streams tokens: the bench measures TTFT and inter-token latency.
    streams: bool = False
    # SGLang's /flush_cache (radix cache and cumulative counters): True has it, False has not, None: try it.
    flush_cache: bool | None = False
    # /metrics carries the spec-decode counters the bench reads per measurement (vLLM's).
    reports_counters: bool = False

    @property
    def not_streaming_note(self) -> str:
        """The bench report's note for an engine that does not stream."""
        return f"engine {self.name}: TTFT and inter-token latency are not measured (it does not stream)"

    def client_style(self, settings: Mapping[str, Any]) -> GenerateStyle:
        """Which API the bench measures with: SGLang's /generate ("sglang") or OpenAI completions,
        given the settings the running server reported."""
        return self.generate_style

    def runs_without_gpu(self, serve) -> bool:
        """The server of `serve` (a ServeConfig) takes no GPU: preflight skips the GPU check."""
        return False

    def servers_share_no_gpu(self, serve) -> bool:
        """Several servers of `serve` can run at once (the bench's `concurrent` interleave)."""
        return self.runs_without_gpu(serve)

    def serve_problem(self, serve) -> str | None:
        """What `serve` (a ServeConfig) lacks for this engine: a configuration error, or None."""
        return None

    def speculative_problem(self, spec: SpeculativeConfig) -> str | None:
        """Why this engine cannot run `spec` beyond what SpeculativeConfig and `build_launch`
        enforce (a server that would exit at start), or None."""
        return None

    def bench_serve_update(self, serve, spec: SpeculativeConfig | None, draft_path: str | None) -> dict[str, Any]:
        """ServeConfig fields the bench changes, besides speculative / draft_path, to serve `spec`."""
        return {}

    # ---- preflight ---------------------------------------------------------------------------
    # Preflight checks that a local draft path is a drafter directory (config.json + safetensors).
    checks_draft_dir: bool = True
    # (module to find, distributions whose version to read) in the engine's interpreter; None: no
    # version to ask (then the draft's layer ids are not checked against a versioned rule).
    version_packages: tuple[str, tuple[str, ...]] | None = None

    def check_layer_ids(self, draft_path: str | None, target_path: str, python: str) -> dict[str, Any]:
        """The layer-id rule hook: are the draft config's ids the ones this engine, at the version
        installed for `python`, needs for the layers the drafter was trained on? A report for the
        serve record; ServerConfigError when they are not (drafter.engines.layer_check)."""
        from drafter.engines.layer_check import check_versioned

        if self.version_packages is None or draft_path is None:
            return {"checked": False, "why": f"engine {self.name!r} reads our ids as they are" if draft_path
                    else "no drafter"}
        return check_versioned(self.name, draft_path, target_path, python)

    def launch_rules(self, cfg: LifecycleConfig, argv: Sequence[str], env: Mapping[str, str], python: str,
                     layer_ids: Mapping[str, Any], *, speculating: bool) -> dict[str, Any]:
        """Who decides how this engine reads the exact launch argv (the installed engine, asked
        without starting it, or our transcribed rules): a report with a `source`; {} when nothing
        is asked. Raises ServerConfigError when the launch would not serve what was asked."""
        return {}

    def validate_profile(self, cfg: LifecycleConfig) -> str:
        """`drafter config validate`: what this engine says about every launch the profile can
        make, as a suffix of the profile's `ok` line ("" for nothing). ServerConfigError: a problem."""
        return ""

    # ---- command lines SGLang and vLLM share ---------------------------------------------------
    def _begin_launch(self, cfg: LifecycleConfig, draft_path: str | None, faults: Sequence[str],
                      forced_accept_length: float | None):
        """(serve, target, forced acceptance) of a production engine's launch: no fault injection."""
        _no_faults(self.name, faults)
        s = cfg.serve
        return s, cfg.target, _forced(self, s.speculative, draft_path, forced_accept_length)

    @staticmethod
    def _target_flags(target) -> list[str]:
        return (["--dtype", target.dtype] if target.dtype != "auto" else []) + (
            ["--trust-remote-code"] if target.trust_remote_code else [])


def generate_one_token(client: httpx.Client, spec: LaunchSpec, prompt: str,
                       timeout_s: float) -> tuple[bool, str | None, httpx.Response]:
    """One greedy token in the server's generate style (the readiness gate's last check):
    (answered, the text, the response)."""
    if spec.generate_style == "sglang":
        resp = client.post("/generate", timeout=timeout_s, json={
            "text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        body = resp.json() if resp.status_code == 200 else None
        ok = isinstance(body, dict) and "text" in body
        return ok, body["text"] if ok else None, resp
    resp = client.post("/v1/completions", timeout=timeout_s, json={
        "model": spec.served_model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0.0})
    choices = resp.json().get("choices") if resp.status_code == 200 else None
    ok = bool(choices)
    return ok, choices[0].get("text") if ok else None, resp


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------

def _probe_host(host: str) -> str:
    """Probes go to loopback when the server listens on every interface."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def keep_secret_placeholders(arg: str) -> str:
    from drafter.secrets import _PLACEHOLDER

    return _PLACEHOLDER.sub(lambda m: "{" + m.group(0) + "}", arg)


def _launch_env(cfg: LifecycleConfig) -> tuple[dict[str, str], dict[str, str]]:
    from drafter.launch_env import launch_overrides

    overrides = launch_overrides(cfg.serve.env)
    return {**os.environ, **overrides}, overrides


def _speculates(spec: SpeculativeConfig | None, draft_path: str | None) -> bool:
    """Whether the server gets a drafter; serve.speculative without a draft path is refused."""
    if draft_path is None and spec is not None:
        raise ServerConfigError(
            "serve.speculative is set but no draft path was given: refusing to start a "
            "server that would silently run without speculation")
    return draft_path is not None


def speculative_flags(spec: SpeculativeConfig | None, draft_path: str | None) -> list[str]:
    """SGLang-style flags. S/K/D come all three or not at all (SGLang asserts otherwise);
    SpeculativeConfig has already enforced that and SGLang's K=1 / S*K+1 rules."""
    if not _speculates(spec, draft_path):
        return []
    algorithm = spec.algorithm if spec is not None else "EAGLE3"
    flags = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(draft_path)]
    if spec is not None and spec.is_set:
        flags += ["--speculative-num-steps", str(spec.num_steps),
                  "--speculative-eagle-topk", str(spec.eagle_topk),
                  "--speculative-num-draft-tokens", str(spec.num_draft_tokens)]
    return flags


def _forced(engine: Engine, spec: SpeculativeConfig | None, draft_path: str | None,
            accept_length: float | None) -> ForcedAcceptance | None:
    """The engine's forced acceptance for a launch, checked: a drafter, explicit settings, and an
    accept length a chain of num_steps drafts can reach ([1, num_steps + 1])."""
    if accept_length is None:
        return None
    if draft_path is None or spec is None or not spec.is_set:
        raise ServerConfigError(f"{engine.name}: a forced accept length needs a drafter and explicit speculative "
                                f"settings (num_steps / eagle_topk / num_draft_tokens)")
    if not 1.0 <= accept_length <= spec.num_steps + 1:
        raise ServerConfigError(f"{engine.name}: forced accept length {accept_length:g} is out of reach of "
                                f"{spec.num_steps} draft steps: it must be in [1, {spec.num_steps + 1}]")
    return engine.forced_acceptance(accept_length, spec.num_steps)


def _with_forced(launch: LaunchSpec, forced: ForcedAcceptance | None) -> LaunchSpec:
    """`launch` with the forced acceptance's flags and environment (saved with the run like any)."""
    if forced is not None:
        launch.argv += list(forced.args)
        launch.env.update(forced.env)
        launch.env_overrides.update(forced.env)
    return launch


def _no_faults(engine: str, faults: Sequence[str]) -> None:
    if faults:
        raise ServerConfigError(f"fault injection is only available for the reference engine, not {engine!r}")


def engine_python(cfg: LifecycleConfig) -> str:
    """The interpreter that runs SGLang / vLLM: `serve.python` (the engine's own environment), else ours."""
    return cfg.serve.python or sys.executable


# --------------------------------------------------------------------------------------------
# What the server reports against what we asked for
# --------------------------------------------------------------------------------------------

_MISSING = object()


def _same_path(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return False


def check_speculative_settings(requested: SpeculativeConfig | None, actual: Mapping[str, Any],
                               draft_path: str | None = None) -> list[str]:
    """Every difference between what we asked for and what the server reports using.

    Speculation is expected when `requested` is set or a `draft_path` was given; then the
    algorithm must match, S/K/D must match when they were set (SGLang rewrites D when K=1,
    vLLM has no topk), and the draft path must be the one we launched with."""
    if not actual:
        return ["could not read the server's settings back: nothing reported"]
    if "error" in actual:
        return [f"could not read the server's settings back: {actual['error']}"]
    expect = requested is not None or draft_path is not None
    problems: list[str] = []
    algo = actual.get("algorithm", _MISSING)
    if not expect:
        if algo not in (None, _MISSING, "", "NONE"):
            problems.append(f"algorithm: no speculation was requested but the server runs {algo}")
        return problems
    want_algo = requested.algorithm if requested is not None else "EAGLE3"
    if algo is _MISSING:
        problems.append("algorithm: the server did not report its speculative algorithm")
    elif not algo:
        problems.append(f"algorithm: {want_algo} was requested but speculation is off on the server")
    elif str(algo).upper() != want_algo.upper():
        problems.append(f"algorithm: requested {want_algo}, server uses {algo}")
    if requested is not None and requested.is_set:
        for key in ("num_steps", "eagle_topk", "num_draft_tokens"):
            want, got = getattr(requested, key), actual.get(key)
            if got is None:
                problems.append(f"{key}: requested {want}, the server did not report it")
            elif not (isinstance(got, (int, float)) and not isinstance(got, bool) and math.isclose(got, want)):
                problems.append(f"{key}: requested {want}, server uses {got}")
    if draft_path is not None:
        got = actual.get("draft_path")
        if got is None:
            problems.append(f"draft_path: requested {draft_path}, the server did not report it")
        elif not _same_path(str(got), str(draft_path)):
            problems.append(f"draft_path: requested {draft_path}, server uses {got}")
    return problems
