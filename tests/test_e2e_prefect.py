"""End to end through a real Prefect server and process worker, as `make demo` does it.

infra/prefect-up.sh starts the server (SQLite in a temp PREFECT_HOME) and our worker, deploys
deployments/prefect.yaml, and `prefect deployment run drafter-lifecycle/full --watch` runs the flow.
A second run must find every stage complete and skip its work.
"""
import json
import re
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.fixtures.net import free_port

ROOT = Path(__file__).resolve().parents[1]
# In the worker's environment only; the profile names it (serve.secrets), never holds it.
PLANTED = "e2e-planted-Secret-7c41d9"
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def prefect_env(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_API_PORT=str(free_port()),
               PREFECT_UI_ENABLED="false", DRAFTER_E2E_SECRET=PLANTED)
    up = subprocess.run([str(ROOT / "infra" / "prefect-up.sh")], env=env, capture_output=True,
                        text=True, timeout=240)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        env["PREFECT_API_URL"] = f"http://127.0.0.1:{env['PREFECT_SERVER_API_PORT']}/api"
        yield env
    finally:
        down = subprocess.run([str(ROOT / "infra" / "prefect-down.sh")], env=env, capture_output=True,
                              text=True, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        for name in ("server", "worker"):
            assert not (home / "run" / f"{name}.pid").exists()


def run_deployment(env, profile: Path) -> str:
    prefect = str(ROOT / ".venv" / "bin" / "prefect") if (ROOT / ".venv").exists() else "prefect"
    proc = subprocess.run([prefect, "deployment", "run", "drafter-lifecycle/full",
                           "--param", f"profile={profile}", "--watch", "--watch-timeout", "240"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def run_logs(env, home: Path) -> str:
    """All log lines the worker's flow runs wrote."""
    return (Path(env["PREFECT_HOME"]) / "run" / "worker.log").read_text()


def test_full_deployment_runs_and_second_run_skips(prefect_env, tiny_target, tmp_path):
    corpus = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Question number {i}?"}]}
            for i in range(40)]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    store = tmp_path / "store"
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump({
        "name": "e2e",
        "target": {"path": str(tiny_target)},
        "data": {"sources": [{"kind": "jsonl", "path": str(corpus)}], "eval_fraction": 0.1},
        "datagen": {"max_tokens": 12, "shard_size": 16},
        "train": {"draft_vocab_size": 64, "max_steps": 6, "ttt_length": 3},
        "dump": {"aux_layer_ids": [0, 1, 2], "max_length": 64, "samples_per_shard": 8, "devices": ["cpu"]},
        # The tiny target is random: the judge records its figures, the thresholds let it pass.
        "export": {"eval_prompts": 4, "judge_max_new_tokens": 12, "judge_num_steps": 2, "min_accept_ratio": 0.01, "min_accept_length": 1.0,
                   "device": "cpu"},
        "serve": {"engine": "reference", "device": "cpu", "port": free_port(), "log_dir": str(tmp_path / "logs"),
                  "extra_args": ["--cpu-threads", "1"], "speculative": {"num_steps": 2, "eagle_topk": 1,
                                                                       "num_draft_tokens": 3},
                  "startup_timeout_s": 180, "stall_timeout_s": 90,
                  "secrets": {"HF_TOKEN": "env:DRAFTER_E2E_SECRET"}},
        "bench": {"speculative": [{"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3}], "num_prompts": 3,
                  "max_tokens": 8, "repeats": 2, "warmup_requests": 1},
        "storage": {"root": f"file://{store}"},
    }))

    first = run_deployment(prefect_env, profile)
    assert "Completed" in first
    generated = list(store.glob("datagen/*/_SUCCESS.json"))
    assert len(generated) == 1
    gen_meta = json.loads(generated[0].read_text())["meta"]
    manifests = list(store.glob("prepare/*/_SUCCESS.json"))
    assert len(manifests) == 1
    meta = json.loads(manifests[0].read_text())["meta"]
    assert meta["train"] + meta["eval"] == 40
    assert gen_meta["conversations"] == meta["train"] and gen_meta["generated"] >= 1
    before = manifests[0].stat().st_mtime_ns
    gen_before = generated[0].stat().st_mtime_ns
    dumped = list(store.glob("dump/*/_SUCCESS.json"))
    assert len(dumped) == 1
    dump_meta = json.loads(dumped[0].read_text())["meta"]
    assert dump_meta["aux_layer_ids"] == [0, 1, 2] and dump_meta["upstream"] == {"stage": "datagen", "fingerprint": generated[0].parent.name}
    assert dump_meta["num_samples"] + dump_meta["quarantined"]["total"] == gen_meta["generated"]

    trained = list(store.glob("train/*/_SUCCESS.json"))
    assert len(trained) == 1
    train_meta = json.loads(trained[0].read_text())["meta"]
    assert train_meta["dump_fingerprint"] == dumped[0].parent.name and train_meta["steps"] >= 1
    assert train_meta["final_eval"] is not None  # the held-out split was dumped and evaluated

    run_deployment(prefect_env, profile)
    assert manifests[0].stat().st_mtime_ns == before  # nothing rewritten
    assert generated[0].stat().st_mtime_ns == gen_before
    logs = run_logs(prefect_env, store)
    assert logs.count("prepare: wrote") == 1
    assert "prepare: skipped, output already complete" in logs
    assert logs.count("datagen: wrote") == 1
    assert "datagen: skipped, output already complete" in logs
    assert logs.count("dump: wrote") == 1
    assert "dump: skipped, output already complete" in logs
    assert logs.count("train: wrote") == 1
    assert "train: skipped, output already complete" in logs
    for stage in ("export", "bench"):
        assert logs.count(f"{stage}: wrote") == 1 and f"{stage}: skipped, output already complete" in logs
    exported = list(store.glob("export/*/_SUCCESS.json"))
    judge = json.loads(exported[0].read_text())["meta"]["judge"]
    assert judge["accept_length"] >= 1.0 and len(judge["per_position"]) == 2
    report = json.loads(next(store.glob("bench/*/report.json")).read_text())
    assert [row["config"] for row in report["table"]] == ["baseline (no speculation)", "EAGLE3 2/1/3"]
    assert report["table"][1]["verdict"] in ("faster", "slower", "no measurable difference")
    # the serve stage started the reference engine, gated it on a generation, and tore it down
    assert logs.count("serve: reference ready in") == 2  # the serve task, once per run
    assert re.search(r"\[server\] .*The server is fired up and ready to roll!", logs)
    # launches: datagen's server (first run only) + the serve stage twice (with this run's export) +
    # the bench's baseline and 2/1/3 servers (first run only; the second run finds the report committed)
    assert len(list((tmp_path / "logs").glob("reference-*.launch.json"))) == 5
    assert "Speculative decoding: EAGLE3 num_steps=2 topk=1 num_draft_tokens=3" in logs  # served the export
    # the secret reached every launch (masked in each launch file) and no file at rest: not the
    # store, the server logs, the Prefect database or the worker's logs
    launches = [json.loads(p.read_text()) for p in (tmp_path / "logs").glob("*.launch.json")]
    assert all(l["env_from_config"]["HF_TOKEN"] == "<masked>" for l in launches)
    for root in (tmp_path, Path(prefect_env["PREFECT_HOME"])):
        for path in (p for p in root.rglob("*") if p.is_file()):
            assert PLANTED.encode() not in path.read_bytes(), f"the secret is stored in {path}"
