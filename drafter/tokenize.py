"""Conversations -> token ids + loss mask, with the target's own chat template.

The mask is 1 exactly on what the target generates in an assistant turn: the content and the
end-of-turn token that closes it, never the role header. Two ways to get it:
- templates that mark assistant text with `{% generation %}` ... `{% endgeneration %}`:
  `apply_chat_template(..., return_assistant_tokens_mask=True)` (transformers does the bookkeeping);
- any other template: render the conversation prefixes and diff them (character spans of each
  assistant turn), then map the spans onto token offsets.
Both paths agree on templates that have the markers (tests check it), so a target whose template
lacks them gets the same masks it would get with them.
"""
from __future__ import annotations

import json
import re

from drafter.hashing import short_hash

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
# End-of-turn tokens of common chat formats. Some templates close `{% generation %}` before the
# end-of-turn token, but the drafter must learn to predict it (it ends every answer).
_KNOWN_EOT = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


def has_generation_markers(tokenizer) -> bool:
    template = _template_text(tokenizer)
    return bool(template) and bool(_GENERATION_TAG.search(template))


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int,
                          eot_ids: set[int] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) for one conversation, truncated to `max_length` tokens.
    `eot_ids`: `end_of_turn_ids(tokenizer)`, computed once by callers that tokenise many
    conversations (it builds the whole vocabulary: ~0.14 s per call for a 128k vocab)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if has_generation_markers(tokenizer):
        ids, mask = _with_generation_markers(tokenizer, messages)
    else:
        ids, mask = _by_prefix_diff(tokenizer, messages)
    mask = _extend_over_eot(ids, mask, end_of_turn_ids(tokenizer) if eot_ids is None else eot_ids)
    return ids[:max_length], mask[:max_length]


def end_of_turn_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    ids |= {vocab[t] for t in _KNOWN_EOT if t in vocab and t in tokenizer.all_special_tokens}
    return ids


def _with_generation_markers(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids = list(out["input_ids"])
    mask = [int(bool(m)) for m in out["assistant_masks"]]
    return ids, mask


def _extend_over_eot(ids: list[int], mask: list[int], eot_ids: set[int]) -> list[int]:
    """Mask the end-of-turn token right after a masked span when the template left it out."""
    mask = list(mask)
    for i in range(1, len(ids)):
        if mask[i - 1] and not mask[i] and ids[i] in eot_ids:
            mask[i] = 1
    return mask


# ---- fallback: templates without generation markers


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant turn.

    Span of turn k = what rendering messages[:k+1] adds over messages[:k] + generation prompt,
    i.e. content + end-of-turn, without the header (the generation prompt is the header). Trailing
    whitespace after the end-of-turn token (ChatML's newline) is not generated: left out. A template
    that re-renders earlier turns differently (some drop old reasoning) breaks the prefix property:
    then the span is found by searching the content after the previous span.
    """
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    text = render(messages, False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:k], True), render(messages[:k + 1], False)
        if text.startswith(before) and text.startswith(through) and len(before) >= cursor:
            start, end = len(before), len(through)
            while end > start and text[end - 1].isspace():
                end -= 1
        else:
            content = message["content"].strip()
            start = text.find(content, cursor)
            if start < 0 or not content:
                continue  # the template did not render this turn's content: nothing to learn
            end = start + len(content)
            eos = tokenizer.eos_token
            if eos and text.startswith(eos, end):
                end += len(eos)
        if end > start:
            spans.append((start, end))
            cursor = end
    return text, spans


def _by_prefix_diff(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    text, spans = assistant_char_spans(tokenizer, messages)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        # A token belongs to a turn when it starts inside the turn's span: a token that straddles
        # header and content (rare with byte-level BPE) counts as header.
        mask = [int(any(s <= a < e for s, e in spans)) for a, _b in enc["offset_mapping"]]
        return ids, mask
    # Slow tokenizers have no offsets: tokenize segment by segment (exact for templates whose
    # segment boundaries are token boundaries, which special-token delimiters guarantee).
    ids, mask, pos = [], [], 0
    for s, e in spans + [(len(text), len(text))]:
        for seg, flag in ((text[pos:s], 0), (text[s:e], 1)):
            if seg:
                seg_ids = tokenizer(seg, add_special_tokens=False)["input_ids"]
                ids += seg_ids
                mask += [flag] * len(seg_ids)
        pos = e
    return ids, mask


# ---- provenance


def _template_text(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders conversations
        template = template.get("default")
    return template


def _sha16(text: str) -> str:
    return short_hash(text)


def template_hash(tokenizer) -> str:
    """Identity of the chat template(s): any edit changes which tokens are masked."""
    template = getattr(tokenizer, "chat_template", None)
    return _sha16(json.dumps(template, sort_keys=True, ensure_ascii=False))


def tokenizer_hash(tokenizer) -> str:
    """Identity of the text -> ids mapping (vocab, merges, normalizer, special tokens), independent
    of the tokenizer class name, which changes across transformers releases."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        core = backend.to_str()
    else:
        core = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    special = {"special": sorted((t, tokenizer.convert_tokens_to_ids(t)) for t in tokenizer.all_special_tokens),
               "bos": tokenizer.bos_token, "eos": tokenizer.eos_token, "pad": tokenizer.pad_token}
    return _sha16(core + json.dumps(special, sort_keys=True, ensure_ascii=False))
