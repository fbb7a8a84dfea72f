"""Launcher, stall watchdog, readiness gate and teardown against REAL processes.

tests/fixtures/fake_server.py (stdlib only) prints SGLang's start-up lines and serves the
SGLang/OpenAI endpoints; flags make it hang, crash, stay unhealthy or ignore SIGTERM. Every
test checks that nothing of the server's process group survives.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from drafter.config import parse_config
from drafter.serving.check import check_server, serve_forever
from drafter.engines import check_speculative_settings
from drafter.server_errors import HealthCheckTimeout, ServerConfigError, ServerCrashed, ServerStalled
from drafter.serving.host import parse_compute_apps, port_free
from drafter.serving.launcher import ServerProcess, launch, preflight
from drafter.serving.ownership import group_members, pid_file
from tests.fixtures.net import free_port
from tests.fixtures.servers import NCCL, ROOT, SGLANG, command_config, fake_spec, gate


def assert_all_gone(server: ServerProcess) -> None:
    assert server.teardown is not None and server.teardown.ok, server.teardown
    assert group_members(server.pgid, server.pgid) == []
    assert port_free("127.0.0.1", server.spec.port)


# ---------------------------------------------------------------------------------------------
# Ready path
# ---------------------------------------------------------------------------------------------

def test_ready_with_phases_settings_and_quiet_rewrite(tmp_path):
    spec = fake_spec(tmp_path, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d",
                     "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                     "--speculative-num-draft-tokens", "4", "--report-num-draft-tokens", "2")
    lines: list[str] = []
    with launch(spec, SGLANG, tmp_path / "server.log", on_line=lines.append) as server:
        report = gate(server, spec)
        assert pid_file(server.log_path).exists()
    names = [p["phase"] for p in report.phases]
    assert names[:6] == ["launch", "load_weights", "kv_cache", "cuda_graph", "post_capture", "http_server"]
    assert report.seconds_to_ready < 10 and report.sample == " the"
    assert report.settings["num_steps"] == 3 and report.settings["draft_path"] == "/d"
    # the server "quietly rewrote" num_draft_tokens 4 -> 2: the read-back catches it
    from drafter.config import SpeculativeConfig
    problems = check_speculative_settings(SpeculativeConfig(num_steps=3, eagle_topk=1, num_draft_tokens=4),
                                          report.settings, "/d")
    assert problems == ["num_draft_tokens: requested 4, server uses 2"]
    # every line went to the callback AND to the log file
    assert any("Load weight begin" in line for line in lines)
    assert "Capture cuda graph begin" in (tmp_path / "server.log").read_text()
    assert_all_gone(server)
    assert not pid_file(server.log_path).exists()  # clean teardown removes the pid file


def test_slow_but_steady_start_is_not_a_stall(tmp_path):
    # 14 lines 0.3 s apart: 4 s in total, each gap well inside a 1.5 s budget
    spec = fake_spec(tmp_path, "--step-s", "0.3")
    with launch(spec, SGLANG, tmp_path / "server.log") as server:
        report = gate(server, spec, stall=1.5)
    assert report.seconds_to_ready > 1.5
    assert_all_gone(server)


# ---------------------------------------------------------------------------------------------
# Stalls, crashes, unhealthy servers
# ---------------------------------------------------------------------------------------------

# A hang after the HTTP server opened is a health timeout, not a stall (test_server_lifecycle.py).
@pytest.mark.parametrize("phase", ["launch", "load_weights", "kv_cache", "cuda_graph", "post_capture"])
def test_hang_in_any_phase_is_detected_and_cleaned_up(tmp_path, phase):
    # --access-log: our own probes show up in the log once the port is open; they are not progress
    spec = fake_spec(tmp_path, "--hang-in", phase, "--access-log", "--spawn-child")
    budget = 1.0
    t0 = time.monotonic()
    with pytest.raises(ServerStalled) as info:
        with launch(spec, SGLANG, tmp_path / "server.log") as server:
            gate(server, spec, stall=budget)
    assert time.monotonic() - t0 < budget + 5
    err = info.value
    assert err.phase == phase and err.seconds >= budget and err.engine == "sglang"
    assert err.log_tail and str(budget) in err.message
    assert_all_gone(server)


def test_phase_budgets_override_the_stall_timeout(tmp_path):
    spec = fake_spec(tmp_path, "--hang-in", "cuda_graph")
    t0 = time.monotonic()
    with pytest.raises(ServerStalled) as info:
        with launch(spec, SGLANG, tmp_path / "server.log") as server:
            gate(server, spec, stall=60.0, phase_budgets={"cuda_graph": 0.8})
    assert info.value.phase == "cuda_graph" and time.monotonic() - t0 < 6
    assert_all_gone(server)


def test_crash_reports_exit_code_and_log_tail(tmp_path):
    # the child outlives the crashed parent, like an orphaned SGLang scheduler process
    spec = fake_spec(tmp_path, "--crash-in", "load_weights", "--exit-code", "3", "--spawn-child")
    with pytest.raises(ServerCrashed) as info:
        with launch(spec, SGLANG, tmp_path / "server.log") as server:
            gate(server, spec)
    err = info.value
    assert err.exit_code == 3 and err.phase == "load_weights"
    assert any("CUDA out of memory" in line for line in err.log_tail)
    assert "CUDA out of memory" in str(err)
    assert_all_gone(server)


def test_fatal_log_line_is_a_crash_even_while_alive(tmp_path):
    spec = fake_spec(tmp_path, "--fatal-in", "cuda_graph")
    with pytest.raises(ServerCrashed) as info:
        with launch(spec, SGLANG, tmp_path / "server.log") as server:
            gate(server, spec)
    assert info.value.exit_code is None and "Scheduler hit an exception" in info.value.message
    assert_all_gone(server)


@pytest.mark.parametrize("args,failing", [
    (["--health-status", "503"], ["health"]),
    (["--models", "some-other-model"], ["model listing"]),
    (["--generate-status", "500"], ["generation"]),
])
def test_health_timeout_names_the_failing_check(tmp_path, args, failing):
    spec = fake_spec(tmp_path, *args)
    with pytest.raises(HealthCheckTimeout) as info:
        with launch(spec, SGLANG, tmp_path / "server.log") as server:
            gate(server, spec, startup=2.0, stall=30.0)
    assert info.value.failing == failing
    assert failing[0] in info.value.message
    assert_all_gone(server)


# ---------------------------------------------------------------------------------------------
# Teardown
# ---------------------------------------------------------------------------------------------

def test_teardown_kills_sigterm_ignoring_server_and_its_child(tmp_path):
    child_file = tmp_path / "child.pid"
    spec = fake_spec(tmp_path, "--ignore-sigterm", "--spawn-child", "--child-pid-file", str(child_file))
    server = launch(spec, SGLANG, tmp_path / "server.log")
    try:
        gate(server, spec)
        child = int(child_file.read_text())
        assert sorted(group_members(server.pgid)) == sorted([server.pid, child])
    finally:
        report = server.stop(grace_s=0.5)
    assert report.signals == ["SIGTERM", "SIGKILL"] and report.exit_code == -signal.SIGKILL
    assert not Path(f"/proc/{child}").exists() or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"
    assert_all_gone(server)


def test_graceful_sigterm_takes_the_child_along(tmp_path):
    spec = fake_spec(tmp_path, "--spawn-child")
    with launch(spec, SGLANG, tmp_path / "server.log") as server:
        gate(server, spec)
    assert server.teardown.signals == ["SIGTERM"] and server.teardown.exit_code == 0
    assert_all_gone(server)


def test_keyboard_interrupt_inside_with_tears_down(tmp_path):
    spec = fake_spec(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        with launch(spec, SGLANG, tmp_path / "server.log") as server:
            gate(server, spec)
            raise KeyboardInterrupt
    assert_all_gone(server)


LEFT_BEHIND = r"""
import json, os, sys, time
from drafter.engines import LaunchSpec, make_engine
from drafter.serving.launcher import launch
spec = LaunchSpec(**json.loads(sys.argv[1]))
spec.env = dict(os.environ)
server = launch(spec, make_engine("sglang"), sys.argv[2])
print(server.pid_path, flush=True)
time.sleep(3600)
"""


def test_reap_from_another_process_kills_a_left_behind_server(tmp_path):
    spec = fake_spec(tmp_path, "--ignore-sigterm", "--spawn-child")
    fields = {k: v for k, v in vars(spec).items() if k != "env"} | {"env": {}}
    log_path = tmp_path / "server.log"
    # A "flow run" that launches the server and is then killed without running its finally.
    run = subprocess.Popen([sys.executable, "-c", LEFT_BEHIND, json.dumps(fields), str(log_path)],
                           cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pid_path = Path(run.stdout.readline().strip())
    info = json.loads(pid_path.read_text())
    deadline = time.monotonic() + 120  # a generous budget: Python's start-up alone is seconds under load
    while True:  # wait until it serves
        try:
            if httpx.get(spec.health_url, timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "fake server never came up"
        time.sleep(0.1)
    os.kill(info["watchdog_pid"], signal.SIGKILL)  # with its watchdog, the server would die with the run
    run.kill()
    run.wait()
    run.stdout.close()
    time.sleep(0.2)
    assert group_members(info["pgid"], info["sid"]), "the server should outlive its launcher"

    res = subprocess.run([sys.executable, "-m", "drafter.serving.launcher", "reap", str(pid_path),
                          "--grace", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["reaped"] and out["signals"] == ["SIGTERM", "SIGKILL"] and out["problems"] == []
    assert group_members(info["pgid"], info["sid"]) == []
    assert port_free("127.0.0.1", spec.port) and not pid_path.exists()
    # a second reap (e.g. the hook and the finally both run) is harmless
    res2 = subprocess.run([sys.executable, "-m", "drafter.serving.launcher", "reap", str(pid_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert json.loads(res2.stdout)["reaped"] is False
    assert out["seconds"] > 0


# ---------------------------------------------------------------------------------------------
# Launch record, preflight, GPUs
# ---------------------------------------------------------------------------------------------

def test_launch_environment_is_saved_and_applied(tmp_path):
    spec = fake_spec(tmp_path, env={**NCCL, "HF_TOKEN": "hf_secret"})
    with launch(spec, SGLANG, tmp_path / "server.log") as server:
        gate(server, spec)
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
    saved = json.loads((tmp_path / "server.launch.json").read_text())
    for key, value in NCCL.items():
        assert saved["env"][key] == value and saved["env_from_config"][key] == value
        assert f"{key}={value}".encode() in environ  # the process really got it
    assert saved["env"]["HF_TOKEN"] == "<masked>"
    assert "PATH" not in saved["env"]  # only the difference to our own environment is saved
    assert saved["argv"] == spec.argv and saved["cwd"] == str(tmp_path)
    assert_all_gone(server)


def test_port_taken_is_a_config_error_at_once(tmp_path):
    spec = fake_spec(tmp_path)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", spec.port))
        s.listen()
        t0 = time.monotonic()
        with pytest.raises(ServerConfigError, match=f"port {spec.port}"):
            preflight(spec, check_gpus=False)
        assert time.monotonic() - t0 < 2


def test_preflight_reports_every_problem(tmp_path):
    spec = fake_spec(tmp_path)
    spec.model_path, spec.draft_path = "/nonexistent/model", "./missing-draft"
    with pytest.raises(ServerConfigError) as info:
        preflight(spec, check_gpus=False, min_free_disk_gb=1e9)
    problems = info.value.problems
    assert any("model path does not exist: /nonexistent/model" in p for p in problems)
    assert any("draft path does not exist: ./missing-draft" in p for p in problems)
    assert any("GB free" in p for p in problems)
    # an existing folder that is not a drafter is refused before any launch
    spec.model_path, spec.draft_path = "meta-llama/Llama-3.1-8B-Instruct", str(tmp_path)
    with pytest.raises(ServerConfigError, match="is not a drafter: it has no config.json"):
        preflight(spec, check_gpus=False)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    with pytest.raises(ServerConfigError, match=r"is not a drafter: it has no \*.safetensors weights"):
        preflight(spec.__class__(**{**spec.__dict__, "draft_path": str(draft)}), check_gpus=False)
    (draft / "model.safetensors").write_bytes(b"")
    # hub ids are not local paths; an existing local drafter passes
    spec.draft_path = str(draft)
    assert preflight(spec, check_gpus=False) == []
    spec.argv = ["no-such-server-binary", "--port", "1"]
    with pytest.raises(ServerConfigError, match="executable not found"):
        preflight(spec, check_gpus=False)
    spec.argv = [sys.executable, "-m", "no_such_module_xyz.server"]
    with pytest.raises(ServerConfigError, match="no_such_module_xyz"):
        preflight(spec, check_gpus=False)


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """An `nvidia-smi` on PATH whose GPU memory and compute apps the test controls."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    mem, apps = tmp_path / "gpu_mem", tmp_path / "gpu_apps"
    mem.write_text("500")
    apps.write_text("")
    script = bindir / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
case "$*" in
  *query-gpu=*) echo "0, GPU-aaaa, $(cat {mem})"; echo "1, GPU-bbbb, 3";;
  *query-compute-apps=*) cat {apps};;
esac
""")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return mem, apps


def test_preflight_refuses_busy_gpus(tmp_path, fake_nvidia_smi):
    mem, apps = fake_nvidia_smi
    apps.write_text("4242, 76000 MiB, GPU-aaaa\n")
    spec = fake_spec(tmp_path)
    with pytest.raises(ServerConfigError, match=r"pid 4242 \(76000 MiB\)"):
        preflight(spec)
    # a process on a GPU this server does not use is not in the way
    spec.env["CUDA_VISIBLE_DEVICES"] = "1"
    assert preflight(spec) == []
    assert parse_compute_apps("4242, 76000 MiB\n99, [N/A]\n") == [
        {"pid": 4242, "used_mib": 76000.0, "gpu_uuid": None}, {"pid": 99, "used_mib": None, "gpu_uuid": None}]


def test_preflight_does_not_count_the_launching_process_as_a_competitor(tmp_path, fake_nvidia_smi):
    """train / export on the GPU earlier in the same flow-run process leave it holding GPU memory:
    a note, not a refusal (found on the H200: the bench after an in-process train was refused)."""
    mem, apps = fake_nvidia_smi
    apps.write_text(f"{os.getpid()}, 12810 MiB, GPU-aaaa\n")
    notes = preflight(fake_spec(tmp_path))
    assert any(f"this process (pid {os.getpid()}) holds GPU memory: 12810 MiB" in n for n in notes)
    apps.write_text(f"{os.getpid()}, 12810 MiB, GPU-aaaa\n4242, 100 MiB, GPU-aaaa\n")
    with pytest.raises(ServerConfigError, match=r"pid 4242 \(100 MiB\)") as err:
        preflight(fake_spec(tmp_path))
    assert str(os.getpid()) not in str(err.value)


def test_teardown_reports_gpu_memory_that_is_not_released(tmp_path, fake_nvidia_smi):
    mem, _ = fake_nvidia_smi
    spec = fake_spec(tmp_path)
    server = launch(spec, SGLANG, tmp_path / "server.log")  # baseline: 500 MiB
    gate(server, spec)
    mem.write_text("76000")  # field note 1: the GPU kept 76 GB after the kill
    report = server.stop(gpu_timeout_s=1.0)
    assert report.gpu_released is False
    assert any("GPU 0: 76000 MiB used (was 500 MiB" in p for p in report.problems)
    assert pid_file(server.log_path).exists()  # kept so reap() can try again
    assert group_members(server.pgid) == []

    spec2 = fake_spec(tmp_path)
    mem.write_text("500")
    with launch(spec2, SGLANG, tmp_path / "server2.log") as server2:
        gate(server2, spec2)
    assert server2.teardown.gpu_released is True


# ---------------------------------------------------------------------------------------------
# check_server end to end (command engine running the fake server)
# ---------------------------------------------------------------------------------------------

def test_check_server_ready(tmp_path):
    result = check_server(command_config(tmp_path), poll_s=0.1)
    assert result["status"] == "ready", result["message"]
    assert json.loads(json.dumps(result)) == result  # JSON-able
    assert result["teardown"]["problems"] == [] and result["phases"][0]["phase"] == "launch"
    assert Path(result["log_path"]).exists() and Path(result["launch_path"]).exists()
    # the command engine reads settings SGLang-style when the server answers /get_server_info
    assert result["settings"]["algorithm"] is None and result["settings_mismatch"] == []


@pytest.mark.parametrize("args,status,retryable", [
    (["--hang-in", "load_weights"], "stalled", True),
    (["--crash-in", "kv_cache"], "crashed", True),
    (["--generate-status", "500"], "health_timeout", True),
])
def test_check_server_failures(tmp_path, args, status, retryable):
    cfg = command_config(tmp_path, *args, stall=1.0 if status == "stalled" else 30.0,
                         startup=2.0 if status == "health_timeout" else 20.0)
    result = check_server(cfg, poll_s=0.1)
    assert result["status"] == status, result["message"]
    assert result["retryable"] is retryable and result["teardown"]["problems"] == []
    assert result["seconds"] < 10


def test_serve_forever_stops_cleanly_on_sigterm(tmp_path):
    # Prefect cancels with SIGTERM, whose default action would skip every `finally`
    seen = {}

    def on_ready(state):
        seen.update(state)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    result = serve_forever(command_config(tmp_path), on_ready=on_ready, poll_s=0.1)
    assert seen["status"] == "ready" and result["status"] == "stopped"
    assert result["teardown"]["problems"] == [] and result["teardown"]["signals"] == ["SIGTERM"]
    assert signal.getsignal(signal.SIGTERM) is previous
    assert port_free("127.0.0.1", int(result["base_url"].rsplit(":", 1)[1]))


def test_serve_forever_raises_when_the_server_dies(tmp_path):
    with pytest.raises(ServerCrashed) as info:
        serve_forever(command_config(tmp_path, "--exit-after-ready", "0.5"), poll_s=0.1)
    assert info.value.exit_code == 7 and info.value.phase == "serving"


def test_check_server_config_error_is_not_retryable(tmp_path):
    cfg = command_config(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", cfg.serve.port))
        s.listen()
        result = check_server(cfg)
    assert result["status"] == "config_error" and result["retryable"] is False
    assert "already in use" in result["message"] and result["teardown"] is None


# ---------------------------------------------------------------------------------------------
# The reference server (drafter/engines/reference/reference_server.py) on the tiny target
# ---------------------------------------------------------------------------------------------

def _tiny_target_path(request) -> str:
    if importlib.util.find_spec("drafter.engines.reference.reference_server") is None:
        pytest.skip("drafter/engines/reference/reference_server.py not there yet")
    pytest.importorskip("torch")
    try:
        target = request.getfixturevalue("tiny_target")
    except pytest.FixtureLookupError:
        pytest.skip("tiny_target fixture not there yet")
    return str(getattr(target, "path", target))


def reference_config(tmp_path, target: str, stall: float):
    return parse_config({
        "target": {"path": target, "name": "tiny"},
        "dump": {"aux_layer_ids": [0, 1, 2]}, "train": {"draft_vocab_size": 256},  # a 4-layer, 512-token target
        "serve": {"engine": "reference", "device": "cpu", "port": free_port(),
                  "log_dir": str(tmp_path / "logs"), "stall_timeout_s": stall, "startup_timeout_s": 120}})


def test_reference_server_ready(tmp_path, request):
    target = _tiny_target_path(request)
    result = check_server(reference_config(tmp_path, target, stall=60), poll_s=0.2)
    assert result["status"] == "ready", (result["message"], result.get("log_tail"))
    assert result["settings"].get("algorithm") is None and result["settings_mismatch"] == []
    assert "load_weights" in [p["phase"] for p in result["phases"]]


def test_reference_server_hang_is_stalled(tmp_path, request):
    target = _tiny_target_path(request)
    # torch/transformers imports are silent: the launch phase gets its own budget
    result = check_server(reference_config(tmp_path, target, stall=2.0), faults=["hang:load_weights"],
                          phase_budgets={"launch": 120.0}, poll_s=0.2)
    assert result["status"] == "stalled", result["message"]
    assert result["error"]["phase"] == "load_weights" and result["teardown"]["problems"] == []


def test_reference_server_speculative_settings_read_back(tmp_path, request):
    target = _tiny_target_path(request)
    from drafter.model import init_random_drafter

    draft = str(init_random_drafter(target, tmp_path / "draft", draft_vocab_size=128, seed=3))
    cfg = reference_config(tmp_path, target, stall=60)
    cfg.serve.speculative = {"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3}
    result = check_server(cfg, draft_path=draft, poll_s=0.2)
    assert result["status"] == "ready", (result["message"], result.get("log_tail"))
    settings = result["settings"]
    assert (settings["algorithm"], settings["num_steps"], settings["eagle_topk"], settings["num_draft_tokens"]) == (
        "EAGLE3", 2, 1, 3)
    assert result["settings_mismatch"] == []
    launch_record = json.loads(Path(result["launch_path"]).read_text())
    assert launch_record["argv"][launch_record["argv"].index("--speculative-draft-model-path") + 1] == draft


def test_start_that_fails_after_the_spawn_stops_the_server(tmp_path, monkeypatch):
    import drafter.serving.launcher as launcher

    def no_pid_file(pid):
        raise OSError("disk full")
    monkeypatch.setattr(launcher, "_start_ticks", no_pid_file)  # the pid file cannot be written
    server = ServerProcess(fake_spec(tmp_path), SGLANG, tmp_path / "server.log")
    with pytest.raises(OSError, match="disk full"):
        server.start()
    assert server.pgid is not None
    assert_all_gone(server)
