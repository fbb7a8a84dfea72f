"""Inference engines behind one interface, and the registry that names them.

Engines: `sglang`, `vllm` (production), `reference` (our own server, SGLang-compatible endpoints
and start-up lines) and `command` (any user command plus a health URL). Each lives in its own
module and subclasses `base.Engine`; adding one is its module plus its entry in `_ENGINES` below
(with the import of its class).

How a chat completion is asked for the token ids it generated, and where each engine puts them
(`TOKEN_IDS_REQUEST`, `answer_token_ids`), is engine-independent (`answers`): datagen talks to
servers it did not start and cannot tell apart, so one request and one reader serve all of them.
Counter parsing lives in drafter.serving.metrics; its readers are re-exported here for callers.
"""
from __future__ import annotations

from drafter.serving.engines.answers import TOKEN_IDS_REQUEST, answer_token_ids
from drafter.serving.engines.base import _launch_env  # noqa: F401  (sglang_rules reads it from here)
from drafter.serving.engines.base import (
    BatchSetting, ConfigErrorLine, Engine, ForcedAcceptance, GenerateStyle, LaunchSpec, PerBatchConfig, Phase,
    check_speculative_settings, engine_python, keep_secret_placeholders, speculative_flags)
from drafter.serving.engines.command import GENERIC_PHASES, CommandEngine
from drafter.serving.engines.reference import ReferenceEngine
from drafter.serving.engines.sglang import (
    SGLANG_CONFIG_ERRORS, SGLANG_FATAL, SGLANG_OPTION_FLAGS, SGLANG_PHASES, SGLANG_READY, SGLangEngine,
    sglang_server_info, sglang_settings_from_info)
from drafter.serving.engines.vllm import (
    VLLM_FATAL, VLLM_OPTION_FLAGS, VLLM_PHASES, VLLM_READY, VLLMEngine, vllm_settings_from_log)
from drafter.serving.errors import ServerConfigError
from drafter.serving.metrics import (
    counters_delta, parse_prometheus, sglang_accept_length, sglang_avg_accept_length, vllm_accept_length,
    vllm_spec_counters)

__all__ = [
    "TOKEN_IDS_REQUEST", "answer_token_ids", "BatchSetting", "ConfigErrorLine", "Engine", "ForcedAcceptance",
    "GenerateStyle", "LaunchSpec", "PerBatchConfig", "Phase",
    "check_speculative_settings", "engine_python", "keep_secret_placeholders", "speculative_flags",
    "GENERIC_PHASES", "CommandEngine", "ReferenceEngine", "SGLANG_CONFIG_ERRORS", "SGLANG_FATAL",
    "SGLANG_OPTION_FLAGS", "SGLANG_PHASES", "SGLANG_READY", "SGLangEngine", "sglang_server_info",
    "sglang_settings_from_info", "VLLM_FATAL", "VLLM_OPTION_FLAGS", "VLLM_PHASES", "VLLM_READY", "VLLMEngine",
    "vllm_settings_from_log", "counters_delta", "parse_prometheus", "sglang_accept_length",
    "sglang_avg_accept_length", "vllm_accept_length", "vllm_spec_counters", "make_engine",
]

# Every engine by its `serve.engine` name: one line per engine module.
_ENGINES: dict[str, type[Engine]] = {
    "sglang": SGLangEngine,
    "vllm": VLLMEngine,
    "reference": ReferenceEngine,
    "command": CommandEngine,
}


def make_engine(name: str) -> Engine:
    try:
        return _ENGINES[name]()
    except KeyError:
        raise ServerConfigError(f"unknown engine {name!r} (known: {', '.join(sorted(_ENGINES))})") from None
