"""Issue 32: what a hostile user could do through a shared log directory and a port, against real
processes and real files. A forged pid file never gets anything signalled; planted links are never
followed; two servers launched in the same second keep their own files; a port holder's secrets never
reach a message or the bench's committed failure record. ~30 s."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest

from drafter import procs
from drafter.serving.check import check_server
from drafter.server_errors import ServerConfigError
from drafter.serving.launcher import launch, launch_file
from drafter.serving.ownership import argv_digest, pid_file, reap, reap_stale
from drafter.serving.session import ServerSession
from tasks.common import reap_left_servers
from tests.fixtures.net import free_port
from tests.fixtures.servers import ROOT, SGLANG, command_config, fake_spec, gate

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]
# A session leader whose session holds one more process (a user's shell and its job, in effect).
LEADER = ("import subprocess, sys, time\n"
          "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
          "print(p.pid, flush=True)\n"
          "time.sleep(300)\n")


def _alive(pid: int) -> bool:
    st = procs.proc_stat(pid)
    return st is not None and st[0] not in "ZX"


@pytest.fixture
def bystanders():
    """Processes that are not ours to kill: `victim` in a session of its own, `decoy` leading a
    session whose other member is `decoy_child`, and the pid of a process that already exited."""
    started: list[subprocess.Popen] = []
    try:
        victim = subprocess.Popen(SLEEPER, start_new_session=True)
        started.append(victim)
        decoy = subprocess.Popen([sys.executable, "-c", LEADER], start_new_session=True,
                                 stdout=subprocess.PIPE, text=True)
        started.append(decoy)
        decoy_child = int(decoy.stdout.readline())
        gone = subprocess.Popen(["true"])
        gone.wait()
        yield SimpleNamespace(victim=victim.pid, decoy=decoy.pid, decoy_child=decoy_child, gone=gone.pid)
    finally:
        for proc in started:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.wait()
            if proc.stdout:
                proc.stdout.close()


def forge(path: Path, *, pid: int, pgid: int, sid: int, port: int, ticks: int | None, argv_of: int | None,
          tag: str = "f" * 32, owner: str = "run-A") -> Path:
    """A pid file as an attacker writes it: the real pid, start time and command-line hash of
    `pid` (all world-readable in /proc), and whatever group and session they want killed."""
    argv = procs.cmdline(argv_of) if argv_of else ["gone"]
    path.write_text(json.dumps({
        "pid": pid, "pgid": pgid, "sid": sid, "tag": tag, "start_ticks": ticks,
        "argv_sha256": argv_digest(argv), "engine": "sglang", "host": "127.0.0.1", "port": port,
        "launcher_pid": 4_000_000, "launcher_start_ticks": 1,
        "owner": {"kind": "prefect", "flow_run_id": owner}}))
    return path


def test_a_forged_pid_file_never_gets_anything_signalled(tmp_path, bystanders):
    b = bystanders
    cfg = command_config(tmp_path)
    logs = Path(cfg.serve.log_dir)
    logs.mkdir()
    port = cfg.serve.port
    decoy_ticks = procs.start_ticks(b.decoy)
    forged = [
        # a harmless decoy (really it: pid, start time, command line) and the victim's session
        forge(logs / "a.pid.json", pid=b.decoy, pgid=b.victim, sid=b.victim, port=port,
              ticks=decoy_ticks, argv_of=b.decoy),
        # the decoy's own group and session, as the kernel has them: still not a server of ours
        forge(logs / "b.pid.json", pid=b.decoy, pgid=b.decoy, sid=b.decoy, port=port,
              ticks=decoy_ticks, argv_of=b.decoy),
        # a leader that is gone, and the victim's session
        forge(logs / "c.pid.json", pid=b.gone, pgid=b.victim, sid=b.victim, port=port, ticks=1, argv_of=None),
    ]
    everyone = (b.victim, b.decoy, b.decoy_child)

    for path in forged:  # the library call (what the hooks and the CLI run)
        result = reap(path, grace_s=0.5, kill_wait_s=0.5, port_timeout_s=0.5)
        assert not result.get("signals"), (path.name, result)
        assert all(_alive(pid) for pid in everyone), (path.name, result)
    assert forged[0].exists() and forged[1].exists()  # a live process's file: a person decides

    forge(logs / "c.pid.json", pid=b.gone, pgid=b.victim, sid=b.victim, port=port, ticks=1, argv_of=None)
    for path in forged[:2]:  # `python -m drafter.serving.launcher reap FILE`
        res = subprocess.run([sys.executable, "-m", "drafter.serving.launcher", "reap", str(path), "--grace", "0.5"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert res.returncode == 1 and "nothing signalled" in res.stdout, res.stdout + res.stderr
    assert all(_alive(pid) for pid in everyone)

    # the flows' cancellation hook for the run the forged files claim
    reap_left_servers(None, SimpleNamespace(id="run-A", parameters={"config": cfg.model_dump(mode="json")}), None)
    assert all(_alive(pid) for pid in everyone)

    # the next launch's reaper, alone and through `drafter serve --check` (check_server)
    forge(logs / "c.pid.json", pid=b.gone, pgid=b.victim, sid=b.victim, port=port, ticks=1, argv_of=None)
    notes = reap_stale(logs, port)
    assert not any("reaped" in note for note in notes), notes
    assert all(_alive(pid) for pid in everyone)
    result = check_server(cfg, poll_s=0.1, grace_s=3.0)
    assert result["status"] == "ready", result["message"]
    assert not any("reaped" in note for note in result["notes"]), result["notes"]
    assert all(_alive(pid) for pid in everyone)


def test_a_pid_file_naming_a_real_server_still_reaps_it(tmp_path):
    """The verification does not stop the real thing: a left-behind server of ours (its watchdog
    and launcher gone) is reaped by its pid file, its whole group included."""
    spec = fake_spec(tmp_path, "--spawn-child")
    server = launch(spec, SGLANG, tmp_path / "server.log")
    try:
        gate(server, spec)
        server._watchdog.proc.kill()  # as if the launcher and its watchdog were killed together
        server._watchdog.proc.wait()
        members = procs.members(server.pgid, server.pgid, server.tag)
        assert len(members) == 2
        result = reap(server.pid_path, grace_s=2.0)
        assert result["reaped"] and result["problems"] == [], result
        assert not any(_alive(pid) for pid in members) and not server.pid_path.exists()
    finally:
        server.stop(grace_s=1.0)


def test_planted_links_are_never_followed(tmp_path):
    """A link under any name the launcher uses (log, launch record, pid file) fails the launch with
    one line; the file it points to keeps its content and mode."""
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    outside.chmod(0o644)
    for suffix in ("log", "launch", "pid"):
        cfg = command_config(tmp_path / suffix)
        session = ServerSession(cfg, poll_s=0.1, grace_s=3.0)
        names = {"log": session.log_path, "launch": launch_file(session.log_path), "pid": pid_file(session.log_path)}
        names[suffix].parent.mkdir(parents=True)
        names[suffix].symlink_to(outside)
        with pytest.raises(ServerConfigError, match="never reused or followed") as info:
            with session:
                pass
        assert str(names[suffix]) in info.value.message
        assert outside.read_text() == "precious\n" and outside.stat().st_mode & 0o777 == 0o644
        assert names[suffix].is_symlink()
        assert not list(names[suffix].parent.glob("*.pid.json")) or suffix == "pid"
    # the names of the old scheme (engine and UTC second, -2, -3...) for the next seconds: not ours any more
    cfg = command_config(tmp_path / "seconds")
    logs = Path(cfg.serve.log_dir)
    logs.mkdir(parents=True)
    now = time.time()
    for s in range(0, 40):  # the log names stay free, so the old scheme picked them and followed the rest
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now + s))
        for n in ("", "-2", "-3"):
            for ext in (".launch.json", ".pid.json"):
                (logs / f"command-{stamp}{n}{ext}").symlink_to(outside)
    result = check_server(cfg, poll_s=0.1, grace_s=3.0)
    assert result["status"] == "ready", result["message"]
    assert outside.read_text() == "precious\n" and outside.stat().st_mode & 0o777 == 0o644


def test_a_missing_log_dir_is_created_owner_only(tmp_path):
    cfg = command_config(tmp_path)
    result = check_server(cfg, poll_s=0.1, grace_s=3.0)
    assert result["status"] == "ready", result["message"]
    assert Path(cfg.serve.log_dir).stat().st_mode & 0o777 == 0o700


def test_two_servers_launched_at_once_keep_their_own_files(tmp_path):
    a, b = command_config(tmp_path), command_config(tmp_path)
    assert a.serve.log_dir == b.serve.log_dir and a.serve.port != b.serve.port
    # both named in the same second, before either file exists (fan-out children on one host)
    session_a, session_b = ServerSession(a, poll_s=0.1, grace_s=3.0), ServerSession(b, poll_s=0.1, grace_s=3.0)
    assert session_a.log_path != session_b.log_path
    with ExitStack() as stack:
        served_a = stack.enter_context(session_a)
        served_b = stack.enter_context(session_b)
        pid_a, pid_b = (json.loads(pid_file(s.log_path).read_text()) for s in (served_a, served_b))
        assert pid_a["port"] == a.serve.port and pid_b["port"] == b.serve.port
        for served, cfg in ((served_a, a), (served_b, b)):
            assert json.loads(served.launch_path.read_text())["base_url"].endswith(f":{cfg.serve.port}")
            other = (b if cfg is a else a).serve.port
            assert f"--port {other}" not in " ".join(json.loads(served.launch_path.read_text())["argv"])
        session_a.__exit__(None, None, None)  # A stops first: B's pid file stays
        assert session_a.teardown.ok and not pid_file(served_a.log_path).exists()
        assert json.loads(pid_file(served_b.log_path).read_text()) == pid_b
    assert session_b.teardown.ok and not pid_file(served_b.log_path).exists()


HOLDER = ("import socket, sys, time\n"
          "s = socket.create_server(('127.0.0.1', int(sys.argv[1])))\n"
          "print(1, flush=True)\n"
          "time.sleep(300)\n")


def test_a_port_holders_secrets_reach_no_message_and_no_failure_record(tmp_path, monkeypatch):
    from drafter.config import parse_config
    from drafter.errors import DrafterError
    from drafter.stages import TABLE
    from tests.fixtures.bench import FAKE, FAST, S314, UPSTREAM, fake_config, make_store, no_servers_left

    key, ours = "holder-Api-Key-5d1e93", "our-Secret-Token-8c2f40"
    monkeypatch.setenv("MYTOK_FOR_TEST", ours)
    store = make_store(tmp_path)
    raw = fake_config(tmp_path, [S314], bench_extra={"repeats": 1, "batch_sizes": [1], "num_prompts": 2})
    raw = raw.model_dump(mode="json")
    # our servers get the secret after flags whose names do not look secret (issue 32, item 3)
    raw["serve"]["secrets"] = {"MYTOK": "env:MYTOK_FOR_TEST"}
    # (sh drops them and hands the fake server the rest: the speculative flags the bench appends)
    raw["serve"]["command"] = ["sh", "-c", f'port=$0 name=$1; shift 4; exec {sys.executable} {FAKE} --port "$port" '
                               f'--served-model-name "$name" --step-s 0.005 --decode --token-delay-s 0.002 "$@"',
                               "{port}", "{served_model_name}",
                               "--extra-x", "{secret:MYTOK}", "--header=Authorization: Bearer {secret:MYTOK}"]
    cfg = parse_config(raw)
    (tmp_path / "holder.py").write_text(HOLDER)
    # another program holds the baseline's port, its key on its command line and our token as a plain argument
    holder = subprocess.Popen([sys.executable, "holder.py", str(cfg.serve.port), "--api-key", key, ours],
                              cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()
        with pytest.raises(DrafterError) as err:
            TABLE.run("bench", cfg, store, upstream=UPSTREAM, session_options=FAST)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    out = TABLE.output("bench", cfg, store, UPSTREAM)
    record = out.read_shard("failed/baseline.json")
    text = record if isinstance(record, str) else record.decode()
    assert json.loads(text)["kind"] == "port_taken" and f"pid {holder.pid} (" in text
    message = str(err.value)
    assert f"pid {holder.pid}" in message
    launches = [name for name in out.completed_shards() if name.startswith("launches/")]
    assert launches, "the speculative server launched and recorded its launch"
    for what, blob in [("message", message), ("failed record", text)] + \
                      [(name, out.read_shard(name)) for name in launches]:
        blob = blob if isinstance(blob, str) else blob.decode()
        assert key not in blob and ours not in blob, what
    for path in (tmp_path / "logs").iterdir():
        assert ours.encode() not in path.read_bytes() and key.encode() not in path.read_bytes(), path
    no_servers_left(tmp_path / "logs")
