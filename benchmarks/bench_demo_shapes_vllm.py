"""What a draft step costs against a target step, per demo-target shape, on real vLLM (CPU build).

    .venv/bin/python -m benchmarks.bench_demo_shapes_vllm --vllm-python .venv-vllm/bin/python \
        [--shapes 128x5,64x24] [--rounds 3] [--work DIR] [--port 31200]

The vLLM side of benchmarks/bench_demo_shapes.py (same shapes, same random weights). Per shape and
round, three vLLM servers, one alive at a time, in rotating order (eager mode, 1 GiB KV cache,
512-token context): the plain target, and the target with a random EAGLE-3 drafter (our vLLM
export) at 1 and 3 speculative tokens. A random drafter is never right, so every cycle emits one
token and a decode "token" is one cycle:

- `step ms`: the plain server's decode time per output token;
- `cycle1 ms`, `cycle3 ms`: one draft + verify cycle at 1/1/2 and 3/1/4;
- `draft ms`: (cycle3 - cycle1) / 2, two more draft steps (and two more verified tokens, so an
  upper bound on a draft step's cost);
- `draft/step` and `break-even` (cycle3 / step: the accept length 3/1/4 needs).

A decode time is (time for `--max-new` tokens - time for 1 token) / (max_new - 1), over non-streamed
greedy completions with `ignore_eos`, prompts of `--prompt-tokens` fixed ids, after one warm-up
request; medians over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.bench_demo_shapes import aux_ids, build_shape, parse_shape, report, tokenizer_for_bench
from drafter.export.sglang import TargetInfo
from drafter.export.vllm import write_vllm

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def launch(python: str, target: Path, port: int, log: Path, spec: dict | None) -> subprocess.Popen:
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
            "--served-model-name", "t"]
    if spec:
        argv += ["--speculative-config", json.dumps(spec)]
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **VLLM_ENV})


def wait_ready(proc: subprocess.Popen, port: int, budget_s: float = 900) -> None:
    """Ready = a real completion answered (not just /health); bounded by a generous budget."""
    end = time.monotonic() + budget_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM on port {port} exited with {proc.returncode}")
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": "t", "prompt": [1, 2, 3], "max_tokens": 2})
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"vLLM on port {port} not ready in {budget_s:.0f} s")


def request_s(port: int, prompt: list[int], max_tokens: int) -> float:
    start = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=600,
                   json={"model": "t", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True})
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] == max_tokens
    return time.perf_counter() - start


def decode_s_per_token(port: int, prompts: list[list[int]], max_new: int) -> float:
    full = sum(request_s(port, p, max_new) for p in prompts)
    first = sum(request_s(port, p, 1) for p in prompts)
    return (full - first) / (len(prompts) * (max_new - 1))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_shape(args, shape: dict, tok: Path, work: Path) -> dict:
    target_dir, draft_dir = build_shape(shape, tok, work / shape["label"].replace(":", "_"))
    info = TargetInfo.read(target_dir)
    vllm_dir = draft_dir.parent / "drafter-vllm"
    if not (vllm_dir / "config.json").exists():
        write_vllm(draft_dir, info, vllm_dir, aux_ids(info.num_layers), 3)
    servers = {"step": None, "cycle1": {"method": "eagle3", "model": str(vllm_dir), "num_speculative_tokens": 1},
               "cycle3": {"method": "eagle3", "model": str(vllm_dir), "num_speculative_tokens": 3}}
    prompts = [[1] + [(7 * i + j) % 500 + 10 for j in range(args.prompt_tokens - 1)] for i in range(args.prompts)]
    times = {name: [] for name in servers}
    for r in range(args.rounds):
        names = list(servers)
        for name in names[r % 3:] + names[:r % 3]:
            # One server alive at a time (as the bench's `relaunch`): vLLM's CPU workers spin their
            # threads, so an idle neighbour slowed the one being measured by a varying amount.
            proc = launch(args.vllm_python, target_dir, args.port, work / f"{shape['label']}-{name}-r{r}.log",
                          servers[name])
            try:
                wait_ready(proc, args.port)
                request_s(args.port, prompts[0], 8)  # warm-up
                times[name].append(decode_s_per_token(args.port, prompts, args.max_new))
            finally:
                stop(proc)
            print(f"  {shape['label']} {name} round {r + 1}: {times[name][-1] * 1e3:.3f} ms/token", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    draft = (med["cycle3"] - med["cycle1"]) / 2
    return {"shape": shape["label"], "layers": shape["num_hidden_layers"], "hidden": shape["hidden_size"],
            "step_ms": round(med["step"] * 1e3, 3), "cycle1_ms": round(med["cycle1"] * 1e3, 3),
            "cycle3_ms": round(med["cycle3"] * 1e3, 3), "draft_ms": round(draft * 1e3, 3),
            "draft_over_step": round(draft / med["step"], 3),
            "break_even_3_1_4": round(med["cycle3"] / med["step"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--shapes", default="128x5,64x24")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--port", type=int, default=31200)
    ap.add_argument("--work", default=None, help="keep the built shapes and server logs here")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    if not Path(args.vllm_python).exists():
        sys.exit(f"no vLLM interpreter at {args.vllm_python} (make vllm-env builds it)")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_shapes_vllm_"))
    work.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_for_bench(work)
    rows = []
    for text in args.shapes.split(","):
        rows.append(bench_shape(args, parse_shape(text), tok, work))
        print(json.dumps(rows[-1]), flush=True)
    report(rows, args.json)


if __name__ == "__main__":
    main()
