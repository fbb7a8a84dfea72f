"""SpecForge 0.2.0's own EAGLE-3 trainer on one of our dumps: the second trainer of
bench_drafter_quality.py (`--specforge`).

What is the same as our trainer: the dump (read by our reader, in its seeded order), the draft
vocabulary (our d2t / t2d, counted the same way over the same dump), the teacher (the dumped final
hidden states through the target's lm_head: SpecForge's offline "compact teacher"), the epochs, the
TTT depth and the loss weights 0.8**k. What is SpecForge's: its draft model
(`LlamaForCausalLMEagle3`), its TTT unroll and loss (`OnlineEagle3Model`), its optimizer
(`BF16Optimizer`: AdamW over fp32 masters of bf16 weights, warm-up then cosine, clipping) and its
training script's defaults: one sample per optimizer step (batch 1), lr 1e-4, warm-up ratio
0.015, max grad norm 0.5, its own weight initialisation.

The trained weights are loaded into our `Eagle3Drafter` (both use SGLang's key layout), so our
export code and our judge see them exactly as they see ours.

Install (no registry on the GPU host): `pip download --no-deps specforge==0.2.0 -d .whl` where pip
works, then `pip install --no-deps --target /tmp/sf .whl/specforge-*.whl` and PYTHONPATH=/tmp/sf.
On a CPU (a check of this script only) SpecForge's Triton loss kernel cannot run: its own reference
implementation of the same loss (`specforge.core.loss._compute_loss`) is used instead.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from drafter.model import Eagle3Drafter, draft_config_for_target, read_target_config, save_drafter, set_draft_vocab
from drafter.training.data import Cursor, DumpExpectation, DumpReader, count_vocab, dump_splits, pack
from drafter.training.teacher import load_target_head
from drafter.training.vocab import select_draft_vocab

SPECFORGE_DEFAULTS = {"learning_rate": 1e-4, "batch_size": 1, "warmup_ratio": 0.015, "max_grad_norm": 0.5,
                      "ploss_decay": 0.8}


def _llama_config(ours):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=ours.hidden_size, intermediate_size=ours.intermediate_size,
                      num_attention_heads=ours.num_attention_heads, num_key_value_heads=ours.num_key_value_heads,
                      head_dim=ours.head_dim, vocab_size=ours.vocab_size, num_hidden_layers=1,
                      max_position_embeddings=ours.max_position_embeddings, rms_norm_eps=ours.rms_norm_eps,
                      rope_theta=ours.rope_theta, rope_scaling=ours.rope_scaling, tie_word_embeddings=False)
    cfg.draft_vocab_size = ours.draft_vocab_size
    cfg.target_hidden_size = ours.target_hidden_size
    return cfg


def _use_reference_loss_on_cpu() -> None:
    """SpecForge's fused Triton loss needs a GPU; its reference implementation computes the same."""
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.core import loss as sf_loss

    class _Reference:
        @staticmethod
        def apply(logits, target_p, position_mask):
            return sf_loss._compute_loss.__wrapped__(logits, target_p, position_mask) \
                if hasattr(sf_loss._compute_loss, "__wrapped__") else sf_loss._compute_loss(logits, target_p, position_mask)

    eagle3_model.LogSoftmaxLoss = _Reference


def train_specforge(cfg, store, dump_fp: str, out_dir: Path, *, device: str, epochs: int,
                    attention_backend: str | None = None, log_every: int = 200) -> dict:
    """Train with SpecForge on `dump_fp`'s train shards; save the drafter (our layout) under
    out_dir/drafter. Returns {"drafter_dir", "steps", "seconds", "tokens", "tokens_per_s", ...}."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from specforge.utils import padding

    tc = cfg.train
    dev = torch.device(device)
    if dev.type != "cuda":
        _use_reference_loss_on_cpu()
    backend = attention_backend or ("flex_attention" if dev.type == "cuda" else "sdpa")
    target = read_target_config(cfg.target.path)
    aux_ids = cfg.aux_layer_ids()
    ours = draft_config_for_target(target, aux_ids, tc.draft_vocab_size)
    train_split, _held_out = dump_splits(store, dump_fp)
    reader = DumpReader(store, train_split, DumpExpectation(aux_layer_ids=aux_ids, hidden_size=target["hidden_size"]),
                        seed=tc.seed, max_length=tc.max_length)
    try:
        # Our vocabulary, counted exactly as our trainer counts it.
        vocab_ids = select_draft_vocab(count_vocab(reader, ours.vocab_size), ours.draft_vocab_size)
        vocab_holder = Eagle3Drafter(ours)
        set_draft_vocab(vocab_holder, vocab_ids)

        torch.manual_seed(tc.seed)
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        draft = LlamaForCausalLMEagle3(_llama_config(ours), attention_backend=backend).to(dev, dtype)
        embed, lm_head = load_target_head(cfg.target.path)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(embed.to(dev, dtype))
            draft.d2t.copy_(vocab_holder.d2t.to(dev))
            draft.t2d.copy_(vocab_holder.t2d.to(dev))
        draft.freeze_embedding()
        head_weight = lm_head.to(dev, dtype)
        model = OnlineEagle3Model(draft, length=tc.ttt_length, attention_backend=backend)

        per_epoch = sum(int(s.meta.get("samples", 0)) for s in reader.shard_info)  # batch 1: a step per sample
        total_steps = max(1, epochs * per_epoch)
        opt = BF16Optimizer(draft, lr=SPECFORGE_DEFAULTS["learning_rate"],
                            max_grad_norm=SPECFORGE_DEFAULTS["max_grad_norm"], total_steps=total_steps,
                            warmup_ratio=SPECFORGE_DEFAULTS["warmup_ratio"])
        weights = [SPECFORGE_DEFAULTS["ploss_decay"] ** k for k in range(tc.ttt_length)]
        steps = tokens = 0
        # Summed on the GPU: a float() per position per step would wait for the GPU every step.
        acc_sum = torch.zeros(tc.ttt_length, device=dev)
        t0 = time.perf_counter()
        for _cur, sample in reader.samples(Cursor(), epochs):
            n = min(int(sample["input_ids"].shape[0]), tc.max_length)
            if n < 2:
                continue
            mb = pack([{k: v[:n] if isinstance(v, torch.Tensor) else v for k, v in sample.items()}])
            ids = mb.input_ids[None].to(dev)
            # SpecForge's TargetHead.preprocess: ids and teacher states shifted left by one, mask as is.
            input_ids = padding(ids, left=False)
            target_hidden = padding(mb.final[None].to(dev, dtype), left=False)
            loss_mask = mb.loss_mask[None, :, None].to(dev).long()
            hidden = mb.aux.reshape(1, n, -1).to(dev, dtype)
            plosses, _rates, acces, *_ = model(
                input_ids=input_ids, attention_mask=torch.ones_like(ids), target=None, loss_mask=loss_mask,
                hidden_states=hidden, target_hidden_for_compact=target_hidden, target_head_weight=head_weight)
            loss = sum(w * p for w, p in zip(weights, plosses))
            loss.backward()
            opt.step()
            steps += 1
            tokens += n
            acc_sum += torch.stack([torch.as_tensor(a, device=dev, dtype=torch.float32).detach() for a in acces])
            if log_every and steps % log_every == 0:
                print(f"specforge step {steps}/{total_steps} at {time.perf_counter() - t0:.1f} s: "
                      f"loss {float(loss.detach()):.3f}, acc {[round(float(a) / log_every, 3) for a in acc_sum]}", flush=True)
                acc_sum.zero_()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    finally:
        reader.close()

    # SpecForge's weights (fp32 masters: what its checkpoint saves) into our layout.
    sd = {k: v.detach().float().cpu() for k, v in draft.state_dict().items()}
    for p, master in zip(opt.model_params, opt.fp32_params):
        name = next(n for n, q in draft.named_parameters() if q is p)
        sd[name] = master.detach().float().cpu()
    result = Eagle3Drafter(ours)
    missing, unexpected = result.load_state_dict(
        {k: v for k, v in sd.items() if k in result.state_dict()}, strict=False)
    if missing:
        raise RuntimeError(f"SpecForge's drafter lacks our keys {missing}")
    drafter_dir = save_drafter(result, Path(out_dir) / "drafter")
    return {"drafter_dir": str(drafter_dir), "steps": steps, "tokens": tokens, "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1), "attention_backend": backend,
            "defaults": SPECFORGE_DEFAULTS, "epochs": epochs,
            "unused_keys": sorted(k for k in sd if k not in result.state_dict())}
