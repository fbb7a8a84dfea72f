"""Loss masks from the target's chat template: generation markers and the prefix-diff fallback."""
from __future__ import annotations

import pytest

from drafter.demo_target import CHAT_TEMPLATE, EOT
from drafter.tokenize import (answer_spans, conversation_tokens, end_of_turn_ids, has_generation_markers,
                              retokenize_agreement, template_hash, tokenize_conversation, tokenizer_hash)

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
        spans = answer_spans(ids, mask)
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


# ---- the engine's recorded ids (datagen's `token_ids`)

# Earlier answers are rendered as "[old]" (like templates that drop old reasoning): the prompt of a
# later turn does not extend the earlier one, so there is no single sequence to feed the ids into.
DROPS_OLD_ANSWERS = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if m['role'] == 'assistant' and not loop.last %}{{- '[old]<|eot_id|>' }}"
    "{%- else %}{{- m['content'] | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


NO_GENERATION_PROMPT = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}")


def with_ids(messages: list[dict], answers: list[list[int]]) -> list[dict]:
    """The messages with each assistant turn carrying the given ids, in order."""
    it = iter(answers)
    return [{**m, "token_ids": next(it)} if m["role"] == "assistant" else m for m in messages]


def char_ids(tok, text: str) -> list[int]:
    """`text` one character at a time: what a target may emit, never what BPE re-tokenises to."""
    return [t for ch in text for t in tok(ch, add_special_tokens=False)["input_ids"]]


@pytest.mark.parametrize("template", ["markers", "no_markers", "newline_after_eot", "eot_outside_block"])
@pytest.mark.parametrize("engine_returns_stop_token", [True, False])
def test_ids_equal_to_the_text_give_the_text_paths_answers(tokenizer, conversations, template,
                                                           engine_returns_stop_token):
    """Ids that are the text's own tokens change nothing the drafter learns: same answer tokens,
    same text, mask on content and end of turn, whether or not the engine returned its stop token."""
    tok = {"markers": tokenizer, "no_markers": with_template(tokenizer, NO_MARKERS),
           "newline_after_eot": with_template(tokenizer, NEWLINE_AFTER_EOT),
           "eot_outside_block": with_template(tokenizer, EOT_OUTSIDE_BLOCK)}[template]
    eot = end_of_turn_ids(tok)
    for messages in conversations:
        text_ids, text_mask, exact = conversation_tokens(tok, messages, eot)
        assert not exact  # no ids: re-tokenised, as before
        spans = answer_spans(text_ids, text_mask)
        answers = spans if engine_returns_stop_token else [s[:-1] for s in spans]
        ids, mask, exact = conversation_tokens(tok, with_ids(messages, answers), eot)
        assert exact and len(ids) == len(mask)
        assert answer_spans(ids, mask) == spans
        assert tok.decode(ids) == tok.decode(text_ids)
        # the first prompt is the template's generation prompt, tokenised as an engine tokenises it
        prompt = tok(tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])


def test_the_engines_ids_are_kept_where_re_tokenising_would_merge_them(tokenizer, conversations):
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    eot = end_of_turn_ids(tokenizer)
    messages = conversations[0]
    answers = [char_ids(tokenizer, m["content"].strip()) + [eot_id] for m in messages if m["role"] == "assistant"]
    ids, mask, exact = conversation_tokens(tokenizer, with_ids(messages, answers), eot)
    assert exact and answer_spans(ids, mask) == answers
    assert tokenize_conversation(tokenizer, with_ids(messages, answers), 10_000) == (ids, mask)
    retokenised = answer_spans(*tokenize_conversation(tokenizer, messages, 10_000))
    assert retokenised != answers  # BPE merges characters: the text alone would have been wrong
    tokens, same = retokenize_agreement(tokenizer, with_ids(messages, answers), eot)
    assert tokens == sum(map(len, answers)) and same < tokens
    # ids that ARE the text's tokens agree fully
    assert retokenize_agreement(tokenizer, with_ids(messages, retokenised), eot) == (sum(map(len, retokenised)),) * 2


def test_agreement_counts_the_tokens_re_tokenising_reproduces(tokenizer):
    """One answer token emitted as its characters: every other token still agrees, in order."""
    eot = end_of_turn_ids(tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the answer is forty two"}]
    span = answer_spans(*tokenize_conversation(tokenizer, messages, 10_000))[0]
    i = next(k for k, t in enumerate(span[:-1]) if len(tokenizer.decode([t])) > 1
             and not set(char_ids(tokenizer, tokenizer.decode([t]))) & set(span))
    chars = char_ids(tokenizer, tokenizer.decode([span[i]]))
    answer = span[:i] + chars + span[i + 1:]
    assert retokenize_agreement(tokenizer, with_ids(messages, [answer]), eot) == (len(answer), len(span) - 1)


def test_records_without_ids_everywhere_or_with_a_template_that_rewrites_history_are_retokenised(
        tokenizer, conversations):
    eot = end_of_turn_ids(tokenizer)
    messages = conversations[0]
    answers = [char_ids(tokenizer, m["content"].strip()) for m in messages if m["role"] == "assistant"]
    text = tokenize_conversation(tokenizer, messages, 10_000)
    partial = with_ids(messages, answers)
    del next(m for m in partial if m["role"] == "assistant")["token_ids"]
    assert conversation_tokens(tokenizer, partial, eot) == (*text, False)  # one rule per sample
    assert retokenize_agreement(tokenizer, partial, eot) is None
    rewrites = with_template(tokenizer, DROPS_OLD_ANSWERS)
    ids, mask, exact = conversation_tokens(rewrites, with_ids(messages, answers), eot)
    assert not exact and (ids, mask) == tokenize_conversation(rewrites, messages, 10_000)
    assert retokenize_agreement(rewrites, with_ids(messages, answers), eot) is None


def test_a_template_without_a_generation_prompt_keeps_the_header_out_of_the_loss(tokenizer, conversations):
    """A template that ignores add_generation_prompt renders the assistant header with the answer:
    the header still goes before the engine's ids, unmasked."""
    no_prompt = with_template(tokenizer, NO_GENERATION_PROMPT)
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    for messages in conversations[:4]:
        answers = [char_ids(tokenizer, m["content"].strip()) + [eot_id] for m in messages if m["role"] == "assistant"]
        ids, mask, exact = conversation_tokens(no_prompt, with_ids(messages, answers), end_of_turn_ids(no_prompt))
        assert exact and answer_spans(ids, mask) == answers
        assert no_prompt.decode(ids) == no_prompt.apply_chat_template(messages, tokenize=False)
