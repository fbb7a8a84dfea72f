"""The second judge: real vLLM serving the target with our vLLM-format export, on the same held-out
prompts at temperature 0, acceptance from the server's own `/metrics` counter deltas.

It exists because the reference judge (drafter.export.judge) only proves that OUR reading of the
drafter works; vLLM reads the exported ids, norms and vocab maps itself (it used an SGLang-format
directory's ids one layer off, silently). Both figures are recorded, and the two judges must agree
within `export.judge_agreement_tolerance` (accept length and every per-position rate).

The server is started through the one server session (preflight, gate on a real generation, settings
read back strictly, teardown) with `export.vllm_judge` as its serve section (engine forced to vllm,
speculation `judge_num_steps`/1/steps+1).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from drafter.config import LifecycleConfig, SpeculativeConfig
from drafter.export.sglang import ExportError


class EnginesDisagree(ExportError):
    """vLLM and the reference engine measured different acceptance on the same prompts: one of them
    reads the export differently (layer ids, norms, vocab maps); the message gives both figures."""


def judge_config(cfg: LifecycleConfig, num_steps: int) -> LifecycleConfig:
    """The configuration whose serve section starts the judge's vLLM server."""
    if cfg.export.vllm_judge is None:
        raise ExportError("export.vllm_judge is not set: no vLLM server to judge with")
    serve = cfg.export.vllm_judge.model_copy(update={
        "engine": "vllm", "draft_path": None,
        "speculative": SpeculativeConfig(num_steps=num_steps, eagle_topk=1, num_draft_tokens=num_steps + 1)})
    return cfg.model_copy(update={"serve": serve})


def judge_with_vllm(cfg: LifecycleConfig, vllm_dir: str | Path, prompts: list[list[int]], *, num_steps: int,
                    max_new_tokens: int, on_line=None, on_prompt=None,
                    request_timeout_s: float = 600.0) -> dict[str, Any]:
    """Serve `vllm_dir` with real vLLM, generate greedily from `prompts` (token ids), and measure
    acceptance from the counter deltas around exactly these requests (the gate's request excluded)."""
    from drafter.engines import counters_delta, make_engine
    from drafter.serving.session import ServerSession

    jcfg = judge_config(cfg, num_steps)
    engine = make_engine("vllm")
    session = ServerSession(jcfg, draft_path=str(vllm_dir), on_line=on_line, strict_settings=True)
    completion = 0
    with session as served, httpx.Client(base_url=served.base_url, timeout=request_timeout_s) as client:
        before = engine.metrics_snapshot(client)
        if not before["present"]:
            raise ExportError(f"vLLM at {served.base_url} reports no speculative-decoding counters at /metrics")
        started = time.monotonic()
        for i, prompt in enumerate(prompts):
            resp = client.post("/v1/completions", json={
                "model": jcfg.target.served_name, "prompt": prompt, "max_tokens": max_new_tokens,
                "temperature": 0.0})
            if resp.status_code != 200:
                raise ExportError(f"vLLM judge: prompt {i} answered HTTP {resp.status_code}: {resp.text[:300]}")
            completion += int(resp.json()["usage"]["completion_tokens"])
            if on_prompt is not None:
                on_prompt(i + 1, len(prompts))
        seconds = time.monotonic() - started
        delta = counters_delta(before, engine.metrics_snapshot(client))
    drafts = delta["drafts"]
    if not drafts:
        raise ExportError(f"vLLM judge: no draft was proposed in {len(prompts)} prompts: nothing was measured")
    per_pos = delta["accepted_per_position"]
    return {
        "engine": "vllm", "engine_version": session.layer_ids.get("engine_version"),
        "num_steps": num_steps, "eagle_topk": 1, "num_draft_tokens": num_steps + 1, "temperature": 0.0,
        "max_new_tokens": max_new_tokens, "prompts": len(prompts), "completion_tokens": completion,
        "drafts": drafts, "verifies": drafts, "draft_tokens": delta["draft_tokens"],
        "accepted_tokens": delta["accepted_tokens"],
        "accept_length": 1 + delta["accepted_tokens"] / drafts,
        "per_position": [per_pos.get(k, 0.0) / drafts for k in range(num_steps)],
        # /metrics counts every request together: no per-position figure exists to place (never estimated)
        "by_context": None, "by_context_note": "vLLM's /metrics counters are aggregate over the requests: "
                                               "no accept length by context position (the reference judge's curve)",
        "seconds": round(seconds, 2), "seconds_to_ready": round(served.seconds_to_ready, 1),
        "log_path": str(served.log_path), "layer_ids": session.layer_ids,
    }


def agreement(reference: dict[str, Any], vllm: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """How far the two judges are apart; raises EnginesDisagree beyond `tolerance`."""
    d_accept = abs(vllm["accept_length"] - reference["accept_length"])
    d_pos = max((abs(a - b) for a, b in zip(vllm["per_position"], reference["per_position"])), default=0.0)
    out = {"tolerance": tolerance, "accept_length_difference": round(d_accept, 6),
           "per_position_max_difference": round(d_pos, 6), "agree": d_accept <= tolerance and d_pos <= tolerance}
    if not out["agree"]:
        fmt = lambda xs: "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"
        raise EnginesDisagree(
            f"the judges disagree beyond export.judge_agreement_tolerance {tolerance}: accept length reference "
            f"{reference['accept_length']:.3f} vs vLLM {vllm['accept_length']:.3f}, per position reference "
            f"{fmt(reference['per_position'])} vs vLLM {fmt(vllm['per_position'])} (same prompts, temperature 0). "
            "One engine reads the export differently: layer ids of another convention, norm flags, vocab maps")
    return out
