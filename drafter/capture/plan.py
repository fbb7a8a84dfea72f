"""A dump's plan: everything decided before a model is loaded (devices, dtype, layer ids, the
tokenizer and the identities the fingerprint names), and the manifest meta summed from the shard
markers."""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from drafter.capture import base
from drafter.config import LAYER_ID_CONVENTION, ConfigError, LifecycleConfig, fingerprint_fields
from drafter.contracts.shards import FINAL_HIDDEN, FORMAT, bytes_per_token, format_version, storage_label, storage_projection
from drafter.dtypes import dtype_name
from drafter.formats import DATAGEN, PREPARE
from drafter.formats import DUMP as STAGE
from drafter.layers import check_aux_layer_ids
from drafter.stage_output import ShardInfo
from drafter.stage_output import fingerprint as stage_fingerprint
from drafter.target_identity import target_fingerprint
from drafter.tokenize import template_hash, tokenizer_hash

UPSTREAM_STAGES = (PREPARE, DATAGEN)


@dataclass
class DumpPlan:
    """Everything decided before a model is loaded (so a complete stage skips without one)."""

    cfg: LifecycleConfig
    upstream_stage: str
    upstream_fingerprint: str
    devices: list[torch.device]
    dtype: torch.dtype
    aux_layer_ids: list[int]
    num_layers: int
    hidden_size: int
    tokenizer: object           # for the fingerprint; workers tokenise with their own copies
    target_fingerprint: str
    tokenizer_hash: str
    template_hash: str

    @property
    def settings(self) -> dict:
        """Everything that determines the bytes except the upstream (outputs with equal settings
        can share shards computed from equal records: drafter.contracts.reuse)."""
        dump = fingerprint_fields(self.cfg.dump)
        del dump["aux_layer_ids"], dump["dtype"]  # in their resolved form below
        storage = dump.pop("storage_dtype")  # `model` is left out: dumps from before fp8 keep their fingerprints
        if storage != "model":
            dump["storage_dtype"] = storage
        return {"dump": dump, "dtype": dtype_name(self.dtype), "target": self.target_fingerprint,
                "tokenizer": self.tokenizer_hash, "chat_template": self.template_hash,
                "aux_layer_ids": self.aux_layer_ids, "layer_id_convention": LAYER_ID_CONVENTION,
                "shard_format": [FORMAT, format_version(storage)], "upstream_stage": self.upstream_stage}

    @property
    def fingerprint(self) -> str:
        return stage_fingerprint(STAGE, self.settings, [self.upstream_fingerprint])


def plan_dump(cfg: LifecycleConfig, upstream: Mapping[str, str]) -> DumpPlan:
    """Everything the fingerprint needs (tokenizer, target identity, resolved dtype and ids)
    without loading the model. The upstream is `dump.upstream`'s output."""
    from transformers import AutoTokenizer

    upstream_stage = cfg.dump.upstream
    if upstream_stage not in UPSTREAM_STAGES:
        raise ValueError(f"dump reads the output of {UPSTREAM_STAGES}, not {upstream_stage!r}")
    upstream_fingerprint = upstream[upstream_stage]
    try:
        # backend vllm: one worker; vLLM places the target itself (dump.tp_size GPUs), tensors come back on the CPU
        devs = base.resolve_devices(cfg.dump.devices) if cfg.dump.backend == "hf" else [torch.device("cpu")]
    except ValueError as e:
        raise ConfigError([("dump.devices", str(e))]) from None
    shape = cfg.target.resolved_shape()
    num_layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    if num_layers is None or hidden is None:
        raise ConfigError([("target.path", f"{cfg.target.path}: no config.json with num_hidden_layers "
                                           f"and hidden_size")])
    try:
        ids = check_aux_layer_ids(cfg.aux_layer_ids(), num_layers)
    except ValueError as e:
        raise ConfigError([("dump.aux_layer_ids", str(e))]) from None
    tok = AutoTokenizer.from_pretrained(cfg.target.path, trust_remote_code=cfg.target.trust_remote_code)
    return DumpPlan(cfg=cfg, upstream_stage=upstream_stage, upstream_fingerprint=upstream_fingerprint,
                    devices=devs, dtype=base.resolve_dtype(
                        cfg.dump.dtype, cfg.target.dtype,
                        torch.device("cuda") if cfg.dump.backend == "vllm" and torch.cuda.is_available() else devs[0]),
                    aux_layer_ids=ids, num_layers=num_layers, hidden_size=hidden, tokenizer=tok,
                    target_fingerprint=target_fingerprint(cfg.target.path, cfg.target.revision),
                    tokenizer_hash=tokenizer_hash(tok), template_hash=template_hash(tok))



def summarize(plan: DumpPlan, shards: list[ShardInfo], eval_shards: list[ShardInfo] = ()) -> dict:
    """Manifest meta from the shard markers (so a resumed run counts shards it did not compute).
    Counts describe the train split; `eval` the held-out split's shards."""
    tokens = sum(s.meta["tokens"] for s in shards)
    total_bytes = sum(s.size for s in shards)
    quarantined = [q for s in shards for q in s.meta["quarantined"]]
    dtype = dtype_name(plan.dtype)
    storage = plan.cfg.dump.storage_dtype
    bpt = total_bytes / tokens if tokens else 0.0
    return {
        "upstream": {"stage": plan.upstream_stage, "fingerprint": plan.upstream_fingerprint},
        "target_path": plan.cfg.target.path,
        "target_fingerprint": plan.target_fingerprint,
        "tokenizer_hash": plan.tokenizer_hash,
        "chat_template_hash": plan.template_hash,
        "dtype": dtype,
        "storage_dtype": storage if storage != "model" else dtype,
        "aux_layer_ids": plan.aux_layer_ids,
        "layer_id_convention": LAYER_ID_CONVENTION,
        "final_hidden_state": FINAL_HIDDEN,
        "hidden_size": plan.hidden_size,
        "num_hidden_layers": plan.num_layers,
        "max_length": plan.cfg.dump.max_length,
        "samples_per_shard": plan.cfg.dump.samples_per_shard,
        "shard_format": {"name": FORMAT, "version": format_version(storage)},
        "num_shards": len(shards),
        "num_samples": sum(s.meta["samples"] for s in shards),
        "num_tokens": tokens,
        "num_loss_tokens": sum(s.meta["loss_tokens"] for s in shards),
        "truncated": sum(s.meta["truncated"] for s in shards),
        # samples tokenised from the engine's recorded ids; the rest re-tokenised from text (records
        # without ids; shards computed before ids were recorded count none)
        "samples_from_token_ids": sum(s.meta.get("from_token_ids", 0) for s in shards),
        "bytes": total_bytes,
        "bytes_per_token": round(bpt, 2),
        "payload_bytes_per_token": bytes_per_token(plan.hidden_size, dtype, storage_dtype=storage),
        "storage_projection": storage_projection(bpt, tokens, plan.hidden_size, storage_label(dtype, storage)),
        "quarantined": {"total": len(quarantined),
                        "by_reason": dict(sorted(Counter(q["reason"] for q in quarantined).items())),
                        "samples": quarantined},
        "eval": {"num_shards": len(eval_shards), "num_samples": sum(s.meta["samples"] for s in eval_shards),
                 "num_tokens": sum(s.meta["tokens"] for s in eval_shards),
                 "num_loss_tokens": sum(s.meta["loss_tokens"] for s in eval_shards),
                 "quarantined": sum(len(s.meta["quarantined"]) for s in eval_shards)},
    }
