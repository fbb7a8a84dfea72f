"""`LifecycleConfig`: every section together, and the checks that need more than one of them."""
from __future__ import annotations

from pydantic import Field, model_validator

from drafter.config.base import ConfigError, Strict
from drafter.config.sections import (
    BenchConfig, DataConfig, DatagenConfig, DumpConfig, ExportConfig, RetrainConfig, ServeConfig, StorageConfig,
    TrainConfig)
from drafter.config.target import TargetConfig
from drafter.layers import aux_layer_id_problem, default_aux_layer_ids


class LifecycleConfig(Strict):
    name: str = Field("drafter", description="run name used in logs and reports")
    target: TargetConfig
    data: DataConfig = Field(default_factory=DataConfig)
    datagen: DatagenConfig = Field(default_factory=DatagenConfig)
    dump: DumpConfig = Field(default_factory=DumpConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)
    retrain: RetrainConfig = Field(default_factory=RetrainConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> "LifecycleConfig":
        vocab = self.target.resolved_shape()["vocab_size"]
        if "draft_vocab_size" not in self.train.model_fields_set and vocab is not None \
                and vocab < self.train.draft_vocab_size:
            # The default (32000) only fits large vocabularies: a smaller target drafts over all of
            # its vocabulary unless told otherwise (a serve-only profile needs no train fields).
            self.train.draft_vocab_size = vocab
        problems = cross_field_problems(self)
        if problems:
            # One line per problem, "field: message"; `_problems` splits them back into fields.
            raise ValueError("\n".join(f"{field}: {msg}" for field, msg in problems))
        return self

    def aux_layer_ids(self) -> list[int]:
        """The configured aux layer ids, or the default for the target's depth."""
        if self.dump.aux_layer_ids is not None:
            return list(self.dump.aux_layer_ids)
        layers = self.target.resolved_shape()["num_hidden_layers"]
        if layers is None:
            raise ConfigError([("target.num_hidden_layers",
                                "unknown: set it or point target.path at a model with config.json")])
        return default_aux_layer_ids(layers)


def cross_field_problems(cfg: LifecycleConfig) -> list[tuple[str, str]]:
    """Checks that need more than one section (or the target's config.json)."""
    problems: list[tuple[str, str]] = []
    shape = cfg.target.resolved_shape()
    layers, vocab = shape["num_hidden_layers"], shape["vocab_size"]
    ids = cfg.dump.aux_layer_ids
    if ids is not None and len(set(ids)) != 3:
        problems.append(("dump.aux_layer_ids", f"{ids} must be three distinct layers"))
    if ids is None and layers is not None and len(set(default_aux_layer_ids(layers))) != 3:
        problems.append(("dump.aux_layer_ids",
                         f"the default {default_aux_layer_ids(layers)} for a {layers}-layer target is "
                         f"not three distinct layers; set them explicitly"))
    if ids is not None and layers is not None:
        problem = aux_layer_id_problem(ids, layers)
        if problem is not None:
            problems.append(("dump.aux_layer_ids", problem))
    if cfg.train.nproc_per_node > cfg.train.micro_batches_per_step:
        problems.append(("train.nproc_per_node",
                         f"{cfg.train.nproc_per_node} processes split each step's "
                         f"{cfg.train.micro_batches_per_step} micro-batches: set train.micro_batches_per_step "
                         f">= {cfg.train.nproc_per_node} (a multiple keeps the global batch per process equal)"))
    if cfg.retrain.bench and not cfg.bench.speculative:
        problems.append(("retrain.bench", "needs bench.speculative: the settings the challenger and the champion "
                                          "are benched at"))
    if vocab is not None and cfg.train.draft_vocab_size > vocab:
        problems.append(("train.draft_vocab_size",
                         f"{cfg.train.draft_vocab_size} exceeds the target vocab ({vocab})"))
    return problems

