"""Which engine versions read EAGLE 3.1's two config flags (`fc_norm`, `norm_output`): the one rule,
torch-free, asked by config validation, the export writers and the serve preflight.

An engine that does not read them loads a 3.1 drafter cleanly and drafts without its norms (its
`fc_norm` weights dropped, the pre-norm hidden fed on): silently worse, never an error. So a 3.1
drafter goes only to versions whose draft model code was read with both flags.
"""
from __future__ import annotations

from drafter.layers import parse_version

# The first versions read with both flags (sglang/srt/models/llama_eagle3.py in 0.5.23,
# vllm/model_executor/models/llama_eagle3.py in 0.32.0); a newer one is trusted to keep reading them.
EAGLE31_READ_SINCE = {"sglang": "0.5.23", "vllm": "0.32.0"}


def eagle31_engine_problem(engine: str, version: str) -> str | None:
    """Why `engine` at `version` must not be given an EAGLE 3.1 drafter, or None."""
    since = EAGLE31_READ_SINCE.get(engine)
    if since is None or parse_version(version) >= parse_version(since):
        return None
    return (f"{engine} {version} is older than the first version read with EAGLE 3.1's fc_norm/norm_output "
            f"({engine} {since}): it may load this eagle3.1 drafter and draft without its norms. Use {engine} "
            f">= {since}, or train with train.drafter: eagle3")
