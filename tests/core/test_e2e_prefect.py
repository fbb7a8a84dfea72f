"""End to end through a real Prefect server and process worker, as `make demo` does it.

infra/prefect-up.sh starts the server (SQLite in a temp PREFECT_HOME) and our worker, deploys
deployments/prefect.yaml, and `prefect deployment run drafter-lifecycle/full --watch` runs the flow.
A second run must find every stage complete and skip its work.
"""
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.fixtures.local_prefect import down, local_prefect, stored_workers
from tests.fixtures.net import free_port
from drafter.stages import TABLE

ROOT = Path(__file__).resolve().parents[2]
# In the worker's environment only; the profile names it (serve.secrets), never holds it.
PLANTED = "e2e-planted-Secret-7c41d9"
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def prefect_env(tmp_path_factory):
    # a home that does not exist yet: infra/prefect-up.sh creates it, as on a fresh clone
    with local_prefect(tmp_path_factory.mktemp("prefect-e2e") / "home", DRAFTER_E2E_SECRET=PLANTED) as env:
        yield env


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_prefect_home_the_scripts_create_is_private(prefect_env):
    """The database holds every run's parameters, states and logs; the run dir the server's and
    workers' logs; the workers' TMPDIR what Prefect's process worker writes there (below)."""
    home = Path(prefect_env["PREFECT_HOME"])
    assert mode(home) == 0o700 and mode(home / "run") == 0o700 and mode(home / "run" / "tmp") == 0o700
    assert mode(home / "prefect.db") == 0o600
    for log in ("server.log", "worker.log", "deploy.log"):
        assert mode(home / "run" / log) == 0o600, log
    # the worker's TMPDIR is that private folder, which infra/prefect-down.sh removes
    worker = int((home / "run" / "worker.pid").read_text())
    environ = dict(item.split(b"=", 1) for item in Path(f"/proc/{worker}/environ").read_bytes().split(b"\0") if b"=" in item)
    assert environ[b"TMPDIR"].decode() == str(home / "run" / "tmp")


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

    # the second run through the demo's own script path (infra/prefect-env.sh, as infra/demo.sh runs it)
    demo = subprocess.run(["bash", "-c", f"source {ROOT}/infra/prefect-env.sh && "
                           "run_deployment drafter-lifecycle/full e2e-again.log && ui_hint && answer_line"],
                          env={**prefect_env, "PROFILE": str(profile)}, capture_output=True, text=True, timeout=400)
    assert demo.returncode == 0, demo.stdout + demo.stderr
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
    # the export stage's own lines go to the run log as they are; only the servers' carry [server]
    assert "export: SGLang files checked key by key" in logs and "[server] export:" not in logs
    # a gate's verdict is a markdown artifact of its task run; a skipped stage says so in its state
    assert artifacts(prefect_env, "export-verdict")[0]["data"].startswith("## export: passed\n")
    assert artifacts(prefect_env, "bench-verdict")[0]["data"].startswith("## bench: recommendation\n")
    skipped = [t for t in task_runs(prefect_env) if t["name"].startswith("prepare")
               and (t["state"]["message"] or "").startswith("skipped: output already complete at file://")]
    # the stage's task run and its subflow's run in the parent (the stage as the UI's graph shows it)
    assert len(skipped) == 2 and {t["state"]["type"] for t in skipped} == {"COMPLETED"}
    assert "prepare (skipped)" in {t["name"] for t in skipped}
    # the demo's last line: the answer, with the run that measured it (the first run's bench stage)
    bench_fp = next(store.glob("bench/*/report.json")).parent.name
    (measured,) = flow_runs(prefect_env, {"tags": {"all_": [f"drafter-wrote:bench/{bench_fp}"]}})
    (again,) = flow_runs(prefect_env, {"tags": {"all_": ["skipped"]}, "name": {"any_": ["bench (skipped)"]}})
    assert again["state"]["name"] == "Skipped" and again["state"]["type"] == "COMPLETED"
    out = demo.stdout.rstrip().splitlines()
    measured_url = f"/runs/flow-run/{measured['id']}"
    assert out[-1].startswith("answer: ") and " on engine reference at batch 1: " in out[-1], out[-1]
    assert out[-1].endswith(measured_url) and "(speedup over no speculation, 95% interval); from run http://" in out[-1]
    assert out[-2].startswith("run: http://127.0.0.1:") and measured_url not in out[-2]  # this run's own page
    assert re.search(rf"^stage bench: skipped \(output already complete\) file://\S+ \(written by run http://\S+"
                     rf"{measured_url}\)$", demo.stdout, re.M)
    # the skipped bench stage's page shows the figures it skipped with, speedup and verdict first
    figures = [a for a in artifacts(prefect_env, "bench-summary") if a["flow_run_id"] == again["id"]]
    assert len(figures) == 1 and list(figures[0]["data"])[:4] == ["config", "batch", "speedup [CI]", "verdict"]
    assert figures[0]["data"]["config"] == ["baseline (no speculation)", "EAGLE3 2/1/3"]

    # A refusing export gate, through the demo's own script path (infra/prefect-env.sh run_deployment):
    # the run ends Failed, the reason and where to look are printed, the exit code is not 0.
    strict = yaml.safe_load(profile.read_text())
    strict["export"]["min_accept_length"] = 50.0
    refusing = tmp_path / "refusing.yaml"
    refusing.write_text(yaml.safe_dump(strict))
    demo = subprocess.run(["bash", "-c", f"source {ROOT}/infra/prefect-env.sh && "
                           "run_deployment drafter-lifecycle/full e2e-refused.log"],
                          env={**prefect_env, "PROFILE": str(refusing)}, capture_output=True, text=True, timeout=400)
    out = demo.stdout
    assert demo.returncode == 1, out + demo.stderr
    reason = re.compile(r"stage export refused: error \(JudgedTooLow\): export judged too low: offline accept "
                        r"length \d\.\d{3} < export\.min_accept_length 50\.0.* \(see http://127\.0\.0\.1:\d+/runs/"
                        r"flow-run/[0-9a-f-]{36}\)")
    assert "Flow run finished in state 'Failed'" in out
    watched, final = out.split("== the run failed")
    assert reason.search(watched)  # the parent run's log line, streamed by `--watch` itself
    assert re.search(r"^Failed: " + reason.pattern, final, re.M)  # the run's state message
    assert f"logs: {prefect_env['PREFECT_HOME']}/run/worker.log" in final and "run: http://127.0.0.1:" in final
    assert "stage export: refused" in watched and "stage bench: not run (an earlier stage failed)" in watched
    summary = {r["stage"]: r for r in artifacts(prefect_env, "lifecycle-summary")[-1]["data"]}
    assert [summary[s]["state"] for s in ("train", "export", "serve", "bench")] == [
        "skipped (output already complete)", "refused", "not run (an earlier stage failed)",
        "not run (an earlier stage failed)"]
    refused = artifacts(prefect_env, "export-verdict")[-1]
    assert refused["data"].startswith("## export: refused (JudgedTooLow)\n") and refused["task_run_id"]
    assert "export.min_accept_length 50.0" in refused["data"]

    # the secret reached every launch (masked in each launch file) and no file at rest: not the
    # store, the server logs, the Prefect database or the worker's logs
    launches = [json.loads(p.read_text()) for p in (tmp_path / "logs").glob("*.launch.json")]
    assert all(l["env_from_config"]["HF_TOKEN"] == "<masked>" for l in launches)
    for root in (tmp_path, Path(prefect_env["PREFECT_HOME"])):
        for path in (p for p in root.rglob("*") if p.is_file()):
            assert PLANTED.encode() not in path.read_bytes(), f"the secret is stored in {path}"


# ---- the retrain loop: two nightly retrains on a growing source, a planted worse challenger, rollback


def api(env, method: str, path: str, body: dict | None = None):
    """One API call; retried, as Prefect's own client does, while the server says it is busy (a 503
    when SQLite is locked under load)."""
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    for attempt in range(8):
        req = urllib.request.Request(env["PREFECT_API_URL"] + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            if err.code not in (429, 502, 503) or attempt == 7:
                raise
        time.sleep(2 ** min(attempt, 4))


def prefect_cli(env, *args, timeout=300) -> str:
    prefect = str(ROOT / ".venv" / "bin" / "prefect") if (ROOT / ".venv").exists() else "prefect"
    proc = subprocess.run([prefect, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def drafter_cli(*args) -> str:
    drafter = str(ROOT / ".venv" / "bin" / "drafter") if (ROOT / ".venv").exists() else "drafter"
    proc = subprocess.run([drafter, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def drafter_events(env) -> list[dict]:
    """The drafter.* events the Prefect server stored (it persists them asynchronously)."""
    return api(env, "POST", "/events/filter", {"filter": {"event": {"prefix": ["drafter."]}}, "limit": 50})["events"]


def artifacts(env, key: str) -> list[dict]:
    found = sorted(api(env, "POST", "/artifacts/filter", {"artifacts": {"key": {"any_": [key]}}}),
                   key=lambda a: a["created"])  # oldest first
    for art in found:  # a table artifact's data is its JSON text
        if isinstance(art["data"], str) and art["type"] == "table":
            art["data"] = json.loads(art["data"])
    return found


def flow_runs(env, flow_runs_filter: dict) -> list[dict]:
    return api(env, "POST", "/flow_runs/filter", {"flow_runs": flow_runs_filter, "limit": 200})


def task_runs(env) -> list[dict]:
    return api(env, "POST", "/task_runs/filter", {"limit": 200})


def wait_for_events(env, count: int) -> list[dict]:
    """The server persists events asynchronously: seconds idle, longer under load (a generous budget)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        events = drafter_events(env)
        if len(events) >= count:
            return sorted(events, key=lambda e: e["occurred"])
        time.sleep(0.5)
    raise AssertionError(f"expected {count} drafter events, got {drafter_events(env)}")


def plant_worse_challenger(store_dir: Path, champion_fp: str) -> str:
    """A copy of the champion's export with its drafter's weights scrambled (the embedding and the
    vocab maps kept): it loads and runs, and proposes nonsense."""
    import torch
    from safetensors.torch import load_file, save_file

    from drafter.stage_output import StageOutput
    from drafter.store import FileStore

    store = FileStore(store_dir)
    source = StageOutput.committed(store, "export", champion_fp)
    planted = StageOutput(store, "export", "planted0worse000")
    gen = torch.Generator().manual_seed(0)
    for shard in source.manifest.shards:
        data = source.read_shard(shard.name)
        if shard.name == "sglang/model.safetensors":
            tmp = store_dir / "planted.safetensors"
            tmp.write_bytes(data)
            tensors = load_file(tmp)
            for k, v in tensors.items():
                if v.is_floating_point() and "embed_tokens" not in k:
                    tensors[k] = torch.randn(v.shape, generator=gen).to(v.dtype)
            save_file(tensors, tmp)
            data = tmp.read_bytes()
        planted.write_shard(shard.name, data)
    planted.commit(source.manifest.meta)
    return planted.fingerprint


def test_retrain_nightly_promotes_reuses_rejects_and_rolls_back(prefect_env, tiny_target, tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    write = lambda name, lo, hi: (source / name).write_text("".join(
        json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Tell me about number {i}."}]}) + "\n"
        for i in range(lo, hi)))
    write("day-1.jsonl", 0, 24)
    store = tmp_path / "store"
    logs = tmp_path / "logs"
    spec = {"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3}
    profile = tmp_path / "retrain.yaml"
    profile.write_text(yaml.safe_dump({
        "name": "e2e-retrain",
        "target": {"path": str(tiny_target)},
        "data": {"sources": [{"kind": "jsonl", "path": str(source)}], "eval_fraction": 0.2},
        "datagen": {"max_tokens": 8, "shard_size": 8},
        "dump": {"aux_layer_ids": [0, 1, 2], "max_length": 48, "samples_per_shard": 4, "devices": ["cpu"]},
        # ~11 steps: the tiny target's short greedy answers are learnt (accept length well above 1)
        "train": {"init_from": "champion", "draft_vocab_size": 64, "epochs": 30, "learning_rate": 0.005,
                  "ttt_length": 2},
        "export": {"eval_prompts": 4, "judge_max_new_tokens": 8, "judge_num_steps": 2, "min_accept_ratio": 0.01,
                   "min_accept_length": 1.0, "device": "cpu", "formats": ["sglang"]},
        # the challenger and the champion benched against the baseline before every verdict
        "retrain": {"min_improvement": 0.02, "bootstrap_samples": 500, "bench": True},
        "bench": {"speculative": [spec], "num_prompts": 3, "max_tokens": 8, "repeats": 2, "warmup_requests": 1,
                  "bootstrap_samples": 200},
        "serve": {"engine": "reference", "device": "cpu", "port": free_port(), "log_dir": str(logs),
                  "extra_args": ["--cpu-threads", "1"], "speculative": spec, "draft_path": "champion",
                  "startup_timeout_s": 180, "stall_timeout_s": 90},
        "storage": {"root": f"file://{store}"},
    }))
    stages = '["prepare", "datagen", "dump", "train", "export", "bench", "champion"]'  # serve: once, at the end
    retrain = lambda: prefect_cli(prefect_env, "deployment", "run", "drafter-retrain/retrain-nightly",
                                  "--param", f"profile={profile}", "--param", f"stages={stages}",
                                  "--watch", "--watch-timeout", "280")
    manifest = lambda stage, fp: json.loads((store / stage / fp / "_SUCCESS.json").read_text())
    decisions = lambda: sorted((json.loads(p.read_text()) for p in store.glob("champion/*/decision.json")),
                               key=lambda d: len(d.get("champion") or ""))
    registry = lambda: json.loads(next(store.glob("_registry/*/e2e-retrain.json")).read_text())

    # Retrain 1: no champion yet, the first drafter that passes the export gate is promoted.
    assert "Completed" in retrain()
    (first,) = decisions()
    assert first["challenger_accept_length"] > 1.5  # a drafter worth comparing against
    assert first["verdict"] == "promoted" and first["champion"] is None
    champion_1 = first["challenger"]
    (alone,) = first["bench"]["rows"]  # no champion yet: the challenger against the baseline only
    assert alone["challenger_accept_length"] > 1.0 and alone["challenger_speedup"] > 0
    assert registry()["events"][-1]["export"] == champion_1
    (promoted_event,) = wait_for_events(prefect_env, 1)
    assert promoted_event["event"] == "drafter.promoted" and promoted_event["payload"]["challenger"] == champion_1

    # Retrain 2: a new file; datagen asks only for its conversations, the dump references the first
    # dump's shards, the champion is fine-tuned, and the verdict follows the figures.
    (gen_1,) = [p.parent.name for p in store.glob("datagen/*/_SUCCESS.json")]
    (dump_1,) = [p.parent.name for p in store.glob("dump/*/_SUCCESS.json")]
    write("day-2.jsonl", 24, 30)
    assert "Completed" in retrain()
    (gen_2,) = [p.parent.name for p in store.glob("datagen/*/_SUCCESS.json") if p.parent.name != gen_1]
    (dump_2,) = [p.parent.name for p in store.glob("dump/*/_SUCCESS.json") if p.parent.name != dump_1]
    g2, d2 = manifest("datagen", gen_2), manifest("dump", dump_2)
    assert g2["meta"]["reuse"]["linked_shards"] >= 1 and g2["meta"]["reuse"]["asked_conversations"] <= 6
    assert g2["meta"]["conversations"] + g2["meta"]["eval"]["conversations"] == 30
    referenced = [s for s in d2["shards"] if s.get("source")]
    assert referenced and all(s["source"].startswith(f"dump/{dump_1}/") for s in referenced)
    assert d2["meta"]["reuse"]["linked_shards"] == len(referenced) and d2["meta"]["reuse"]["computed_shards"] >= 1
    (train_2,) = [m for m in (json.loads(p.read_text()) for p in store.glob("train/*/_SUCCESS.json"))
                  if m["meta"]["dump_fingerprint"] == dump_2]
    assert train_2["meta"]["init_from_champion"] == champion_1
    second = next(d for d in decisions() if d["champion"] == champion_1)
    better = second["relative"] >= 0.02 and second["interval"][0] > 0
    assert second["verdict"] == ("promoted" if better else "rejected"), second
    champion_2 = second["champion_after"]
    assert champion_2 == (second["challenger"] if better else champion_1)
    assert registry()["events"][-1]["export"] == champion_2
    events = wait_for_events(prefect_env, 2)
    assert events[-1]["event"] == f"drafter.{second['verdict']}"
    assert events[-1]["payload"]["challenger_accept_length"] == second["challenger_accept_length"]
    # ... and benched side by side with the champion it faced, in one sweep with the baseline
    (versus,) = second["bench"]["rows"]
    assert versus["rounds"] == 2 and versus["challenger_over_champion"] > 0 and versus["champion_accept_length"] > 1.0
    assert events[-1]["payload"]["bench"]["rows"] == second["bench"]["rows"]
    bench_2 = json.loads((store / "bench" / second["bench"]["fingerprint"] / "report.json").read_text())
    assert bench_2["drafters"] == {"challenger": second["challenger"], "champion": champion_1}
    assert {m["key"] for m in map(json.loads, map(Path.read_text, (store / "bench" / second["bench"]["fingerprint"])
                                                  .glob("m/*/bs0001/r000.json")))} == {
        "baseline", "challenger-eagle3-s2-k1-d3", "champion-eagle3-s2-k1-d3"}
    # The champion-vs-challenger table and the accept length across the two retrains (plot + table).
    table = artifacts(prefect_env, "champion-summary")[-1]["data"]  # columns, in the stage's order
    assert list(table)[0] == "figure" and set(table["figure"]) >= {
        "export", "offline accept length", "verdict", "bench EAGLE3 2/1/3 @ batch 1: challenger / champion throughput"}
    plot = artifacts(prefect_env, "accept-length-across-retrains")[-1]["data"]
    assert "data:image/png;base64," in plot and plot.count(f"| {second['verdict']} |") >= 1

    # A planted worse challenger is judged against the champion on the same prompts and rejected.
    from drafter.config import load_config
    from drafter.stages import bench as bench_stage
    from drafter.stages import champion as champion_stage
    from drafter.store import FileStore

    cfg = load_config(profile)
    planted = plant_worse_challenger(store, champion_2)
    upstream = {"export": planted, "prepare": second["corpus"]}
    benched = TABLE.run("bench", cfg, FileStore(store), upstream=upstream)
    verdict = TABLE.run("champion", cfg, FileStore(store), upstream={**upstream, "bench": benched.fingerprint})
    assert verdict.meta["verdict"] == "rejected" and verdict.meta["champion_after"] == champion_2
    assert verdict.meta["challenger_accept_length"] < verdict.meta["champion_accept_length"]
    (versus,) = verdict.meta["bench"]["rows"]  # the served drafters say the same: nonsense is not accepted
    assert versus["challenger_accept_length"] < versus["champion_accept_length"]
    assert registry()["events"][-1]["export"] == champion_2

    # Promoted by hand anyway, then rolled back: the serve stage serves the champion before it.
    drafter_cli("registry", "promote", planted, "--config", str(profile), "--reason", "e2e: a bad promotion")
    assert drafter_cli("registry", "rollback", "--config", str(profile)).split()[3:5] == ["export", champion_2]
    assert f"champion {champion_2}" in drafter_cli("registry", "list", "--config", str(profile))
    prefect_cli(prefect_env, "deployment", "run", "drafter-lifecycle/stage", "--param", f"profile={profile}",
                "--param", 'stages=["serve"]',
                "--watch", "--watch-timeout", "200")
    newest = max(logs.glob("reference-*.launch.json"), key=lambda p: p.stat().st_mtime_ns)
    argv = json.loads(newest.read_text())["argv"]
    assert argv[argv.index("--speculative-draft-model-path") + 1].endswith(f"export-{champion_2}")


# ---- runs the flow refuses: a profile it cannot use, no stage selected ------------------------


def start_run(env, deployment: str, parameters: dict) -> str:
    """A flow run of `deployment` as `prefect deployment run` creates one (no watch); its id."""
    dep = api(env, "GET", f"/deployments/name/{deployment}")
    return api(env, "POST", f"/deployments/{dep['id']}/create_flow_run", {"parameters": parameters})["id"]


FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def wait_until(what: str, predicate, timeout: float = 600.0, poll: float = 1.0):
    """Poll `predicate` until it returns something; a generous budget (minutes on a loaded 2-core
    machine), never a short fixed deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(poll)


def run_log(env, run_id: str) -> list[str]:
    logs = api(env, "POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200})
    return [entry["message"] for entry in logs]


SECRETISH = "hf_E2eSeCrEt_planted_in_a_profile"


def test_a_profile_the_run_cannot_use_or_no_stage_fails_the_run_in_one_line(prefect_env, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text(f"name: broken\nserve:\n  env:\n    HF_TOKEN: {SECRETISH}: typo\n")
    fields = tmp_path / "fields.yaml"
    fields.write_text(f"name: fields\ntarget: {{path: {tmp_path}}}\nserve:\n  port: not-a-port\n")
    cases = {
        # the `stage` deployment with nothing selected: refused, never Completed
        "stages=[]": (start_run(prefect_env, "drafter-lifecycle/stage", {"stages": []}),
                      "no stages selected: parameter stages is empty; choose one or more of "
                      + ", ".join(TABLE.names)),
        "missing": (start_run(prefect_env, "drafter-lifecycle/full", {"profile": str(tmp_path / "nope.yaml")}),
                    f"bad profile {tmp_path / 'nope.yaml'}: no such file: {tmp_path / 'nope.yaml'}"),
        # `full` runs one at a time (a second is cancelled): the others go to `stage` and the retrain
        "yaml": (start_run(prefect_env, "drafter-lifecycle/stage", {"profile": str(broken)}),
                 f"bad profile {broken}: line 4, column {15 + len(SECRETISH)}: not valid YAML: mapping values are "
                 "not allowed here (the file's content is not shown)"),
        "field": (start_run(prefect_env, "drafter-retrain/retrain-nightly", {"profile": str(fields)}),
                  f"bad profile {fields}: line 4: serve.port: Input should be a valid integer, unable to parse "
                  "string as an integer"),
    }
    runs = {name: wait_until(f"run {name} to end", lambda run_id=run_id: (
        lambda r: r if r["state_type"] in FINAL else None)(api(prefect_env, "GET", f"/flow_runs/{run_id}")))
        for name, (run_id, _) in cases.items()}
    for name, (run_id, line) in cases.items():
        run = runs[name]
        assert (run["state_type"], run["state"]["message"]) == ("FAILED", line), name
        # the run log's error is the same one line (logs reach the server shortly after the state)
        logged = wait_until(f"the run log of {name}", lambda run_id=run_id, line=line: (
            lambda messages: messages if line in messages else None)(run_log(prefect_env, run_id)), timeout=120)
        assert not [m for m in logged if "Traceback" in m or "Encountered exception" in m], name
    # nothing of the broken file reached the run logs, the worker's log or Prefect's database
    home = Path(prefect_env["PREFECT_HOME"])
    for path in [home / "run" / "worker.log", *home.glob("prefect.db*")]:
        assert SECRETISH.encode() not in path.read_bytes(), path


# ---- kill -9 of a lifecycle run's process: its running subflow does not stay Running ----------


def flow_run_process(run_id: str) -> int | None:
    """The flow run's own process: the oldest one whose environment names the run (the servers it
    starts inherit the variable too)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"PREFECT__FLOW_RUN_ID={run_id}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return min(found) if found else None


def pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(1200)  # a run's start, the kill, the worker's hooks: each bounded below, minutes under load
def test_kill_9_of_a_lifecycle_run_crashes_the_subflow_it_was_running(prefect_env, tiny_target, tmp_path):
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"k{i}", "messages": [{"role": "user", "content": f"Item {i}?"}]})
                              + "\n" for i in range(12)))
    logs = tmp_path / "logs"
    profile = tmp_path / "killed.yaml"
    profile.write_text(yaml.safe_dump({
        "name": "killed",
        "target": {"path": str(tiny_target), "name": "tiny"},
        "data": {"sources": [{"kind": "jsonl", "path": str(corpus)}], "eval_fraction": 0.0},
        # 12 requests of 5 s, one at a time: datagen is still running when its run is killed
        "datagen": {"max_tokens": 8, "shard_size": 2, "concurrency_per_server": 1},
        "serve": {"engine": "command", "port": free_port(), "log_dir": str(logs),
                  "command": [sys.executable, str(ROOT / "tests" / "fixtures" / "chat_server.py"), "--port", "{port}",
                              "--served-model-name", "{served_model_name}", "--delay-s", "5"],
                  "startup_timeout_s": 300, "stall_timeout_s": 300},
        "storage": {"root": f"file://{tmp_path / 'store'}"},
    }))
    parent = start_run(prefect_env, "drafter-lifecycle/stage", {"profile": str(profile),
                                                                "stages": ["prepare", "datagen"]})
    datagen_runs = lambda: api(prefect_env, "POST", "/flow_runs/filter", {
        "flow_runs": {"parent_flow_run_id": {"any_": [parent]}}, "flows": {"name": {"any_": ["datagen"]}}})

    def datagen_serving():
        state = api(prefect_env, "GET", f"/flow_runs/{parent}")["state"]
        assert state["type"] not in FINAL, f"the run ended before it could be killed: {state}"
        running = [r for r in datagen_runs() if r["state_type"] == "RUNNING"]
        pids = [json.loads(p.read_text())["pid"] for p in logs.glob("*.pid.json")] if logs.exists() else []
        return (running[0], pids[0]) if running and pids and pid_alive(pids[0]) else None

    datagen, server = wait_until("the datagen subflow running, its server up", datagen_serving, timeout=480)
    # What Prefect's process worker writes meanwhile: the run's whole environment, the worker's
    # secret included, in its TMPDIR (the private run/tmp of infra/prefect-up.sh; docs/operations.md: Secrets)
    tmp = Path(prefect_env["PREFECT_HOME"]) / "run" / "tmp"
    (workspace,) = [w for w in tmp.glob("prefect-workspace-attempt-*/workspace.json")
                    if parent.encode() in w.read_bytes()]
    assert PLANTED.encode() in workspace.read_bytes() and mode(workspace) == 0o600

    process = flow_run_process(parent)
    assert process is not None
    os.kill(process, signal.SIGKILL)
    # the worker sees its process exit and sets the run Crashed (Prefect's part) ...
    crashed = wait_until("the killed run Crashed", timeout=240, predicate=lambda: (lambda r: r if r["state_type"] in FINAL else None)(
        api(prefect_env, "GET", f"/flow_runs/{parent}")))
    assert crashed["state_type"] == "CRASHED", crashed["state"]
    # ... and its on_crashed hook ends the subflow and the task runs its process left Running
    ended = wait_until("the datagen subflow ended", lambda: (lambda r: r if r["state_type"] in FINAL else None)(
        api(prefect_env, "GET", f"/flow_runs/{datagen['id']}")), timeout=300)
    assert ended["state_type"] == "CRASHED", ended["state"]
    assert ended["state"]["message"].startswith(f"orphaned: the process of run {crashed['name']!r} ({parent}), "
                                                f"which ran this, crashed: "), ended["state"]
    tasks_of_run = api(prefect_env, "POST", "/task_runs/filter",
                    {"flow_runs": {"id": {"any_": [parent, datagen["id"]]}}, "limit": 50})
    assert tasks_of_run and not [t["name"] for t in tasks_of_run if t["state_type"] not in FINAL], tasks_of_run
    # the run's server went with it (its watchdog), and the worker removed the run's workspace
    wait_until("the datagen server gone", lambda: not pid_alive(server), timeout=120)
    wait_until("the run's workspace removed", lambda: not workspace.exists(), timeout=120)


# ---- last: the stack stopped as `make demo` stops it ----------------------------------------


def test_prefect_down_leaves_no_worker_online_and_removes_the_workers_tmpdir(prefect_env):
    home = Path(prefect_env["PREFECT_HOME"])
    stopped = down(home, prefect_env)  # checked: no pid file left, run/tmp removed
    assert "removed worker(s) worker-" in stopped.stdout, stopped.stdout
    # what a UI over this database shows later (`make demo-ui` runs none of the server's services,
    # which would otherwise mark a silent worker offline): no worker Online, the pool not Ready
    workers, pools = stored_workers(home)
    assert "ONLINE" not in workers.values(), workers
    assert pools["drafter-local"] == "NOT_READY", pools
    assert mode(home) == 0o700 and mode(home / "prefect.db") == 0o600
