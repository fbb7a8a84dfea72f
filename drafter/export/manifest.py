"""The per-export manifest (`export.json`): where the drafter came from and how each engine must
read it. Everything a later stage (serve, bench) or a person needs to trust the export."""
from __future__ import annotations

from typing import Any

from drafter.export.sglang import TargetInfo, draft_vocab_hash
from drafter.export.vllm import VLLM_LAYER_ID_CONVENTION
from drafter.layers import LAYER_ID_CONVENTION

EXPORT_FORMAT_VERSION = 1


def export_manifest(*, target: TargetInfo, target_fingerprint: str, train_fingerprint: str, train_meta: dict,
                    dump_fingerprint: str, prepare_fingerprint: str, our_aux_ids: list[int], sglang: dict,
                    vllm: dict | None, d2t, vocab_size: int) -> dict[str, Any]:
    return {
        "format_version": EXPORT_FORMAT_VERSION,
        "target": {"fingerprint": target_fingerprint, "path": target.path, "architecture": target.architecture,
                   "num_hidden_layers": target.num_layers, "hidden_size": target.hidden_size,
                   "vocab_size": target.vocab_size},
        "train_fingerprint": train_fingerprint,
        "dump_fingerprint": dump_fingerprint,
        "eval_dump_fingerprint": train_meta.get("eval_dump"),
        "prepare_fingerprint": prepare_fingerprint,
        "layer_ids": {
            "trained": {"ids": [int(i) for i in our_aux_ids], "convention": LAYER_ID_CONVENTION},
            "sglang": {"eagle_aux_hidden_state_layer_ids": sglang["eagle_aux_hidden_state_layer_ids"],
                       "rule": sglang["rule"], "engine_version": sglang["engine_version"]},
            **({"vllm": {"eagle_aux_hidden_state_layer_ids": vllm["eagle_aux_hidden_state_layer_ids"],
                         "convention": VLLM_LAYER_ID_CONVENTION, "rule": vllm["rule"],
                         "engine_version": vllm["engine_version"]}} if vllm else {}),
        },
        "draft_vocab": {"size": int(len(d2t)), "target_vocab_size": vocab_size, "hash": draft_vocab_hash(d2t),
                        "source": train_meta.get("vocab_source"),
                        "vllm_maps": None if vllm is None else bool(vllm["vocab_maps"])},
        "dtype": sglang["dtype"],
        "training": {k: train_meta.get(k) for k in ("steps", "final_eval", "final_train", "init_from",
                                                    "world_size", "parallel")},
    }
