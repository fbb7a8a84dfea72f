"""One validated configuration for the whole lifecycle.

Every stage reads its own section of `LifecycleConfig`. Validation runs before any expensive work
and every error names the field it is about (pydantic's `loc`), so `drafter config validate` can
print all problems at once.

Modules: `base` (strict sections, OutputField / OperationalField, ConfigError), `target`, `sections`
(one per stage, and storage), `lifecycle` (all of them, cross-section checks), `loading` (YAML in
and out, local paths). Everything is imported from `drafter.config`.
"""
from __future__ import annotations

from drafter.config.base import (
    ConfigError, OperationalField, OutputField, Strict, fingerprint_fields, is_output_field)
from drafter.config.lifecycle import LifecycleConfig, cross_field_problems
from drafter.config.loading import config_to_yaml, load_config, parse_config, path_problems
from drafter.config.sections import (
    BenchConfig, DataConfig, DatagenConfig, DataSource, DumpConfig, ExportConfig, RetrainConfig, ServeConfig,
    SpeculativeConfig, StorageConfig, TrainConfig)
from drafter.config.target import DemoTargetConfig, TargetConfig
from drafter.layers import LAYER_ID_CONVENTION, default_aux_layer_ids

# Every name callers import from drafter.config (the modules above are where they live).
__all__ = ["LAYER_ID_CONVENTION", "default_aux_layer_ids", "ConfigError", "LifecycleConfig", "load_config",
           "parse_config", "OutputField", "OperationalField", "fingerprint_fields", "is_output_field", "Strict",
           "cross_field_problems", "config_to_yaml", "path_problems", "DemoTargetConfig",
           "TargetConfig", "DataSource", "DataConfig", "DatagenConfig", "DumpConfig", "TrainConfig", "ExportConfig",
           "SpeculativeConfig", "ServeConfig", "BenchConfig", "RetrainConfig", "StorageConfig"]
