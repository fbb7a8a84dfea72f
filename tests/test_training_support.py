"""Builders for the training tests: a tiny target directory (config + embedding + lm_head only)
and a tiny committed dump written straight with the shard writer. Also a subprocess entry point
(`python -m tests.test_training_support SPEC.json`) for the kill / torchrun tests."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from drafter.config import parse_config
from drafter.layers import LAYER_ID_CONVENTION
from drafter.capture.shards import write_shard_file
from drafter.stage_output import StageOutput

H, V, LAYERS = 32, 97, 4
AUX = [0, 1, 2]
TARGET_FP = "tiny-target-fp"


def make_target(path: Path, hidden: int = H, vocab: int = V, seed: int = 0) -> Path:
    """A Llama-shaped target directory with the two tensors the trainer reads."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": 2 * hidden, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 512, "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(vocab, hidden, generator=g)
    head[vocab // 2:] *= 0.3  # the teacher's argmax mostly lies among the frequent low ids
    save_file({"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
               "lm_head.weight": head}, str(path / "model.safetensors"))
    return path


def make_samples(n: int, seed: int, hidden: int = H, vocab: int = V) -> list[dict]:
    """Chat-like samples: a prompt then an answer span; ids skewed towards low ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(12, 48, (1,), generator=g))
        ids = (torch.rand(length, generator=g) ** 2 * (vocab // 2 + 10)).long().clamp(max=vocab - 1)
        mask = torch.zeros(length, dtype=torch.uint8)
        mask[length // 3:] = 1
        out.append({"id": f"s{seed}-{i}", "input_ids": ids, "loss_mask": mask,
                    "aux_hidden_states": torch.randn(length, 3, hidden, generator=g),
                    "hidden_states": torch.randn(length, hidden, generator=g)})
    return out


def make_dump(store, tmp: Path, fp: str = "dump0001", aux=AUX, hidden: int = H, shards: int = 3,
              per_shard: int = 8, eval_shards: int = 1, target_fp: str = TARGET_FP) -> str:
    """A committed dump output: hs-* (train) and eval-hs-* (held-out) shards."""
    out = StageOutput(store, "dump", fp)
    names = [(f"hs-{i:05d}.safetensors", 100 + i) for i in range(shards)]
    names += [(f"eval-hs-{i:05d}.safetensors", 900 + i) for i in range(eval_shards)]
    for name, seed in names:
        samples = make_samples(per_shard, seed, hidden)
        path = write_shard_file(tmp / name, samples, {"aux_layer_ids": list(aux),
                                                     "layer_id_convention": LAYER_ID_CONVENTION})
        out.write_shard(name, path, meta={"samples": len(samples),
                                          "tokens": sum(int(s["input_ids"].numel()) for s in samples)})
    out.commit({"aux_layer_ids": list(aux), "layer_id_convention": LAYER_ID_CONVENTION, "hidden_size": hidden,
                "target_fingerprint": target_fp, "dtype": "float32"})
    return fp


def make_cfg(target: Path, root: str, **train):
    section = dict(draft_vocab_size=40, ttt_length=3, tokens_per_micro_batch=96, micro_batches_per_step=2,
                   learning_rate=3e-3, lr_scaling="none", max_length=64, save_every_steps=4, log_every_steps=2,
                   eval_every_steps=4, warmup_ratio=0.1, seed=0, device="cpu", threads=1)
    section.update(train)
    return parse_config({"target": {"path": str(target)}, "dump": {"aux_layer_ids": AUX},
                         "train": section, "storage": {"root": root}})


def main(spec_file: str) -> None:
    """Train as the spec says; write the final weights (fp32 masters) and metrics to spec['out']."""
    from drafter.store import FileStore
    from drafter.training.trainer import train_drafter

    spec = json.loads(Path(spec_file).read_text())
    cfg = make_cfg(Path(spec["target"]), "file:///unused", **spec["train"])
    store = FileStore(spec["store"])
    delay = float(spec.get("delay_per_log_s", 0))
    def progress(done, total, info):  # after the SIGTERM handler is in place: tests wait for this line
        print(f"progress {done}/{total}", flush=True)
        __import__("time").sleep(delay)

    res = train_drafter(cfg, store, spec["dump"], run_fingerprint=spec["run"], out_dir=spec["out"],
                        target_fingerprint=TARGET_FP, progress=progress)
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        Path(spec["out"], "result.json").write_text(json.dumps(res.meta, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
