"""The CLI's one error boundary as a user meets it: the installed `drafter` script, a real process.
Usage errors are a usage line and exit 2, never a traceback (typer >= 0.29 raises its vendored
click's exceptions, which the boundary must catch too)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DRAFTER = str(Path(sys.executable).with_name("drafter"))


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([DRAFTER, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.parametrize("args, says", [
    (["train"], "Missing option '--config'"),
    (["train", "--config", "x.yaml", "--bogus"], "No such option: --bogus"),
    (["train", "--config", "x.yaml", "--nproc-per-node", "abc"], "Invalid value for '--nproc-per-node'"),
    (["nosuchcommand"], "No such command 'nosuchcommand'"),
    (["storage-estimate", "--tokens", "1e6", "--hidden", "64", "--dtype", "int3"], "'int3' is not one of"),
    (["storage-estimate", "--tokens", "-5", "--hidden", "64"], "a corpus has at least 1 token"),
    (["storage-estimate", "--tokens", "1e6", "--hidden", "0"], "a hidden size is at least 1"),
    (["verify", "file://"], "an output URI is ROOT/STAGE/FINGERPRINT"),
    (["verify", "file:///tmp/store/notastage/ab12"], "an output URI is ROOT/STAGE/FINGERPRINT"),
])
def test_usage_errors_are_a_usage_line_and_exit_2(args, says):
    out = _run(*args)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) <= 6, out.stderr
    assert "Usage: drafter" in out.stderr and says in out.stderr, out.stderr


@pytest.mark.slow
def test_export_out_is_checked_before_the_stage_runs(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    onto_file = _run("export", "--config", "profiles/demo.yaml", "--out", "README.md", cwd=repo)
    assert onto_file.returncode == 2 and "README.md exists and is not a folder" in onto_file.stderr
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        unwritable = _run("export", "--config", "profiles/demo.yaml", "--out", str(locked / "x"), cwd=repo)
    finally:
        locked.chmod(0o700)
    if unwritable.returncode != 2:  # root writes anywhere: fall back to a path under a file
        unwritable = _run("export", "--config", "profiles/demo.yaml", "--out", "README.md/x", cwd=repo)
    assert unwritable.returncode == 2 and "cannot write into" in unwritable.stderr, unwritable.stderr
    assert "Traceback" not in unwritable.stderr


def test_storage_estimate_still_answers():
    out = _run("storage-estimate", "--tokens", "87.8e6", "--hidden", "7168")
    assert out.returncode == 0 and "87.8M tokens at hidden 7168" in out.stdout, out


def test_sigterm_exits_143_and_saves_nothing(tmp_path):
    """Any command, not only serve: the CLI turns SIGTERM into an interrupt (cleanup runs) and exit 143."""
    import signal
    import time

    import yaml

    repo = Path(__file__).resolve().parents[2]
    profile = yaml.safe_load((repo / "profiles" / "demo.yaml").read_text())
    profile["target"]["path"] = str(tmp_path / "target")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(profile))
    log = (tmp_path / "err.txt").open("w")
    proc = subprocess.Popen([DRAFTER, "demo-target", "--config", str(tmp_path / "p.yaml")], cwd=repo,
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None \
            and "demo target:" not in (tmp_path / "err.txt").read_text():
        time.sleep(0.2)  # training has started once its progress bar shows
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    err = (tmp_path / "err.txt").read_text()
    assert proc.returncode == 143, err[-2000:]
    assert "terminated" in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "target" / "model.safetensors").exists()


def test_expected_failures_of_issue_32_are_one_line_with_their_exit_code(tmp_path):
    """Each used to end in a traceback or the wrong exit code (issue 32): a store root under a file
    (a 46-line traceback), a store that does not exist (created by verify), `serve --check` of a
    configuration error (exit 1, not 2)."""
    import yaml

    passwd = _run("verify", "file:///../../etc/passwd/dump/abc")
    assert passwd.returncode == 2 and "Traceback" not in passwd.stderr
    assert passwd.stderr.strip() == "error (StoreRootError): storage root file:///etc/passwd is a file, not a directory"
    nowhere = _run("verify", f"file://{tmp_path}/nowhere/dump/ab12cd34ef56ab78")
    assert nowhere.returncode == 4 and "Traceback" not in nowhere.stderr
    assert nowhere.stderr.strip().splitlines()[-1] == (f"error (ObjectNotFound): no store at file://{tmp_path}/nowhere: "
                                                        f"the directory does not exist")
    assert not (tmp_path / "nowhere").exists()
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump({
        "target": {"path": str(tmp_path / "no-model"), "num_hidden_layers": 8, "vocab_size": 1000},
        "serve": {"engine": "reference", "device": "cpu", "draft_path": str(tmp_path),
                  "log_dir": str(tmp_path / "logs")},
        "storage": {"root": f"file://{tmp_path}/store"}}))
    check = _run("serve", "--check", "--config", str(profile))
    assert check.returncode == 2 and "Traceback" not in check.stderr, check.stderr
    assert '"status": "config_error"' in check.stdout
    assert check.stderr.strip().splitlines()[-1].startswith("error (config_error): preflight failed: model path "
                                                            f"does not exist: {tmp_path / 'no-model'}")
