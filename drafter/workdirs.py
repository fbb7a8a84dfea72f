"""Local scratch folders that a dead run does not leave behind.

A stage's scratch folder is named after the stage, its output fingerprint and its owner (pid and
start time): `<tmp>/drafter-<stage>-<fp>-<pid>.<ticks>-*`. `kill -9` skips the cleanup, so the next
run of the same output removes the folders whose owner is gone (never a live run's), and says so.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from drafter.serving import procs

log = logging.getLogger(__name__)


def _prefix(stage: str, fp: str) -> str:
    return f"drafter-{stage}-{fp}-"


def remove_dead_runs_dirs(stage: str, fp: str, root: str | None = None) -> list[Path]:
    """Remove the scratch folders of `stage`/`fp` whose owning process is gone."""
    removed = []
    owner = re.compile(re.escape(_prefix(stage, fp)) + r"(\d+)\.(\d+)-")
    for path in sorted(Path(root or tempfile.gettempdir()).glob(_prefix(stage, fp) + "*")):
        m = owner.match(path.name)
        if m and path.is_dir() and not procs.alive(int(m[1]), int(m[2])):
            shutil.rmtree(path, ignore_errors=True)
            log.warning("removed %s: the scratch folder of a %s run of %s that died", path, stage, fp)
            removed.append(path)
    return removed


@contextmanager
def scratch_dir(stage: str, fp: str, root: str | None = None) -> Iterator[Path]:
    """A scratch folder for one run of `stage`/`fp`, removed afterwards; dead runs' folders first."""
    remove_dead_runs_dirs(stage, fp, root)
    me = f"{os.getpid()}.{procs.start_ticks(os.getpid())}"
    with tempfile.TemporaryDirectory(prefix=f"{_prefix(stage, fp)}{me}-", dir=root) as path:
        yield Path(path)
