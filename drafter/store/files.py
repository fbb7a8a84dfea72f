"""Local files written atomically (temp file + fsync + rename), shared by both backends: FileStore
stores objects this way, S3Store downloads into local files this way."""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from drafter.hashing import CHUNK
from drafter.store.base import TMP_MARK
from drafter.store.errors import StoreError


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write via a temp file in the same directory + fsync + os.replace: a crash leaves either the
    old content or the new, never a half-written file under `path`."""
    for attempt in (1, 2):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{TMP_MARK}", dir=path.parent)
            break
        except FileNotFoundError:  # a concurrent delete_prefix pruned the empty directory
            if attempt == 2:
                raise
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(d: Path) -> None:
    """Make the rename itself durable (POSIX); not supported everywhere, hence best effort."""
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _open_local(path: str | os.PathLike, what: str) -> BinaryIO:
    try:
        return open(path, "rb")
    except OSError as e:
        raise StoreError(f"{what}: cannot read local file {path}: {e}") from e


def _copy_stream(src: BinaryIO, dst: BinaryIO) -> None:
    while chunk := src.read(CHUNK):
        dst.write(chunk)

