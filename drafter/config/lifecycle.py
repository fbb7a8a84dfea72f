"""`LifecycleConfig`: every section together, and the checks that need more than one of them."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from drafter.config.base import ConfigError, Strict
from drafter.config.registry_names import registry_name_problem
from drafter.config.sections import (
    BenchConfig, DataConfig, DatagenConfig, DumpConfig, ExportConfig, RetrainConfig, ServeConfig, StorageConfig,
    TrainConfig, server_key)
from drafter.config.target import TargetConfig
from drafter.engine_registry import make_engine
from drafter.eagle31 import eagle31_engine_problem, kind_at
from drafter.layers import aux_layer_id_problem, default_aux_layer_ids

MAX_PORT = 65535
Interleave = Literal["concurrent", "relaunch"]


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
        """The configured aux layer ids, or the default for the target's depth. The default of a
        very shallow target (under 7 layers) is not three distinct layers: asked for then (by the
        stages that dump, train or export a drafter), that is a ConfigError naming the field. A
        profile that never asks (serve-only: a drafter directory, the target alone) needs no dump
        fields, whatever the target's depth."""
        if self.dump.aux_layer_ids is not None:
            return list(self.dump.aux_layer_ids)
        layers = self.target.resolved_shape()["num_hidden_layers"]
        if layers is None:
            raise ConfigError([("target.num_hidden_layers",
                                "unknown: set it or point target.path at a model with config.json")])
        ids = default_aux_layer_ids(layers)
        if len(set(ids)) != 3:
            raise ConfigError([("dump.aux_layer_ids", f"the default {ids} for a {layers}-layer target is not three "
                                                      f"distinct layers; set them explicitly")])
        return ids

    def registry_name(self) -> str:
        """The drafter registry's name for this profile: `retrain.drafter_name`, else `name`."""
        return self.retrain.drafter_name or self.name


def cross_field_problems(cfg: LifecycleConfig) -> list[tuple[str, str]]:
    """Checks that need more than one section (or the target's config.json)."""
    problems: list[tuple[str, str]] = []
    shape = cfg.target.resolved_shape()
    layers, vocab = shape["num_hidden_layers"], shape["vocab_size"]
    ids = cfg.dump.aux_layer_ids
    if ids is not None and len(set(ids)) != 3:
        problems.append(("dump.aux_layer_ids", f"{ids} must be three distinct layers"))
    # (the default ids of a very shallow target are checked when a stage asks for them:
    # `LifecycleConfig.aux_layer_ids`; a serve-only profile never does)
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
    start = cfg.train.init_from
    if start not in (None, "champion") and (kind := kind_at(start)) not in (None, cfg.train.drafter):
        # the trainer refuses it too, but only after datagen and dump (the champion is resolved then)
        problems.append(("train.drafter", f"{cfg.train.drafter}, but train.init_from {start} is an {kind} drafter: "
                                          f"set train.drafter: {kind} to fine-tune it"))
    for engine in ("sglang", "vllm"):  # the export refuses it too, but only after the training
        version = getattr(cfg.export, f"{engine}_version")
        if (problem := eagle31_engine_problem(cfg.train.drafter, engine, version)) is not None:
            problems.append((f"export.{engine}_version", problem))
    if (problem := registry_name_problem(cfg.registry_name())) is not None:
        field = "retrain.drafter_name" if cfg.retrain.drafter_name else "name"
        problems.append((field, problem + ("" if cfg.retrain.drafter_name else
                                           " (the profile's name is the registry name unless retrain.drafter_name "
                                           "is set)")))
    return problems


def port_problems(cfg: LifecycleConfig) -> list[tuple[str, str]]:
    """Servers started on ports above `serve.port` must stay at or below 65535: a fanned-out stage's
    children serve on `serve.port + range index` (drafter.fanout.child_config, up to `workers` - 1),
    and the bench's concurrent interleave serves its servers at once on `serve.port + index`
    (drafter.bench.plan's rules, `server_key` and `resolve_interleave`, kept here so the profile's check
    and the plan agree: the baseline, every distinct `bench.speculative` setting once per drafter,
    two drafters with `retrain.bench`, and each setting again per `bench.accept_curve` length).

    A check of the profile, made where one is read (`parse_config`, `load_config`: the CLI, `config
    validate`, the flows' `profile`), not by every validation of the model: a fan-out child's
    configuration is the parent's with `serve.port + its index` (and the parent's `workers`), and
    must not be refused for the ports its parent already checked."""
    port, problems = cfg.serve.port, []
    for section in ("datagen", "dump"):
        workers = getattr(cfg, section).workers
        if port + workers - 1 > MAX_PORT:
            problems.append(("serve.port", f"{section}.workers={workers} children serve on serve.port + their range "
                                           f"index, up to {port + workers - 1} > {MAX_PORT}: set serve.port "
                                           f"<= {MAX_PORT - workers + 1}"))
    servers = bench_servers_at_most(cfg)
    if servers is not None and port + servers - 1 > MAX_PORT:
        problems.append(("serve.port", f"the bench's concurrent interleave serves up to {servers} servers on "
                                       f"consecutive ports from serve.port={port}, up to {port + servers - 1} > "
                                       f"{MAX_PORT}: set serve.port <= {MAX_PORT - servers + 1} (or "
                                       f"bench.interleave: relaunch)"))
    return problems


def resolve_interleave(cfg: LifecycleConfig) -> Interleave:
    """`bench.interleave`, with `auto` decided: `concurrent` where the engine's servers share no GPU."""
    mode = cfg.bench.interleave
    if mode != "auto":
        return mode
    s = cfg.serve
    return "concurrent" if make_engine(s.engine).servers_share_no_gpu(s) else "relaunch"


def bench_servers_at_most(cfg: LifecycleConfig) -> int | None:
    """How many servers the bench's sweep may run at once on consecutive ports (an upper bound: the
    plan may skip settings the engine refuses), None when it runs one at a time (relaunch)."""
    if resolve_interleave(cfg) != "concurrent":
        return None
    settings = len({server_key(spec) for spec in cfg.bench.speculative})
    drafters = 2 if cfg.retrain.bench else 1  # challenger and champion, head to head
    return 1 + settings * drafters + settings * len(cfg.bench.accept_curve)

