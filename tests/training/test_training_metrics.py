"""The per-position metrics on hand-built cases whose answers are known (drafter.training.metrics)."""
from __future__ import annotations

import pytest
import torch

from drafter.contracts.accept import predicted_accept
from drafter.training.metrics import summarize
from drafter.training.ttt import doc_positions, step_loss_mask, step_stats

K = 3


def _stats(loss_mask: list[int], hits: dict[tuple[int, int], bool]) -> dict:
    """One document; hits[(k, t)] = step k from position t was right (only where it has a loss)."""
    mask = torch.tensor(loss_mask, dtype=torch.bool)
    _doc, pos, dlen = doc_positions([len(loss_mask)])
    _lm, _v, lm = step_loss_mask(mask, pos, dlen, K)
    correct = torch.zeros_like(lm)
    for (k, t), ok in hits.items():
        assert lm[k, t], f"hand-built case: step {k} at {t} carries no loss"
        correct[k, t] = ok
    return summarize(step_stats(lm, lm, torch.zeros(K, dtype=torch.float64), correct))


def test_chain_metrics_simulate_a_chain_drafter():
    # Positions 1..4 start drafts (their step 0 has a loss); 5 is the document's last token.
    # start 1: right, right, right -> 3 accepted     start 2: right, wrong, (right) -> 1
    # start 3: wrong, (right)      -> 0              start 4: right, then the answer ends -> 1
    # position 0 is the prompt's last token: its steps 1 and 2 count in acc_k, it starts no draft.
    hits = {(0, 1): True, (1, 1): True, (2, 1): True,
            (0, 2): True, (1, 2): False, (2, 2): True,
            (0, 3): False, (1, 3): True,
            (0, 4): True,
            (1, 0): True, (2, 0): True}
    s = _stats([0, 1, 1, 1, 1, 0], hits)
    assert s["draft_starts"] == 4
    assert s["accept_rate"] == pytest.approx([3 / 4, 1 / 4, 1 / 4])
    assert s["accept_length"] == pytest.approx(1 + (3 + 1 + 0 + 1) / 4)  # 1 + mean accepted per start
    assert s["acc"] == pytest.approx([3 / 4, 3 / 4, 3 / 3])  # SpecForge's acces: over step k's loss mask
    assert s["cond_acc"] == pytest.approx([3 / 4, 1 / 3, 1.0])
    assert predicted_accept(s, 1) == {"accept_length": pytest.approx(1.75), "per_position": [0.75],
                                      "positions_used": 1, "source": "accept_rate"}
    assert predicted_accept(s, 5)["positions_used"] == K


def test_one_token_answers_cannot_look_accepted_beyond_the_answer():
    """The contradiction once printed ("acc [0.99, 0.73, 0.73], conditional [0.99, 0.0, 0.0]"): with
    answers one loss position long, the later steps' accuracy comes from prompt positions only, so
    nothing is accepted past position 0, and the figures say so consistently."""
    hits = {(0, 3): True, (1, 2): True, (2, 1): True}
    s = _stats([0, 0, 0, 1, 0], hits)
    assert s["acc"] == pytest.approx([1.0, 1.0, 1.0])
    assert s["accept_rate"] == pytest.approx([1.0, 0.0, 0.0])
    assert s["cond_acc"] == pytest.approx([1.0, 0.0, None])
    assert s["accept_length"] == pytest.approx(2.0)


def test_no_draft_start_gives_no_conditional_and_accept_length_one():
    s = _stats([0, 0, 0, 0], {})
    assert s["draft_starts"] == 0 and s["accept_length"] == 1.0
    assert s["accept_rate"] == [0.0, 0.0, 0.0] and s["cond_acc"] == [None, None, None]


def test_statistics_add_across_micro_batches():
    """Sums of two micro-batches' statistics give the metrics of both together."""
    a = {(0, 1): True, (1, 1): True, (2, 1): True}
    b = {(0, 1): True}
    mask = [0, 1, 1, 1, 1, 0]

    def raw(hits):
        m = torch.tensor(mask, dtype=torch.bool)
        _d, pos, dlen = doc_positions([len(mask)])
        _lm, _v, lm = step_loss_mask(m, pos, dlen, K)
        correct = torch.zeros_like(lm)
        for key, ok in hits.items():
            correct[key] = ok
        return step_stats(lm, lm, torch.zeros(K, dtype=torch.float64), correct)

    both = summarize(raw(a) + raw(b))
    assert both["draft_starts"] == 8
    assert both["accept_rate"] == pytest.approx([2 / 8, 1 / 8, 1 / 8])


def test_peak_learning_rate_follows_the_batch_by_the_square_root_rule():
    from drafter.training.optim import LR_REFERENCE_TOKENS, peak_learning_rate

    assert peak_learning_rate(6e-4, LR_REFERENCE_TOKENS, "sqrt") == pytest.approx(6e-4)
    assert peak_learning_rate(6e-4, 4 * LR_REFERENCE_TOKENS, "sqrt") == pytest.approx(1.2e-3)
    assert peak_learning_rate(6e-4, LR_REFERENCE_TOKENS // 4, "sqrt") == pytest.approx(3e-4)
    assert peak_learning_rate(6e-4, 4 * LR_REFERENCE_TOKENS, "none") == pytest.approx(6e-4)


def test_the_served_walk_follows_the_chain_from_verify_to_verify():
    """One answer of 8 draft starts (positions 1..8); the walk of a 3-step chain drafter: from 1 it
    accepts 3 (1 -> 5), from 5 it accepts 0 (-> 6), from 6 it accepts 2 (the answer ends) -> 9."""
    from drafter.training.metrics import served_figures, served_walk

    T = 10
    starts = torch.zeros(T, dtype=torch.bool)
    starts[1:9] = True
    correct = torch.zeros(K, T, dtype=torch.bool)
    correct[:, 1] = True                 # 3 right from 1
    correct[0, 2] = correct[0, 3] = True  # positions the walk jumps over: not counted
    correct[1:, 5] = True                # step 0 wrong at 5: nothing accepted there
    correct[:2, 6] = True                # 2 right from 6, then its answer ends
    walk = served_walk(correct, starts)
    assert walk[2].tolist() == [3, 2, 2, 1]          # 3 verifies; position 0 accepted twice, ...
    f = served_figures(walk)
    assert f["served_accept_length"][2] == pytest.approx(1 + 5 / 3)
    assert f["served_per_position"][2] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    # one step: 1 -> 3 (right), 3 -> 5 (right), 5 -> 6 (wrong), 6 -> 8 (right), 8 -> 9 (wrong): 5 verifies, 3 accepted
    assert walk[0].tolist() == [5, 3, 0, 0]
    assert predicted_accept({**f, "accept_rate": [0.0] * K}, 1)["accept_length"] == pytest.approx(1 + 3 / 5)
    assert predicted_accept({"accept_rate": [0.5, 0.25, 0.0]}, 2)["accept_length"] == pytest.approx(1.75)
