"""The training step's faster pieces against plain references: the fused lm_head + soft CE over
every TTT step's rows, and AdamW with low-precision moments (an explicit, non-default option)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drafter.config import TrainConfig
from drafter.training.optim import MasterAdamW
from drafter.training.teacher import linear_soft_cross_entropy


@pytest.mark.parametrize("chunk", [3, 4, 100])
def test_fused_head_and_soft_ce_match_autograd(chunk):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w_head = torch.randn(13, 6, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(torch.randn(5, 13, generator=g, dtype=torch.float64), -1)
    rows = torch.tensor([0, 4, 4, 1, 2, 3, 0, 1, 2, 2])
    w = torch.rand(10, generator=g, dtype=torch.float64)
    loss, ce, pred = linear_soft_cross_entropy(x, w_head, probs, rows, w, chunk=chunk)
    (2.5 * loss).backward()  # an incoming gradient other than 1 scales both gradients
    logits = F.linear(x, w_head)
    ref_ce = -(probs[rows] * torch.log_softmax(logits, -1)).sum(-1)
    gx, gw = torch.autograd.grad(2.5 * (ref_ce * w).sum(), [x, w_head])
    torch.testing.assert_close(ce, ref_ce.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss.detach(), (ref_ce * w).sum().detach(), rtol=1e-12, atol=1e-12)
    assert torch.equal(pred, logits.argmax(-1))
    torch.testing.assert_close(x.grad, gx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w_head.grad, gw, rtol=1e-10, atol=1e-12)


def test_fused_head_without_grad_only_measures():
    g = torch.Generator().manual_seed(3)
    x, w_head = torch.randn(7, 4, generator=g), torch.randn(9, 4, generator=g)
    probs = torch.softmax(torch.randn(3, 9, generator=g), -1)
    with torch.no_grad():
        loss, ce, pred = linear_soft_cross_entropy(x, w_head, probs, torch.tensor([0, 1, 2, 0, 1, 2, 0]),
                                                   torch.ones(7), chunk=2)
    assert not loss.requires_grad and ce.shape == (7,) and pred.shape == (7,)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((33, 7), (5,), (40,))]


def test_bf16_moments_track_float32_adamw_and_resume_exactly(monkeypatch):
    monkeypatch.setattr("drafter.training.optim.CHUNK_ELEMENTS", 64)  # several chunks per tensor
    ours, ref = _params(), _params()
    opt = MasterAdamW(ours, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, state_dtype=torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(9)
    grads = [[torch.randn(p.shape, generator=g) for p in ours] for _ in range(6)]
    for step, gs in enumerate(grads):
        if step == 3:
            state = opt.state_dict()
            assert state["adamw"]["lowp"] == "bfloat16" and opt.lowp.exp_avg[0].dtype == torch.bfloat16
        for p, q, gr in zip(ours, ref, gs):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    for p, q in zip(ours, ref):  # bf16 moments: close to, not equal to, the fp32 AdamW
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=2e-3)
    # resume from the step-3 state: the same parameters as the uninterrupted run
    again = _params()
    opt2 = MasterAdamW(again, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, state_dtype=torch.bfloat16)
    opt2.load_state_dict(state)
    for gs in grads[3:]:
        for p, gr in zip(again, gs):
            p.grad = gr.clone()
        opt2.step()
        opt2.zero_grad()
    for p, q in zip(again, ours):
        assert torch.equal(p.detach(), q.detach())
    fp32_state = MasterAdamW(_params(), lr=1e-2).state_dict()  # a float32 run's checkpoint
    with pytest.raises(ValueError, match="optimizer_state_dtype"):
        MasterAdamW(_params(), lr=1e-2, state_dtype=torch.bfloat16).load_state_dict(fp32_state)


def test_low_precision_moments_are_an_output_option_defaulting_to_exact():
    f = TrainConfig.model_fields["optimizer_state_dtype"]
    assert TrainConfig().optimizer_state_dtype == "float32"
    assert (f.json_schema_extra or {}).get("fingerprint") is True
