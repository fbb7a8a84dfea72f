"""The bench client: one measurement = every held-out prompt sent to a running server at a fixed
concurrency (the batch size), temperature 0, a fixed number of new tokens.

Per measurement: warm-up requests first (discarded), then `/flush_cache` where the engine has it
(the prefix cache must not serve the measured prompts from the warm-up or an earlier round, and
SGLang's cumulative accept-length counters restart), then the timed requests.

What is measured, and where it comes from:
- output tokens/s: sum of completion tokens / wall time from the first request sent to the last
  answer received; request latency per request;
- TTFT and inter-token latency (time per output token after the first): only where the engine
  streams (SGLang `/generate` SSE, vLLM `/v1/completions` SSE). The reference engine does not
  stream: both are reported as None, never estimated;
- accept length: SGLang-style engines (reference, sglang, a command server answering SGLang's
  /generate) from the answers' meta_info, sum(completion_tokens) / sum(spec_verify_ct); vLLM from
  Prometheus counter deltas around the measurement (`Engine.metrics_snapshot`), never totals;
- draft acceptance (accepted / proposed drafts) where meta_info reports it, and per-position
  acceptance where the engine reports it (vLLM `..._per_pos`);
- draft accept length: 1 + accepted drafts / verifies, without SGLang's prefill token: the offline
  judge's figure and what each engine's forced acceptance sets (drafter.bench.predict's curve);
- by request (`by_request`): per request its context (prompt + completion tokens), verifies and
  accepted drafts, where the answer carries them (SGLang-style meta_info), for accept length by
  context position; None where the engine only has aggregate counters (vLLM's /metrics).
"""
from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from drafter.errors import DrafterError
from drafter.chat_client import RETRY_STATUS
from drafter.engines import Engine, counters_delta

Prompt = str | list[int]


class MeasurementError(DrafterError):
    """A request of a measurement failed (server died, timed out, answered an error). `status`: the
    HTTP status of an answered request. Retryable unless the server refused the request itself (a
    4xx other than 408 / 429, the datagen client's rule): the same request would be refused again."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status
        self.retryable = status is None or status in RETRY_STATUS or status >= 500

    def __reduce__(self):
        return (MeasurementError, (str(self), self.status))


@dataclass(frozen=True)
class ClientApi:
    """How to talk to one server: `sglang` (/generate, meta_info) or `openai` (/v1/completions)."""

    style: str
    stream: bool
    flush_cache: bool | None          # True: must work, None: try (404 = not available), False: skip
    served_model_name: str
    counters: bool = False            # vLLM: accept length from /metrics deltas

    def to_dict(self) -> dict:
        return {"style": self.style, "stream": self.stream, "flush_cache": self.flush_cache,
                "counters": self.counters}


def _prompt_field(prompt: Prompt, style: str) -> dict:
    if style == "sglang":
        return {"text": prompt} if isinstance(prompt, str) else {"input_ids": list(prompt)}
    return {"prompt": prompt}


def request_body(api: ClientApi, prompt: Prompt, max_tokens: int, ignore_eos: bool) -> dict:
    if api.style == "sglang":
        params = {"max_new_tokens": max_tokens, "temperature": 0}
        if ignore_eos:
            params["ignore_eos"] = True
        body = {**_prompt_field(prompt, "sglang"), "sampling_params": params}
    else:
        body = {"model": api.served_model_name, **_prompt_field(prompt, "openai"),
                "max_tokens": max_tokens, "temperature": 0}
        if ignore_eos:
            body["ignore_eos"] = True
        if api.stream:
            body["stream_options"] = {"include_usage": True}
    if api.stream:
        body["stream"] = True
    return body


def _sse_events(resp: httpx.Response):
    """(arrival time, parsed JSON) per `data:` event, until [DONE]."""
    for line in resp.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield time.perf_counter(), json.loads(data)


def one_request(client: httpx.Client, api: ClientApi, prompt: Prompt, max_tokens: int,
                ignore_eos: bool) -> dict[str, Any]:
    """Send one request; return its latency, TTFT / last-token time (streaming), token counts and
    the speculative counters the answer carries."""
    body = request_body(api, prompt, max_tokens, ignore_eos)
    path = "/generate" if api.style == "sglang" else "/v1/completions"
    start = time.perf_counter()
    first = last = None
    meta: dict = {}
    tokens = prompt_tokens = None
    try:
        if api.stream:
            with client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise MeasurementError(f"POST {path}: HTTP {resp.status_code}: {resp.text[:300]}",
                                           resp.status_code)
                seen = 0
                for at, event in _sse_events(resp):
                    if api.style == "sglang":
                        meta = event.get("meta_info") or meta
                        count = int(meta.get("completion_tokens", 0) or 0)
                    else:
                        usage = event.get("usage") or {}
                        if usage.get("completion_tokens") is not None:
                            tokens = int(usage["completion_tokens"])
                        choices = event.get("choices") or []
                        count = seen + (1 if choices and choices[0].get("text") else 0)
                    if count > seen:
                        first = at if first is None else first
                        last = at
                        seen = count
                if api.style == "sglang":
                    tokens = int(meta.get("completion_tokens", seen) or 0)
                elif tokens is None:
                    tokens = seen
        else:
            resp = client.post(path, json=body)
            if resp.status_code != 200:
                raise MeasurementError(f"POST {path}: HTTP {resp.status_code}: {resp.text[:300]}", resp.status_code)
            answer = resp.json()
            if api.style == "sglang":
                meta = (answer[0] if isinstance(answer, list) else answer).get("meta_info") or {}
                tokens = int(meta.get("completion_tokens", 0) or 0)
            else:
                tokens = int((answer.get("usage") or {}).get("completion_tokens", 0) or 0)
                prompt_tokens = (answer.get("usage") or {}).get("prompt_tokens")
    except httpx.HTTPError as err:
        raise MeasurementError(f"POST {path} failed: {type(err).__name__}: {err}") from err
    end = time.perf_counter()
    out: dict[str, Any] = {"latency_s": end - start, "completion_tokens": tokens,
                           "ttft_s": (first - start) if first is not None else None,
                           "itl_s": ((last - first) / (tokens - 1)) if first is not None and tokens and tokens > 1
                           else None}
    for key in ("spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts"):
        if meta.get(key) is not None:
            out[key] = int(meta[key])
    prompt_tokens = meta.get("prompt_tokens", prompt_tokens)
    if prompt_tokens is None and not isinstance(prompt, str):
        prompt_tokens = len(prompt)  # token ids: their count is the prompt's length
    out["prompt_tokens"] = int(prompt_tokens) if prompt_tokens is not None else None
    return out


def by_request(results: list[dict]) -> tuple[list[list[int]] | None, str | None]:
    """Per request [context (prompt + completion tokens), verifies, accepted drafts] and which
    figure the accepted drafts are: `draft` (the answer counts them: 1 + accepted / verifies) or
    `completion / verifies` (SGLang's meta_info figure, completion - verifies taken as accepted).
    (None, None) where an answer carries no verify count or prompt length (no speculation, or an
    engine with aggregate counters only)."""
    if not results or any(not r.get("spec_verify_ct") or r.get("prompt_tokens") is None for r in results):
        return None, None
    exact = all(r.get("spec_num_correct_drafts") is not None for r in results)
    rows = [[r["prompt_tokens"] + (r["completion_tokens"] or 0), r["spec_verify_ct"],
             r["spec_num_correct_drafts"] if exact else (r["completion_tokens"] or 0) - r["spec_verify_ct"]]
            for r in results]
    return rows, "draft" if exact else "completion / verifies"


def _run_at(client: httpx.Client, api: ClientApi, prompts: Sequence[Prompt], concurrency: int,
            max_tokens: int, ignore_eos: bool) -> tuple[list[dict], float]:
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        start = time.perf_counter()
        futures = [pool.submit(one_request, client, api, p, max_tokens, ignore_eos) for p in prompts]
        results = [f.result() for f in futures]
        wall = time.perf_counter() - start
    return results, wall


def flush_cache(client: httpx.Client, api: ClientApi, attempts: int = 20, wait_s: float = 0.25) -> str:
    """'ok', 'not available' or 'skipped'. SGLang answers 400 while requests run: wait for them."""
    if api.flush_cache is False:
        return "not available"
    last = ""
    for _ in range(attempts):
        try:
            resp = client.post("/flush_cache")
        except httpx.HTTPError as err:
            raise MeasurementError(f"POST /flush_cache failed: {err}") from err
        if resp.status_code == 200:
            return "ok"
        if resp.status_code in (404, 405) and api.flush_cache is None:
            return "not available"
        last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        time.sleep(wait_s)
    raise MeasurementError(f"POST /flush_cache kept failing: {last}")


def _sum(results: list[dict], key: str) -> int | None:
    values = [r[key] for r in results if r.get(key) is not None]
    return sum(values) if len(values) == len(results) and values else None


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def measure(base_url: str, api: ClientApi, prompts: Sequence[Prompt], *, batch_size: int, max_tokens: int,
            ignore_eos: bool = True, warmup_requests: int = 0, flush: bool = True,
            engine: Engine | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
    """One measurement of one server at one concurrency (see the module docstring)."""
    if not prompts:
        raise MeasurementError("no prompts to measure")
    limits = httpx.Limits(max_connections=batch_size + 2, max_keepalive_connections=batch_size + 2)
    with httpx.Client(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        if warmup_requests:
            warm = [prompts[i % len(prompts)] for i in range(warmup_requests)]
            _run_at(client, api, warm, batch_size, max_tokens, ignore_eos)
        flushed = flush_cache(client, api) if flush else "skipped"
        before = engine.metrics_snapshot(client) if api.counters and engine is not None else None
        started_at = time.time()
        results, wall = _run_at(client, api, prompts, batch_size, max_tokens, ignore_eos)
        after = engine.metrics_snapshot(client) if api.counters and engine is not None else None
    tokens = sum(r["completion_tokens"] or 0 for r in results)
    latencies = [r["latency_s"] for r in results]
    busy = sum(latencies)
    verify = _sum(results, "spec_verify_ct")
    correct, proposed = _sum(results, "spec_num_correct_drafts"), _sum(results, "spec_num_proposed_drafts")
    per_position = None
    accept = None
    if api.counters and before is not None and after is not None:
        delta = counters_delta(before, after)
        accept = engine.accept_length(before, after)
        verify = int(delta["drafts"]) if delta["drafts"] else None
        if delta["drafts"]:
            per_position = {str(p): v / delta["drafts"] for p, v in delta["accepted_per_position"].items()}
            proposed, correct = int(delta["draft_tokens"]), int(delta["accepted_tokens"])
    elif verify:
        accept = tokens / verify
    requests, figure = by_request(results)
    return {
        "batch_size": batch_size, "requests": len(results), "completion_tokens": tokens, "wall_s": wall,
        "output_tok_s": tokens / wall if wall > 0 else None,
        "latency_s": _mean(latencies), "latency_p50_s": _quantile(latencies, 0.5),
        "latency_p90_s": _quantile(latencies, 0.9),
        "ttft_s": _mean(r["ttft_s"] for r in results) if api.stream else None,
        "itl_s": _mean(r["itl_s"] for r in results) if api.stream else None,
        "verify_ct": verify or None,
        "accept_length": accept,
        "draft_acceptance": (correct / proposed) if proposed else None,
        "draft_accept_length": (1 + correct / verify) if verify and correct is not None else None,
        "accepted_per_position": per_position,
        # costs for the break-even analysis: per request, time per output token / per verify cycle
        "step_time_s": busy / tokens if tokens else None,
        "cycle_time_s": busy / verify if verify else None,
        "flush_cache": flushed, "warmup_requests": warmup_requests, "started_at": started_at,
        "by_request": requests, "by_request_figure": figure,
    }
