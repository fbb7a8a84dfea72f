"""A cancelled run never leaves a server behind: SIGTERM tears it down, and the flow's
cancellation hook reaps what a killed run left (it runs in another process, from the pid file)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from drafter.serving.ownership import group_members
from tasks.common import reap_left_servers
from tests.fixtures.net import free_port
from tests.fixtures.servers import FAKE, ROOT, wait_for_pid_file, wait_gone


def hanging_server_config(tmp_path) -> dict:
    port = free_port()
    return {
        "target": {"path": str(tmp_path), "name": "fake-model", "num_hidden_layers": 8, "vocab_size": 1000},
        "train": {"draft_vocab_size": 100}, "dump": {"aux_layer_ids": [1, 3, 4]},
        "serve": {"engine": "command", "port": port, "log_dir": str(tmp_path / "logs"),
                  "command": [sys.executable, str(FAKE), "--port", "{port}", "--hang-in", "cuda_graph"],
                  "health_url": f"http://127.0.0.1:{port}/health",
                  "stall_timeout_s": 600, "startup_timeout_s": 600}}


def start_checker(tmp_path, run_id: str = "run-A") -> subprocess.Popen:
    """A process running check_server, as flow run `run_id`, against a server that hangs in
    CUDA-graph capture."""
    code = ("import json,sys; from drafter.config import parse_config; "
            "from drafter.serving.check import check_server; from drafter.serving.ownership import owned_by\n"
            f"with owned_by(kind='prefect', flow_run_id={run_id!r}):\n"
            "    check_server(parse_config(json.loads(sys.argv[1])))")
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(hanging_server_config(tmp_path))],
                            cwd=ROOT)


def wait_for_hang(info, timeout=120.0) -> None:
    """Until the server sits silent in CUDA-graph capture (it no longer writes to its log pipe)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "Capture cuda graph bs" in Path(info["log_path"]).read_text():
            time.sleep(0.3)
            return
        time.sleep(0.1)
    raise AssertionError("the server never reached CUDA-graph capture")



def test_sigterm_to_the_run_tears_the_server_down(tmp_path):
    checker = start_checker(tmp_path)
    info = wait_for_pid_file(tmp_path)
    wait_for_hang(info)
    assert group_members(info["pgid"], info.get("sid"))
    checker.send_signal(signal.SIGTERM)  # what Prefect sends a cancelled run
    checker.wait(timeout=60)
    assert wait_gone(info)
    assert not info["path"].exists()


def test_sigkill_of_the_run_takes_its_server_along(tmp_path):
    checker = start_checker(tmp_path)
    info = wait_for_pid_file(tmp_path)
    wait_for_hang(info)
    os.kill(checker.pid, signal.SIGKILL)  # no finally runs; the watchdog sees its pipe close
    checker.wait(timeout=10)
    assert wait_gone(info)  # within the watchdog's grace period (10 s) + SIGKILL


def test_cancellation_hook_reaps_only_its_own_runs_server(tmp_path):
    checker = start_checker(tmp_path, run_id="run-A")
    info = wait_for_pid_file(tmp_path)
    wait_for_hang(info)
    os.kill(info["watchdog_pid"], signal.SIGKILL)  # the watchdog dies too: only the hook is left
    os.kill(checker.pid, signal.SIGKILL)
    checker.wait(timeout=10)
    time.sleep(0.5)
    assert group_members(info["pgid"], info.get("sid")), "nothing else stops this server"
    params = {"config": hanging_server_config(tmp_path) | {
        "serve": {**hanging_server_config(tmp_path)["serve"], "log_dir": str(tmp_path / "logs")}}}
    reap_left_servers(None, SimpleNamespace(id="run-B", parameters=params), None)  # another run's hook
    time.sleep(0.5)
    assert group_members(info["pgid"], info.get("sid")) and info["path"].exists()
    reap_left_servers(None, SimpleNamespace(id="run-A", parameters=params), None)
    assert wait_gone(info)
    assert not info["path"].exists()


def test_sigterm_becomes_an_interrupt_only_where_nothing_else_handles_it():
    from drafter.serving.session import Terminated, sigterm_as_interrupt

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(Terminated):
            with sigterm_as_interrupt():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

        class Cancelled(BaseException):  # what Prefect's engine raises: it reads a cancellation from it
            pass

        def engines_handler(signum, frame):
            raise Cancelled()

        signal.signal(signal.SIGTERM, engines_handler)
        with pytest.raises(Cancelled):
            with sigterm_as_interrupt():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
        assert signal.getsignal(signal.SIGTERM) is engines_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


LAUNCHER = """
import subprocess, sys, time
from drafter import procs
server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
procs.Watchdog(server.pid, server.pid, "no-tag", grace_s=1.0)
print(server.pid, flush=True)
time.sleep(300)
"""


def test_the_watchdog_ends_the_server_when_the_launchers_log_pipe_is_gone_too():
    """A stopped Prefect worker takes the pipe its runs log to: the watchdog's "launcher gone" line
    hits a broken pipe, and it must still end the server."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    server = int(launcher.stdout.readline())
    launcher.stdout.close()
    launcher.stderr.close()  # nobody reads the launcher's (and so the watchdog's) stderr any more
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and group_members(server, server):
        time.sleep(0.1)
    left = group_members(server, server)
    if left:
        os.killpg(server, signal.SIGKILL)
    assert not left, f"server {server} outlived its launcher"
