"""One run per output on a host (drafter.workdirs, drafter.stages.base): two real `drafter run`
processes of one datagen or dump output at once do the work once (the second waits, naming the
first's pid, then finds the output complete and skips it, exit 0); runs on two hosts (two temp
directories: no shared lock) both end well, the loser reporting the output complete; the lock file
is never a planted symlink, FIFO or hard link; `workers: 3` outside Prefect says so on stderr."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from drafter.config import StorageConfig, config_to_yaml, parse_config
from drafter.stages import TABLE
from drafter.store import open_store
from drafter.training.workdir import TrainInProgress, train_lock
from drafter.workdirs import OutputBusy, OutputLock, UnsafeLockFile, lock_path, output_lock
from tests.fixtures.datagen_fakes import fakes, make_cfg, prepared, sharegpt, with_datagen  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 300  # an upper bound only: every wait below ends as soon as what it waits for happens

# The CLI's own entry point in a fresh interpreter; TEST_GATE holds the dump after it tokenized
# its first shard (until the gate file exists), TEST_WRITES logs every verified shard write.
CLI = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path

    if os.environ.get("TEST_GATE"):
        from drafter.capture import tokenized
        real_tokenize, gate = tokenized.tokenize_shard, Path(os.environ["TEST_GATE"])

        def held(*args, **kwargs):
            built = real_tokenize(*args, **kwargs)
            gate.with_suffix(".reached").touch()
            while not gate.exists():
                time.sleep(0.05)
            return built

        tokenized.tokenize_shard = held
    if os.environ.get("TEST_WRITES"):
        from drafter.stage_output import StageOutput
        real_write = StageOutput.write_shard

        def write_shard(self, name, data, meta=None):
            info = real_write(self, name, data, meta)
            with open(os.environ["TEST_WRITES"], "a") as f:
                f.write(f"{os.getpid()} {name}\\n")
            return info

        StageOutput.write_shard = write_shard
    from drafter.cli import main
    sys.argv = ["drafter", *sys.argv[1:]]
    main()
""")


class Cli:
    """`drafter ARGV...` in its own process, its stdout and stderr in files (read while it runs)."""

    def __init__(self, tmp: Path, name: str, argv: list[str], **env: str):
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        child_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", CLI, *argv], cwd=REPO, env=child_env, stdout=out,
                                         stderr=err)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.err.read_text()

    def stdout(self) -> str:
        return self.out.read_text()

    def wait(self, timeout: float = WAIT_S) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def clis():
    started: list[Cli] = []

    def start(*args, **kwargs) -> Cli:
        started.append(Cli(*args, **kwargs))
        return started[-1]

    yield start
    for cli in started:
        cli.kill()


def wait_until(what: str, done, *alive: Cli, timeout: float = WAIT_S) -> None:
    """Until `done()`; fails at once when one of `alive` ended meanwhile (naming its output)."""
    deadline = time.monotonic() + timeout
    while not done():
        for cli in alive:
            assert cli.proc.poll() is None, f"{what}: pid {cli.pid} ended ({cli.proc.returncode}):\n{cli.stderr()}"
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.05)


def assert_waited_for(cli: Cli, stage: str, holder: Cli) -> None:
    # the line may follow the progress bar's last redraw on the same terminal line
    lines = [l[l.index(f"{stage}: output "):] for l in cli.stderr().splitlines() if "is being computed by" in l]
    assert lines and f"pid {holder.pid} on " in lines[0] and "waiting for that run to end" in lines[0], cli.stderr()


def outcome(cli: Cli) -> str:
    return next(l for l in cli.stdout().splitlines() if l.startswith("stage "))


# ---------------------------------------------------------------------------------- the lock file


def test_a_planted_symlink_is_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    planted = lock_path("datagen", "0123456789abcdef", root=str(tmp_path))
    planted.symlink_to(victim)
    with pytest.raises(UnsafeLockFile, match="symbolic link") as err:
        OutputLock("datagen", "0123456789abcdef", root=str(tmp_path)).acquire(wait=True)
    assert str(planted) in str(err.value) and not err.value.retryable
    assert victim.read_text() == "precious\n" and planted.is_symlink()  # not written, not removed

    dangling = lock_path("dump", "0123456789abcdef", root=str(tmp_path))
    dangling.symlink_to(tmp_path / "created-through-the-link")
    with pytest.raises(UnsafeLockFile, match="symbolic link"):
        OutputLock("dump", "0123456789abcdef", root=str(tmp_path)).acquire(wait=False)
    assert not (tmp_path / "created-through-the-link").exists()


def test_the_train_lock_refuses_a_planted_symlink_too(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "drafter-train-0123456789abcdef.lock").symlink_to(victim)
    with pytest.raises(UnsafeLockFile, match="symbolic link"):
        with train_lock("0123456789abcdef"):
            pass
    assert victim.read_text() == "precious\n"


def test_a_fifo_or_a_hard_link_is_refused_and_a_lock_file_is_private(tmp_path):
    root = str(tmp_path)
    os.mkfifo(lock_path("dump", "fifo", root=root))
    with pytest.raises(UnsafeLockFile, match="not a regular file"):  # and never blocks on the FIFO
        OutputLock("dump", "fifo", root=root).acquire(wait=False)
    other = tmp_path / "other"
    other.write_text("x")
    os.link(other, lock_path("dump", "linked", root=root))
    with pytest.raises(UnsafeLockFile, match="2 hard links"):
        OutputLock("dump", "linked", root=root).acquire(wait=False)
    assert other.read_text() == "x"

    old = os.umask(0)
    try:
        with output_lock("dump", "fresh", wait=False, root=root):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(lock_path("dump", "fresh", root=root).stat().st_mode) == 0o600
    wide = lock_path("dump", "wide", root=root)
    wide.write_text("")
    wide.chmod(0o666)
    with output_lock("dump", "wide", wait=False, root=root):
        assert stat.S_IMODE(wide.stat().st_mode) == 0o600
        assert json.loads(wide.read_text())["pid"] == os.getpid()


HOLDER = textwrap.dedent("""
    import sys, time
    from drafter.workdirs import output_lock
    with output_lock("dump", "held", wait=False, root=sys.argv[1]):
        print("held", flush=True)
        sys.stdin.readline()
""")


def test_refused_or_waiting_a_second_run_names_the_holders_pid(tmp_path):
    root = str(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, root], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(OutputBusy) as busy:
            OutputLock("dump", "held", root=root).acquire(wait=False)
        assert f"pid {holder.pid} on " in str(busy.value) and str(lock_path("dump", "held", root=root)) in str(busy.value)
        assert busy.value.retryable

        told = []

        def waiting(who, path, waited_s):
            told.append(who["pid"])
            holder.stdin.write("go\n")  # the holder lets go once we said whom we wait for
            holder.stdin.flush()

        with output_lock("dump", "held", wait=True, on_wait=waiting, root=root, poll_s=0.02):
            assert told == [holder.pid]
        assert holder.wait(WAIT_S) == 0
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------------- two real runs of one output


def _datagen_profile(tmp_path: Path, url: str, **datagen) -> tuple[Path, object, str]:
    cfg = with_datagen(make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"),
                                [sharegpt(i) for i in range(8)], concurrency_per_server=1, **datagen),
                       server_urls=[url])
    store = open_store(cfg.storage)
    fp = prepared(cfg, store)
    path = tmp_path / "datagen.yaml"
    path.write_text(config_to_yaml(cfg))
    return path, cfg, fp


def test_two_runs_of_one_datagen_output_do_the_work_once(tmp_path, fakes, clis):
    fake = fakes()
    fake.hold_after = 0  # every request waits for release(): the first run holds its output meanwhile
    profile, cfg, fp = _datagen_profile(tmp_path, fake.url)
    (tmp_path / "tmp").mkdir()
    first = clis(tmp_path, "first", ["run", "datagen", "--config", str(profile)], TMPDIR=str(tmp_path / "tmp"))
    wait_until("the first run's first request", lambda: fake.received, first)
    second = clis(tmp_path, "second", ["run", "datagen", "--config", str(profile)], TMPDIR=str(tmp_path / "tmp"))

    def second_waits() -> bool:
        assert max(Counter(fake.prompts).values()) == 1, f"asked twice: {sorted(fake.prompts)}\n{second.stderr()}"
        return "is being computed by" in second.stderr()

    wait_until("the second run's waiting line", second_waits, first, second)
    assert_waited_for(second, "datagen", first)
    fake.release()
    assert first.wait() == 0, first.stderr()
    assert second.wait() == 0, second.stderr()
    assert Counter(fake.prompts) == {f"question {i}.0": 1 for i in range(8)}  # each asked once, by the first
    assert outcome(first).startswith("stage datagen: done ")
    assert outcome(second).startswith("stage datagen: skipped (output already complete) ")
    assert "reset()" not in second.stderr() + second.stdout()


def test_a_run_whose_output_another_host_committed_meanwhile_reports_it_complete(tmp_path, fakes, clis):
    """No shared lock (two temp directories, as on two hosts sharing a store): the second run is
    at work (its requests held) when the first commits the output; the second then finds it
    committed under it and reports it complete, exit 0 (never `call reset()`, exit 3)."""
    slow, fast = fakes(), fakes()
    slow.hold_after = 0
    profile, cfg, fp = _datagen_profile(tmp_path, slow.url)
    fast_profile = tmp_path / "fast.yaml"
    fast_profile.write_text(config_to_yaml(with_datagen(cfg, server_urls=[fast.url])))  # operational: same output
    for host in ("a", "b"):
        (tmp_path / host).mkdir()
    late = clis(tmp_path, "late", ["run", "datagen", "--config", str(profile)], TMPDIR=str(tmp_path / "a"))
    wait_until("the late run at work", lambda: slow.received, late)
    first = clis(tmp_path, "first", ["run", "datagen", "--config", str(fast_profile)], TMPDIR=str(tmp_path / "b"))
    assert first.wait() == 0, first.stderr()
    assert outcome(first).startswith("stage datagen: done ")
    slow.release()
    assert late.wait() == 0, late.stderr()
    assert outcome(late).startswith("stage datagen: skipped (output already complete) "), late.stdout()
    assert "was committed by another run of the same output while this one worked" in late.stderr()
    assert "reset()" not in late.stderr() + late.stdout() and "error" not in late.stderr(), late.stderr()
    assert TABLE.output("datagen", cfg, open_store(cfg.storage), {"prepare": fp}).is_complete()


def _dump_profile(tmp_path: Path, target, conversations, workers: int = 1) -> tuple[Path, object]:
    source = tmp_path / "conversations.jsonl"
    source.write_text("".join(json.dumps({"id": c["id"], "messages": [
        {"role": m["role"], "content": m["content"][:40 + 23 * (k % 5)]} for m in c["messages"][:4]]}) + "\n"
        for k, c in enumerate(conversations[:8])))
    cfg = parse_config({"target": {"path": str(target)},
                        "data": {"sources": [{"kind": "jsonl", "path": str(source)}], "eval_fraction": 0},
                        "dump": {"aux_layer_ids": [0, 1, 2], "max_length": 160, "tokens_per_batch": 400,
                                 "samples_per_shard": 2, "devices": ["cpu"], "upstream": "prepare",
                                 "workers": workers},
                        "train": {"draft_vocab_size": 256}, "storage": {"root": f"file://{tmp_path}/store"}})
    TABLE.run("prepare", cfg, open_store(cfg.storage))
    path = tmp_path / "dump.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path, cfg


def test_two_runs_of_one_dump_output_do_the_work_once(tmp_path, tiny_target, tiny_conversations, clis):
    """The first (`drafter dump`, workers: 3 outside Prefect) is held after tokenizing its first
    shard; the second (`drafter run dump`) waits for it, then skips. Each shard is written once.
    The first says on stderr that `workers: 3` does not fan out here (no on_line: a warning)."""
    profile, cfg = _dump_profile(tmp_path, tiny_target, tiny_conversations, workers=3)
    tmp, gate, writes = tmp_path / "tmp", tmp_path / "gate", tmp_path / "writes.log"
    tmp.mkdir()
    first = clis(tmp_path, "first", ["dump", "--config", str(profile)], TMPDIR=str(tmp), TEST_GATE=str(gate),
                 TEST_WRITES=str(writes))
    wait_until("the first dump at work", gate.with_suffix(".reached").exists, first)
    second = clis(tmp_path, "second", ["run", "dump", "--config", str(profile)], TMPDIR=str(tmp),
                  TEST_WRITES=str(writes))
    wait_until("the second run's waiting line", lambda: "is being computed by" in second.stderr(), first, second)
    assert_waited_for(second, "dump", first)
    assert not writes.exists() or not writes.read_text()  # nothing written yet by either
    gate.touch()
    assert first.wait() == 0, first.stderr()
    assert second.wait() == 0, second.stderr()
    written = [line.split() for line in writes.read_text().splitlines()]
    assert {pid for pid, _ in written} == {str(first.pid)}, written
    names = [name for _, name in written]
    assert len(names) == len(set(names)) == 4, names  # 8 samples, 2 per shard: each shard once
    assert outcome(second).startswith("stage dump: skipped (output already complete) ")
    assert "dump: dump.workers = 3 fans out only in the Prefect flow; computing all 4 pending shards here" in \
        first.stderr(), first.stderr()


def test_workers_outside_prefect_is_said_on_the_clis_stderr(tmp_path, fakes, clis):
    fake = fakes()
    profile, cfg, fp = _datagen_profile(tmp_path, fake.url, workers=3)
    run = clis(tmp_path, "run", ["run", "datagen", "--config", str(profile)])
    assert run.wait() == 0, run.stderr()
    assert ("datagen: datagen.workers = 3 fans out only in the Prefect flow; computing all 4 pending shards here"
            in run.stderr()), run.stderr()
