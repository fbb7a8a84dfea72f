"""SGLang (`python -m sglang.launch_server`): its command line, its start-up log lines, and how
its /get_server_info answer reads back as our settings names. The reference and command engines
reuse the server-info readers (both speak SGLang's endpoints)."""
from __future__ import annotations

import re
from typing import Any, Mapping

import httpx

from drafter.engines.base import (ConfigErrorLine, Engine, ForcedAcceptance, GenerateStyle, Phase, _option_flags, _rx,
                                  _with_forced, engine_python, speculative_flags)
from drafter.engines.metrics import sglang_accept_length, sglang_avg_accept_length

# ServeConfig field -> engine flag (see _option_flags; vllm.VLLM_OPTION_FLAGS is the same table for vLLM).
SGLANG_OPTION_FLAGS = {
    "mem_fraction_static": "--mem-fraction-static",
    "cuda_graph_max_bs": "--cuda-graph-max-bs",
    "disable_cuda_graph": "--disable-cuda-graph",
    "disable_custom_all_reduce": "--disable-custom-all-reduce",
    "max_running_requests": "--max-running-requests",
}

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



class SGLangEngine(Engine):
    name = "sglang"
    generate_style: GenerateStyle = "sglang"
    phases = SGLANG_PHASES
    ready_patterns = SGLANG_READY
    fatal_patterns = SGLANG_FATAL
    config_error_patterns = SGLANG_CONFIG_ERRORS

    # srt/arg_groups/fields/spec.py: --speculative-num-steps / -eagle-topk / -num-draft-tokens are server
    # arguments. --speculative-adaptive with --speculative-adaptive-config (candidate steps per batch-size
    # slot, topk 1 only: srt/speculative/adaptive_spec_params.py) picks among a slot's candidates at run
    # time from the accept length it sees: a server this bench did not measure, so not what we emit.
    per_batch_note = ("SGLang 0.5.23 takes one speculative setting per server: launch one server per batch size, "
                      "or the one for the batch size it will serve. (Its --speculative-adaptive-config gives "
                      "candidate steps per batch-size slot, topk 1 only, chosen at run time from the accept length "
                      "it sees: a server not measured here.)")

    # what the stages ask (drafter.engines.base.Engine)
    export_format = "sglang"
    streams = True
    flush_cache = True
    version_packages = ("sglang", ("sglang",))

    def build_launch(self, cfg, draft_path=None, log_dir=None, *, faults=(), forced_accept_length=None):
        s, t, forced = self._begin_launch(cfg, draft_path, faults, forced_accept_length)
        argv = [engine_python(cfg), "-m", "sglang.launch_server",
                "--model-path", t.path, "--served-model-name", t.served_name,
                "--host", s.host, "--port", str(s.port), "--tp-size", str(s.tp_size)]
        argv += self._target_flags(t)
        argv += speculative_flags(s.speculative, draft_path)
        argv += _option_flags(s, SGLANG_OPTION_FLAGS)
        argv += list(s.extra_args)
        return _with_forced(self._host_port_spec(cfg, argv, draft_path, log_dir), forced)

    def forced_acceptance(self, accept_length, num_steps):
        # sglang 0.5.23 srt/environ.py:527-528 declares SGLANG_SIMULATE_ACC_LEN (-1: off) and
        # SGLANG_SIMULATE_ACC_METHOD; srt/speculative/spec_utils.py:276 reads them at import, and
        # eagle_utils.py:807 replaces the verify's accept index when > 0 (spec_utils.py:527
        # generate_simulated_accept_index: length - 1 correct drafts, counted in meta_info).
        # match-expected (spec_utils.py:505) draws floor or ceil so the mean is the value asked
        # for; it is the default, set here so a changed default cannot move the curve.
        return ForcedAcceptance(accept_length, env={"SGLANG_SIMULATE_ACC_LEN": str(float(accept_length)),
                                                    "SGLANG_SIMULATE_ACC_METHOD": "match-expected"},
                                source="sglang srt/speculative/spec_utils.py SGLANG_SIMULATE_ACC_LEN")

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

    def launch_rules(self, cfg, argv, env, python, layer_ids, *, speculating):
        # the installed SGLang decides how it reads our flags and ids (drafter.engines.sglang_rules)
        from drafter.engines.sglang_rules import preflight_with_sglang

        return preflight_with_sglang(cfg, argv, env, python, layer_ids, speculating=speculating)

    def validate_profile(self, cfg):
        """The installed SGLang (serve.python) resolves every launch of the profile and names the layers
        it captures; says which source decided."""
        from drafter.engines.sglang_rules import validate_with_sglang

        report = validate_with_sglang(cfg)
        if not report["asked_sglang"]:
            return f" (sglang: {report['source']})"
        checked = ", ".join(f"{l['setting']} -> {l['resolved']['num_steps']}/{l['resolved']['eagle_topk']}/"
                            f"{l['resolved']['num_draft_tokens']}" for l in report["launches"]
                            if l["resolved"]["algorithm"])
        layers = report.get("layers")
        return (f" (checked by {report['source']}: {checked}"
                + (f"; draft ids {layers['ids']} capture the outputs of layers {layers['aux_layer_ids']}"
                   if layers else "")
                + ")")
