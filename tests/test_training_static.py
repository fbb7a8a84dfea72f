"""The fixed-shape TTT step (CUDA-graph path) computes what the fast path and the dense reference do."""
from __future__ import annotations

import pytest
import torch

from drafter.training import attention as attn_mod
from drafter.training.static_step import plan_static, static_ttt_loss
from drafter.training.teacher import TargetHead
from drafter.training.ttt import dense_ttt_loss, fast_ttt_loss, prepare
from tests.test_training_units import _tiny


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_static_step_equals_fast_path_and_dense_reference(attention, monkeypatch):
    """Padding to fixed shapes, one position set for every step and zero-weight loss rows change
    nothing: same loss, gradients and statistics (float64; `flash` runs the merge algebra with the
    plain varlen kernel, including the empty trailing documents of the padded layout)."""
    monkeypatch.setattr(attn_mod, "FLASH_KERNELS", [attn_mod.reference_flash_fwd, attn_mod.reference_flash_bwd])
    m, embed, head, mb = _tiny()
    K, norm = 4, float(mb.num_tokens)
    th = TargetHead(head, m.t2d, "cpu", torch.float64, vocab_chunk=16)
    sb = plan_static(mb, K, 0.8, norm, tokens=48, row_multiple=8, embed=embed).to("cpu", torch.float64)
    T, R = sb.pos.numel(), sb.S.numel()
    assert T == 48 and R % 8 == 0 and R < T and sb.cu_seqlens.numel() == 8 + 1  # 6 docs + padding -> 8
    assert sb.key == plan_static(mb, K, 0.8, 2 * norm, tokens=48, row_multiple=8, embed=embed).key
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
    m, embed, head, mb = _tiny()
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
