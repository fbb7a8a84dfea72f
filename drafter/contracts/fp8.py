"""fp8 (e4m3) storage of hidden states, one float32 scale per row (per token and state).

A row x (one token's H values of one captured state) is stored as q = x / s in float8_e4m3fn with
s = max|x| / 448 (448 is e4m3's largest finite value), so the row's largest value uses the whole
range and nothing overflows. Decoding is q * s in float32, then the caller's dtype.

Error bound (e4m3 keeps 3 mantissa bits, round to nearest): |decode(x) - x| <= |x| / 16 for values
in e4m3's normal range (|x| >= s * 2^-6) and <= s * 2^-10 below it (subnormals); the cast to bf16
adds its own 2^-9 relative rounding. Per-token scales matter: hidden states carry a few outlier
channels and token norms that differ by orders of magnitude between layers and positions, so one
scale per tensor would flush most values of small rows to zero.
"""
from __future__ import annotations

import torch

STORAGE_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
_TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero row (any positive value decodes to 0)


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [..., H] float8_e4m3fn, scale [...] float32) of x [..., H], on x's device."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp_min(_TINY)
    q = (xf / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(STORAGE_DTYPE)
    return q, scale.squeeze(-1)


def decode(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., H] in `dtype` from q [..., H] and scale [...]."""
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)
