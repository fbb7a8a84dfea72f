"""The drafter kinds (`train.drafter`: eagle3, eagle3.1), the config flags that tell them apart, and
which engine versions read EAGLE 3.1's flags: torch-free, for config validation, the export writers
and the serve preflight.

An engine that does not read the flags loads a 3.1 drafter cleanly and drafts without its norms (its
`fc_norm` weights dropped, the pre-norm hidden fed on): silently worse, never an error. So a 3.1
drafter goes only to versions whose draft model code was read with both flags.
"""
from __future__ import annotations

import json
from pathlib import Path

from drafter.layers import UnknownLayerIdRule, parse_version

# EAGLE 3.1 is still `eagle3` to the engines: two config flags switch on its parts, read as
# `config.fc_norm` / `config.norm_output`, absent = false (drafter.model says where; SGLang 0.5.23's
# sglang/srt/models/llama_eagle3.py l.185 and l.207).
FLAGS = ("fc_norm", "norm_output")
# The flags each kind sets.
DRAFTERS = {"eagle3": {"fc_norm": False, "norm_output": False},
            "eagle3.1": {"fc_norm": True, "norm_output": True}}
# The first versions read with both flags (sglang/srt/models/llama_eagle3.py in 0.5.23,
# vllm/model_executor/models/llama_eagle3.py in 0.32.0); a newer one is trusted to keep reading them.
EAGLE31_READ_SINCE = {"sglang": "0.5.23", "vllm": "0.32.0"}


def flags_kind(config) -> str:
    """The kind an engine sees in a draft config (a config.json dict or a draft config object):
    eagle3.1 as soon as one flag is set, since either one changes the drafting math."""
    get = config.get if isinstance(config, dict) else (lambda flag, default: getattr(config, flag, default))
    return "eagle3.1" if any(get(flag, False) for flag in FLAGS) else "eagle3"


def eagle31_engine_problem(kind: str, engine: str, version: str) -> str | None:
    """Why `engine` at `version` must not be given a drafter of `kind`, or None. Only eagle3.1 has a
    version floor; a version that is not a number is a problem too (nothing can be said of it)."""
    since = EAGLE31_READ_SINCE.get(engine)
    if kind == "eagle3" or since is None:
        return None
    try:
        if parse_version(version) >= parse_version(since):
            return None
    except UnknownLayerIdRule as err:
        return f"{engine}: {err}"
    return (f"{engine} {version} is older than the first version read with EAGLE 3.1's fc_norm/norm_output "
            f"({engine} {since}): it may load this eagle3.1 drafter and draft without its norms. Use {engine} "
            f">= {since}, or train with train.drafter: eagle3")


def kind_at(draft_dir: str) -> str | None:
    """The kind of the drafter whose config.json is in `draft_dir` (either layout keeps the flags at
    the top), or None when there is none to read here or its flags name no kind."""
    try:
        config = json.loads((Path(draft_dir).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    flags = {flag: bool(config.get(flag, False)) for flag in FLAGS}
    return next((name for name, f in DRAFTERS.items() if f == flags), None)
