"""The one layer-id convention, the one rule for which aux layer ids a target can serve, and the one
mapping from our ids to the ids each engine must be given.

An aux layer id i means "the OUTPUT of decoder layer i" (0-based), i.e. Hugging Face
`hidden_states[i + 1]`. This is what SpecForge trains with (reference: sglang-eagle3-contract.md
section 2). Config validation, capture and serving all call `aux_layer_id_problem` /
`check_aux_layer_ids`, so the rule cannot drift apart.

What an engine does with the ids in a draft config depends on the engine, its version and the
target's architecture (contract sections 8-9, read in the engines' own model code):
- SGLang, Llama-like models: `layers_to_capture = [i + 1 for i in ids]` -> our ids, unchanged;
- SGLang 0.5.23, deepseek_v2.py (DeepSeek-V3, Kimi-K2/K2.5): +1 only when ids[0] == 1, else the ids
  are taken as "input of layer i" -> unchanged when ids[0] == 1, else ours + 1 (our 0 impossible);
- vLLM 0.32 (llama.py, deepseek_v2.py): id i = input of layer i -> ours + 1.
`engine_layer_ids` is the only place that knows this; export, serve and capture call it, and a
combination nobody has read is an error naming it, never a guess.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from drafter.errors import DrafterError

LAYER_ID_CONVENTION = "output-of-layer-0-based"
INPUT_OF_LAYER_CONVENTION = "input-of-layer-0-based"  # vLLM / speculators / ModelOpt: HF hidden_states[i]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """SpecForge/SGLang default: [1, N//2 - 1, N - 4], clamped for very shallow targets."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    return [min(max(i, 0), max(num_layers - 2, 0)) for i in ids]


def aux_layer_id_problem(ids: list[int], num_layers: int) -> str | None:
    """None when every id can be captured from a `num_layers`-layer target, else why not.

    The last layer (N - 1) is excluded: HF returns its output only after the final norm, and SGLang
    captures aux states at the input of layer i + 1, which does not exist for i = N - 1, so a
    drafter would be trained on features serving never has."""
    bad = [int(i) for i in ids if not 0 <= int(i) < num_layers - 1]
    if not bad:
        return None
    return (f"{bad} out of range for a target with {num_layers} layers (convention "
            f"{LAYER_ID_CONVENTION!r}: id i = output of decoder layer i (0-based) = HF hidden_states[i + 1], "
            f"so valid ids are 0..{num_layers - 2}; SGLang cannot capture the last layer's output; ids in the "
            f"'input of layer i' convention (vLLM speculators, ModelOpt) are one higher)")


def check_aux_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    """`ids` as ints, or ValueError naming the ids out of range (see aux_layer_id_problem)."""
    problem = aux_layer_id_problem(ids, num_layers)
    if problem is not None:
        raise ValueError(f"aux layer ids {problem}")
    return [int(i) for i in ids]


# ------------------------------------------------------------------ ids per engine, version, architecture

class UnknownLayerIdRule(DrafterError, ValueError):
    """No rule was read for this (engine, version, architecture), or the ids cannot be expressed
    there. Never retried: guessing would serve the drafter one layer off, silently."""

    retryable = False


# Architectures whose model code shares the Llama capture loop in each engine (read in the wheels).
LLAMA_LIKE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
              "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Glm4MoeLiteForCausalLM")
DEEPSEEK_V2 = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK2ForCausalLM",
               "KimiK25ForConditionalGeneration")
# vLLM 0.32 (read in the wheel): llama.py (Mistral subclasses it), qwen2.py (Qwen3 reuses it) and
# qwen3_moe.py append the state after layer idx as id idx + 1; deepseek_v2.py appends it before layer idx.
VLLM_PLUS_ONE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Qwen3MoeForCausalLM") + DEEPSEEK_V2


@dataclass(frozen=True)
class _Rule:
    engine: str
    versions: tuple[tuple[int, ...], tuple[int, ...]]   # inclusive range, by (major, minor[, patch])
    architectures: tuple[str, ...]
    kind: str                                            # "unchanged" | "plus_one" | "deepseek_v2_first_is_1"
    source: str                                          # where the rule was read

    def covers(self, engine: str, version: tuple[int, ...], architecture: str) -> bool:
        lo, hi = self.versions
        return (engine == self.engine and architecture in self.architectures
                and lo <= version[:len(lo)] and version[:len(hi)] <= hi)


# Only versions whose model code was read (or run) are listed: a newer engine gets a rule when someone
# has read its capture loop, not before.
RULES = (
    _Rule("sglang", ((0, 5), (0, 5, 23)), LLAMA_LIKE, "unchanged",
          "sglang 0.5.x llama.py: layers_to_capture = [i + 1 for i in ids] (read in 0.5.23)"),
    _Rule("sglang", ((0, 5, 23), (0, 5, 23)), DEEPSEEK_V2, "deepseek_v2_first_is_1",
          "sglang 0.5.23 deepseek_v2.py (sglang#25454): +1 only when ids[0] == 1"),
    _Rule("vllm", ((0, 32), (0, 32)), VLLM_PLUS_ONE, "plus_one",
          "vllm 0.32 llama.py / deepseek_v2.py: id i = input of layer i (run here on CPU)"),
)
# The versions our rules were read in: what export writes for when the engine is not installed.
READ_VERSIONS = {"sglang": "0.5.23", "vllm": "0.32.0"}


@dataclass(frozen=True)
class EngineLayerIds:
    """Our ids and the ids to write for one engine: what every stage records next to each other."""

    ours: list[int]
    ids: list[int]
    engine: str
    engine_version: str
    architecture: str
    rule: str

    def as_dict(self) -> dict:
        return {"aux_layer_ids": self.ours, "ids": self.ids, "engine": self.engine,
                "engine_version": self.engine_version, "target_architecture": self.architecture,
                "rule": self.rule}


def parse_version(version: str) -> tuple[int, ...]:
    """'0.5.23' -> (0, 5, 23); '0.32.0+cpu' / '0.6.0rc1' / '0.5.23.post1' keep their leading numbers."""
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", str(version))
    if not m:
        raise UnknownLayerIdRule(f"engine version {version!r} is not a version number")
    return tuple(int(p) for p in m.group(1).split("."))


def engine_layer_ids(our_ids: list[int], engine: str, engine_version: str,
                     architecture: str) -> EngineLayerIds:
    """The ids to give `engine` `engine_version` serving (or capturing from) a target of
    `architecture` so that it uses the outputs of our layers `our_ids`.

    Raises UnknownLayerIdRule naming the combination when no rule was read for it, and when the ids
    cannot be expressed on that path (our id 0 on SGLang 0.5.23's DeepSeek path)."""
    ours = [int(i) for i in our_ids]
    version = parse_version(engine_version)
    rule = next((r for r in RULES if r.covers(engine, version, architecture)), None)
    if rule is None:
        known = "; ".join(f"{r.engine} {'.'.join(map(str, r.versions[0]))}..{'.'.join(map(str, r.versions[1]))} "
                          f"for {', '.join(r.architectures)}" for r in RULES)
        raise UnknownLayerIdRule(
            f"no layer-id rule for engine {engine!r} version {engine_version} with target architecture "
            f"{architecture!r}: which layers it captures for draft-config ids has not been read for that "
            f"combination (known: {known}); refusing to guess (one layer off serves the drafter on the wrong "
            "features). Read the engine's model code and add a rule in drafter/layers.py")
    if rule.kind == "unchanged":
        ids, how = list(ours), "written unchanged"
    elif rule.kind == "plus_one":
        ids, how = [i + 1 for i in ours], "written +1"
    elif ours[0] == 1:  # deepseek_v2_first_is_1: SGLang adds the 1 itself
        ids, how = list(ours), "ids[0] == 1 switches SGLang's +1 on: written unchanged"
    elif ours[0] == 0:
        raise UnknownLayerIdRule(
            f"aux layer ids {ours}: our id 0 cannot be expressed for {architecture} on {engine} {engine_version} "
            "(ids[0] == 1 switches its +1 on, so written id 1 means our id 1); pick ids starting at >= 1")
    else:
        ids, how = [i + 1 for i in ours], "ids used as 'input of layer i': written +1"
    return EngineLayerIds(ours=ours, ids=ids, engine=engine, engine_version=str(engine_version),
                          architecture=architecture, rule=f"{rule.source}: {how}")
