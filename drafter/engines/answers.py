"""How a chat completion is asked for the token ids it generated, and where each engine puts them.

Engine-independent on purpose: datagen talks to servers it did not start and cannot tell apart, so
one request (`TOKEN_IDS_REQUEST`) and one reader (`answer_token_ids`) serve all of them.
"""
from __future__ import annotations

from typing import Any, Mapping

# --------------------------------------------------------------------------------------------
# The generated token ids of a chat answer (datagen keeps the target's own ids: re-tokenising the
# text merges tokens the target emitted one by one, e.g. a run of "\n")
# --------------------------------------------------------------------------------------------

# The same request field asks every engine we serve with. A server that does not know it ignores it
# (vLLM, SGLang and FastAPI/pydantic servers drop unknown fields) and answers without ids.
TOKEN_IDS_REQUEST = {"return_token_ids": True}

# Where each engine answers, in a non-streaming chat completion (the first choice):
# - vLLM 0.32 and our reference engine: `choices[i].token_ids`, plus `prompt_token_ids` at the top
#   (vllm/entrypoints/openai/chat_completion/protocol.py: ChatCompletionResponseChoice.token_ids,
#   ChatCompletionResponse.prompt_token_ids; chat_completion/serving.py fills both when
#   request.return_token_ids). The stop token is included: vllm/v1/core/sched/scheduler.py appends
#   each sampled id before v1/core/sched/utils.py check_stop ends the request on it.
# - SGLang 0.5.23: `choices[i].response_token_ids` and `choices[i].prompt_token_ids`
#   (python/sglang/srt/entrypoints/openai/protocol.py: ChatCompletionRequest.return_token_ids,
#   ChatCompletionResponseChoice; serving_chat.py sets response_token_ids from the request's
#   output_ids, which srt/managers/schedule_batch.py `output_ids_through_stop` cuts "through the
#   stop condition. Stop position is included"). Only 0.5.23 was read: a version without the field
#   ignores it (its request models are plain pydantic models, which drop unknown fields) and answers
#   no ids.
_ANSWER_ID_FIELDS = ("token_ids", "response_token_ids")


def answer_token_ids(body: Mapping[str, Any]) -> list[int] | None:
    """The ids the engine generated for the first choice of a chat completion (the stop token
    included when it stopped on one), or None when the server returned none. Raises ValueError
    on ids that are not a list of integers (a broken answer, not an absent one)."""
    choice = body["choices"][0]
    for name in _ANSWER_ID_FIELDS:
        ids = choice.get(name)
        if ids is None:
            continue
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"choices[0].{name} is not a list of token ids")
        return ids
    return None
