"""The one layer-id convention, and the one rule for which aux layer ids a target can serve.

An aux layer id i means "the OUTPUT of decoder layer i" (0-based), i.e. Hugging Face
`hidden_states[i + 1]`. This is what SGLang reads from the draft config's
`eagle_aux_hidden_state_layer_ids` and what SpecForge trains with (reference:
sglang-eagle3-contract.md section 2). Config validation, capture and serving all call
`aux_layer_id_problem` / `check_aux_layer_ids`, so the rule cannot drift apart.
"""
from __future__ import annotations

LAYER_ID_CONVENTION = "output-of-layer-0-based"


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
