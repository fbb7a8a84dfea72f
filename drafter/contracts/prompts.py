"""The held-out prompt builder: conversations -> the token ids a chat request sends (the target's
chat template, up to the first assistant turn, with a generation prompt), the same for the export
judge and the bench, so both measure on the same prompts under the same length rule."""
from __future__ import annotations


def prompts_from_conversations(tokenizer, conversations: list[dict], limit: int, max_prompt_tokens: int
                               ) -> tuple[list[list[int]], dict[str, int]]:
    """Token ids of the first `limit` usable prompts: each conversation's messages up to its first
    assistant turn, rendered with the target's chat template and a generation prompt."""
    prompts, skipped = [], {"no_user_turn": 0, "too_long": 0}
    for conv in conversations:
        if len(prompts) >= limit:
            break
        messages = []
        for m in conv.get("messages") or []:
            if m.get("role") == "assistant":
                break
            messages.append({"role": m["role"], "content": m["content"]})
        if not any(m["role"] == "user" for m in messages):
            skipped["no_user_turn"] += 1
            continue
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        ids = [int(i) for i in ids]
        if len(ids) > max_prompt_tokens:
            skipped["too_long"] += 1
            continue
        prompts.append(ids)
    return prompts, skipped
