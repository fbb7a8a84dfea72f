"""plan_static(buckets=N): a few fixed shape keys (CUDA graphs) for real, variable micro-batches,
and still the fast path's loss, gradients and statistics."""
from __future__ import annotations

import pytest
import torch

from drafter.training import attention as attn_mod
from drafter.training.static_step import plan_static, static_ttt_loss
from drafter.training.teacher import TargetHead
from drafter.training.ttt import MicroBatch, fast_ttt_loss, prepare
from tests.fixtures.ttt import tiny_ttt_case


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_bucketed_layout_equals_fast_path(attention, monkeypatch):
    """Length rounded to the budget's multiple, rows to 1/N of it, many empty documents and the
    longest document taken as T: same loss, gradients and statistics (float64)."""
    monkeypatch.setattr(attn_mod, "FLASH_KERNELS", [attn_mod.reference_flash_fwd, attn_mod.reference_flash_bwd])
    m, embed, head, mb = tiny_ttt_case()
    K, norm = 4, float(mb.num_tokens)
    th = TargetHead(head, m.t2d, "cpu", torch.float64, vocab_chunk=16)
    sb = plan_static(mb, K, 0.8, norm, tokens=24, row_multiple=8, embed=embed, buckets=2)
    # 36 tokens at a 24-token budget: T = 48; rows a multiple of 24; >= 48 / 16 document slots
    assert sb.pos.numel() == 48 and sb.S.numel() % 24 == 0 and sb.max_len == 48 and sb.cu_seqlens.numel() >= 4
    ls, stats_s = static_ttt_loss(m, th, sb.to("cpu", torch.float64), attention=attention)
    gs = torch.autograd.grad(ls, list(m.parameters()))
    si = prepare(mb, embed, th, K, "cpu", torch.float64)
    lf, stats_f = fast_ttt_loss(m, si, 0.8, norm, attention=attention)
    gf = torch.autograd.grad(lf, list(m.parameters()))
    torch.testing.assert_close(ls, lf, rtol=1e-12, atol=1e-12)
    for (name, _), a, b in zip(m.named_parameters(), gs, gf):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)
    torch.testing.assert_close(stats_s, stats_f, rtol=1e-12, atol=1e-12)


def test_buckets_bound_the_number_of_keys():
    """Packed micro-batches of chat-like lengths (budget 256, samples up to 512): the default keys
    keep growing with the data; N buckets give at most N per multiple of the budget."""
    g = torch.Generator().manual_seed(0)
    keys = {0: set(), 4: set()}
    for _ in range(150):
        lens, n = [], 0
        while True:
            L = int(torch.randint(2, 512, (1,), generator=g))
            if lens and n + L > 256:
                break
            lens.append(L)
            n += L
            if n >= 256:
                break
        T = sum(lens)
        mask = torch.rand(T, generator=g) < float(torch.rand(1, generator=g))
        mb = MicroBatch(torch.zeros(T, dtype=torch.int64), mask, torch.zeros(T, 3, 4), torch.zeros(T, 4), lens,
                        [str(i) for i in range(len(lens))])
        for b in keys:
            sb = plan_static(mb, 3, 0.8, 1.0, tokens=256, row_multiple=32, e_next=torch.zeros(T, 4), buckets=b)
            assert sb.S.numel() >= int(sb.lm.any(0).sum()) and sb.pos.numel() >= T
            keys[b].add(sb.key)
    assert len(keys[4]) <= 4 * 2 < 20 < len(keys[0])  # lengths up to 2 x the budget
