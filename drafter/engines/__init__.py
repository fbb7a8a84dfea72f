"""Inference engines behind one interface (their registry of names: drafter.engine_registry).

Engines: `sglang`, `vllm` (production), `reference` (our own server, SGLang-compatible endpoints
and start-up lines; the `reference` subpackage also holds that server and its speculative decoder)
and `command` (any user command plus a health URL). Each lives in its own module and subclasses
`base.Engine`, which is where every fact about an engine is asked (launch, log lines, export format,
streaming, cache flush, counters, version, settings read-back, preflight and layer-id rules); adding
one is its module plus its line in drafter.engine_registry.ENGINES. Server supervision
(drafter.serving) asks the engine object and names none.

How a chat completion is asked for the token ids it generated, and where each engine puts them
(`TOKEN_IDS_REQUEST`, `answer_token_ids`), is engine-independent (`answers`): datagen talks to
servers it did not start and cannot tell apart, so one request and one reader serve all of them.
Counter parsing lives in drafter.engines.metrics; its readers are re-exported here for callers.
"""
from __future__ import annotations

from drafter.engines.answers import TOKEN_IDS_REQUEST, answer_token_ids
from drafter.engines.base import _launch_env  # noqa: F401  (sglang_rules reads it from here)
from drafter.engines.base import (
    BatchSetting, ConfigErrorLine, Engine, ForcedAcceptance, GenerateStyle, LaunchSpec, PerBatchConfig, Phase,
    check_speculative_settings, engine_python, keep_secret_placeholders, speculative_flags)
from drafter.engines.command import GENERIC_PHASES, CommandEngine
from drafter.engines.reference import ReferenceEngine
from drafter.engines.sglang import (
    SGLANG_CONFIG_ERRORS, SGLANG_FATAL, SGLANG_OPTION_FLAGS, SGLANG_PHASES, SGLANG_READY, SGLangEngine,
    sglang_server_info, sglang_settings_from_info)
from drafter.engines.vllm import (
    VLLM_FATAL, VLLM_OPTION_FLAGS, VLLM_PHASES, VLLM_READY, VLLMEngine, vllm_settings_from_log)
from drafter.engine_registry import ENGINES, engine_class, make_engine
from drafter.engines.metrics import (
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
    "sglang_avg_accept_length", "vllm_accept_length", "vllm_spec_counters", "ENGINES", "engine_class", "make_engine",
]
