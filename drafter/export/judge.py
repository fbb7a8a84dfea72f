"""Offline judgement of an export: the EXPORTED SGLang-format files loaded into the reference
engine's speculative decoder (drafter.engines.reference.speculative, the same code the reference server
runs) with the real target, greedy, chain drafting (topk 1), on held-out prompts.
The second judge, real vLLM on the vLLM export, is drafter.export.vllm_judge.

Figures (all over verify steps, the bonus token included where it says accept length):
- accept_length: 1 + accepted drafts / verifies: what training's simulated accept length predicts
  (1 + sum_k accept_rate_k over the first `num_steps` positions; drafter.contracts.accept);
- sglang_accept_length: completion tokens / verifies (SGLang's meta_info figure; it also counts the
  token from the prefill, so it is a little higher on short outputs);
- per_position: accepted at draft position k / verifies (k = 0 .. num_steps-1), next to training's
  accept_rate_k;
- by_output_length: accept length of the verifies whose output had [lo, hi) tokens before them, so
  a drop past the training length shows;
- by_context: accept length by context position (prompt + output tokens before the verify: where
  the draft block starts), in buckets up to the target's context (drafter.contracts.context_curve).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from drafter.export.sglang import PROVENANCE_KEY, ExportError
from drafter.contracts.accept import predicted_accept
from drafter.contracts.context_curve import accept_by_context, last_full_bucket
from drafter.contracts.context_curve import bucket_edges as context_bucket_edges
from drafter.contracts.prompts import prompts_from_conversations


class JudgedTooLow(ExportError):
    """The exported drafter accepts too few tokens offline; the message names the threshold."""


def _buckets(edges: list[int]) -> list[tuple[int, int | None]]:
    lows = [0] + list(edges)
    return [(lo, hi) for lo, hi in zip(lows, list(edges) + [None])]


def judge_export(sglang_dir: str | Path, target, prompts: list[list[int]], *, num_steps: int,
                 max_new_tokens: int, bucket_edges: list[int], prediction: dict | None = None,
                 on_prompt=None, context_edges: list[int] | None = None) -> dict[str, Any]:
    """Generate from `prompts` with the exported drafter and measure acceptance.
    `target`: a loaded drafter.target.HFTarget (its device and dtype are used)."""
    import torch

    from drafter.model import load_drafter
    from drafter.engines.reference.speculative import SamplingParams, SpeculativeEngine

    drafter = load_drafter(sglang_dir, device=target.device, dtype=target.dtype)
    # The reference engine captures features in our convention; the export records our ids next
    # to the engine's (they differ only for targets where SGLang does not add 1 itself).
    ours = (drafter.config.extra.get(PROVENANCE_KEY) or {}).get("aux_layer_ids")
    if ours is not None:
        drafter.config.aux_layer_ids = list(ours)
    try:
        engine = SpeculativeEngine(target, drafter, num_steps)
    except ValueError as err:
        raise ExportError(f"the export does not fit the target: {err} (a drafter trained for another target?)") \
            from None
    buckets = _buckets(bucket_edges)
    b_verifies, b_accepted = [0] * len(buckets), [0] * len(buckets)
    at_position = [0] * num_steps
    verifies = accepted = completion = requests = 0
    per_prompt: list[list[int]] = []  # [verifies, accepted drafts] per prompt: paired comparisons
    blocks: list[tuple[int, int, int]] = []  # (context position, 1, accepted) per verify
    started = time.monotonic()
    for i, prompt in enumerate(prompts):
        res = engine.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
        requests += 1
        completion += res.completion_tokens
        per_prompt.append([len(res.verifies), sum(acc for _, acc in res.verifies)])
        for before, acc in res.verifies:
            verifies += 1
            accepted += acc
            for k in range(acc):
                at_position[k] += 1
            b = next(j for j, (lo, hi) in enumerate(buckets) if hi is None or before < hi)
            b_verifies[b] += 1
            b_accepted[b] += acc
            blocks.append((len(prompt) + before, 1, acc))
        if on_prompt is not None:
            on_prompt(i + 1, len(prompts))
    seconds = time.monotonic() - started
    context = target.max_position_embeddings
    if verifies == 0:
        raise JudgedTooLow(f"no verify step in {requests} judged prompts (outputs of at most one token?): "
                           "nothing was measured")
    report: dict[str, Any] = {
        "num_steps": num_steps, "eagle_topk": 1, "num_draft_tokens": num_steps + 1, "temperature": 0.0,
        "max_new_tokens": max_new_tokens, "prompts": requests, "completion_tokens": completion,
        "verifies": verifies, "accepted_drafts": accepted,
        "accept_length": 1 + accepted / verifies,
        "sglang_accept_length": completion / verifies,
        "per_position": [c / verifies for c in at_position],
        "by_output_length": [
            {"output_tokens": f"[{lo}, {'inf' if hi is None else hi})", "verifies": v,
             "accept_length": (1 + a / v) if v else None}
            for (lo, hi), v, a in zip(buckets, b_verifies, b_accepted)],
        "by_context": accept_by_context(blocks, context_bucket_edges(context, context_edges), context),
        "context_length": context,
        "per_prompt": per_prompt,
        "device": str(target.device), "dtype": str(target.dtype).removeprefix("torch."),
        "seconds": round(seconds, 2), "torch": torch.__version__,
    }
    if prediction and prediction.get("accept_rate"):
        report["predicted"] = predicted_accept(prediction, num_steps)
    return report


def held_out_judging(cfg, store, prepare_fp: str) -> tuple[Any, list[list[int]], int, int]:
    """What every offline judgement of a configuration uses (the export gate, the champion's paired
    comparison): the target on `export.device` and the held-out prompts, the eval split's first
    `export.eval_prompts` that leave room for `judge_max_new_tokens`. Returns (target, prompts,
    skipped prompts, eval conversations)."""
    from drafter.formats import load_prepared
    from drafter.target import HFTarget

    ec = cfg.export
    target = HFTarget(cfg.target.path, device=ec.device, dtype=cfg.target.dtype,
                      trust_remote_code=cfg.target.trust_remote_code)
    conversations = load_prepared(store, prepare_fp, "eval")
    prompts, skipped = prompts_from_conversations(target.tokenizer, conversations, ec.eval_prompts,
                                                  target.max_position_embeddings - ec.judge_max_new_tokens)
    return target, prompts, skipped, len(conversations)


def judge_as_configured(ec, sglang_dir: str | Path, target, prompts: list[list[int]], *,
                        prediction: dict | None = None, on_prompt=None) -> dict[str, Any]:
    """`judge_export` with the `export` section's judge settings (steps, new tokens, buckets)."""
    return judge_export(sglang_dir, target, prompts, num_steps=ec.judge_num_steps,
                        max_new_tokens=ec.judge_max_new_tokens, bucket_edges=ec.judge_bucket_edges,
                        prediction=prediction, on_prompt=on_prompt, context_edges=ec.context_bucket_edges)


def check_last_bucket(report: dict[str, Any], min_accept_length: float | None, min_blocks: int) -> dict | None:
    """export.min_last_bucket_accept_length: the accept length in the bucket farthest into the
    context with at least `min_blocks` draft blocks (fewer is noise). None when off or when no
    context curve was measured; raises JudgedTooLow, one line, when it is missed."""
    if min_accept_length is None or not report.get("by_context"):
        return None
    last = last_full_bucket(report["by_context"], min_blocks)
    if last is None:
        raise JudgedTooLow(f"export judged too low: no context bucket has export.last_bucket_min_blocks {min_blocks} "
                           f"draft blocks ({report['verifies']} in all): nothing to hold "
                           f"export.min_last_bucket_accept_length {min_accept_length} against; judge more or longer "
                           "prompts (export.eval_prompts, export.judge_max_new_tokens) or lower the block count")
    out = {"positions": last["positions"], "blocks": last["blocks"], "accept_length": last["accept_length"],
           "min_accept_length": min_accept_length, "min_blocks": min_blocks}
    if last["accept_length"] < min_accept_length:
        raise JudgedTooLow(f"export judged too low at long context: accept length {last['accept_length']:.3f} at "
                           f"context positions {last['positions']} ({last['blocks']} draft blocks, the last bucket "
                           f"with >= {min_blocks}) < export.min_last_bucket_accept_length {min_accept_length} "
                           f"(offline accept length over all positions {report['accept_length']:.3f})")
    return out


def check(report: dict[str, Any], min_accept_length: float, min_accept_ratio: float) -> dict[str, Any]:
    """The verdict; raises JudgedTooLow naming the threshold missed (both, when both are)."""
    got = report["accept_length"]
    pred = (report.get("predicted") or {}).get("accept_length")
    problems = []
    if got < min_accept_length:
        problems.append(f"offline accept length {got:.3f} < export.min_accept_length {min_accept_length}")
    if pred is not None and got < min_accept_ratio * pred:
        problems.append(f"offline accept length {got:.3f} < export.min_accept_ratio {min_accept_ratio} x training "
                        f"prediction {pred:.3f} = {min_accept_ratio * pred:.3f}")
    verdict = {"passed": not problems, "min_accept_length": min_accept_length, "min_accept_ratio": min_accept_ratio,
               "ratio_to_prediction": (got / pred) if pred else None, "problems": problems}
    if problems:
        per_pos = ", ".join(f"{p:.3f}" for p in report["per_position"])
        pred_pos = ", ".join(f"{p:.3f}" for p in (report.get("predicted") or {}).get("per_position", []))
        raise JudgedTooLow(
            "export judged too low: " + "; ".join(problems)
            + f" (steps {report['num_steps']}, topk 1, {report['prompts']} held-out prompts, {report['verifies']} "
              f"verifies; accepted at position k / verifies: [{per_pos}], training predicted [{pred_pos}]). "
              "Usual causes: aux layer ids of another convention, a vocab map (d2t) that does not belong to "
              "lm_head, a drafter trained for another target or on other hidden states")
    return verdict
