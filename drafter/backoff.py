"""Exponential backoff with full jitter, shared by the store and the OpenAI-compatible client."""
from __future__ import annotations

import random
from collections.abc import Callable


def backoff_delay(attempt: int, base_s: float, max_s: float, rand: Callable[[], float] = random.random) -> float:
    """Uniform in [0, min(max_s, base_s * 2**(attempt-1))] (the AWS architecture blog's "full
    jitter"): jitter keeps many workers from retrying in lockstep."""
    return rand() * min(max_s, base_s * 2 ** (attempt - 1))
