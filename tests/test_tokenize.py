"""Loss masks from the target's chat template: generation markers and the prefix-diff fallback."""
from __future__ import annotations

import pytest

from drafter.demo_target import CHAT_TEMPLATE, EOT
from drafter.tokenize import (end_of_turn_ids, has_generation_markers, template_hash, tokenize_conversation,
                              tokenizer_hash)

NO_MARKERS = CHAT_TEMPLATE.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
# ChatML-like layout: a newline after every end-of-turn token (not generated, so never masked).
NEWLINE_AFTER_EOT = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
# Generation block closed before the end-of-turn token: the eot must still be learned.
EOT_OUTSIDE_BLOCK = CHAT_TEMPLATE.replace(
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}",
    "{%- generation %}{{- message['content'] | trim }}{%- endgeneration %}{{- '<|eot_id|>' }}")


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


def with_template(tokenizer, template: str):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def conversations(tiny_conversations):
    """Short multi-turn conversations (2-3 assistant turns), so full renders stay small."""
    out = []
    for conv in tiny_conversations:
        msgs = [{"role": m["role"], "content": m["content"][:300]} for m in conv["messages"][:6]]
        if sum(m["role"] == "assistant" for m in msgs) >= 2:
            out.append(msgs)
        if len(out) == 12:
            break
    assert len(out) == 12
    return out


def masked_spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    spans, cur = [], []
    for token, m in zip(ids, mask):
        if m:
            cur.append(token)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


def expected_answers(messages: list[dict]) -> list[str]:
    return [m["content"].strip() + EOT for m in messages if m["role"] == "assistant"]


@pytest.mark.parametrize("template", ["markers", "no_markers", "newline_after_eot", "eot_outside_block"])
def test_masked_spans_are_exactly_the_answers_and_eot(tokenizer, conversations, template):
    tok = {"markers": tokenizer, "no_markers": with_template(tokenizer, NO_MARKERS),
           "newline_after_eot": with_template(tokenizer, NEWLINE_AFTER_EOT),
           "eot_outside_block": with_template(tokenizer, EOT_OUTSIDE_BLOCK)}[template]
    assert has_generation_markers(tok) == (template in ("markers", "eot_outside_block"))
    for messages in conversations:
        ids, mask = tokenize_conversation(tok, messages, max_length=10_000)
        # The ids are the template's own tokenisation, untouched.
        assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert len(mask) == len(ids) and set(mask) <= {0, 1}
        spans = masked_spans(ids, mask)
        assert [tok.decode(s) for s in spans] == expected_answers(messages)


def test_fallback_equals_generation_markers(tokenizer, tiny_conversations):
    """On the same layout, the prefix-diff fallback gives the masks transformers gives."""
    fallback = with_template(tokenizer, NO_MARKERS)
    for conv in tiny_conversations[:40]:
        assert (tokenize_conversation(fallback, conv["messages"], 4096)
                == tokenize_conversation(tokenizer, conv["messages"], 4096))


def test_header_and_user_tokens_are_never_masked(tokenizer, conversations):
    header = tokenizer.convert_tokens_to_ids(["<|start_header_id|>", "<|end_header_id|>"])
    for messages in conversations:
        ids, mask = tokenize_conversation(tokenizer, messages, 10_000)
        assert not any(m for t, m in zip(ids, mask) if t in header)
        unmasked_text = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
        for m in messages:
            if m["role"] == "user":
                assert m["content"].strip() in unmasked_text


def test_precomputed_end_of_turn_ids_give_the_same_masks(tokenizer, conversations):
    eot_ids = end_of_turn_ids(tokenizer)
    assert eot_ids  # the demo template closes turns with <|eot_id|>
    for messages in conversations[:4]:
        assert (tokenize_conversation(tokenizer, messages, 10_000, eot_ids)
                == tokenize_conversation(tokenizer, messages, 10_000))


def test_truncation_keeps_a_prefix(tokenizer, conversations):
    for messages in conversations[:4]:
        full_ids, full_mask = tokenize_conversation(tokenizer, messages, 10_000)
        for limit in (1, 17, len(full_ids) - 1, len(full_ids), len(full_ids) + 5):
            ids, mask = tokenize_conversation(tokenizer, messages, limit)
            assert ids == full_ids[:limit] and mask == full_mask[:limit]
    with pytest.raises(ValueError):
        tokenize_conversation(tokenizer, conversations[0], 0)


def test_provenance_hashes(tokenizer):
    again = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    assert tokenizer_hash(again) == tokenizer_hash(tokenizer)
    assert template_hash(again) == template_hash(tokenizer)
    # Only the template changed: the tokenizer hash stays, the template hash moves.
    other = with_template(tokenizer, NO_MARKERS)
    assert tokenizer_hash(other) == tokenizer_hash(tokenizer)
    assert template_hash(other) != template_hash(tokenizer)
    again.add_special_tokens({"additional_special_tokens": ["<|new|>"]})
    assert tokenizer_hash(again) != tokenizer_hash(tokenizer)
