"""The draft vocabulary: the most frequent answer tokens, and SGLang's d2t / t2d maps.

Contract (sglang-eagle3-contract.md section 1): count tokens where loss_mask == 1, take the
`draft_vocab_size` most common, pad with unseen ids when fewer distinct tokens exist, sort by id.
d2t holds OFFSETS (target_id = draft_id + d2t[draft_id]); t2d[target_id] is True in the vocab.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def count_loss_tokens(samples: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size] counts of the token ids where loss_mask is set."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        ids = torch.as_tensor(s["input_ids"], dtype=torch.int64)[torch.as_tensor(s["loss_mask"]).bool()]
        if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            raise ValueError(f"sample {s.get('id')}: token id outside the target vocab 0..{vocab_size - 1}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Sorted target ids of the draft vocab. Ties (and the unseen-id padding) go to the lower id,
    so the choice is a pure function of the counts."""
    vocab_size = counts.numel()
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab_size}")
    # Stable sort on -count: equal counts keep id order; unseen ids (count 0) come last, lowest first.
    order = torch.sort(-counts, stable=True).indices
    return order[:draft_vocab_size].sort().values


def vocab_maps(target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t offsets int64 [draft], t2d bool [vocab]) for sorted, distinct target ids."""
    target_ids = torch.as_tensor(target_ids, dtype=torch.int64)
    if not torch.equal(target_ids, target_ids.unique(sorted=True)):
        raise ValueError("draft vocab ids must be distinct and sorted")
    d2t = target_ids - torch.arange(target_ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


def ids_from_maps(d2t: torch.Tensor, t2d: torch.Tensor | None = None) -> torch.Tensor:
    """The sorted target ids back from d2t (checked against t2d when given)."""
    ids = torch.arange(d2t.numel()) + d2t.cpu()
    if t2d is not None and not torch.equal(t2d.cpu().nonzero().flatten(), ids):
        raise ValueError("d2t and t2d disagree")
    return ids
