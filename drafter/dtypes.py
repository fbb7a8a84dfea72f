"""Torch dtypes by name: the one table and the resolvers every module uses."""
from __future__ import annotations

import torch

# The dtypes a checkpoint's `torch_dtype`, a config field or a --dtype flag may name.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a checkpoint names ('bfloat16', 'torch.float16', ...), else `default`."""
    return DTYPES.get(str(name or "").removeprefix("torch."), default)


def parse_dtype(name: str) -> torch.dtype:
    """An explicit dtype name, or ValueError listing the ones we know."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_dtype(settings: list[str], device: torch.device, auto_gpu: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The first explicit (non-'auto') setting; else float32 on CPU (half precision is slow there
    and tests compare exactly) and `auto_gpu` on a GPU."""
    for setting in settings:
        if isinstance(setting, torch.dtype):
            return setting
        if setting and setting != "auto":
            return parse_dtype(setting)
    return torch.float32 if device.type == "cpu" else auto_gpu
