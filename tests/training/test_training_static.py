"""The fixed-shape TTT step (CUDA-graph path) computes what the fast path and the dense reference do."""
from __future__ import annotations

import pytest
import torch

from drafter.training import attention as attn_mod
from drafter.training.static_step import bucket_rows, plan_static, static_ttt_loss
from drafter.training.teacher import TargetHead
from drafter.training.ttt import dense_ttt_loss, fast_ttt_loss, prepare
from tests.fixtures.ttt import tiny_ttt_case


@pytest.mark.parametrize("attention,tokens,docs,drafter", [("math", 48, 8, "eagle3"), ("flash", 48, 8, "eagle3"),
                                                            ("flash", 80, 16, "eagle3"), ("flash", 48, 8, "eagle3.1")])
def test_static_step_equals_fast_path_and_dense_reference(attention, tokens, docs, drafter, monkeypatch):
    """Padding to fixed shapes, one position set for every step and zero-weight loss rows change
    nothing: same loss, gradients and statistics (float64; `flash` runs the merge algebra with the
    plain varlen kernel, including the empty trailing documents of the padded layout); for EAGLE 3.1
    too (per-state norms before fc, post-norm feedback)."""
    monkeypatch.setattr(attn_mod, "FLASH_KERNELS", [attn_mod.reference_flash_fwd, attn_mod.reference_flash_bwd])
    m, embed, head, mb = tiny_ttt_case(drafter=drafter)
    K, norm = 4, float(mb.num_tokens)
    th = TargetHead(head, m.t2d, "cpu", torch.float64, vocab_chunk=16)
    sb = plan_static(mb, K, 0.8, norm, tokens=tokens, row_multiple=8, embed=embed).to("cpu", torch.float64)
    T, R = sb.pos.numel(), sb.S.numel()
    # 6 documents + padding documents of at most 16 tokens (1 or 3), slots rounded to a power of two
    assert T == tokens and R % 8 == 0 and R < T and sb.cu_seqlens.numel() == docs + 1 and sb.max_len == 16
    assert sb.key == plan_static(mb, K, 0.8, 2 * norm, tokens=tokens, row_multiple=8, embed=embed).key
    ls, stats_s = static_ttt_loss(m, th, sb, attention=attention)
    gs = torch.autograd.grad(ls, list(m.parameters()))
    si = prepare(mb, embed, th, K, "cpu", torch.float64)
    lf, stats_f = fast_ttt_loss(m, si, 0.8, norm, attention=attention)
    gf = torch.autograd.grad(lf, list(m.parameters()))
    ld = dense_ttt_loss(m, mb, embed, head, m.t2d, K, 0.8, norm)
    torch.testing.assert_close(ls, ld, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ls, lf, rtol=1e-12, atol=1e-12)
    for (name, _), a, b in zip(m.named_parameters(), gs, gf):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)
    torch.testing.assert_close(stats_s, stats_f, rtol=1e-12, atol=1e-12)


def test_static_plan_covers_every_loss_position_and_pads_without_loss():
    m, embed, head, mb = tiny_ttt_case()
    K = 3
    sb = plan_static(mb, K, 0.8, 1.0, tokens=40, row_multiple=16, embed=embed)
    n, T = mb.num_tokens, sb.pos.numel()
    assert T == 48 and sb.num_tokens == n  # 36 tokens asked for 40, rounded up to the multiple
    assert bool((sb.S[1:] > sb.S[:-1]).all())  # distinct, sorted
    assert not sb.lm[:, (sb.S >= n)].any()     # padding carries no loss
    assert bool((sb.w[~sb.lm.flatten()] == 0).all())
    assert bool((sb.aux[n:] == 0).all()) and sb.doc[n:].unique().tolist() == [len(mb.doc_lens)]
    # a micro-batch longer than the budget keeps all of its tokens
    assert plan_static(mb, K, 0.8, 1.0, tokens=8, row_multiple=16, embed=embed).pos.numel() == 48


def test_row_buckets_waste_at_most_an_eighth_and_stay_few():
    sizes = {bucket_rows(n, 128) for n in range(1, 16385)}
    assert all(bucket_rows(n, 128) >= n and bucket_rows(n, 128) <= max(128, n * 1.125 + 1) or n < 1024
               for n in range(1, 16385))
    assert bucket_rows(1270, 128) == 1280 and bucket_rows(1, 128) == 128
    assert len(sizes) <= 8 * 7 + 8  # ~8 per doubling from 1024 to 16384, multiples of 128 below
