"""Conversations -> token ids + loss mask, with the target's own chat template.

The mask is 1 exactly on what the target generates in an assistant turn: the content and the
end-of-turn token that closes it, never the role header. Two ways to get it:
- templates that mark assistant text with `{% generation %}` ... `{% endgeneration %}`:
  `apply_chat_template(..., return_assistant_tokens_mask=True)` (transformers does the bookkeeping);
- any other template: render the conversation prefixes and diff them (character spans of each
  assistant turn), then map the spans onto token offsets.
Both paths agree on templates that have the markers (tests check it), so a target whose template
lacks them gets the same masks it would get with them.

Records whose every assistant message carries `token_ids` (the ids the engine generated, recorded
by datagen) are not re-tokenised: re-tokenising the text merges tokens the target emitted one by
one (a run of "\n" becomes one longer token), a sequence the target never produces. Then the
sequence is, turn by turn, the template's prompt for the turn (the history rendered with
`add_generation_prompt`, tokenised as the engine tokenises its prompt), the engine's ids (mask 1),
and the template's end-of-turn (mask 1, unless the engine returned its stop token itself; trailing
whitespace after it mask 0). A template that re-renders earlier turns differently (the prompt of
turn k is not a prefix of turn k+1's) has no single sequence to give: such a record is
re-tokenised, like a record without ids.
"""
from __future__ import annotations

import json
import re

from drafter.hashing import short_hash

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
# End-of-turn tokens of common chat formats. Some templates close `{% generation %}` before the
# end-of-turn token, but the drafter must learn to predict it (it ends every answer).
_KNOWN_EOT = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")
TOKEN_IDS = "token_ids"  # an assistant message's generated ids (datagen records)


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
    ids, mask, _ = conversation_tokens(tokenizer, messages, end_of_turn_ids(tokenizer) if eot_ids is None else eot_ids)
    return ids[:max_length], mask[:max_length]


def conversation_tokens(tokenizer, messages: list[dict], eot_ids: set[int]) -> tuple[list[int], list[int], bool]:
    """(input_ids, loss_mask, from the recorded ids): the engine's ids where every answer has
    them and the template allows it, else the text re-tokenised."""
    out = from_token_ids(tokenizer, messages, eot_ids) if has_token_ids(messages) else None
    if out is not None:
        return *out, True
    return *retokenize_conversation(tokenizer, messages, eot_ids), False


def retokenize_conversation(tokenizer, messages: list[dict], eot_ids: set[int]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) from the text alone (any `token_ids` are ignored)."""
    messages = text_only(messages)
    if has_generation_markers(tokenizer):
        ids, mask = _with_generation_markers(tokenizer, messages)
    else:
        ids, mask = _by_prefix_diff(tokenizer, messages)
    return ids, _extend_over_eot(ids, mask, eot_ids)


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


# ---- the engine's own ids


def valid_token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def has_token_ids(messages: list[dict]) -> bool:
    """Every assistant message carries its generated ids (a record with some turns lacking them
    is re-tokenised whole: one rule per sample)."""
    answers = [m for m in messages if m.get("role") == "assistant"]
    return bool(answers) and all(valid_token_ids(m.get(TOKEN_IDS)) for m in answers)


def text_only(messages: list[dict]) -> list[dict]:
    """The messages as the chat template sees them (no ids)."""
    return [{k: v for k, v in m.items() if k != TOKEN_IDS} for m in messages]


def from_token_ids(tokenizer, messages: list[dict], eot_ids: set[int]) -> tuple[list[int], list[int]] | None:
    """(input_ids, loss_mask) with each assistant turn's recorded ids in place of its text, or None
    when the template does not render the conversation as a growing prefix (see the module doc)."""
    plain = text_only(messages)
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    encode = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # the rendered text the sequence covers so far

    def add(tokens: list[int], flag: int) -> None:
        ids.extend(tokens)
        mask.extend([flag] * len(tokens))

    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, through = render(plain[:k], True), render(plain[:k + 1], False)
        parts = _around_content(through[len(prompt):], message["content"]) if through.startswith(prompt) else None
        if not prompt.startswith(done) or parts is None:
            return None
        header, closing = parts  # header: "" unless the template ignores add_generation_prompt
        generated = list(message[TOKEN_IDS])
        add(encode(prompt[len(done):] + header), 0)  # what the engine was given, never learned
        add(generated, 1)
        # The template's end of turn is learned like the text path learns it (up to trailing
        # whitespace); an engine that returned its stop token already has it in `generated`.
        end = closing.rstrip()
        end_ids = encode(end)
        if not (generated and generated[-1] in eot_ids and all(t in eot_ids for t in end_ids)):
            add(end_ids, 1)
        add(encode(closing[len(end):]), 0)
        done = through
    full = render(plain, False)
    if not full.startswith(done):
        return None
    add(encode(full[len(done):]), 0)  # turns after the last answer
    return ids, mask


def _around_content(rendered: str, content: str) -> tuple[str, str] | None:
    """(what the template puts before, after an answer's content) in the rendered turn: the header
    a template that ignores add_generation_prompt renders, and the end of turn; None when the
    content cannot be found (the template rewrote it)."""
    if rendered.startswith(content):
        return "", rendered[len(content):]
    core = content.strip()  # templates that trim the content
    if not core:
        return "", rendered
    at = rendered.find(core)
    return None if at < 0 else (rendered[:at], rendered[at + len(core):])


def answer_spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The masked runs of a sequence: one per assistant turn (content and end of turn)."""
    spans: list[list[int]] = []
    run: list[int] = []
    for token, m in zip(ids, mask):
        if m:
            run.append(token)
        elif run:
            spans.append(run)
            run = []
    return spans + ([run] if run else [])


def retokenize_agreement(tokenizer, messages: list[dict], eot_ids: set[int]) -> tuple[int, int] | None:
    """(answer tokens trained from the recorded ids, how many of them re-tokenising the text gives
    too) for a conversation whose answers all carry ids; None when it has none or the dump would
    re-tokenise it anyway. Matching tokens are counted turn by turn as in-order matching blocks,
    so one merged run costs its own tokens, not the rest of the turn."""
    exact = from_token_ids(tokenizer, messages, eot_ids) if has_token_ids(messages) else None
    if exact is None:
        return None
    ours, theirs = answer_spans(*exact), answer_spans(*retokenize_conversation(tokenizer, messages, eot_ids))
    if len(ours) != len(theirs):  # a turn rendered empty on one side: compare the answers whole
        ours, theirs = [sum(ours, [])], [sum(theirs, [])]
    return sum(len(a) for a in ours), sum(_matching_tokens(a, b) for a, b in zip(ours, theirs))


def _matching_tokens(a: list[int], b: list[int]) -> int:
    """Tokens of `a` matched in order in `b`: the common prefix and suffix, then difflib's blocks
    in between (so equal answers, the usual case, cost one pass; difflib is pure Python)."""
    from difflib import SequenceMatcher

    n = min(len(a), len(b))
    head = next((i for i in range(n) if a[i] != b[i]), n)
    tail = next((i for i in range(n - head) if a[-1 - i] != b[-1 - i]), n - head)
    middle = SequenceMatcher(None, a[head:len(a) - tail], b[head:len(b) - tail], autojunk=False)
    return head + tail + sum(block.size for block in middle.get_matching_blocks())


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
