"""Servers never outlive what started them, and the next launch says what it found: real processes
(the stdlib fake server), kill -9, stale pid files, a daemonising server, a 503 that is not a
stall, the foreground server's exit code. ~25 s, most of it waiting for real teardowns."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from drafter.serving.check import check_server
from drafter.server_errors import HealthCheckTimeout, ServerConfigError
from drafter.serving.launcher import launch, preflight
from drafter.serving.ownership import group_members, reap
from tests.fixtures.servers import ROOT, SGLANG, command_config, fake_spec, gate, wait_for_pid_file, wait_gone


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def wait_healthy(url: str, timeout: float = 120.0) -> None:  # generous: a loaded machine
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server never turned healthy"
        time.sleep(0.1)


def test_stale_server_of_a_dead_run_is_reaped_by_the_next_launch(tmp_path):
    cfg = command_config(tmp_path)
    code = ("import json,sys; from drafter.config import parse_config; "
            "from drafter.serving.check import serve_forever; serve_forever(parse_config(json.loads(sys.argv[1])))")
    run = subprocess.Popen([sys.executable, "-c", code, cfg.model_dump_json()], cwd=ROOT,
                           stderr=subprocess.DEVNULL)
    info = wait_for_pid_file(tmp_path)
    wait_healthy(cfg.serve.health_url)  # silent from then on: no write into the dead run's pipe
    os.kill(info["watchdog_pid"], signal.SIGKILL)  # both die at once: nothing stops the server
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    time.sleep(0.3)
    assert group_members(info["pgid"], info["sid"]), "the orphan holds the port"

    result = check_server(cfg, poll_s=0.1)
    assert result["status"] == "ready", result["message"]
    assert any(f"reaped a server left by a dead run on port {cfg.serve.port}: pid {info['pid']}" in note
               for note in result["notes"]), result["notes"]
    assert not group_members(info["pgid"], info["sid"]) and not info["path"].exists()


def test_a_port_held_by_another_process_names_it(tmp_path):
    spec = fake_spec(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import socket,sys,time; s=socket.socket(); "
                               "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                               f"s.bind(('127.0.0.1', {spec.port})); s.listen(); print(1, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()
        with pytest.raises(ServerConfigError, match=rf"port {spec.port} on 127.0.0.1 is already in use by pid {holder.pid} "):
            preflight(spec, check_gpus=False)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_a_daemonised_child_is_torn_down_and_reap_never_says_gone_while_it_listens(tmp_path):
    child_pid_file = tmp_path / "daemon.pid"
    spec = fake_spec(tmp_path)
    # `setsid -f`: the child leaves the server's process group AND session, yet keeps the tag.
    spec.argv = ["sh", "-c", f"setsid -f sh -c 'echo $$ > {child_pid_file}; exec sleep 300'; exec \"$@\"",
                 "sh", *spec.argv]
    with launch(spec, SGLANG, tmp_path / "server.log") as server:
        gate(server, spec)
        while not child_pid_file.exists() or not child_pid_file.read_text().strip():
            time.sleep(0.05)
        daemon = int(child_pid_file.read_text())
        assert daemon not in group_members(server.pgid, server.pgid)  # out of group and session
        assert daemon in group_members(server.pgid, server.pgid, server.tag)
    assert server.teardown.ok and not _alive(daemon)

    # A pid file whose processes are gone while its port is still held: reap says who holds it.
    other = fake_spec(tmp_path)
    listener = subprocess.Popen([sys.executable, "-c", "import socket,time; s=socket.socket(); "
                                 f"s.bind(('127.0.0.1', {other.port})); s.listen(); print(1, flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        listener.stdout.readline()
        pid_path = tmp_path / "gone.pid.json"
        pid_path.write_text(json.dumps({"pid": 999999, "pgid": 999999, "sid": 999999, "tag": "nope",
                                        "port": other.port, "start_ticks": 1}))
        result = reap(pid_path)
        assert result["reaped"] is False and f"held by pid {listener.pid}" in result["reason"]
        assert pid_path.exists()
    finally:
        listener.kill()
        listener.wait()
        listener.stdout.close()


def test_a_server_answering_503_is_a_health_timeout_not_a_stall(tmp_path):
    # the HTTP server is up and answers 503; the log is silent for longer than the stall budget
    spec = fake_spec(tmp_path, "--hang-in", "http_server", "--health-status", "503")
    with pytest.raises(HealthCheckTimeout) as info:
        with launch(spec, SGLANG, tmp_path / "server.log") as server:
            gate(server, spec, startup=3.0, stall=0.5)
    assert "health: HTTP 503" in info.value.message and info.value.reasons["health"].startswith("HTTP 503")
    assert server.teardown.ok


def test_foreground_serve_exits_143_after_sigterm_and_files_are_owner_only(tmp_path):
    cfg = command_config(tmp_path)
    profile = tmp_path / "serve.yaml"
    profile.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    proc = subprocess.Popen([sys.executable, "-m", "drafter.cli", "serve", "--config", str(profile), "--quiet"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    info = wait_for_pid_file(tmp_path)
    wait_healthy(cfg.serve.health_url)
    for path in (info["path"], Path(info["log_path"]), Path(info["log_path"]).with_suffix(".launch.json")):
        assert path.stat().st_mode & 0o077 == 0, path
    time.sleep(0.5)  # past the gate, serving
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert wait_gone(info)


def test_a_port_held_by_our_live_server_names_its_pid_file_and_reap(tmp_path):
    spec = fake_spec(tmp_path)
    with launch(spec, SGLANG, tmp_path / "server.log") as server:
        gate(server, spec)
        again = fake_spec(tmp_path)
        again.port = spec.port
        with pytest.raises(ServerConfigError) as info:
            preflight(again, check_gpus=False)
    message = str(info.value)
    assert f"port {spec.port} on 127.0.0.1 is already in use by our sglang server pid {server.pid}" in message
    assert f"launched by pid {os.getpid()} (running)" in message
    assert f"python -m drafter.serving.launcher reap {server.pid_path}" in message
