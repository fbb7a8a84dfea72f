"""The reference server's HTTP side: the state its endpoints share (`ServerState`: the engine,
readiness, cumulative speculative stats), reading a request (SGLang sampling params, OpenAI
parameters, chat templates), describing a generation the SGLang way (meta_info), and the FastAPI
app with SGLang's and OpenAI's endpoints (`build_app`). Loading, start-up and the command line are
drafter.engines.reference.reference_server's."""
from __future__ import annotations

import argparse
import logging
import threading
import time
import uuid
from typing import Any

WARMUP_TEXT = "The capital city of France is"
VERSION = "drafter-reference-0.1"

log = logging.getLogger("drafter.reference_server")  # the server's one logger (reference_server sets it up)


# =========================================================================== server state

class ServerState:
    """Everything the endpoints share: the engine, readiness, cumulative speculative stats."""

    def __init__(self, args: argparse.Namespace, engine, served_name: str):
        self.args, self.engine, self.served_name = args, engine, served_name
        self.faults = args.faults             # reference_server.Faults
        self.ready = False
        self.engine_lock = threading.Lock()   # one generation at a time
        self.stats_lock = threading.Lock()
        self.running = 0
        self.reset_stats()

    def reset_stats(self) -> None:
        self.completion_tokens = self.verify_ct = self.requests = 0
        self.last_throughput = 0.0

    def record(self, result, seconds: float) -> None:
        if not result.speculative:
            return
        with self.stats_lock:
            self.completion_tokens += result.completion_tokens
            self.verify_ct += result.spec_verify_ct
            self.requests += 1
            self.last_throughput = result.completion_tokens / seconds if seconds > 0 else 0.0

    def generate(self, prompt: list[int], params, stop_fn=None, internal: bool = False):
        """Run one generation under the engine lock; `internal` ones (warmup, health) are not counted."""
        if not internal:
            with self.stats_lock:
                self.running += 1
        try:
            start = time.perf_counter()
            with self.engine_lock:
                result = self.engine.generate(prompt, params, stop_fn=stop_fn)
            seconds = time.perf_counter() - start
            if not internal:
                self.record(result, seconds)
            return result, seconds
        finally:
            if not internal:
                with self.stats_lock:
                    self.running -= 1

    def server_args(self) -> dict[str, Any]:
        a = self.args
        target = self.engine.target
        drafter = self.engine.drafter
        return {
            "model_path": a.model_path, "tokenizer_path": a.tokenizer_path or a.model_path,
            "served_model_name": self.served_name, "host": a.host, "port": a.port,
            "device": str(target.device), "dtype": str(target.dtype).removeprefix("torch."),
            "tp_size": 1, "mem_fraction_static": a.mem_fraction_static,
            "cuda_graph_max_bs": a.cuda_graph_max_bs, "disable_cuda_graph": True,
            "disable_custom_all_reduce": a.disable_custom_all_reduce,
            "max_running_requests": a.max_running_requests, "context_length": target.max_position_embeddings,
            "speculative_algorithm": a.speculative_algorithm,
            "speculative_draft_model_path": a.speculative_draft_model_path,
            "speculative_num_steps": a.speculative_num_steps,
            "speculative_eagle_topk": a.speculative_eagle_topk,
            "speculative_num_draft_tokens": a.speculative_num_draft_tokens,
            "simulate_accept_length": a.simulate_accept_length,
            "speculative_aux_hidden_state_layer_ids": target.aux_layer_ids if drafter is not None else None,
            "layer_id_convention": layer_id_convention(),
            "engine": "reference", "faults": list(a.fault), "version": VERSION,
        }

    def internal_state(self) -> dict[str, Any]:
        with self.stats_lock:
            avg = self.completion_tokens / self.verify_ct if self.verify_ct else 0.0
            return {"avg_spec_accept_length": avg, "spec_verify_ct": self.verify_ct,
                    "completion_tokens": self.completion_tokens, "num_requests": self.requests,
                    "num_running_reqs": self.running, "last_gen_throughput": self.last_throughput}


def layer_id_convention() -> str:
    from drafter.config import LAYER_ID_CONVENTION

    return LAYER_ID_CONVENTION


# =========================================================================== request handling

class BadRequest(Exception):
    pass


# SGLang sampling params we accept only at their neutral value.
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_new_tokens": 0, "min_p": 0.0, "n": 1, "skip_special_tokens": True,
            "spaces_between_special_tokens": True, "no_stop_trim": False}


def sampling_params(raw: dict[str, Any] | None, default_max: int):
    from drafter.engines.reference.speculative import SamplingParams

    raw = dict(raw or {})
    for key, neutral in _NEUTRAL.items():
        if key in raw and raw.pop(key) != neutral:
            raise BadRequest(f"sampling param {key!r} other than {neutral!r} is not supported by the reference engine")
    stop = raw.pop("stop", None) or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    seed = raw.pop("sampling_seed", None)
    seed = raw.pop("seed", seed)

    def take(key: str, default, kind):
        value = raw.pop(key, None)
        return default if value is None else kind(value)
    try:
        params = SamplingParams(
            max_new_tokens=take("max_new_tokens", default_max, int),
            temperature=take("temperature", 1.0, float),  # SGLang's default, like OpenAI's
            top_p=take("top_p", 1.0, float), top_k=take("top_k", -1, int),
            stop_token_ids=[int(t) for t in take("stop_token_ids", [], list)],
            ignore_eos=take("ignore_eos", False, bool), seed=None if seed is None else int(seed))
    except (TypeError, ValueError) as err:
        raise BadRequest(f"bad sampling params: {err}") from None
    if raw:
        raise BadRequest(f"unknown sampling params: {sorted(raw)}")
    if params.max_new_tokens < 1 or params.temperature < 0 or not 0 < params.top_p <= 1:
        raise BadRequest("max_new_tokens must be >= 1, temperature >= 0, top_p in (0, 1]")
    return params, stop


def stop_string_fn(tokenizer, stops: list[str]):
    """Token count to keep once the decoded output contains a stop string (SGLang trims it)."""
    if not stops:
        return None

    def check(ids: list[int]) -> int | None:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if not any(s in text for s in stops):
            return None
        for keep in range(1, len(ids) + 1):  # the shortest prefix that completes a stop string
            if any(s in tokenizer.decode(ids[:keep], skip_special_tokens=True) for s in stops):
                return keep
        return len(ids)
    return check


def run_generation(state: ServerState, prompt: list[int], raw_params: dict | None, default_max: int):
    """Generate and describe the result the SGLang way: (text, ids, meta_info)."""
    if state.faults.refuse_generation:
        raise RuntimeError("generation refused (injected fault refuse-generation)")
    params, stops = sampling_params(raw_params, default_max)
    tokenizer = state.engine.target.tokenizer
    try:
        result, seconds = state.generate(prompt, params, stop_string_fn(tokenizer, stops))
    except ValueError as err:  # prompt too long, bad token ids
        raise BadRequest(str(err)) from None
    text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
    matched = result.matched_stop
    if matched == "stop_string":
        matched = next(s for s in stops if s in text)
        text = text[:text.index(matched)]
    if result.finish_reason == "length":
        finish = {"type": "length", "length": result.completion_tokens}
    else:
        finish = {"type": "stop", "matched": matched}
    meta = {
        "id": uuid.uuid4().hex, "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens, "cached_tokens": 0,
        "finish_reason": finish, "e2e_latency": seconds,
        "spec_verify_ct": result.spec_verify_ct,
        "spec_accept_length": result.accept_length,
        "spec_num_correct_drafts": result.accepted_drafts,
        "spec_num_proposed_drafts": result.proposed_drafts,
        "speculative": result.speculative,
    }
    log.info(f"Finished request: prompt_tokens={result.prompt_tokens}, completion_tokens="
             f"{result.completion_tokens}, spec_verify_ct={result.spec_verify_ct}, "
             f"gen throughput (token/s): {result.completion_tokens / max(seconds, 1e-9):.2f}")
    return text, result.output_ids, meta


def encode(state: ServerState, text: str) -> list[int]:
    return state.engine.target.tokenizer(text).input_ids


def _chat_ids(state: ServerState, messages: list[dict]) -> list[int]:
    tok = state.engine.target.tokenizer
    if not tok.chat_template:
        raise BadRequest("the model's tokenizer has no chat template")
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # template errors (unknown role, ...) are the client's
        raise BadRequest(f"chat template failed: {err}") from None
    return tok(text, add_special_tokens=False).input_ids


def _openai_finish(meta: dict) -> str:
    return "length" if meta["finish_reason"]["type"] == "length" else "stop"


# =========================================================================== the HTTP app

def build_app(state: ServerState):
    from fastapi import FastAPI

    app = FastAPI(title="drafter reference server")
    _add_health_routes(app, state)
    _add_info_routes(app, state)
    _add_generate_route(app, state)
    _add_openai_routes(app, state)
    return app


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status},
                        "object": "error", "message": message}, status_code=status)


def _guarded(fn):
    """Map our exceptions to HTTP: 400 for client errors, 500 for generation failures."""
    try:
        return fn()
    except BadRequest as err:
        return _error(400, str(err))
    except Exception as err:  # noqa: BLE001 - a failed generation must answer, not hang
        log.error(f"generation failed: {err}")
        return _error(500, f"generation failed: {err}", "server_error")


def _usage(metas: list[dict]) -> dict:
    prompt = sum(m["prompt_tokens"] for m in metas)
    completion = sum(m["completion_tokens"] for m in metas)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _openai_params(body: dict) -> dict:
    if body.get("stream"):
        raise BadRequest("streaming is not supported by the reference engine")
    if (body.get("n") or 1) != 1:
        raise BadRequest("n > 1 is not supported by the reference engine")
    params = {"max_new_tokens": body.get("max_completion_tokens") or body.get("max_tokens"),
              "temperature": body.get("temperature"), "top_p": body.get("top_p"),
              "stop": body.get("stop"), "seed": body.get("seed")}
    for key in ("top_k", "ignore_eos", "stop_token_ids"):
        if key in body:
            params[key] = body[key]
    return {k: v for k, v in params.items() if v is not None}


def _add_health_routes(app, state: ServerState) -> None:
    from fastapi.responses import Response

    @app.get("/health")
    def health():
        ok = state.ready and not state.faults.never_healthy
        return Response(status_code=200 if ok else 503)

    @app.get("/health_generate")
    def health_generate():
        if not state.ready or state.faults.never_healthy:
            return Response(status_code=503)
        if state.faults.refuse_generation:
            return Response(status_code=503)
        from drafter.engines.reference.speculative import SamplingParams

        done, ok = threading.Event(), []

        def one_token():
            try:
                state.generate(encode(state, WARMUP_TEXT), SamplingParams(max_new_tokens=1, temperature=0.0),
                               internal=True)
                ok.append(True)
            except Exception as err:  # noqa: BLE001 - a failed generation is an unhealthy server
                log.error(f"health_generate failed: {err}")
            finally:
                done.set()  # a failure answers 503 now, not after the 20 s wait
        threading.Thread(target=one_token, daemon=True).start()
        return Response(status_code=200 if done.wait(20.0) and ok else 503)


def _add_info_routes(app, state: ServerState) -> None:
    from fastapi.responses import PlainTextResponse

    @app.get("/v1/models")
    def models():
        target = state.engine.target
        return {"object": "list", "data": [{
            "id": state.served_name, "object": "model", "created": int(time.time()),
            "owned_by": "drafter-lifecycle", "root": state.args.model_path,
            "max_model_len": target.max_position_embeddings}]}

    @app.get("/get_model_info")
    def model_info():
        target = state.engine.target
        return {"model_path": state.args.model_path, "tokenizer_path": state.args.tokenizer_path or state.args.model_path,
                "is_generation": True, "served_model_name": state.served_name,
                "architecture": target.architecture, "max_context_length": target.max_position_embeddings,
                "preferred_sampling_params": None, "weight_version": "default"}

    def server_info():
        return {**state.server_args(), "internal_states": [state.internal_state()]}
    app.get("/get_server_info")(server_info)
    app.get("/server_info")(server_info)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache():
        with state.stats_lock:
            if state.running:
                return PlainTextResponse(f"Cache not flushed. There are {state.running} running requests.",
                                         status_code=400)
            state.reset_stats()
        return PlainTextResponse("Cache flushed.", status_code=200)


def _add_generate_route(app, state: ServerState) -> None:
    from fastapi import Body

    @app.post("/generate")
    def generate(body: dict = Body(...)):
        def work():
            if body.get("stream"):
                raise BadRequest("streaming is not supported by the reference engine")
            if body.get("return_logprob"):
                raise BadRequest("return_logprob is not supported by the reference engine")
            text, ids = body.get("text"), body.get("input_ids")
            if (text is None) == (ids is None):
                raise BadRequest("give exactly one of 'text' and 'input_ids'")
            batched = isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
            prompts = text if isinstance(text, list) else ids if batched else [text if text is not None else ids]
            params = body.get("sampling_params")
            params = params if isinstance(params, list) else [params] * len(prompts)
            if len(params) != len(prompts):
                raise BadRequest("sampling_params list length differs from the number of prompts")
            out = []
            for prompt, p in zip(prompts, params):
                prompt_ids = encode(state, prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
                gen_text, gen_ids, meta = run_generation(state, prompt_ids, p, default_max=128)
                out.append({"text": gen_text, "output_ids": gen_ids, "meta_info": meta})
            return out if batched else out[0]
        return _guarded(work)


def _add_openai_routes(app, state: ServerState) -> None:
    from fastapi import Body

    @app.post("/v1/completions")
    def completions(body: dict = Body(...)):
        def work():
            params = _openai_params(body)
            prompt = body.get("prompt")
            if prompt is None:
                raise BadRequest("'prompt' is required")
            if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
                prompt = [prompt]
            choices, metas = [], []
            for i, p in enumerate(prompt):
                ids = encode(state, p) if isinstance(p, str) else [int(t) for t in p]
                text, _, meta = run_generation(state, ids, params, default_max=16)
                choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": _openai_finish(meta),
                                "matched_stop": meta["finish_reason"].get("matched")})
                metas.append(meta)
            return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                    "model": state.served_name, "choices": choices, "usage": _usage(metas)}
        return _guarded(work)

    @app.post("/v1/chat/completions")
    def chat_completions(body: dict = Body(...)):
        def work():
            params = _openai_params(body)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list")
            prompt_ids = _chat_ids(state, messages)
            text, ids, meta = run_generation(state, prompt_ids, params, default_max=16 * 1024)
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": _openai_finish(meta),
                      "matched_stop": meta["finish_reason"].get("matched")}
            answer = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                      "created": int(time.time()), "model": state.served_name, "choices": [choice],
                      "usage": _usage([meta])}
            if body.get("return_token_ids"):
                # vLLM's fields and shape (drafter.engines.answer_token_ids): the generated
                # ids as sampled, the stop token included, and the prompt the template gave.
                choice["token_ids"] = list(ids)
                answer["prompt_token_ids"] = prompt_ids
            return answer
        return _guarded(work)
