"""The target section: the model we want to speed up, and the tiny demo target built locally."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from drafter.config.base import Strict


class DemoTargetConfig(Strict):
    """The tiny Llama-architecture target the demo trains locally (no model hub here).

    What is built depends on this config and the data only, never on the machine's load: training
    runs exactly `max_steps` optimizer steps (the schedule follows steps, not the clock) on exactly
    `threads` torch CPU threads (CPU float reductions can differ with the thread count).
    """

    vocab_size: int = Field(4096, ge=300)
    hidden_size: int = Field(256, ge=16)
    num_hidden_layers: int = Field(6, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(688, ge=16)
    max_position_embeddings: int = Field(1024, ge=64)
    seq_len: int = Field(256, ge=16)
    batch_size: int = Field(8, ge=1)
    learning_rate: float = Field(2e-3, gt=0)
    max_steps: int = Field(400, ge=1, description="the step budget: training runs exactly this many steps")
    train_seconds: float | None = Field(
        None, gt=0, description="optional hard limit on training time: exceeding it FAILS the build "
                                "(nothing saved); it never cuts training short into another model")
    tokenizer_texts: int = Field(4000, ge=10, description="conversations used to learn the BPE merges")
    train_conversations: int = Field(12000, ge=10)
    eval_conversations: int = Field(200, ge=5)
    seed: int = 0
    threads: int = Field(1, ge=1, description="torch CPU threads, part of the recipe (same on every machine)")
    device: str = Field("cpu", description="cpu, or cuda for the larger GPU preset (bf16 autocast)")
    collapse_whitespace: bool = Field(
        False, description="train on messages whose whitespace runs are one space (no newline runs "
                           "for a tiny model's greedy answers to collapse into)")
    answer_prompts: int = Field(16, ge=0, description="held-out chat prompts answered greedily for the "
                                                       "report's answer-diversity figures (0: none)")
    answer_tokens: int = Field(64, ge=1, description="max new tokens per greedy answer")
    fail_on_degenerate: bool = Field(
        False, description="fail the build (nothing saved) when the greedy answers degenerate: mean "
                           "distinct tokens per answer < 3, or one token > 80% of all answer tokens")

    @model_validator(mode="after")
    def _heads(self) -> "DemoTargetConfig":
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        if self.fail_on_degenerate and not self.answer_prompts:
            raise ValueError("fail_on_degenerate needs answer_prompts > 0 (the answers it judges)")
        return self


class TargetConfig(Strict):
    """The model we want to speed up."""

    path: str = Field(..., description="Hugging Face model directory (local path)")
    name: str | None = Field(None, description="served model name; defaults to the directory name")
    revision: str | None = Field(
        None, description="trusted identity of the weights (hub revision, registry digest); when "
                          "omitted, stage fingerprints hash the weight files (cached per machine)")
    num_hidden_layers: int | None = Field(
        None, ge=1, description="layer count; read from <path>/config.json when omitted")
    hidden_size: int | None = Field(None, ge=1)
    vocab_size: int | None = Field(None, ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    trust_remote_code: bool = False
    demo: DemoTargetConfig | None = Field(
        None, description="when set, `drafter demo-target` builds this target at `path`")

    @property
    def served_name(self) -> str:
        return self.name or Path(self.path).name

    def resolved_shape(self) -> dict[str, int | None]:
        """Layer count / hidden / vocab from the config, else from the model's config.json, else demo."""
        shape: dict[str, int | None] = {
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }
        cfg_file = Path(self.path) / "config.json"
        if cfg_file.is_file():
            on_disk = json.loads(cfg_file.read_text())
            on_disk = on_disk.get("text_config", on_disk)
            for key in shape:
                if shape[key] is None:
                    shape[key] = on_disk.get(key)
        if self.demo is not None:
            for key in shape:
                if shape[key] is None:
                    shape[key] = getattr(self.demo, key)
        return shape

