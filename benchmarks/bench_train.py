"""Our EAGLE-3 training step beside SpecForge 0.2.0's, at the anchor's shapes, on one GPU.

One optimizer step = teacher (restricted target head + full-vocab argmax in chunks, position
mask), the fast TTT unroll, backward, clipping, AdamW on fp32 masters (moments fp32, or bf16 with
--moments bfloat16). Synthetic offline features
like ../shared/anchors/specforge_train_step.py: one 2048-token sequence per step, answer-like loss
spans covering ~`--loss-fraction` of it, random ids and states; the target lm_head's non-draft rows
are scaled by 0.5 so the teacher's full-vocab argmax lies in the draft vocab about as often as on
real chat data (the JSON reports the measured share). Prints one JSON line per run.

  python benchmarks/bench_train.py --loss-fraction 0.6            # ours, Llama-3.1-8B shapes
  python benchmarks/bench_train.py --exactness                    # fast path == dense on this device
  python benchmarks/bench_train.py --all --anchor PATH --out DIR  # anchor + ours (compiled; CUDA graphs
                                                                  # fp32 / bf16 moments) + exactness, table
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.model import Eagle3DraftConfig, Eagle3Drafter, set_draft_vocab  # noqa: E402
from drafter.training.optim import MasterAdamW, clip_gradients  # noqa: E402
from drafter.training.static_step import GraphedTTT, plan_static, static_ttt_loss  # noqa: E402
from drafter.training.teacher import TargetHead  # noqa: E402
from drafter.training.ttt import MicroBatch, dense_ttt_loss, embed_next, fast_ttt_loss, prepare  # noqa: E402


def answer_spans_mask(T: int, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """The anchor's mask: alternating prompt / answer spans, answers ~ `fraction` of the tokens."""
    m = torch.zeros(T, dtype=torch.long)
    if fraction >= 1:
        return m + 1
    pos = 0
    while pos < T:
        prompt = int(torch.randint(32, 160, (1,), generator=gen))
        answer = max(1, int(prompt * fraction / max(1e-6, 1 - fraction)))
        pos += prompt
        m[pos:pos + answer] = 1
        pos += answer
    return m


def build(a, device, dtype):
    cfg = Eagle3DraftConfig(hidden_size=a.hidden, intermediate_size=14336 if a.hidden == 4096 else 4 * a.hidden,
                            num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                            draft_vocab_size=a.draft_vocab, target_hidden_size=a.hidden, aux_layer_ids=[1, 15, 28],
                            rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)
    torch.manual_seed(a.seed)
    model = Eagle3Drafter(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if n.endswith("norm.weight") else torch.randn_like(p) * 0.02)
    used = torch.arange(0, a.vocab, a.vocab // a.draft_vocab)[:a.draft_vocab]  # the anchor's map
    set_draft_vocab(model, used)
    model.to(device=device, dtype=dtype)
    head_w = torch.randn(a.vocab, a.hidden, dtype=dtype) * 0.02
    head_w[~model.t2d.cpu()] *= 0.5
    head = TargetHead(head_w, model.t2d.cpu(), device, dtype, vocab_chunk=32768)
    del head_w
    embed = torch.randn(a.vocab, a.hidden, dtype=dtype)  # stays on the CPU, as in the trainer
    return model, head, embed


def batch(a, device, dtype, gen, lens=None):
    lens = lens or [a.seq]
    T = sum(lens)
    lm = torch.cat([answer_spans_mask(n, a.loss_fraction, gen) for n in lens]).bool()
    mb = MicroBatch(input_ids=torch.randint(0, a.vocab, (T,), generator=gen), loss_mask=lm,
                    aux=torch.randn(T, 3, a.hidden, generator=gen).to(dtype),
                    final=torch.randn(T, a.hidden, generator=gen).to(dtype), doc_lens=lens,
                    sample_ids=[str(i) for i in range(len(lens))])
    return mb


class TrainStep:
    """One optimizer step of our trainer (forward, backward, clip, AdamW) on a fresh synthetic batch;
    `__call__` returns (seconds, loss, step inputs). Shared by the timing and the profile."""

    def __init__(self, a):
        self.a, self.device, self.dtype = a, torch.device("cuda"), torch.bfloat16
        self.model, self.head, self.embed = build(a, self.device, self.dtype)
        self.graphed = GraphedTTT(self.model, self.head, a.attention, a.compile) if a.graphs else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = MasterAdamW(self.params, lr=1e-4, state_dtype=getattr(torch, a.moments), compile=a.compile,
                               keep_grads=a.graphs)
        self.gen = torch.Generator().manual_seed(a.seed)

    def __call__(self):
        a = self.a
        mb = batch(a, self.device, self.dtype, self.gen)
        e_next = embed_next(mb, self.embed).to(self.device)  # data preparation (frozen table lookup)
        # the states on the GPU (as the anchor's), ids and masks where the trainer keeps them
        mb = MicroBatch(mb.input_ids, mb.loss_mask, mb.aux.to(self.device), mb.final.to(self.device),
                        mb.doc_lens, mb.sample_ids)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if self.graphed is not None:
            sb = plan_static(mb, a.ttt, 0.8, float(mb.num_tokens), a.seq, e_next=e_next)
            loss, stats = self.graphed(sb)
        else:
            si = prepare(mb, None, self.head, a.ttt, self.device, self.dtype, e_next=e_next)
            loss, _ = fast_ttt_loss(self.model, si, 0.8, float(si.T), attention=a.attention, compile=a.compile)
            loss.backward()
        clip_gradients(self.params, 0.5)
        self.opt.step()
        self.opt.zero_grad()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        frac = float(stats[0, 1] / mb.num_tokens) if self.graphed is not None else float(si.pm[0].float().mean())
        return dt, loss, frac


def run_ours(a) -> dict:
    step = TrainStep(a)
    times, fracs = [], []
    for k in range(a.steps + 3):
        dt, loss, frac = step()
        if k >= 3:
            times.append(dt)
            fracs.append(frac)
    med = statistics.median(times)
    return {"impl": "ours", "compile": a.compile, "cuda_graphs": a.graphs, "attention": a.attention, "moments": a.moments, "seq": a.seq, "ttt": a.ttt, "hidden": a.hidden, "vocab": a.vocab,
            "draft_vocab": a.draft_vocab, "loss_fraction": a.loss_fraction,
            "position_mask_fraction_step0": round(statistics.mean(fracs), 3),
            "trainable_params_M": round(sum(p.numel() for p in step.params) / 1e6, 1),
            "step_s_median": round(med, 4), "step_s_min": round(min(times), 4),
            "tokens_per_s": round(a.seq / med, 1),
            "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2), "loss": float(loss.detach()),
            "resident_between_steps_GiB": round(torch.cuda.memory_allocated() / 2 ** 30, 2),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__}


def profile(a) -> None:
    """Two profiled steps: device time vs wall time, and the kernels that take it."""
    from torch.profiler import ProfilerActivity, profile as prof

    step = TrainStep(a)
    for _ in range(3):
        step()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        wall = step()[0] + step()[0]
    ka = p.key_averages()
    dev_total = sum(e.self_device_time_total for e in ka if e.device_type.name == "CUDA") / 1e3 / 2
    print(ka.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
    n_kernels = sum(e.count for e in ka if e.device_type.name == "CUDA") / 2
    print(json.dumps({"profile": True, "wall_ms_per_step": round(wall / 2 * 1e3, 1),
                      "device_ms_per_step": round(dev_total, 1), "kernels_per_step": n_kernels}))


def full_head(head: TargetHead) -> torch.Tensor:
    """The target lm_head in target-id order, rebuilt from its draft / other rows."""
    return torch.cat([head.draft_rows, head.rest_rows])[torch.argsort(torch.cat([head.draft_ids, head.rest_ids]))]


def max_rel_err(xs, ys) -> float:
    """The worst ||x - y|| / ||y|| over pairs of tensors (y the reference)."""
    return max(float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-12)) for x, y in zip(xs, ys))


def exactness(a) -> dict:
    """Fast path vs the dense reference on a small shape: fp32 (math attention) and bf16 (flash)."""
    out = {}
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    small = argparse.Namespace(**{**vars(a), "hidden": 128, "heads": 4, "kv_heads": 2, "vocab": 1000,
                                  "draft_vocab": 250, "seq": 96})
    cases = [(torch.float32, "math", False), (torch.bfloat16, "flash" if device.type == "cuda" else "math", False)]
    if device.type == "cuda" or a.compile:
        cases.append((torch.bfloat16 if device.type == "cuda" else torch.float32,
                      "flash" if device.type == "cuda" else "math", True))
    for dtype, attention, comp in cases:
        model, head, embed = build(small, device, dtype)
        head_full = full_head(head)
        gen = torch.Generator().manual_seed(1)
        mb = batch(small, device, dtype, gen, lens=[230, 170, 199])
        si = prepare(mb, embed, head, small.ttt, device, dtype)
        lf, _ = fast_ttt_loss(model, si, 0.8, float(si.T), attention=attention, compile=comp)
        gf = torch.autograd.grad(lf, list(model.parameters()))
        ld = dense_ttt_loss(model, mb, embed, head_full, model.t2d, small.ttt, 0.8, float(si.T))
        gd = torch.autograd.grad(ld, list(model.parameters()))
        rel = max_rel_err(gf, gd)
        key = f"{str(dtype).removeprefix('torch.')}_{attention}" + ("_compile" if comp else "")
        tol_loss, tol_grad = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 5e-2)
        lf, ld = float(lf.detach()), float(ld.detach())
        out[key] = {"loss_fast": lf, "loss_dense": ld, "loss_rel_err": abs(lf - ld) / abs(ld),
                    "grad_max_rel_err": rel, "pass": abs(lf - ld) / abs(ld) < tol_loss and rel < tol_grad}
    if device.type == "cuda":  # the fixed-shape step replayed as a CUDA graph, against dense and eager
        for comp in (False, True):
            model, head, embed = build(small, device, torch.bfloat16)
            head_full = full_head(head)
            mb = batch(small, device, torch.bfloat16, torch.Generator().manual_seed(1), lens=[230, 170, 199])
            params = list(model.parameters())
            sb = plan_static(mb, small.ttt, 0.8, float(mb.num_tokens), 640, embed=embed)
            # The graph first: a live autograd graph built on the default stream (its gradient
            # accumulators) would make the capture depend on the legacy stream.
            graphed = GraphedTTT(model, head, compile=comp)
            lg = None
            for _ in range(2):  # capture, then a plain replay: both must give the same
                graphed.zero_grads()
                lg = float(graphed(sb)[0])
            gg = [p.grad.clone() for p in params]
            le, _ = static_ttt_loss(model, head, sb.to(device, torch.bfloat16), compile=comp)
            ge = torch.autograd.grad(le, params)
            ld = dense_ttt_loss(model, mb, embed, head_full, model.t2d, small.ttt, 0.8, float(mb.num_tokens))
            gd = torch.autograd.grad(ld, params)
            res = {"loss_graph": lg, "loss_eager_static": float(le), "loss_dense": float(ld),
                   "loss_rel_err": abs(lg - float(ld)) / abs(float(ld)), "grad_max_rel_err": max_rel_err(gg, gd),
                   "graph_vs_eager_static_grad_max_rel_err": max_rel_err(gg, ge)}
            res["pass"] = res["loss_rel_err"] < 2e-2 and res["grad_max_rel_err"] < 5e-2
            out["bfloat16_flash_cuda_graph" + ("_compile" if comp else "")] = res
            del le, ld, ge, gd, graphed
        out.update(trainer_graphs_check())
    out["device"] = str(device)
    return out


def trainer_graphs_check() -> dict:
    """train_drafter on the tests' tiny target and dump, on CUDA, with and without
    train.cuda_graphs: same metrics and final weights (float32 with math attention: equal up to
    summation order; bfloat16 with flash: within bf16 rounding)."""
    import tempfile

    from safetensors.torch import load_file

    from drafter.store import FileStore
    from drafter.training.trainer import train_drafter
    from tests.fixtures.training_data import TARGET_FP, make_cfg, make_dump, make_target

    out = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        target = make_target(tmp / "target")
        store = FileStore(tmp / "store")
        make_dump(store, tmp)
        for dtype, tol in (("float32", 1e-4), ("bfloat16", 5e-2)):
            got = {}
            for graphs in (False, True):
                cfg = make_cfg(target, "file:///x", device="cuda", dtype=dtype, cuda_graphs=graphs,
                               compile=graphs, max_steps=8, tokens_per_micro_batch=128)
                r = train_drafter(cfg, store, "dump0001", run_fingerprint=f"{dtype}-{graphs}",
                                  out_dir=tmp / f"o-{dtype}-{graphs}", target_fingerprint=TARGET_FP)
                rows = [json.loads(x) for x in r.metrics_path.read_text().splitlines()]
                got[graphs] = (rows, load_file(str(r.drafter_dir / "model.safetensors")))
            (ra, wa), (rb, wb) = got[False], got[True]
            keys = [k for k in wa if wa[k].is_floating_point()]
            rel = max_rel_err([wb[k] for k in keys], [wa[k] for k in keys])
            la, lb = ra[-1]["loss"][0], rb[-1]["loss"][0]
            out[f"trainer_{dtype}_cuda_graphs"] = {"final_eval_loss0_plain": la, "final_eval_loss0_graphs": lb,
                                                   "weights_max_rel_err": rel,
                                                   "pass": rel < tol and abs(la - lb) <= tol * max(1.0, abs(la))}
    return out


def run_all(a) -> None:
    out = Path(a.out or ".")
    out.mkdir(parents=True, exist_ok=True)
    results = []
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--loss-fraction", str(a.loss_fraction), "--steps", str(a.steps)]
    jobs = []
    if a.anchor:
        jobs.append(("specforge", [sys.executable, a.anchor, "--loss-fraction", str(a.loss_fraction),
                                   "--steps", str(a.steps)]))
    if a.eager:
        jobs.append(("ours", me + common))
    if not a.graphs_only:
        jobs.append(("ours-compile", me + common + ["--compile"]))
    jobs.append(("ours-graphs", me + common + ["--compile", "--graphs"]))
    jobs.append(("ours-graphs-bf16m", me + common + ["--compile", "--graphs", "--moments", "bfloat16"]))
    jobs.append(("exactness", me + ["--exactness"]))
    for name, cmd in jobs:
        if name == "ours-compile" and a.eager and "error" in results[-1]:  # flash failed: measure math
            name, cmd = "ours-math", me + common + ["--attention", "math"]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.job_timeout)
            stdout, stderr = p.stdout, p.stderr
        except subprocess.TimeoutExpired as err:  # reported in the JSON, and the next job runs
            text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            stdout, stderr = text(err.stdout), text(err.stderr) + f"\ntimed out after {a.job_timeout} s"
        (out / f"{name}.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
        line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("{")), None)
        res = json.loads(line) if line else {"error": stderr[-2000:]}
        res["job"], res["wall_s"] = name, round(time.time() - t0, 1)
        results.append(res)
        print(json.dumps(res), flush=True)
    (out / "bench_train.json").write_text(json.dumps(results, indent=2))
    sf = next((r for r in results if r["job"] == "specforge" and "tokens_per_s" in r), None)
    print("\njob                 tokens/s   step ms   peak GiB   vs specforge")
    for r in results:
        if "tokens_per_s" in r:
            ratio = f"{r['tokens_per_s'] / sf['tokens_per_s']:.2f}x" if sf else "-"
            print(f"{r['job']:<19} {r['tokens_per_s']:>9.0f} {r['step_s_median'] * 1e3:>9.1f} "
                  f"{r['peak_mem_GiB']:>10.2f}   {ratio}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--loss-fraction", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--attention", default="auto", help="auto (flash on CUDA) or math")
    p.add_argument("--moments", default="float32", choices=["float32", "bfloat16"],
                   help="AdamW moments (train.optimizer_state_dtype; bfloat16 is not the exact default)")
    p.add_argument("--graphs", action="store_true", help="fixed-shape step replayed as a CUDA graph (train.cuda_graphs)")
    p.add_argument("--graphs-only", action="store_true", help="--all measures only the CUDA-graph steps")
    p.add_argument("--eager", action="store_true", help="--all also measures the eager step")
    p.add_argument("--exactness", action="store_true")
    p.add_argument("--all", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--anchor", default=None, help="path of specforge_train_step.py (run in its own process)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--job-timeout", type=int, default=240)
    a = p.parse_args()
    if a.all:
        run_all(a)
    elif a.profile:
        profile(a)
    elif a.exactness:
        print(json.dumps(exactness(a)))
    else:
        print(json.dumps(run_ours(a)))


if __name__ == "__main__":
    main()
