"""Fan-out through a real Prefect server with 3 process workers on one pool (infra/prefect-up.sh
with DRAFTER_WORKERS=3), as a user runs it: `prefect deployment run drafter-lifecycle/stage`.

datagen and dump of a small corpus run as 3 children each (flows/fanout.py). Each datagen child
starts its own server (engine `command`: tests/fixtures/chat_server.py, a known per-request
latency). The test kills a worker with its child mid-range (the range is relaunched and lands on
another worker), fails a range on purpose (the parent fails naming it), re-runs (only that range
is launched), cancels a parent (its children are cancelled, no server is left) and checks that
every shard is byte-identical to a `workers: 1` run of the same profile in this process.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from drafter.config import load_config
from drafter.stage_output import StageOutput
from drafter.stages import TABLE
from drafter.store import open_store
from tests.fixtures.local_prefect import local_prefect
from tests.fixtures.net import free_port_block

ROOT = Path(__file__).resolve().parents[2]
PREFECT = str(ROOT / ".venv" / "bin" / "prefect") if (ROOT / ".venv").exists() else "prefect"
CHAT = ROOT / "tests" / "fixtures" / "chat_server.py"
STAGES = '["prepare", "datagen", "dump"]'
# In the workers' environment only (as an `env:` secret would be): what Prefect's process worker
# leaves behind when it dies (docs/operations.md: Secrets).
PLANTED = "fanout-planted-Secret-51be0a"
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A Prefect server and 3 process workers on one pool, the deployments registered."""
    with local_prefect(tmp_path_factory.mktemp("prefect-fanout"), DRAFTER_WORKERS="3", DRAFTER_WORKER_LIMIT="2",
                       DRAFTER_FANOUT_PLANTED=PLANTED) as env:
        yield env


def profile(tmp_path: Path, target: Path, store: str, *, workers: int, delay_s: float, base_port: int,
            name: str) -> Path:
    corpus = tmp_path / "prompts.jsonl"
    if not corpus.exists():
        rows = [{"id": f"p{i:02d}", "messages": [{"role": "user", "content": f"Tell me about item {i}."}]}
                for i in range(18)]
        corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fan = {"workers": workers, "worker_lease_timeout_s": 12.0}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name,
        "target": {"path": str(target), "name": "tiny"},
        "data": {"sources": [{"kind": "jsonl", "path": str(corpus)}], "eval_fraction": 0.0},
        # 9 shards of 2: each child's own server answers one request at a time, delay_s each
        "datagen": {"max_tokens": 8, "shard_size": 2, "concurrency_per_server": 1, **fan},
        "dump": {"aux_layer_ids": [0, 1, 2], "max_length": 64, "samples_per_shard": 3, "devices": ["cpu"], **fan},
        "serve": {"engine": "command", "port": base_port, "log_dir": str(tmp_path / f"{name}-logs"),
                  "command": [sys.executable, str(CHAT), "--port", "{port}", "--served-model-name",
                              "{served_model_name}", "--delay-s", str(delay_s)],
                  "startup_timeout_s": 60, "stall_timeout_s": 60},
        "storage": {"root": store},
    }))
    return path


def run(env, profile_path: Path, *, watch: bool = True) -> subprocess.CompletedProcess:
    args = [PREFECT, "deployment", "run", "drafter-lifecycle/stage", "--param", f"profile={profile_path}",
            "--param", f"stages={STAGES}"]
    if watch:
        args += ["--watch", "--watch-timeout", "400"]
    return subprocess.run(args, env={**env, "PREFECT_CLI_WRAP_LINES": "false"}, capture_output=True, text=True,
                          timeout=450)


def run_id_of(output: str) -> str:
    return re.search(r"UUID: ([0-9a-f-]{36})", output).group(1)


def api(env, path: str, body: dict | None = None):
    url = env["PREFECT_API_URL"] + path
    resp = httpx.post(url, json=body or {}, timeout=30) if body is not None else httpx.get(url, timeout=30)
    resp.raise_for_status()
    return resp.json()


def children(env, parent_id: str, stage: str | None = None) -> list[dict]:
    tags = [f"drafter-fanout-of:{parent_id}"] + ([f"drafter-stage:{stage}"] if stage else [])
    return api(env, "/flow_runs/filter", {"flow_runs": {"tags": {"all_": tags}}, "limit": 200})


def digests(root: str, stage: str) -> dict[str, str]:
    store = open_store(load_config_root(root))
    [fp] = [k.split("/")[1] for k in store.list(f"{stage}/") if k.endswith("_SUCCESS.json")]
    out = StageOutput(store, stage, fp)
    return {s.name: hashlib.sha256(out.read_shard(s.name)).hexdigest() for s in out.manifest.shards}


def graph(env, run_id: str) -> list[dict]:
    """The nodes of a flow run's graph, as the UI's run graph draws them."""
    return [node for _, node in api(env, f"/flow_runs/{run_id}/graph-v2")["nodes"]]


def load_config_root(root: str):
    from drafter.config import StorageConfig

    return StorageConfig(root=root)


def wait_for(what: str, predicate, timeout: float = 120.0, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def leases(root: Path, stage: str) -> list[dict]:
    found = []
    for path in root.glob(f"_fanout/{stage}/*/*.json"):
        try:
            found.append({"path": path, **json.loads(path.read_text())})
        except (OSError, ValueError):
            pass
    return found


def worker_pids(env) -> dict[int, str]:
    run_dir = Path(env["PREFECT_HOME"]) / "run"
    return {int(p.read_text()): p.stem for p in run_dir.glob("worker*.pid")}


def ancestor_in(pid: int, candidates: dict[int, str]) -> int | None:
    while pid > 1:
        if pid in candidates:
            return pid
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return None


def flow_run_processes() -> dict[str, int]:
    """Flow run id -> the oldest process naming it (its servers inherit the variable too)."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"PREFECT__FLOW_RUN_ID="):
                run = item.split(b"=", 1)[1].decode()
                found[run] = min(found.get(run, 1 << 30), int(entry.name))
    return found


def run_of(pid: int) -> str:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(i.split(b"=", 1)[1].decode() for i in env if i.startswith(b"PREFECT__FLOW_RUN_ID="))


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_fanned_out_stages_survive_a_killed_worker_and_equal_one_worker(pool, tiny_target, tmp_path):
    # the one-worker reference, in this process: same profile, its own store
    ref_root = f"file://{tmp_path}/ref-store"
    ref = load_config(profile(tmp_path, tiny_target, ref_root, workers=1, delay_s=0.0,
                              base_port=free_port_block(1), name="ref"))
    fps = TABLE.fingerprints(ref)
    for stage in ("prepare", "datagen", "dump"):
        fps.record(TABLE.run(stage, ref, fingerprints=fps))

    store_dir = tmp_path / "store"
    # 6 requests of 2 s per range: long enough on a loaded machine to catch a child mid-range
    fanned = profile(tmp_path, tiny_target, f"file://{store_dir}", workers=3, delay_s=2.0,
                     base_port=free_port_block(3), name="fanned")
    proc = subprocess.Popen([PREFECT, "deployment", "run", "drafter-lifecycle/stage", "--param", f"profile={fanned}",
                             "--param", f"stages={STAGES}", "--watch", "--watch-timeout", "400"],
                            env={**pool, "PREFECT_CLI_WRAP_LINES": "false"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    # A machine dies mid-range: the child's process group and the worker that ran it, SIGKILL.
    # The victim: a child mid-range whose worker does not also run the parent (a killed worker
    # takes its flow runs with it; the machine that dies here is not the parent's).
    workers = worker_pids(pool)

    def victim_on_another_worker():
        runs = flow_run_processes()
        for lease in (l for l in leases(store_dir, "datagen") if l["beat"] >= 2):
            try:
                tags = api(pool, f"/flow_runs/{run_of(lease['pid'])}")["tags"]
            except (OSError, StopIteration):
                continue
            parents = [t.split(":", 1)[1] for t in tags if t.startswith("drafter-fanout-of:")]
            worker = ancestor_in(lease["pid"], workers)
            if worker is None or worker in {ancestor_in(runs[p], workers) for p in parents if p in runs}:
                continue
            # Not while a child is taken by a worker but not started (Pending): on the killed worker it
            # would wait out worker_start_timeout_s (900 s) before it counts as lost. A child still
            # Scheduled is fine: only a live worker can take it.
            if any(k["state_type"] == "PENDING" for p in parents for k in children(pool, p, "datagen")):
                return None
            return lease, worker
        return None

    victim, worker = wait_for("a datagen child mid-range on a worker without the parent", victim_on_another_worker,
                              timeout=240)
    victim_run = run_of(victim["pid"])
    # the run's environment as Prefect's process worker wrote it into the worker's TMPDIR, the
    # workers' secret included (the worker removes it when the run ends, unless it dies first)
    tmp = Path(pool["PREFECT_HOME"]) / "run" / "tmp"
    (workspace,) = [w for w in tmp.glob("prefect-workspace-attempt-*/workspace.json")
                    if json.loads(w.read_text())["environment"].get("PREFECT__FLOW_RUN_ID") == victim_run]
    assert json.loads(workspace.read_text())["environment"]["DRAFTER_FANOUT_PLANTED"] == PLANTED
    os.killpg(worker, signal.SIGKILL)  # the worker first: it cannot clean up after its child
    os.killpg(victim["pgid"], signal.SIGKILL)
    out = ""
    try:
        out, _ = proc.communicate(timeout=450)
        assert proc.returncode == 0 and "Completed" in out, out + fan_out_story(pool, run_id_of(out))
    finally:
        proc.kill()
        # the next tests get 3 workers and an idle pool whatever happened here
        restart_workers_and_cancel(pool, out)
    parent = run_id_of(out)

    assert digests(ref_root, "datagen") == digests(f"file://{store_dir}", "datagen")
    assert digests(ref_root, "dump") == digests(f"file://{store_dir}", "dump")
    kids = children(pool, parent, "datagen")
    by_state = sorted((k["name"], k["state_type"], k["state"]["message"]) for k in kids)
    # every child of the killed worker (the victim's, and any other it ran) was lost and its range
    # relaunched on a worker still alive; each range completed exactly once
    lost = {k["name"] for k in kids if k["state_type"] == "CRASHED"}
    # the victim died at once: only its silent lease tells (another child of that worker may notice
    # its worker gone itself and end Crashed: lost as well)
    assert "no lease beat" in api(pool, f"/flow_runs/{victim_run}")["state"]["message"], by_state
    done = sorted(k["name"].replace(" (attempt 2)", "") for k in kids if k["state_type"] == "COMPLETED")
    assert done == ["datagen shards 0-2", "datagen shards 3-5", "datagen shards 6-8"], by_state
    assert {k["name"] for k in kids if k["name"].endswith("(attempt 2)")} == {f"{n} (attempt 2)" for n in lost}
    assert len([k for k in children(pool, parent, "dump") if k["state_type"] == "COMPLETED"]) == 3
    # the stage's task run says how many ranges are done
    messages = [t["state"]["message"] or "" for t in api(pool, "/task_runs/filter", {"limit": 200})
                if t["name"].startswith("datagen-")]
    assert "datagen: 3 of 3 ranges done, 0 failed (3 launched here)" in messages, messages
    assert not leases(store_dir, "datagen") and not leases(store_dir, "dump")
    # the UI's run graph: the chain prepare -> datagen -> dump, each stage's children drawn inside its
    # subflow, under its task, named by their range
    stages = {n["label"].split(" / ")[0]: n for n in graph(pool, parent) if n["kind"] == "flow-run"}
    assert {p["id"] for p in stages["datagen"]["parents"]} >= {stages["prepare"]["id"]}, stages
    assert {p["id"] for p in stages["dump"]["parents"]} >= {stages["datagen"]["id"]}, stages
    for stage in ("datagen", "dump"):
        inner = graph(pool, stages[stage]["id"])
        [task_node] = [n for n in inner if n["kind"] == "task-run"]
        drawn = sorted(n["label"].split(" / ")[1].replace(" (attempt 2)", "") for n in inner
                       if n["kind"] == "flow-run" and [e["id"] for e in n["encapsulating"]] == [task_node["id"]])
        assert set(drawn) == {f"{stage} shards 0-2", f"{stage} shards 3-5", f"{stage} shards 6-8"}, inner
    # the dead worker left the run's environment behind, in the private TMPDIR that
    # infra/prefect-down.sh removes (checked when this module's stack stops: local_prefect.down)
    assert workspace.exists() and PLANTED in workspace.read_text()


def restart_workers_and_cancel(env, output: str) -> None:
    """The killed worker started again (same name, same pool); a parent still running is cancelled."""
    match = re.search(r"UUID: ([0-9a-f-]{36})", output)
    if match and api(env, f"/flow_runs/{match.group(1)}")["state_type"] in ("RUNNING", "PENDING", "SCHEDULED"):
        subprocess.run([PREFECT, "flow-run", "cancel", match.group(1)], env=env, capture_output=True, timeout=60)
    restart = subprocess.run([str(ROOT / "infra" / "prefect-up.sh")], env={**env, "DRAFTER_WORKERS": "3"},
                             capture_output=True, text=True, timeout=300)
    assert restart.returncode == 0, restart.stdout + restart.stderr


def fan_out_story(env, parent: str) -> str:
    """For a failure message: every child of the run (name, state, message), each stage task's last
    status line and the tail of each worker's log."""
    lines = ["", "children:"]
    lines += [f"  {k['name']}: {k['state_type']} {k['state']['message']!r}" for k in children(env, parent)]
    lines += ["stage tasks:"] + [f"  {t['name']}: {t['state_type']} {t['state']['message']!r}"
                                 for t in api(env, "/task_runs/filter", {"limit": 200})
                                 if t["name"].startswith(("datagen-", "dump-"))]
    for log in sorted((Path(env["PREFECT_HOME"]) / "run").glob("worker*.log")):
        lines += [f"{log.name} (tail):"] + ["  " + l for l in log.read_text(errors="replace").splitlines()[-15:]]
    return "\n".join(lines)


def test_a_failed_range_fails_the_run_naming_it_and_a_rerun_runs_only_it(pool, tiny_target, tmp_path):
    base = free_port_block(3)
    store_dir = tmp_path / "store"
    path = profile(tmp_path, tiny_target, f"file://{store_dir}", workers=3, delay_s=0.0, base_port=base,
                   name="failing")
    # the third child's own server cannot start: its port (base + 2) is taken by another program
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", base + 2))
    squatter.listen()
    try:
        first = run(pool, path)
    finally:
        squatter.close()
    assert first.returncode != 0, first.stdout
    message = re.search(r"^Failed: (.*)$", first.stdout, re.M) or re.search(r"stage datagen failed: .*", first.stdout)
    assert message, first.stdout + first.stderr
    assert re.search(r"datagen: 1 of 3 ranges failed: shards 6-8 \(failed: ", first.stdout), first.stdout
    parent = run_id_of(first.stdout)
    assert sorted(k["state_type"] for k in children(pool, parent, "datagen")) == ["COMPLETED", "COMPLETED", "FAILED"]

    second = run(pool, path)
    assert second.returncode == 0, second.stdout + second.stderr
    rerun = children(pool, run_id_of(second.stdout), "datagen")
    assert [k["name"] for k in rerun] == ["datagen shards 6-8"]  # the finished ranges were not launched
    assert len(children(pool, run_id_of(second.stdout), "dump")) == 3


def test_cancelling_the_parent_cancels_its_children_and_leaves_no_server(pool, tiny_target, tmp_path):
    store_dir = tmp_path / "store"
    # 6 requests of 15 s per range: no child can finish its range before the cancellation reaches it
    path = profile(tmp_path, tiny_target, f"file://{store_dir}", workers=3, delay_s=15.0,
                   base_port=free_port_block(3), name="cancelled")
    started = run(pool, path, watch=False)
    assert started.returncode == 0, started.stdout + started.stderr
    parent = run_id_of(started.stdout)
    wait_for("3 datagen children beating", lambda: len(leases(store_dir, "datagen")) == 3, timeout=240)

    def servers_up():  # each child's own server: pid file written, process alive
        pids = [json.loads(p.read_text())["pid"] for p in (tmp_path / "cancelled-logs").glob("*.pid.json")]
        return pids if len(pids) == 3 and all(alive(pid) for pid in pids) else None

    servers = wait_for("3 datagen servers up", servers_up, timeout=300)
    t0 = time.monotonic()
    cancel = subprocess.run([PREFECT, "flow-run", "cancel", parent], env=pool, capture_output=True, text=True,
                            timeout=60)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    final = ("CANCELLED", "COMPLETED", "FAILED", "CRASHED")
    kids = wait_for("the children cancelled", lambda: (lambda ks: ks if len(ks) == 3 and all(
        k["state_type"] in final for k in ks) else None)(children(pool, parent, "datagen")), timeout=120)
    seconds = time.monotonic() - t0
    # stopped, none finished its range, each recorded as cancelled (not crashed: the server session
    # leaves Prefect's own SIGTERM handler in place, from which the engine reads the cancellation)
    states = [(k["name"], k["state_type"], k["state"]["message"]) for k in kids]
    assert all(k["state_type"] == "CANCELLED" for k in kids), states
    wait_for("the servers gone", lambda: not any(alive(pid) for pid in servers), timeout=60)
    assert not list((tmp_path / "cancelled-logs").glob("*.pid.json"))
    print(f"cancel -> 3 children cancelled in {seconds:.1f} s")
