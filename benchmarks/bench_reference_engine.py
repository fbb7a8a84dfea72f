"""Decode throughput of the reference engine: target-only vs EAGLE-3 speculative, same target.

    .venv/bin/python -m benchmarks.bench_reference_engine [--repeats 5] [--max-new 128] [--threads 1]

Engine level (no HTTP), greedy, ignore_eos, one request at a time. Two targets, both built here
in seconds with the test helpers:
- `tiny`: the demo recipe's tiny trained Llama (tests/fixtures/targets.py) with a RANDOM drafter:
  accept length ~1, so this is the cost of speculation that never pays off;
- `successor`: the crafted target of tests/fixtures/speculative.py with its crafted drafter: on x+1
  runs its first draft is always right (accept length 2), once the run reaches the fixed point
  200 every draft is (accept length S+1): the upper side, where only the engine's own overhead
  limits the speed-up.
Configurations are interleaved inside each repeat (field note 6), and every speculative output is
checked token for token against the target-only output of the same prompt.
Recorded results are at the bottom of this file.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from drafter.model import init_random_drafter, load_drafter
from drafter.target import HFTarget
from drafter.engines.reference.speculative import SamplingParams, SpeculativeEngine


def build_models(work: Path) -> dict[str, tuple[Path, Path]]:
    from drafter.contracts.sharegpt import load_sharegpt
    from drafter.demo_target import build_demo_target
    from tests.fixtures.targets import TINY_CONVERSATIONS, tiny_target_config
    from tests.fixtures.speculative import build_successor_drafter, build_successor_target

    tiny = work / "tiny"
    if not (tiny / "model.safetensors").exists():
        build_demo_target(tiny_target_config(), tiny, conversations=load_sharegpt(TINY_CONVERSATIONS))
    random_draft = init_random_drafter(tiny, work / "tiny_random_draft", seed=0)
    succ = build_successor_target(tiny, work / "succ_target")
    succ_draft = build_successor_drafter(succ, work / "succ_draft")
    # (target, drafter, range the prompts' last token is drawn from)
    return {"tiny + random drafter": (tiny, random_draft, (10, 400)),
            "successor, x+1 runs (1st draft right)": (succ, succ_draft, (201, 260)),
            "successor, runs into a fixed point": (succ, succ_draft, (150, 190))}


def run(engine: SpeculativeEngine, prompts: list[list[int]], max_new: int) -> tuple[float, int, int, list]:
    outputs, tokens, verify = [], 0, 0
    start = time.perf_counter()
    for prompt in prompts:
        res = engine.generate(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
        outputs.append(res.output_ids)
        tokens += res.completion_tokens
        verify += res.spec_verify_ct
    return time.perf_counter() - start, tokens, verify, outputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", default="1,3,5")
    ap.add_argument("--work", default=None, help="keep the built models here (default: a temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_ref_"))
    work.mkdir(parents=True, exist_ok=True)
    steps = [int(s) for s in args.steps.split(",")]
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.prompts} prompts x {args.max_new} "
          f"tokens, {args.repeats} repeats")
    for name, (target_dir, draft_dir, (low, high)) in build_models(work).items():
        target = HFTarget(target_dir, device="cpu")
        drafter = load_drafter(draft_dir)
        engines = {"target-only": SpeculativeEngine(target)}
        engines.update({f"EAGLE3 {s}/1/{s + 1}": SpeculativeEngine(target, drafter, s) for s in steps})
        gen = torch.Generator().manual_seed(0)
        prompts = [[0] + torch.randint(10, 400, (11,), generator=gen).tolist()
                   + torch.randint(low, high, (1,), generator=gen).tolist() for _ in range(args.prompts)]
        rates: dict[str, list[float]] = {k: [] for k in engines}
        accept: dict[str, float] = {}
        run(engines["target-only"], prompts[:1], 8)  # warm up
        for _ in range(args.repeats):
            reference = None
            for label, engine in engines.items():
                seconds, tokens, verify, outputs = run(engine, prompts, args.max_new)
                reference = reference or outputs
                assert outputs == reference, f"{name} {label}: output differs from target-only"
                rates[label].append(tokens / seconds)
                accept[label] = tokens / verify if verify else float("nan")
        base = statistics.median(rates["target-only"])
        print(f"\n{name} (target {target_dir.name}, drafter {draft_dir.name})")
        for label, values in rates.items():
            med = statistics.median(values)
            print(f"  {label:16s} {med:8.1f} tok/s (min {min(values):7.1f}, max {max(values):7.1f})  "
                  f"x{med / base:4.2f}  accept length {accept[label]:.2f}")


if __name__ == "__main__":
    main()

# Recorded results
# ----------------
# 2026-11-29, shared 2-core CPU sandbox (other jobs running: load average 2-3, so min..max is wide),
# `.venv/bin/python -m benchmarks.bench_reference_engine --work /tmp/bench`:
#
# torch 2.13.0+cpu, 1 thread(s), 4 prompts x 128 tokens, 5 repeats
#
# tiny + random drafter (target tiny, drafter tiny_random_draft)
#   target-only         721.2 tok/s (min   654.2, max   818.5)  x1.00  accept length nan
#   EAGLE3 1/1/2        384.8 tok/s (min   331.4, max   427.1)  x0.53  accept length 1.01
#   EAGLE3 3/1/4        284.7 tok/s (min   237.2, max   292.9)  x0.39  accept length 1.01
#   EAGLE3 5/1/6        245.6 tok/s (min   224.9, max   267.2)  x0.34  accept length 1.01
#
# successor, x+1 runs (1st draft right) (target succ_target, drafter succ_draft)
#   target-only         742.4 tok/s (min   658.6, max   830.9)  x1.00  accept length nan
#   EAGLE3 1/1/2        850.3 tok/s (min   749.4, max   980.2)  x1.15  accept length 2.00
#   EAGLE3 3/1/4        561.3 tok/s (min   487.9, max   672.3)  x0.76  accept length 2.00
#   EAGLE3 5/1/6        443.7 tok/s (min   419.7, max   520.6)  x0.60  accept length 2.00
#
# successor, runs into a fixed point (target succ_target, drafter succ_draft)
#   target-only         741.1 tok/s (min   596.3, max   855.0)  x1.00  accept length nan
#   EAGLE3 1/1/2        925.5 tok/s (min   640.5, max   967.3)  x1.25  accept length 2.00
#   EAGLE3 3/1/4       1069.6 tok/s (min   980.2, max  1146.0)  x1.44  accept length 3.24
#   EAGLE3 5/1/6       1009.8 tok/s (min   891.1, max  1134.7)  x1.36  accept length 4.13
#
# Reading: on a tiny CPU model every forward costs about the same whatever its length (per-call
# overhead dominates), so a draft step (~0.4 ms) is a third of a target step (~1.3 ms) instead of
# the ~1/30 it is for a real target on a GPU. Speculation therefore only pays here with accept
# length >= ~2 and few steps; a drafter that is never right (accept length 1.01) costs 2-3x.
# Every speculative output above was token-for-token identical to target-only decoding.
