"""Do SpecForge 0.2.0's two attention backends compute the same training step? And how fast is each?

Why: at batch 1 with a new sequence length every step, SpecForge's default `flex_attention` runs
uncompiled up to 128 tokens and recompiles (dynamic shapes, up to its recompile limit) above, which
made its 4000-conversation epoch too slow for one device call. `sdpa` is its other backend for the
same TTT unroll (a dense mask instead of a block mask). bench_drafter_quality.py may run SpecForge on
`sdpa` only because this check shows both give the same losses and gradients from the same weights.

Prints one JSON object: per length, the largest loss and gradient differences (fp32, both backends,
same init and inputs) and each backend's seconds per step over a run of varying lengths.
Usage (GPU; PYTHONPATH with specforge): python3 benchmarks/specforge_backends.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def _draft(backend: str, device: str, dtype):
    from transformers import LlamaConfig

    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    cfg = LlamaConfig(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=4,
                      head_dim=64, vocab_size=8192, num_hidden_layers=1, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    cfg.draft_vocab_size = 4096
    cfg.target_hidden_size = 768
    torch.manual_seed(1)
    draft = LlamaForCausalLMEagle3(cfg, attention_backend=backend).to(device, dtype)
    with torch.no_grad():
        draft.t2d.copy_(torch.arange(8192, device=device) % 2 == 0)
        draft.d2t.copy_(torch.arange(4096, device=device))  # draft id i is target id 2i
    return draft


def _inputs(n: int, device: str, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 8192, (1, n), generator=g).to(device),
            "hidden": torch.randn(1, n, 3 * 768, generator=g).to(device, dtype),
            "final": torch.randn(1, n, 768, generator=g).to(device, dtype),
            "mask": (torch.rand(1, n, 1, generator=g) > 0.3).long().to(device)}


def _step(model, x, head):
    from specforge.utils import padding

    plosses, _rates, acces, *_ = model(
        input_ids=padding(x["ids"], left=False), attention_mask=torch.ones_like(x["ids"]), target=None,
        loss_mask=x["mask"], hidden_states=x["hidden"], target_hidden_for_compact=padding(x["final"], left=False),
        target_head_weight=head)
    loss = sum(0.8 ** k * p for k, p in enumerate(plosses))
    loss.backward()
    return torch.stack([p.detach().float() for p in plosses])


def compare(n: int, device: str) -> dict:
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    head = (torch.randn(8192, 768, generator=torch.Generator().manual_seed(2)) * 0.05).to(device)
    x = _inputs(n, device, torch.float32, seed=n)
    out = {}
    for backend in ("sdpa", "flex_attention"):
        draft = _draft(backend, device, torch.float32)
        losses = _step(OnlineEagle3Model(draft, length=7, attention_backend=backend), x, head)
        grads = torch.cat([p.grad.flatten() for p in draft.parameters() if p.grad is not None])
        out[backend] = (losses, grads)
    (l1, g1), (l2, g2) = out["sdpa"], out["flex_attention"]
    return {"length": n, "losses_sdpa": [round(float(v), 5) for v in l1],
            "max_loss_diff": float((l1 - l2).abs().max()), "max_grad_diff": float((g1 - g2).abs().max()),
            "max_grad": float(g1.abs().max())}


def speed(backend: str, device: str, lengths: list[int]) -> float:
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    head = (torch.randn(8192, 768, generator=torch.Generator().manual_seed(2)) * 0.05).to(device, torch.bfloat16)
    draft = _draft(backend, device, torch.bfloat16)
    model = OnlineEagle3Model(draft, length=7, attention_backend=backend)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-5)
    t0 = time.perf_counter()
    for i, n in enumerate(lengths):
        _step(model, _inputs(n, device, torch.bfloat16, seed=i), head)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / len(lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--steps", type=int, default=150, help="steps per backend for the speed figure")
    args = ap.parse_args()
    device = "cuda"
    result = {"equal": [compare(n, device) for n in (100, 300, 512)]}
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 513, (args.steps,), generator=g).tolist()
    result["seconds_per_step"] = {b: round(speed(b, device, lengths), 4) for b in ("sdpa", "flex_attention")}
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
