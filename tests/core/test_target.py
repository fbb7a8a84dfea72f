"""HFTarget's CPU attention: a multi-token verify over a KV cache lets torch's SDPA share the KV
heads instead of copying them per layer (drafter.target._masked_gqa_sdpa). The fast path must give
exactly what transformers' own sdpa attention gives, for the prefill, a verify and a decode step."""
from __future__ import annotations

import torch

from drafter.target import MASKED_GQA_SDPA, HFTarget, crop_cache


def test_masked_gqa_attention_gives_exactly_transformers_sdpa_numbers(tiny_target):
    fast, stock = HFTarget(tiny_target, device="cpu"), HFTarget(tiny_target, device="cpu")
    stock.model.set_attn_implementation("sdpa")
    assert fast.model.config._attn_implementation == MASKED_GQA_SDPA
    assert fast.model.config.num_key_value_heads < fast.model.config.num_attention_heads  # GQA: the fast path runs
    for t in (fast, stock):
        t.set_aux_layer_ids([0, 1, 2])
    caches = fast.new_cache(), stock.new_cache()
    prompt = torch.arange(10, 60)[None]
    for step in (prompt, torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9]])):
        a, b = (t.forward(step, c, want_aux=True) for t, c in zip((fast, stock), caches))
        assert torch.equal(a.logits, b.logits) and torch.equal(a.aux, b.aux)
    for c in caches:  # a rejected verify rolled back, then verified again over the same cache
        crop_cache(c, 52)
    a, b = (t.forward(torch.tensor([[7, 3, 2]]), c, want_aux=True) for t, c in zip((fast, stock), caches))
    assert torch.equal(a.logits, b.logits) and torch.equal(a.aux, b.aux)
    assert a.logits.shape == (1, 3, fast.vocab_size)
