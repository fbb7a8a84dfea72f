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
  python benchmarks/bench_train.py --trainer-check                # CUDA: the trainer's own runs agree
  python benchmarks/bench_train.py --all --anchor PATH --out DIR  # anchor + ours (compiled; CUDA graphs
                                                                  # fp32 / bf16 moments) + exactness, table

Real data (`--sharegpt-lengths` or `--shards`): micro-batches of real lengths through the training
reader (DumpReader + Packer, fp8 decoded on its thread) into the trainer's own optimizer step, each
job in its own process on the same dump (the same batches, checked by digests), SpecForge's step
(its wheel on PYTHONPATH, CUDA only) on those batches too; tokens/s end to end, data-wait share,
graph captures per 100 steps, shape keys, peak memory, in DIR/bench_train_real.json after each job:

  python benchmarks/bench_train.py --all --sharegpt-lengths .bench-data/sharegpt.jsonl.gz --out DIR
      # ShareGPT lengths at the 8B shape, synthetic states, bf16 and fp8 dumps under --store-dir
  python benchmarks/bench_train.py --all --shards file:///data/store --dump FP --out DIR  # a real dump
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import real_batches as rb  # noqa: E402
from benchmarks.corpus import read_conversations  # noqa: E402
from drafter.config import TrainConfig  # noqa: E402
from drafter.errors import DrafterError  # noqa: E402
from drafter.model import Eagle3DraftConfig, Eagle3Drafter, set_draft_vocab  # noqa: E402
from drafter.training.optim import MasterAdamW, clip_gradients  # noqa: E402
from drafter.training.static_step import GraphedTTT, plan_static, static_ttt_loss  # noqa: E402
from drafter.training.teacher import TargetHead  # noqa: E402
from drafter.training.ttt import MicroBatch, dense_ttt_loss, embed_next, fast_ttt_loss, prepare  # noqa: E402

TRAIN_DEFAULTS = {k: f.default for k, f in TrainConfig.model_fields.items()}


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
    summation order; bfloat16 with flash: within bf16 rounding); in float32 also with keys per
    batch (train.cuda_graph_buckets: 0) and with a device sync after every step."""
    import tempfile

    from drafter.store import FileStore
    from tests.fixtures.training_data import make_cfg, make_dump, make_target

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
                got[graphs] = trained(cfg, store, tmp / f"o-{dtype}-{graphs}")
            (ra, wa), (rb, wb) = got[False], got[True]
            keys = [k for k in wa if wa[k].is_floating_point()]
            rel = max_rel_err([wb[k] for k in keys], [wa[k] for k in keys])
            la, lb = ra[-1]["loss"][0], rb[-1]["loss"][0]
            out[f"trainer_{dtype}_cuda_graphs"] = {"final_eval_loss0_plain": la, "final_eval_loss0_graphs": lb,
                                                   "weights_max_rel_err": rel,
                                                   "pass": rel < tol and abs(la - lb) <= tol * max(1.0, abs(la))}
            if dtype != "float32":
                continue
            # the queued steps (pinned batches, no per-step sync) against in-step syncs; the keys
            # that follow each batch (train.cuda_graph_buckets: 0) against the default few buckets
            per_batch = make_cfg(target, "file:///x", device="cuda", dtype=dtype, cuda_graphs=True, compile=True,
                                 max_steps=8, tokens_per_micro_batch=128, cuda_graph_buckets=0)
            for name, (rs, ws) in (("steps_in_flight", synced_run(cfg, store, tmp / "o-synced")),
                                   ("buckets_0", trained(per_batch, store, tmp / "o-b0"))):
                rel = max_rel_err([ws[k] for k in keys], [wb[k] for k in keys])
                out[f"trainer_float32_{name}"] = {
                    "weights_max_rel_err": rel, "bitwise_equal": all(torch.equal(ws[k], wb[k]) for k in wb),
                    "same_metrics": rs == rb,
                    "pass": rel < tol and abs(rs[-1]["loss"][0] - lb) <= tol * max(1.0, abs(lb))}
    return out


def trained(cfg, store, out_dir: Path) -> tuple[list[dict], dict]:
    """(metrics rows, final weights) of train_drafter on the tests' dump."""
    from safetensors.torch import load_file

    from drafter.training.trainer import train_drafter
    from tests.fixtures.training_data import TARGET_FP

    r = train_drafter(cfg, store, "dump0001", run_fingerprint=out_dir.name, out_dir=out_dir,
                      target_fingerprint=TARGET_FP)
    rows = [json.loads(x) for x in r.metrics_path.read_text().splitlines()]
    return rows, load_file(str(r.drafter_dir / "model.safetensors"))


def synced_run(cfg, store, out_dir: Path) -> tuple[list[dict], dict]:
    """`trained` as before the host ran ahead: pageable batches, a device sync after every step."""
    from drafter.training import trainer

    saved = trainer.STEPS_IN_FLIGHT, trainer.packer_for
    trainer.STEPS_IN_FLIGHT = 0
    trainer.packer_for = lambda *args: dataclasses.replace(saved[1](*args), pin=False)
    try:
        return trained(cfg, store, out_dir)
    finally:
        trainer.STEPS_IN_FLIGHT, trainer.packer_for = saved


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
        results.append(run_job(name, cmd, a, out))
    (out / "bench_train.json").write_text(json.dumps(results, indent=2))
    sf = next((r for r in results if r["job"] == "specforge" and "tokens_per_s" in r), None)
    print("\njob                 tokens/s   step ms   peak GiB   vs specforge")
    for r in results:
        if "tokens_per_s" in r:
            ratio = f"{r['tokens_per_s'] / sf['tokens_per_s']:.2f}x" if sf else "-"
            print(f"{r['job']:<19} {r['tokens_per_s']:>9.0f} {r['step_s_median'] * 1e3:>9.1f} "
                  f"{r['peak_mem_GiB']:>10.2f}   {ratio}")


# ---- real data: the training reader feeds the step (--sharegpt-lengths FILE or --shards STORE)

STORAGE = {"bfloat16": "model", "float8_e4m3": "float8_e4m3"}  # CLI name -> dump.storage_dtype
OURS_JOBS = {"ours": [], "ours-compile": ["--compile"], "ours-graphs": ["--compile", "--graphs"]}


def job_flags(name: str) -> list[str]:
    """A --jobs name as flags: specforge, ours, ours-compile, ours-graphs, ours-graphs-bN (N buckets)."""
    if name == "specforge":
        return ["--impl", "specforge"]
    if name.startswith("ours-graphs-b") and name[len("ours-graphs-b"):].isdigit():
        return OURS_JOBS["ours-graphs"] + ["--graph-buckets", name[len("ours-graphs-b"):]]
    if name in OURS_JOBS:
        return OURS_JOBS[name]
    raise SystemExit(f"--jobs: unknown job {name!r} (specforge, ours, ours-compile, ours-graphs, ours-graphs-bN)")


def real_dump(a, storage: str) -> tuple[str, str, dict]:
    """(store location, dump fingerprint, facts) of the data a real-data job reads: --shards as
    given, else a synthetic-state dump with --sharegpt-lengths' lengths written under --store-dir."""
    if a.shards:
        store, fp = rb.open_dump(a.shards, a.dump)
        meta = rb.StageOutput.committed(store, rb.DUMP_STAGE, fp).manifest.meta
        return a.shards, fp, {"source": a.shards, "storage_dtype": meta.get("storage_dtype"),
                              "hidden": meta.get("hidden_size")}
    root = Path(a.store_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    # ShareGPT at 1024 tokens: ~1.4k tokens per micro-batch (a sample over the budget is one of its own)
    need = int(1.6 * (a.warmup + a.steps) * a.micro_batches * a.tokens_per_micro_batch)
    need = min(need, a.dump_tokens) if a.dump_tokens else need  # a long window reads the dump again (epochs)
    masks = rb.sharegpt_masks(read_conversations(Path(a.sharegpt_lengths)), a.max_length, a.chars_per_token,
                              max_tokens=need)
    t = time.perf_counter()
    fp, facts = rb.write_synthetic_dump(rb.FileStore(root), masks, a.hidden, STORAGE[storage], a.vocab, seed=a.seed)
    lens = torch.tensor([m.numel() for m in masks], dtype=torch.float)
    loss = sum(int(m.sum()) for m in masks)
    return f"file://{root}", fp, {"source": a.sharegpt_lengths, "storage_dtype": STORAGE[storage], "hidden": a.hidden,
                                  **facts, "write_s": round(time.perf_counter() - t, 1),
                                  "sample_len_mean": round(float(lens.mean()), 1),
                                  "sample_len_max": int(lens.max()), "loss_share": round(loss / float(lens.sum()), 3),
                                  "chars_per_token": a.chars_per_token}


def ours_stepper(a, device: torch.device):
    """The trainer's own optimizer step (trainer._optimizer_step: plan + graph replay or prepare +
    fast path, clipping, AdamW, statistics) over our synthetic-weight drafter."""
    from types import SimpleNamespace

    from drafter.training import distributed
    from drafter.training.trainer import TTTModule, _optimizer_step, _Parts, _Schedule, _State
    from drafter.training.ttt import STATS

    tc = TrainConfig(ttt_length=a.ttt, tokens_per_micro_batch=a.tokens_per_micro_batch, max_length=a.max_length,
                     micro_batches_per_step=a.micro_batches, draft_vocab_size=a.draft_vocab, compile=a.compile,
                     cuda_graphs=a.graphs, optimizer_state_dtype=a.moments, device=str(device), seed=a.seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # train.dtype auto
    model, head, embed = build(a, device, dtype)
    graphed = GraphedTTT(model, head, compile=a.compile, buckets=a.graph_buckets) if a.graphs else None
    opt = MasterAdamW(list(model.parameters()), tc.learning_rate, tc.adam_betas, tc.adam_eps, tc.weight_decay,
                      state_dtype=getattr(torch, tc.optimizer_state_dtype), compile=tc.compile,
                      keep_grads=graphed is not None)
    parts = _Parts(model, "bench", dtype, embed, head, TTTModule(model), graphed, opt)
    run = SimpleNamespace(cfg=SimpleNamespace(train=tc), d=distributed.init(str(device)))
    sched = _Schedule(tc.tokens_per_micro_batch * tc.micro_batches_per_step, a.warmup + a.steps, 0, tc.learning_rate)
    state = _State(acc=torch.zeros(tc.ttt_length, len(STATS), dtype=torch.float64))
    captures = (lambda: len(graphed.graphs)) if graphed is not None else (lambda: 0)
    return (lambda group: _optimizer_step(run, parts, sched, state, group)), captures


def specforge_stepper(a, device: torch.device):
    """SpecForge 0.2.0's step as the anchor builds it (LlamaForCausalLMEagle3 + OnlineEagle3Model,
    fused AdamW, clip 0.5, loss weights 0.8**k), fed our micro-batch as one sequence [1, T] (its
    batch-1 layout: documents are not kept apart), with its offline teacher from the dumped final
    states (`target_hidden_for_compact`, as benchmarks/specforge_trainer.py): computed in the step,
    like ours. (None, why) where SpecForge cannot run."""
    if device.type != "cuda":
        return None, "SpecForge's step needs CUDA (its Triton loss kernel)"
    try:
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from specforge.utils import padding
        from transformers import LlamaConfig
    except Exception as e:  # noqa: BLE001 - any import failure is a note in the JSON
        return None, f"cannot import specforge (install .whl/specforge-0.2.0 on PYTHONPATH): {e!r}"[:500]
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=14336 if a.hidden == 4096 else 4 * a.hidden,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, num_hidden_layers=1,
                      vocab_size=a.vocab, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                      torch_dtype="bfloat16")
    cfg.draft_vocab_size = a.draft_vocab
    torch.manual_seed(a.seed)
    draft = LlamaForCausalLMEagle3(cfg, attention_backend=a.specforge_backend).to(device, torch.bfloat16)
    draft.freeze_embedding()
    used = torch.arange(0, a.vocab, a.vocab // a.draft_vocab, device=device)[:a.draft_vocab]  # the anchor's map
    draft.d2t.copy_(used - torch.arange(a.draft_vocab, device=device))
    t2d = torch.zeros(a.vocab, dtype=torch.bool, device=device)
    t2d[used] = True
    draft.t2d.copy_(t2d)
    model = OnlineEagle3Model(draft, length=a.ttt, attention_backend=a.specforge_backend)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    head_w = torch.randn(a.vocab, a.hidden, generator=torch.Generator().manual_seed(a.seed)).to(torch.bfloat16) * 0.02
    head_w[~t2d.cpu()] *= 0.5  # as ours: the teacher's argmax in the draft vocab about as often as on chat data
    head_w = head_w.to(device)

    def step(group) -> None:
        for _c, mb, _n in group:
            mb = mb.decoded(device)  # as the trainer: fp8 states decoded on the GPU
            ids = mb.input_ids[None].to(device)
            plosses, _, _acc, *_ = model(
                input_ids=padding(ids, left=False), attention_mask=torch.ones_like(ids), target=None,
                loss_mask=mb.loss_mask[None, :, None].to(device).long(),
                hidden_states=mb.aux.reshape(1, mb.num_tokens, -1).to(device, torch.bfloat16),
                target_hidden_for_compact=padding(mb.final[None].to(device, torch.bfloat16), left=False),
                target_head_weight=head_w)
            sum(0.8 ** i * pl for i, pl in enumerate(plosses)).backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    return step, lambda: 0


def run_real(a) -> dict:
    """One real-data job in this process: `--impl` stepping on the reader's micro-batches; tokens/s
    end to end (reader, planning, graph captures included), data-wait share, captures, peak memory."""
    device = torch.device(a.device)
    store, fp = rb.open_dump(a.shards, a.dump)
    meta = rb.StageOutput.committed(store, rb.DUMP_STAGE, fp).manifest.meta
    a.hidden = int(meta["hidden_size"])
    head = {"impl": a.impl, "dump": fp, "storage_dtype": meta.get("storage_dtype"), "hidden": a.hidden,
            "tokens_per_micro_batch": a.tokens_per_micro_batch, "micro_batches_per_step": a.micro_batches,
            "max_length": a.max_length, "ttt": a.ttt, "device": str(device)}
    if a.impl == "ours":
        head.update(compile=a.compile, cuda_graphs=a.graphs, graph_buckets=a.graph_buckets, moments=a.moments)
        step, captures = ours_stepper(a, device)
    else:
        head["attention_backend"] = a.specforge_backend
        step, captures = specforge_stepper(a, device)
        if step is None:
            return {**head, "skipped": captures}
    reader = rb.open_reader(store, fp, a.max_length, a.seed, a.cache_shards, a.prefetch_shards)
    stream = rb.batches(reader, a.tokens_per_micro_batch, a.max_length, epochs=1000, device=a.device)
    digests = rb.BatchDigests()
    rows, stopped, t_job, window, epochs = [], "steps", time.perf_counter(), None, 0
    try:
        for k in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            if k == a.warmup:
                window = t0
            group = list(itertools.islice(stream, a.micro_batches))
            t1 = time.perf_counter()
            if len(group) < a.micro_batches:
                stopped = "data exhausted"
                break
            for _c, mb, _n in group:
                digests.add(mb)
            c0 = captures()
            step(group)
            t2 = time.perf_counter()
            rows.append((t1 - t0, t2 - t1, sum(g[1].num_tokens for g in group), captures() - c0))
            epochs = group[-1][2].epoch + (group[-1][2] != rb.Cursor(group[-1][2].epoch))  # begun so far
            if a.max_seconds and window is not None and t2 - window > a.max_seconds:  # the timed window's budget
                stopped = f"time budget ({a.max_seconds} s)"
                break
    finally:
        if device.type == "cuda":  # the trainer queues steps without waiting: the window ends when the GPU does
            torch.cuda.synchronize()
        t_end = time.perf_counter()
        stream.close()
        reader.close()
    timed = rows[a.warmup:]
    out = {**head, "stopped_by": stopped, "steps_warmup": min(len(rows), a.warmup), "steps_timed": len(timed),
           # the first steps: compilation and the first captures (a one-off cost, outside the window)
           "warmup_step_s": [round(r[0] + r[1], 2) for r in rows[:a.warmup]],
           "batch_digests": digests.digests, "data_epochs_begun": epochs, "reader": reader.stats(), "torch": torch.__version__,
           "job_s": round(t_end - t_job, 1), "graph_captures_total": captures(),
           "distinct_shape_keys": captures() if a.impl == "ours" and a.graphs else None}
    if timed:
        span = t_end - window
        tokens = sum(r[2] for r in timed)
        steady = [r for r in timed if not r[3]]
        capture_steps = [r[0] + r[1] for r in timed if r[3]]
        out.update({
            "tokens_timed": tokens, "window_s": round(span, 3),
            "tokens_per_s": round(tokens / span, 1),  # end to end: reader waits and captures included
            "data_wait_share": round(sum(r[0] for r in timed) / span, 4),
            # where the waits fall: seconds waited in each quarter of the timed steps, in order
            "data_wait_s_by_quarter": [round(sum(r[0] for r in q), 3) for q in quarters(timed)],
            "graph_captures_timed": sum(r[3] for r in timed),
            "graph_captures_per_100_steps": round(100 * sum(r[3] for r in timed) / len(timed), 1),
            "capture_step_s_median": round(statistics.median(capture_steps), 3) if capture_steps else None,
            "capture_step_s": [round(x, 3) for x in capture_steps],  # each, in order: a recompile stands out
            "steady_tokens_per_s": (round(sum(r[2] for r in steady) / sum(r[0] + r[1] for r in steady), 1)
                                    if steady else None),  # steps that captured nothing
            "step_s_median": round(statistics.median(r[1] for r in steady), 4) if steady else None,
            "tokens_per_micro_batch_mean": round(tokens / len(timed) / a.micro_batches, 1)})
    if device.type == "cuda":
        out.update(peak_mem_GiB=round(torch.cuda.max_memory_allocated() / 2 ** 30, 2),
                   device_name=torch.cuda.get_device_name())
    return out


def quarters(rows: list) -> list[list]:
    """`rows` cut into four runs of consecutive rows (the last ones may be shorter)."""
    n = -(-len(rows) // 4)
    return [rows[i:i + n] for i in range(0, 4 * n, n)] if rows else []


def run_all_real(a) -> dict:
    """For each storage dtype: the dump (written once), then each of --jobs in its own process on
    the same dump (same seed: the reader hands every job the same micro-batches, checked by their
    digests); the JSON is rewritten after every job."""
    out = Path(a.out or ".")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_train_real.json"
    res = {"args": {k: v for k, v in vars(a).items()}, "data": [], "jobs": [], "summary": []}
    emit = lambda: path.write_text(json.dumps(res, indent=2))
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--device", a.device, "--steps", str(a.steps), "--warmup", str(a.warmup), "--ttt", str(a.ttt),
              "--heads", str(a.heads), "--kv-heads", str(a.kv_heads), "--vocab", str(a.vocab),
              "--draft-vocab", str(a.draft_vocab), "--seed", str(a.seed), "--moments", a.moments,
              "--tokens-per-micro-batch", str(a.tokens_per_micro_batch), "--micro-batches", str(a.micro_batches),
              "--max-length", str(a.max_length), "--max-seconds", str(a.max_seconds),
              "--cache-shards", str(a.cache_shards), "--prefetch-shards", str(a.prefetch_shards),
              "--specforge-backend", a.specforge_backend]
    if a.anchor:  # SpecForge's synthetic fixed-shape step: the earlier figures' reference, on this machine
        res["jobs"].append(run_job("specforge-anchor-synthetic", [sys.executable, a.anchor, "--loss-fraction",
                                                                   str(a.loss_fraction), "--steps", "8"], a, out))
        emit()
    for storage in ([None] if a.shards else a.storage_dtypes):
        try:
            where, fp, facts = real_dump(a, storage)
        except Exception as e:  # noqa: BLE001 - a data problem is an entry, the next dtype still runs
            res["data"].append({"storage": storage, "error": f"{type(e).__name__}: {e}"[:2000]})
            emit()
            continue
        res["data"].append({"dump": fp, **facts})
        emit()
        rows = []
        for name in a.jobs:
            tag = f"{name}-{storage}" if storage else name
            rows.append(run_job(tag, me + common + job_flags(name) + ["--shards", where, "--dump", fp], a, out))
            res["jobs"].append(rows[-1])
            emit()
        res["summary"].append(summarize_real(rows, facts))
        emit()
    print_real(res)
    return res


def run_job(name: str, cmd: list[str], a, out: Path) -> dict:
    """One job in its own process: its last JSON line, or an entry saying why there is none."""
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.job_timeout)
        stdout, stderr, timed_out = p.stdout, p.stderr, False
    except subprocess.TimeoutExpired as err:  # reported in the JSON, and the next job runs
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        stdout, stderr, timed_out = text(err.stdout), text(err.stderr), True
    (out / f"{name}.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("{")), None)
    if timed_out:
        res = {"error": f"timed out after {a.job_timeout} s", "timed_out": True, "stderr_tail": stderr[-1500:]}
    else:
        res = json.loads(line) if line else {"error": stderr[-2000:] or f"exit {p.returncode}, no JSON line"}
    res["job"], res["wall_s"] = name, round(time.time() - t0, 1)
    print(json.dumps({k: v for k, v in res.items() if k != "batch_digests"}), flush=True)
    return res


def summarize_real(rows: list[dict], facts: dict) -> dict:
    """Per data set: each of our jobs against SpecForge's (tokens/s ratio) and the batch check."""
    sf = next((r for r in rows if r.get("impl") == "specforge" and "tokens_per_s" in r), None)
    out = {"storage_dtype": facts.get("storage_dtype"), "specforge_tokens_per_s": sf and sf["tokens_per_s"]}
    for r in rows:
        if r.get("impl") == "ours" and "tokens_per_s" in r:
            row = {k: r.get(k) for k in ("tokens_per_s", "steady_tokens_per_s", "data_wait_share",
                                         "graph_captures_per_100_steps", "distinct_shape_keys", "peak_mem_GiB")}
            if sf:
                row["vs_specforge"] = round(r["tokens_per_s"] / sf["tokens_per_s"], 3)
                row["batches"] = rb.same_batches(r["batch_digests"], sf["batch_digests"])
            out[r["job"]] = row
    if sf is None:
        out["note"] = next((r.get("skipped") or r.get("error") for r in rows if r.get("job", "").startswith("specforge")),
                           "no specforge job")
    return out


def print_real(res: dict) -> None:
    print("\njob                          tokens/s  steady tok/s  data wait  captures/100  keys  peak GiB")
    for r in res["jobs"]:
        if "tokens_per_s" in r:
            print(f"{r['job']:<28} {r['tokens_per_s']:>9.0f} {r.get('steady_tokens_per_s') or 0:>13.0f} "
                  f"{100 * r.get('data_wait_share', 0):>9.1f}% {r.get('graph_captures_per_100_steps') or 0:>13.1f} "
                  f"{r.get('distinct_shape_keys') or '-':>5} {r.get('peak_mem_GiB') or '-':>9}")
        else:
            print(f"{r['job']:<28} {r.get('skipped') or r.get('error', '')[:80]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 8; real data: 200)")
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
    p.add_argument("--graph-buckets", type=int, default=0,
                   help="0: keys that follow each batch; N: at most N row sizes per multiple of the micro-batch "
                        "(plan_static's buckets: fewer graph captures, more padded rows; the trainer's "
                        "train.cuda_graph_buckets defaults to 4, job ours-graphs-b4)")
    p.add_argument("--graphs-only", action="store_true", help="--all measures only the CUDA-graph steps")
    p.add_argument("--eager", action="store_true", help="--all also measures the eager step")
    p.add_argument("--exactness", action="store_true")
    p.add_argument("--trainer-check", action="store_true",
                   help="CUDA: only the trainer runs of --exactness (graphs or not, buckets, queued steps or synced)")
    p.add_argument("--all", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--anchor", default=None, help="path of specforge_train_step.py (run in its own process)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--job-timeout", type=float, default=420,
                   help="a job's whole life: start, warm-up steps (compilation), timed window")
    r = p.add_argument_group("real data (the training reader feeds the step)")
    r.add_argument("--sharegpt-lengths", metavar="FILE", help="ShareGPT JSONL(.gz): its conversations' lengths and "
                   "answer spans, random ids and states, written as a dump under --store-dir")
    r.add_argument("--shards", metavar="STORE", help="read an existing dump: DIR, file://DIR or s3://BUCKET/PREFIX")
    r.add_argument("--dump", metavar="FP", help="the dump's fingerprint (default: the store's only dump)")
    r.add_argument("--store-dir", default="/tmp/bench-train-store", help="file:// store of --sharegpt-lengths' dumps")
    r.add_argument("--dump-tokens", type=int, default=None, help="at most this many tokens in the synthetic dump "
                   "(default: enough for every step once); fewer are read again, epoch after epoch")
    r.add_argument("--storage-dtypes", nargs="+", default=["bfloat16", "float8_e4m3"], choices=list(STORAGE))
    r.add_argument("--chars-per-token", type=float, default=4.0, help="UTF-8 bytes per token of the length estimate")
    r.add_argument("--jobs", nargs="+", default=["specforge", "ours-compile", "ours-graphs", "ours-graphs-b4"],
                   help="with --all: specforge, ours, ours-compile, ours-graphs, ours-graphs-bN")
    r.add_argument("--impl", default="ours", choices=["ours", "specforge"], help="one job (without --all)")
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--tokens-per-micro-batch", type=int, default=TRAIN_DEFAULTS["tokens_per_micro_batch"])
    r.add_argument("--micro-batches", type=int, default=TRAIN_DEFAULTS["micro_batches_per_step"])
    r.add_argument("--max-length", type=int, default=TRAIN_DEFAULTS["max_length"])
    r.add_argument("--cache-shards", type=int, default=TRAIN_DEFAULTS["cache_shards"])
    r.add_argument("--prefetch-shards", type=int, default=TRAIN_DEFAULTS["prefetch_shards"])
    r.add_argument("--warmup", type=int, default=3, help="real data: steps before the timed window")
    r.add_argument("--max-seconds", type=float, default=150, help="real data: a job's timed window stops after this many seconds (warm-up "
                   "steps, compilation included, come before it and count against --job-timeout)")
    r.add_argument("--specforge-backend", default="flex_attention")
    a = p.parse_args(argv)
    a.real = bool(a.sharegpt_lengths or a.shards)
    a.steps = a.steps if a.steps is not None else (200 if a.real else 8)
    return a


def main() -> None:
    a = parse_args()
    try:
        run(a)
    except DrafterError as e:  # a missing store or dump: one line, not a traceback
        raise SystemExit(f"bench_train: {e}") from None


def run(a) -> None:
    if a.real and a.all:
        run_all_real(a)
    elif a.real:
        if a.sharegpt_lengths:  # one job: write (or reuse) the first dtype's dump, then read it
            a.shards, a.dump, _ = real_dump(a, a.storage_dtypes[0])
        print(json.dumps(run_real(a)))
    elif a.all:
        run_all(a)
    elif a.profile:
        profile(a)
    elif a.trainer_check:
        if not torch.cuda.is_available():
            raise SystemExit("bench_train: --trainer-check needs a CUDA device (train.cuda_graphs)")
        print(json.dumps(trainer_graphs_check()))
    elif a.exactness:
        print(json.dumps(exactness(a)))
    else:
        print(json.dumps(run_ours(a)))


if __name__ == "__main__":
    main()
