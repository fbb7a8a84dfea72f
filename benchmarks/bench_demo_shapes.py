"""What a draft step costs against a target step, per demo-target shape (reference engine).

    .venv/bin/python -m benchmarks.bench_demo_shapes [--shapes 128x5,64x16,...] [--repeats 5]
        [--threads 1] [--prompt-tokens 128] [--max-new 64] [--work DIR]

The product is a faster server, and on a small CPU target the draft step's cost decides it: an
EAGLE-3 draft step is one decoder layer (on 2H inputs) plus the draft head, so its cost against a
target step is roughly one layer against the target's depth. This script builds each candidate
shape with random weights (cost does not depend on the weights), a random drafter for it, and
measures on the reference engine, one request at a time, greedy, `ignore_eos`:

- `step ms`: plain decoding, milliseconds per output token;
- `draft ms`: one drafter forward of one token over a `--prompt-tokens` context (its KV cache);
- `draft/step`: the ratio that decides a speed-up (the goal for the demo shape: <= 0.12);
- `cycle ms` and `break-even`: one 3/1/4 draft + verify cycle (a random drafter: every draft is
  rejected, so one token per cycle) over the plain step: the accept length 3/1/4 needs to break even;
- `train ms`: one training step of the demo recipe's batch (16 x 128 tokens, forward + backward +
  AdamW) on the same threads: what a `max_steps: 500` build costs.

Shapes are measured interleaved inside each repeat (field note 6) and every figure is a median
over repeats. The vLLM side is `benchmarks/bench_demo_shapes_vllm.py`. Recorded results are in
benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from drafter.layers import default_aux_layer_ids
from drafter.model import DraftKVCache, init_random_drafter, load_drafter
from drafter.engines.reference.speculative import SamplingParams, SpeculativeEngine
from drafter.target import HFTarget


def parse_shape(text: str) -> dict:
    """'HxL[iI][:vocab[:draft_vocab]]' -> a Llama config (head dim 32, GQA 2:1; intermediate I,
    default 3H): '128x12i192' is hidden 128, 12 layers, intermediate 192, vocab 2048."""
    dims, *vocabs = text.split(":")
    dims, _, inter = dims.partition("i")
    hidden, layers = (int(x) for x in dims.split("x"))
    vocab = int(vocabs[0]) if vocabs else 2048
    draft_vocab = int(vocabs[1]) if len(vocabs) > 1 else min(vocab, 2048)
    heads = max(1, hidden // 32)
    return {"label": text, "hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab,
            "draft_vocab_size": draft_vocab, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2), "intermediate_size": int(inter) if inter else 3 * hidden}


def aux_ids(layers: int) -> list[int]:
    """The default aux layer ids, or [1, 2, 3] where a shallow target's defaults repeat a layer."""
    ids = default_aux_layer_ids(layers)
    return ids if len(set(ids)) == 3 else [1, 2, 3]


def build_shape(shape: dict, tokenizer_dir: Path, out: Path) -> tuple[Path, Path]:
    """A random-weight Llama target of this shape (tokenizer copied) and a random drafter for it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    target_dir, draft_dir = out / "target", out / "drafter"
    if not (target_dir / "config.json").exists():
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
            intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_hidden_layers"],
            num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
            max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=2)
        LlamaForCausalLM(config).save_pretrained(target_dir)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(target_dir)
    if not (draft_dir / "config.json").exists():
        init_random_drafter(target_dir, draft_dir, aux_layer_ids=aux_ids(shape["num_hidden_layers"]),
                            draft_vocab_size=shape["draft_vocab_size"], seed=0)
    return target_dir, draft_dir


def tokenizer_for_bench(work: Path) -> Path:
    """Any tokenizer with the demo's special tokens; only its eos id and vocab bound matter here."""
    from drafter.demo_target import build_tokenizer
    from drafter.contracts.sharegpt import load_sharegpt

    out = work / "tokenizer"
    if not (out / "tokenizer.json").exists():
        texts = [m["content"] for c in load_sharegpt(200) for m in c["messages"]]
        build_tokenizer(texts, 512).save_pretrained(out)
    return out


def time_decode(engine: SpeculativeEngine, prompts: list[list[int]], max_new: int, spec: bool) -> tuple[float, int, int]:
    start = time.perf_counter()
    tokens = verifies = 0
    for prompt in prompts:
        res = engine.generate(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True), use_speculation=spec)
        tokens += res.completion_tokens
        verifies += res.spec_verify_ct
    return time.perf_counter() - start, tokens, verifies


@torch.inference_mode()
def time_draft_step(engine: SpeculativeEngine, context: int, n: int = 64) -> float:
    """Seconds per single-token drafter forward at a `context`-long drafter cache."""
    drafter, target = engine.drafter, engine.target
    cache = DraftKVCache()
    hidden = torch.zeros(1, context, 3 * target.hidden_size)
    drafter(engine._embed(list(range(context))), hidden, engine._positions(0, context), cache)
    own = torch.zeros(1, 1, drafter.config.hidden_size)
    start = time.perf_counter()
    for i in range(n):
        drafter(engine._embed([5]), own, engine._positions(context, 1), cache)
        cache.crop(context)
    return (time.perf_counter() - start) / n


def time_train_step(target_dir: Path, batch: int = 16, seq: int = 128, n: int = 3) -> float:
    """Seconds per demo-recipe training step (AdamW, forward + backward) for this shape."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(3, model.config.vocab_size, (batch, seq))
    for i in range(n + 1):
        if i == 1:
            start = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - start) / n


def report(rows: list[dict], json_path: str | None) -> None:
    """The figures as a markdown table on stdout (and as JSON where asked)."""
    cols = list(rows[0])
    print("\n| " + " | ".join(cols) + " |\n|" + "|".join("---" for _ in cols) + "|")
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="128x5,128x12,64x12,64x16,64x24,96x16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--no-train", action="store_true", help="skip the training-step timing")
    ap.add_argument("--work", default=None, help="keep the built shapes here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_shapes_"))
    work.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_for_bench(work)
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    engines = {}
    for shape in shapes:
        target_dir, draft_dir = build_shape(shape, tok, work / shape["label"].replace(":", "_"))
        target = HFTarget(target_dir, device="cpu")
        engines[shape["label"]] = (SpeculativeEngine(target, load_drafter(draft_dir), num_steps=3), target_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [[0] + torch.randint(10, 500, (args.prompt_tokens - 1,), generator=gen).tolist()
               for _ in range(args.prompts)]
    figures = {label: {"step": [], "cycle": [], "draft": []} for label in engines}
    for label, (engine, _) in engines.items():  # warm-up
        time_decode(engine, prompts[:1], 4, spec=False)
        time_decode(engine, prompts[:1], 4, spec=True)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.prompts} prompts of {args.prompt_tokens} "
          f"tokens x {args.max_new} new, {args.repeats} repeats, interleaved", flush=True)
    for rep in range(args.repeats):
        for label, (engine, _) in engines.items():
            secs, tokens, _ = time_decode(engine, prompts, args.max_new, spec=False)
            figures[label]["step"].append(secs / tokens)
            secs, tokens, verifies = time_decode(engine, prompts, args.max_new, spec=True)
            figures[label]["cycle"].append(secs / verifies)
            figures[label]["draft"].append(time_draft_step(engine, args.prompt_tokens))
        print(f"  repeat {rep + 1}/{args.repeats} done", flush=True)
    rows = []
    for shape in shapes:
        label = shape["label"]
        engine, target_dir = engines[label]
        f = {k: statistics.median(v) for k, v in figures[label].items()}
        params = sum(p.numel() for p in engine.target.model.parameters())
        row = {"shape": label, "layers": shape["num_hidden_layers"], "hidden": shape["hidden_size"],
               "vocab": shape["vocab_size"], "draft_vocab": shape["draft_vocab_size"],
               "params_M": round(params / 1e6, 2), "step_ms": round(f["step"] * 1e3, 3),
               "draft_ms": round(f["draft"] * 1e3, 3), "draft_over_step": round(f["draft"] / f["step"], 3),
               "cycle_ms": round(f["cycle"] * 1e3, 3), "break_even_3_1_4": round(f["cycle"] / f["step"], 2)}
        if not args.no_train:
            row["train_step_ms"] = round(time_train_step(target_dir) * 1e3, 1)
        rows.append(row)
    report(rows, args.json)


if __name__ == "__main__":
    main()
