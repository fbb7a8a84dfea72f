"""Scratch folders of dead runs are removed by the next run of the same output; a live run's stay."""
from __future__ import annotations

import subprocess
import sys

from drafter import procs
from drafter.workdirs import remove_dead_runs_dirs, scratch_dir


def test_a_dead_runs_scratch_folder_is_removed_a_live_ones_kept(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_ticks = procs.start_ticks(dead.pid)
    dead.wait()
    left = tmp_path / f"drafter-export-abc123-{dead.pid}.{dead_ticks}-x1"   # what kill -9 leaves
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"x" * 10)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / f"drafter-export-abc123-{live.pid}.{procs.start_ticks(live.pid)}-x2"
        busy.mkdir()
        other = tmp_path / f"drafter-export-fff000-{dead.pid}.{dead_ticks}-x3"  # another output's
        other.mkdir()
        with scratch_dir("export", "abc123", root=str(tmp_path)) as mine:
            assert mine.is_dir() and mine.name.startswith("drafter-export-abc123-")
            assert not left.exists() and busy.exists() and other.exists()
        assert not mine.exists()
        assert "that died" in caplog.text
        assert remove_dead_runs_dirs("export", "abc123", root=str(tmp_path)) == []
    finally:
        live.kill()
        live.wait()
