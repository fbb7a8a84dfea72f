"""Orchestration overhead of a fanned-out datagen: a local Prefect server, 3 process workers,
datagen of 18 single-turn prompts in 9 shards of 2, `datagen.workers: 3`, each child's own server
answering one request at a time with a fixed latency (tests/fixtures/chat_server.py), so the ideal
wall time is known: 3 shards x 2 requests x DELAY per child, in parallel.

    .venv/bin/python benchmarks/fanout_overhead.py [DELAY_S]    # default 1.0
    .venv/bin/python benchmarks/fanout_overhead.py 1.0 --with-dump --keep-server   # the graph in docs/operations.md

`--with-dump` fans the dump out as well (3 children), `--keep-server` leaves the server (with its UI)
running and prints the run's page and the command that stops it.

Prints the parent's fan-out wall time against the ideal, and per child: the wait from its creation
to its start (scheduling: worker poll, process start) and its run time beyond the ideal (flow-run
process imports, server start and gate, store writes).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from drafter.demo_target import build_demo_target  # noqa: E402
from drafter.contracts.sharegpt import load_sharegpt  # noqa: E402
from tests.fixtures.local_prefect import local_prefect  # noqa: E402
from tests.fixtures.net import free_port_block  # noqa: E402
from tests.fixtures.targets import TINY_CONVERSATIONS, tiny_target_config  # noqa: E402

PREFECT = str(ROOT / ".venv" / "bin" / "prefect")


def when(s: str) -> dt.datetime:
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00"))


def main(delay_s: float, with_dump: bool = False, keep_server: bool = False) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="fanout-bench-"))
    # datagen checks the target's files and renders the prompts with its chat template: the tests' tiny target
    build_demo_target(tiny_target_config(), tmp / "target", conversations=load_sharegpt(TINY_CONVERSATIONS))
    corpus = tmp / "prompts.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i:02d}", "messages": [
        {"role": "user", "content": f"Tell me about item {i}."}]}) + "\n" for i in range(18)))
    profile = tmp / "profile.yaml"
    profile.write_text(yaml.safe_dump({
        "target": {"path": str(tmp / "target"), "name": "bench"},
        "data": {"sources": [{"kind": "jsonl", "path": str(corpus)}], "eval_fraction": 0.0},
        "datagen": {"max_tokens": 8, "shard_size": 2, "concurrency_per_server": 1, "workers": 3},
        "dump": {"aux_layer_ids": [0, 1, 2], "max_length": 64, "samples_per_shard": 3, "devices": ["cpu"],
                 "workers": 3},
        "serve": {"engine": "command", "port": free_port_block(3), "log_dir": str(tmp / "logs"),
                  "command": [sys.executable, str(ROOT / "tests/fixtures/chat_server.py"), "--port", "{port}",
                              "--served-model-name", "{served_model_name}", "--delay-s", str(delay_s)]},
        "storage": {"root": f"file://{tmp}/store"}}))
    with local_prefect(tmp / "prefect", ui=keep_server, keep=keep_server, DRAFTER_WORKERS="3",
                       DRAFTER_WORKER_LIMIT="2") as env:
        api = env["PREFECT_API_URL"]
        stages = ["prepare", "datagen"] + (["dump"] if with_dump else [])
        out = subprocess.run([PREFECT, "deployment", "run", "drafter-lifecycle/stage", "--param", f"profile={profile}",
                              "--param", f"stages={json.dumps(stages)}", "--watch"],
                             env={**env, "PREFECT_CLI_WRAP_LINES": "false"}, capture_output=True, text=True,
                             timeout=600)
        if out.returncode:
            sys.exit(f"the fanned-out run did not complete:\n{out.stdout[-3000:]}{out.stderr[-2000:]}")
        parent = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout).group(1)
        kids = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"tags": {
            "all_": [f"drafter-fanout-of:{parent}", "drafter-stage:datagen"]}}}).json()
        [manifest] = (tmp / "store" / "datagen").glob("*/_SUCCESS.json")
        fan = json.loads(manifest.read_text())["meta"]["fan_out"]
        ideal = 3 * 2 * delay_s
        print(f"delay {delay_s} s/request, 3 children x 3 shards x 2 requests: ideal {ideal:.1f} s")
        print(f"parent fan-out wall {fan['wall_s']:.1f} s = ideal + {fan['wall_s'] - ideal:.1f} s")
        for k in sorted(kids, key=lambda k: k["name"]):
            wait = (when(k["start_time"]) - when(k["created"])).total_seconds()
            run = k["total_run_time"]
            print(f"  {k['name']}: {k['state_type']}, waited {wait:.1f} s to start, ran {run:.1f} s "
                  f"(ideal + {run - ideal:.1f} s)")
        if keep_server:
            print(f"the run: {api.removesuffix('/api')}/runs/flow-run/{parent}")
            print(f"stop the server: PREFECT_HOME={env['PREFECT_HOME']} infra/prefect-down.sh")


if __name__ == "__main__":
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("delay_s", nargs="?", type=float, default=1.0, help="seconds per request (default 1.0)")
    args.add_argument("--with-dump", action="store_true", help="fan the dump out as well")
    args.add_argument("--keep-server", action="store_true", help="leave the server and its UI running")
    a = args.parse_args()
    main(a.delay_s, a.with_dump, a.keep_server)
