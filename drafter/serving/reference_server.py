"""Our reference inference server: a Hugging Face target with EAGLE-3 speculative decoding
behind SGLang-compatible flags, start-up log lines and endpoints (contract sections 3-5).

    python -m drafter.serving.reference_server --model-path DIR --host H --port P \
        [--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR \
         --speculative-num-steps S --speculative-eagle-topk 1 --speculative-num-draft-tokens S+1] \
        [--fault hang:<phase> | crash:<phase> | slow:<phase>:<seconds> | refuse-generation | never-healthy]

Start-up follows SGLang's order: weights -> KV cache -> HTTP server -> warmup generation -> ready.
The port is only bound after loading, so it refuses connections while the model loads. Requests are
served one at a time by the engine (a lock), which keeps per-request accounting exact.
`/v1/chat/completions` with `return_token_ids: true` also answers the generated ids and the prompt
ids in vLLM's fields (`choices[0].token_ids`, `prompt_token_ids`), so one client reads both.

Faults (tests of the readiness gate; all off by default) act at the start of a phase:
  hang      no progress and no log line ever again; the process stays alive
  crash     an error line and a traceback, then exit 1
  slow      the phase takes that long, with a progress line about every second
  refuse-generation   ready and healthy, but every generation answers HTTP 500
  never-healthy       HTTP up, /health stays 503, no more log lines
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

PHASES = ("load_weights", "kv_cache", "warmup")
WARMUP_TEXT = "The capital city of France is"
VERSION = "drafter-reference-0.1"
GB = 1 << 30

log = logging.getLogger("drafter.reference_server")


# =========================================================================== flags and faults

@dataclass
class Faults:
    hang: set[str] = field(default_factory=set)
    crash: set[str] = field(default_factory=set)
    slow: dict[str, float] = field(default_factory=dict)
    refuse_generation: bool = False
    never_healthy: bool = False

    @classmethod
    def parse(cls, specs: list[str]) -> "Faults":
        faults = cls()
        for spec in specs:
            kind, _, rest = spec.partition(":")
            if kind in ("refuse-generation", "never-healthy") and not rest:
                setattr(faults, kind.replace("-", "_"), True)
                continue
            phase, _, seconds = rest.partition(":")
            if kind not in ("hang", "crash", "slow") or phase not in PHASES:
                raise ValueError(f"--fault {spec!r}: expected hang:<phase>, crash:<phase>, "
                                 f"slow:<phase>:<seconds>, refuse-generation or never-healthy; "
                                 f"phases: {', '.join(PHASES)}")
            if kind == "slow":
                try:
                    faults.slow[phase] = float(seconds)
                except ValueError:
                    raise ValueError(f"--fault {spec!r}: slow needs seconds, e.g. slow:{phase}:30") from None
            elif seconds:
                raise ValueError(f"--fault {spec!r}: {kind} takes no argument after the phase")
            else:
                getattr(faults, kind).add(phase)
        return faults

    def at(self, phase: str) -> None:
        """Apply the faults injected for this phase (called at its start)."""
        if phase in self.slow:
            end = time.monotonic() + self.slow[phase]
            while (left := end - time.monotonic()) > 0:
                log.info(f"[{phase}] still working (injected slow fault, {left:.1f} s left)")
                time.sleep(min(1.0, left))
        if phase in self.crash:
            try:
                raise RuntimeError(f"injected fault crash:{phase}")
            except RuntimeError:
                log.error(f"Scheduler hit an exception: {traceback.format_exc()}")
            log.error(f"Initialization failed in phase {phase}. Exiting with code 1.")
            _flush_and_exit(1)
        if phase in self.hang:
            while True:  # silent forever; SIGTERM still ends the process
                time.sleep(3600)


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)  # from any thread, even with uvicorn running


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m drafter.serving.reference_server",
                                description="Reference HF server with EAGLE-3 speculative decoding")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--speculative-algorithm", default=None, choices=["EAGLE3"])
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="fault injection for tests (repeatable), see the module docstring")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads on CPU (1 is fastest for tiny models on busy hosts)")
    # SGLang flags a launcher may pass; recorded in server_info, meaningless for this engine.
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-custom-all-reduce", action="store_true")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--log-level", default="info")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; every error exits with code 2 and says what is wrong."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.faults = Faults.parse(args.fault)
    except ValueError as err:
        parser.error(str(err))
    if args.tp_size != 1:
        parser.error(f"--tp-size {args.tp_size}: the reference engine runs on one device")
    spec = {"--speculative-num-steps": args.speculative_num_steps,
            "--speculative-eagle-topk": args.speculative_eagle_topk,
            "--speculative-num-draft-tokens": args.speculative_num_draft_tokens}
    given = [k for k, v in spec.items() if v is not None]
    if args.speculative_algorithm is None:
        if given or args.speculative_draft_model_path:
            parser.error(f"{given + (['--speculative-draft-model-path'] if args.speculative_draft_model_path else [])} "
                         "given without --speculative-algorithm EAGLE3")
        return args
    if not args.speculative_draft_model_path:
        parser.error("--speculative-algorithm EAGLE3 needs --speculative-draft-model-path")
    if given and len(given) != 3:
        parser.error(f"set all of --speculative-num-steps, --speculative-eagle-topk and "
                     f"--speculative-num-draft-tokens or none (SGLang asserts); given: {given}")
    if not given:  # SGLang's choice for non-Llama-tree setups; topk 1 is all we support
        args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = 3, 1, 4
    s, k, d = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
    if s < 1:
        parser.error(f"--speculative-num-steps {s}: must be >= 1")
    if k != 1:
        parser.error(f"--speculative-eagle-topk {k}: the reference engine drafts a chain (topk 1 only)")
    if d != s + 1:
        parser.error(f"--speculative-num-draft-tokens {d}: with topk 1 it must be num_steps + 1 = {s + 1}")
    return args


# =========================================================================== server state

class ServerState:
    """Everything the endpoints share: the engine, readiness, cumulative speculative stats."""

    def __init__(self, args: argparse.Namespace, engine, served_name: str):
        self.args, self.engine, self.served_name = args, engine, served_name
        self.faults: Faults = args.faults
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
            "speculative_aux_hidden_state_layer_ids": target.aux_layer_ids if drafter is not None else None,
            "layer_id_convention": _layer_id_convention(),
            "engine": "reference", "faults": list(a.fault), "version": VERSION,
        }

    def internal_state(self) -> dict[str, Any]:
        with self.stats_lock:
            avg = self.completion_tokens / self.verify_ct if self.verify_ct else 0.0
            return {"avg_spec_accept_length": avg, "spec_verify_ct": self.verify_ct,
                    "completion_tokens": self.completion_tokens, "num_requests": self.requests,
                    "num_running_reqs": self.running, "last_gen_throughput": self.last_throughput}


def _layer_id_convention() -> str:
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
    from drafter.serving.speculative import SamplingParams

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


def _encode(state: ServerState, text: str) -> list[int]:
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
    from fastapi import Body, FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    app = FastAPI(title="drafter reference server")

    def error(status: int, message: str, kind: str = "invalid_request_error"):
        return JSONResponse({"error": {"message": message, "type": kind, "code": status},
                             "object": "error", "message": message}, status_code=status)

    def guarded(fn):
        """Map our exceptions to HTTP: 400 for client errors, 500 for generation failures."""
        try:
            return fn()
        except BadRequest as err:
            return error(400, str(err))
        except Exception as err:  # noqa: BLE001 - a failed generation must answer, not hang
            log.error(f"generation failed: {err}")
            return error(500, f"generation failed: {err}", "server_error")

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
        from drafter.serving.speculative import SamplingParams

        done, ok = threading.Event(), []

        def one_token():
            try:
                state.generate(_encode(state, WARMUP_TEXT), SamplingParams(max_new_tokens=1, temperature=0.0),
                               internal=True)
                ok.append(True)
            except Exception as err:  # noqa: BLE001 - a failed generation is an unhealthy server
                log.error(f"health_generate failed: {err}")
            finally:
                done.set()  # a failure answers 503 now, not after the 20 s wait
        threading.Thread(target=one_token, daemon=True).start()
        return Response(status_code=200 if done.wait(20.0) and ok else 503)

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
                prompt_ids = _encode(state, prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
                gen_text, gen_ids, meta = run_generation(state, prompt_ids, p, default_max=128)
                out.append({"text": gen_text, "output_ids": gen_ids, "meta_info": meta})
            return out if batched else out[0]
        return guarded(work)

    def usage(metas: list[dict]) -> dict:
        prompt = sum(m["prompt_tokens"] for m in metas)
        completion = sum(m["completion_tokens"] for m in metas)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def openai_params(body: dict) -> dict:
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

    @app.post("/v1/completions")
    def completions(body: dict = Body(...)):
        def work():
            params = openai_params(body)
            prompt = body.get("prompt")
            if prompt is None:
                raise BadRequest("'prompt' is required")
            if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
                prompt = [prompt]
            choices, metas = [], []
            for i, p in enumerate(prompt):
                ids = _encode(state, p) if isinstance(p, str) else [int(t) for t in p]
                text, _, meta = run_generation(state, ids, params, default_max=16)
                choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": _openai_finish(meta),
                                "matched_stop": meta["finish_reason"].get("matched")})
                metas.append(meta)
            return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                    "model": state.served_name, "choices": choices, "usage": usage(metas)}
        return guarded(work)

    @app.post("/v1/chat/completions")
    def chat_completions(body: dict = Body(...)):
        def work():
            params = openai_params(body)
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
                      "usage": usage([meta])}
            if body.get("return_token_ids"):
                # vLLM's fields and shape (drafter.serving.engines.answer_token_ids): the generated
                # ids as sampled, the stop token included, and the prompt the template gave.
                choice["token_ids"] = list(ids)
                answer["prompt_token_ids"] = prompt_ids
            return answer
        return guarded(work)

    return app


# =========================================================================== start-up

def _avail_mem_gb(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / GB
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GB
    except (ValueError, OSError):
        return float("nan")


def _log_load_end(device, start: float, before_gb: float, kind: str, dtype) -> None:
    """SGLang's "Load weight end." line for a load that began at `start` with `before_gb` free."""
    after = _avail_mem_gb(device)
    log.info(f"Load weight end. elapsed={time.perf_counter() - start:.2f} s, type={kind}, "
             f"dtype={dtype}, avail mem={after:.2f} GB, mem usage={max(before_gb - after, 0):.2f} GB.")


def load_engine(args: argparse.Namespace):
    """Weights (target, then draft) and the KV cache phase, with SGLang's log lines."""
    import torch

    from drafter.target import HFTarget, resolve_device

    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    device = resolve_device(args.device)
    faults: Faults = args.faults

    log.info(f"Load weight begin. avail mem={_avail_mem_gb(device):.2f} GB")
    faults.at("load_weights")
    start, before = time.perf_counter(), _avail_mem_gb(device)
    target = HFTarget(args.model_path, device=str(device), dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    if args.tokenizer_path:
        from transformers import AutoTokenizer

        target.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
    _log_load_end(device, start, before, target.architecture, target.dtype)

    drafter = None
    if args.speculative_algorithm:
        from drafter.model import ARCHITECTURE, load_drafter

        log.info(f"Load weight begin. avail mem={_avail_mem_gb(device):.2f} GB")
        start, before = time.perf_counter(), _avail_mem_gb(device)
        drafter = load_drafter(args.speculative_draft_model_path, device=device, dtype=target.dtype)
        _log_load_end(device, start, before, ARCHITECTURE, target.dtype)

    from drafter.serving.speculative import SpeculativeEngine

    faults.at("kv_cache")
    engine = SpeculativeEngine(target, drafter, args.speculative_num_steps or 0)
    # Caches are allocated per request on demand; report what one full-context request takes.
    cfg = target.config
    head_dim = getattr(cfg, "head_dim", None) or target.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    tokens = target.max_position_embeddings
    size = tokens * target.num_layers * kv_heads * head_dim * torch.finfo(target.dtype).bits / 8 / GB
    log.info(f"KV Cache is allocated. #tokens: {tokens}, K size: {size:.2f} GB, V size: {size:.2f} GB")
    if drafter is not None:
        log.info(f"Speculative decoding: EAGLE3 num_steps={args.speculative_num_steps} topk=1 "
                 f"num_draft_tokens={args.speculative_num_draft_tokens}, aux layer ids {target.aux_layer_ids} "
                 f"({_layer_id_convention()})")
    log.info(f"Memory pool end. avail mem={_avail_mem_gb(device):.2f} GB")
    return engine


def warmup(state: ServerState, server) -> None:
    """After the port is open: one real generation, then the ready line (SGLang's order)."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    if state.faults.never_healthy:
        return  # HTTP up, /health stays 503, nothing more in the log
    with state.engine_lock:  # a slow or hung warmup occupies the engine, as a real one would
        state.faults.at("warmup")
    from drafter.serving.speculative import SamplingParams

    try:
        result, _ = state.generate(_encode(state, WARMUP_TEXT), SamplingParams(max_new_tokens=8, temperature=0.0),
                                   internal=True)
    except Exception:  # noqa: BLE001
        log.error(f"Initialization failed. warmup error: {traceback.format_exc()}")
        _flush_and_exit(1)
    state.ready = True
    log.info(f"End of warmup: {result.completion_tokens} tokens, {result.spec_verify_ct} verify steps.")
    log.info("The server is fired up and ready to roll!")


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)  # flushes every record
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.handlers[:] = [handler]  # idempotent: main() may run more than once in a process (tests)
    log.setLevel(level.upper())
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _setup_logging(args.log_level)

    server_ref: dict[str, Any] = {}

    def on_sigterm(signum, frame):
        # While loading (or hung): leave at once. While serving: let uvicorn drain and stop.
        server = server_ref.get("server")
        if server is None:
            raise SystemExit(0)
        server.should_exit = True
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigterm)

    log.info(f"server_args={vars(args) | {'faults': args.fault}}")
    try:
        return _serve(args, server_ref)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - say it in SGLang's words so a watchdog sees it at once
        log.error(f"Scheduler hit an exception: {traceback.format_exc()}")
        log.error("Initialization failed.")
        return 1


def _serve(args: argparse.Namespace, server_ref: dict[str, Any]) -> int:
    # The web stack first: a missing dependency must fail in a second, not after a long load.
    import fastapi  # noqa: F401
    import uvicorn

    engine = load_engine(args)
    state = ServerState(args, engine, args.served_model_name or args.model_path)

    class Server(uvicorn.Server):
        def capture_signals(self):  # our SIGTERM handler stays in charge
            import contextlib

            return contextlib.nullcontext()

    config = uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=5)
    server = Server(config)
    server_ref["server"] = server
    threading.Thread(target=warmup, args=(state, server), name="warmup", daemon=True).start()
    server.run()
    if not server.started:
        log.error(f"Initialization failed: could not serve on {args.host}:{args.port}")
        return 1
    log.info("Server shut down cleanly.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
