"""Training pieces against plain references: draft vocab, teacher, soft CE, fast TTT == dense."""
from __future__ import annotations

import pytest
import torch

from drafter.model import Eagle3DraftConfig, Eagle3Drafter, check_drafter_weights, set_draft_vocab
from drafter.training import attention as attn_mod
from drafter.training.optim import lr_factor
from drafter.training.teacher import TargetHead, reference_teacher, soft_cross_entropy
from drafter.training.ttt import dense_ttt_loss, fast_ttt_loss, prepare
from drafter.training.vocab import count_loss_tokens, ids_from_maps, select_draft_vocab, vocab_maps
from tests.fixtures.ttt import tiny_ttt_case


# ---- vocab

def test_vocab_top_tokens_sorted_by_id_with_ties_to_lower_ids():
    counts = torch.tensor([0, 5, 9, 5, 0, 7, 1, 5])
    ids = select_draft_vocab(counts, 4)
    assert ids.tolist() == [1, 2, 3, 5]  # 9, 7 and two of the three 5s (the lower ids 1, 3)
    assert torch.equal(ids, ids.sort().values)


def test_vocab_pads_with_unseen_ids_when_too_few_distinct_tokens():
    samples = [{"input_ids": torch.tensor([7, 7, 3, 9]), "loss_mask": torch.tensor([1, 1, 1, 0])}]
    counts = count_loss_tokens(samples, 12)
    assert counts[7] == 2 and counts[3] == 1 and counts[9] == 0  # masked token not counted
    ids = select_draft_vocab(counts, 5)
    assert ids.tolist() == [0, 1, 2, 3, 7]  # two seen ids + the lowest unseen ones


def test_d2t_t2d_round_trip_and_sglang_checks():
    ids = torch.tensor([2, 3, 10, 40, 41])
    d2t, t2d = vocab_maps(ids, 50)
    assert torch.equal(torch.arange(5) + d2t, ids)  # target_id = draft_id + d2t[draft_id]
    assert t2d.sum() == 5 and t2d[ids].all()
    assert torch.equal(ids_from_maps(d2t, t2d), ids)
    cfg = Eagle3DraftConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                            vocab_size=50, draft_vocab_size=5, target_hidden_size=8, aux_layer_ids=[0, 1, 2])
    m = Eagle3Drafter(cfg)
    set_draft_vocab(m, ids)
    assert torch.equal(m.d2t, d2t) and torch.equal(m.t2d, t2d)
    assert check_drafter_weights(cfg, dict(m.state_dict())) == []
    with pytest.raises(ValueError):
        vocab_maps(torch.tensor([3, 2]), 50)


# ---- teacher and loss

def test_restricted_teacher_matches_full_logits_in_chunks():
    g = torch.Generator().manual_seed(0)
    V, H = 301, 16
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:120]] = True
    hidden = torch.randn(64, H, generator=g, dtype=torch.float64)
    hidden[0] = 0  # all logits tie: argmax must be id 0 like torch.argmax
    ref = reference_teacher(hidden, head, t2d)
    got = TargetHead(head, t2d, "cpu", torch.float64, vocab_chunk=37, row_chunk=10)(hidden)
    assert torch.equal(got.target_id, ref.target_id) and got.target_id[0] == 0
    assert torch.equal(got.in_draft, ref.in_draft)
    assert 0 < int(got.in_draft.sum()) < 64
    torch.testing.assert_close(got.probs, ref.probs, rtol=1e-12, atol=1e-14)


def test_soft_cross_entropy_value_and_gradient_match_autograd():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 13, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(torch.randn(5, 13, generator=g, dtype=torch.float64), -1)
    rows = torch.tensor([0, 4, 4, 1, 2, 3, 0, 1, 2])
    w = torch.rand(9, generator=g, dtype=torch.float64)
    ours = (soft_cross_entropy(logits, probs, rows, chunk=4) * w).sum()
    (ga,) = torch.autograd.grad(ours, logits)
    ref = (-(probs[rows] * torch.log_softmax(logits, -1)).sum(-1) * w).sum()
    (gb,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-12)


def test_warmup_then_cosine():
    f = [lr_factor(s, 4, 20, 0.1) for s in range(24)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4] == 1.0
    assert all(a >= b for a, b in zip(f[4:], f[5:])) and abs(f[20] - 0.1) < 1e-12 and f[23] == f[20]


# ---- the unroll

@pytest.mark.parametrize("drafter", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("attention", ["math", "flash"])
def test_fast_path_equals_dense_reference_loss_and_gradients(attention, drafter, monkeypatch):
    """Skipping inactive positions, packing, the restricted teacher and (for `flash`) the log-sum-exp
    merge with the kernel's backward give the dense implementation's loss and gradients (float64;
    `flash` runs the merge algebra with a plain varlen kernel, the CUDA one is checked by
    benchmarks/bench_train.py --exactness). EAGLE 3.1: the dense reference is the serving forward
    (per-state norms before fc, post-norm feedback), so both parts are trained as served."""
    monkeypatch.setattr(attn_mod, "FLASH_KERNELS", [attn_mod.reference_flash_fwd, attn_mod.reference_flash_bwd])
    m, embed, head, mb = tiny_ttt_case(drafter=drafter)
    K = 4
    si = prepare(mb, embed, TargetHead(head, m.t2d, "cpu", torch.float64, vocab_chunk=16), K, "cpu", torch.float64)
    assert si.active.sum() < si.active.numel()  # the fast path really skips work here
    assert not si.pm.all(dim=None) and si.pm.any()
    lf, stats = fast_ttt_loss(m, si, 0.8, float(mb.num_tokens), attention=attention)
    gf = torch.autograd.grad(lf, list(m.parameters()))
    ld = dense_ttt_loss(m, mb, embed, head, m.t2d, K, 0.8, float(mb.num_tokens))
    gd = torch.autograd.grad(ld, list(m.parameters()))
    torch.testing.assert_close(lf, ld, rtol=1e-12, atol=1e-12)
    for (name, _), a, b in zip(m.named_parameters(), gf, gd):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)
    assert stats.shape == (K, 6) and (stats[:, 1] <= stats[:, 2]).all()
    if drafter == "eagle3.1":  # the 3.1 parts are trained (non-zero gradients) and change the loss
        grads = dict(zip([n for n, _ in m.named_parameters()], gf))
        assert all(grads[f"fc_norm.{i}.weight"].abs().sum() > 0 for i in range(3))
        m.config.norm_output = False  # pre-norm feedback: another loss, so the flag is what the paths agree on
        assert abs(float(dense_ttt_loss(m, mb, embed, head, m.t2d, K, 0.8, float(mb.num_tokens)).detach() - ld)) > 1e-6


def test_accuracy_statistics_are_consistent():
    """Correct predictions only where a loss is counted, chains never exceed per-step hits, and the
    accept length is 1 + sum_k accept_rate_k with accept_rate_k = prod_{j<=k} cond_acc_j."""
    from drafter.training.metrics import summarize

    m, embed, head, mb = tiny_ttt_case()
    K = 3
    si = prepare(mb, embed, TargetHead(head, m.t2d, "cpu", torch.float64), K, "cpu", torch.float64)
    _, stats = fast_ttt_loss(m, si, 0.8, 1.0)
    s = summarize(stats)
    assert len(s["acc"]) == K and all(0 <= a <= 1 for a in s["acc"])
    # correct can only happen where the loss weight is set; a chain only from a start
    assert (stats[:, 3] <= stats[:, 1]).all() and (stats[:, 4] <= stats[:, 5]).all()
    assert s["accept_length"] == pytest.approx(1 + sum(s["accept_rate"]))
    assert s["acc"][0] == pytest.approx(s["accept_rate"][0])
    assert all(a >= b for a, b in zip(s["accept_rate"], s["accept_rate"][1:]))
    run = 1.0
    for rate, cond in zip(s["accept_rate"], s["cond_acc"]):
        run *= cond if cond is not None else 0.0
        assert rate == pytest.approx(run)


def test_micro_batch_without_loss_gives_a_zero_loss_that_backward_accepts():
    m, embed, head, mb = tiny_ttt_case()
    mb.loss_mask[:] = False
    si = prepare(mb, embed, TargetHead(head, m.t2d, "cpu", torch.float64), 3, "cpu", torch.float64)
    loss, stats = fast_ttt_loss(m, si, 0.8, 1.0)
    loss.backward()
    assert float(loss) == 0.0 and stats[:, 1:].sum() == 0
    assert all(p.grad is None or not p.grad.any() for p in m.parameters())


def test_packer_gives_a_sample_longer_than_the_budget_its_own_micro_batch_uncut():
    from drafter.training.data import Cursor, Packer

    def sample(n):
        return {"id": f"s{n}", "input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.bool),
                "aux_hidden_states": torch.zeros(n, 6), "hidden_states": torch.zeros(n, 2)}

    stream = [(Cursor(0, 0, i), sample(n)) for i, n in enumerate([30, 50, 150, 400, 20])]
    got = [mb.doc_lens for _c, mb, _n in Packer(100, 300, prefetch=0).batches(iter(stream), Cursor(1, 0, 0))]
    # 30 + 50 fit the budget; 150 is longer than it and kept whole; 400 is cut at max_length only
    assert [list(d) for d in got] == [[30, 50], [150], [300], [20]]
