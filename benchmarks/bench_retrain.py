"""The work of a retrain's datagen and dump after the corpus grew by 10%, against a from-scratch run.

    .venv/bin/python -m benchmarks.bench_retrain --out runs/bench-retrain            # the demo corpus (300 + 30)
    .venv/bin/python -m benchmarks.bench_retrain --conversations 24 --max-tokens 8 --out /tmp/b  # a quick look
    python3 -m benchmarks.bench_retrain --device cuda --out $OUT                      # GPU host

A growing source folder gets `--conversations` ShareGPT conversations (batch-0000.jsonl, as `make
demo-retrain` writes them); prepare, datagen and dump run into store A. Then `--new-fraction` more
conversations arrive (batch-0001.jsonl) and the three stages run again into store A: the retrain,
which reuses earlier work (drafter.contracts.reuse). Finally a fresh store B runs the same grown corpus from
scratch. Work = conversations sent to the target (datagen) and samples whose hidden states were
computed (dump), read from the manifests; seconds are each stage's wall time (datagen includes
starting its own target server). Everything goes to `--out`/bench_retrain.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from drafter.config import load_config
from drafter.retrain.demo_source import append_batch
from drafter.stages import TABLE
from drafter.store import open_store

ROOT = Path(__file__).resolve().parents[1]


def run_stages(cfg) -> dict:
    store = open_store(cfg.storage)
    fps = TABLE.fingerprints(cfg)
    figures = {}
    for name in ("prepare", "datagen", "dump"):
        started = time.monotonic()
        result = TABLE.run(name, cfg, store, fingerprints=fps)
        figures[name] = {"seconds": round(time.monotonic() - started, 2), "fingerprint": result.fingerprint}
        if name == "datagen":
            r = result.meta["reuse"]
            total = result.meta["conversations"] + result.meta["eval"]["conversations"]
            figures[name].update(conversations=total, asked=r["asked_conversations"],
                                 linked_shards=r["linked_shards"], copied=r["copied_conversations"],
                                 requests=(result.meta.get("throughput") or {}).get("requests", 0))
        if name == "dump":
            r = result.meta["reuse"]
            figures[name].update(records=r["linked_records"] + r["computed_records"],
                                 computed=r["computed_records"], linked_shards=r["linked_shards"],
                                 computed_shards=r["computed_shards"],
                                 samples=result.meta["num_samples"] + result.meta["eval"]["num_samples"])
    return figures


def configure(profile: str, source: Path, store: Path, args) -> object:
    overrides = {"data.sources": [{"kind": "jsonl", "path": str(source)}], "storage.root": f"file://{store}",
                 "serve.port": args.port, "serve.log_dir": str(store.parent / "logs")}
    if args.target_path:
        overrides["target.path"] = args.target_path
    if args.max_tokens:
        overrides["datagen.max_tokens"] = args.max_tokens
    if args.device:
        overrides.update({"serve.device": args.device, "dump.devices": [args.device]})
    return load_config(profile, overrides)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=str(ROOT / "profiles" / "retrain-demo.yaml"))
    p.add_argument("--target-path", default=None, help="default: the profile's target (the demo builds it once)")
    p.add_argument("--conversations", type=int, default=300)
    p.add_argument("--new-fraction", type=float, default=0.1)
    p.add_argument("--max-tokens", type=int, default=None, help="datagen.max_tokens override")
    p.add_argument("--device", default=None, help="serve.device and dump.devices, e.g. cuda or cpu")
    p.add_argument("--port", type=int, default=30177)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-retrain-") as tmp:
        tmp = Path(tmp)
        source = tmp / "source"
        append_batch(source, args.conversations, 0)
        cfg = configure(args.profile, source, tmp / "a" / "store", args)
        if cfg.target.demo is not None:
            from drafter.demo_target import ensure_demo_target

            ensure_demo_target(cfg.target.demo, cfg.target.path)
        first = run_stages(cfg)
        new = max(1, round(args.conversations * args.new_fraction))
        append_batch(source, args.conversations, new)
        retrain = run_stages(cfg)
        scratch = run_stages(configure(args.profile, source, tmp / "b" / "store", args))
    ratio = lambda stage, key: round(retrain[stage][key] / scratch[stage][key], 4) if scratch[stage][key] else None
    report = {
        "command": "python -m benchmarks.bench_retrain " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": __import__("os").cpu_count()},
        "conversations": {"first": args.conversations, "new": new},
        "first_run": first, "retrain": retrain, "from_scratch": scratch,
        "retrain_vs_scratch": {"datagen_work": ratio("datagen", "asked"), "datagen_seconds": ratio("datagen", "seconds"),
                               "dump_work": ratio("dump", "computed"), "dump_seconds": ratio("dump", "seconds")},
    }
    (out / "bench_retrain.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["retrain_vs_scratch"], indent=2))
    print(f"datagen: retrain asked {retrain['datagen']['asked']} of {retrain['datagen']['conversations']} "
          f"conversations (from scratch {scratch['datagen']['asked']}); dump: retrain computed "
          f"{retrain['dump']['computed']} of {retrain['dump']['records']} samples (from scratch "
          f"{scratch['dump']['computed']})")


if __name__ == "__main__":
    main()
