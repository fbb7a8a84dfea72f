"""`file://`: objects are files under a root directory.

The verified write (`put_stream`) checks that the name now points at the very file it wrote (same
inode, same size). The compare-and-swap (`put_if`) holds an exclusive `flock` on a lock file next
to the object while it compares the content's sha256 and renames.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from drafter.errors import disk_full
from drafter.hashing import CHUNK, BackgroundSha256, sha256_hex
from drafter.store.base import TMP_MARK, ObjectStore, check_key, check_prefix
from drafter.store.errors import CorruptObject, ObjectNotFound, StorageFull, StoreError, StoreRootError
from drafter.store.files import _copy_stream, _open_local, atomic_write


def local_root_problem(root: str | os.PathLike, *, writable: bool = False) -> str | None:
    """Why `root` cannot be a `file://` store root here, to follow the root's name ("is a file, not
    a directory", "cannot be created: ANCESTOR is a file, not a directory"), None if it can: it must
    be a directory, or a path whose nearest existing ancestor is a directory (so it can be created).
    With `writable` (`config validate`), that directory must also be writable by us. The one rule
    for the store root: `config validate` and `FileStore` both ask it."""
    path = Path(root).expanduser().absolute()
    probe = path
    try:
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        is_dir = probe.is_dir()
    except OSError as e:  # a folder on the way we may not look into
        return f"cannot be checked: {e.strerror or e}"
    if not is_dir:
        kind = "a file, not a directory" if probe.is_file() else "not a directory"
        return f"is {kind}" if probe == path else f"cannot be created: {probe} is {kind}"
    if writable and not os.access(probe, os.W_OK | os.X_OK):
        return ("is not writable by this user" if probe == path
                else f"cannot be created: {probe} is not writable by this user")
    return None


class FileStore(ObjectStore):
    """Objects are files under `root_dir`; the key is the relative path. Unlike S3, a key cannot
    also be a "directory" of other keys ("a" and "a/b" together): stage layouts never need that.

    The root is checked when the store is opened (`local_root_problem`: a file, or a path under a
    file, is `StoreRootError`, exit 2). `create=False` opens an existing store only (a read such as
    `drafter verify`): a root that does not exist is `ObjectNotFound`, and nothing is created."""

    def __init__(self, root_dir: str | os.PathLike, *, create: bool = True):
        self.root = Path(root_dir).expanduser().resolve()
        problem = local_root_problem(self.root)
        if problem is not None:
            raise StoreRootError(f"storage root file://{self.root} {problem}")
        if not create:
            if not self.root.is_dir():
                raise ObjectNotFound(f"no store at file://{self.root}: the directory does not exist")
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if disk_full(e):
                raise StorageFull(f"storage root file://{self.root}", e) from e
            raise StoreRootError(f"storage root file://{self.root} cannot be created: {e.strerror or e}") from e

    def __repr__(self) -> str:
        return f"FileStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def uri(self, key: str) -> str:
        return f"file://{self._path(key)}" if key else f"file://{self.root}"

    @contextlib.contextmanager
    def _os_errors(self, op: str, key: str):
        try:
            yield
        except FileNotFoundError as e:
            raise ObjectNotFound(f"{op}: no such object {self.uri(key)}") from e
        except IsADirectoryError as e:
            raise ObjectNotFound(f"{op}: {self.uri(key)} is a directory, not an object") from e
        except OSError as e:
            if disk_full(e):
                raise StorageFull(f"{op} {self.uri(key)}", e) from e
            raise StoreError(f"{op} {self.uri(key)}: {e}") from e

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._os_errors("put", key):
            atomic_write(self._path(key), lambda f: f.write(data))

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        src = _open_local(path, f"put {self.uri(key)}")
        with src, self._os_errors("put", key):
            atomic_write(self._path(key), lambda f: _copy_stream(src, f))

    def put_stream(self, key: str, chunks: Iterable[bytes | memoryview]) -> tuple[int, str]:
        """Hash while writing; then the committed name must be the inode written, with its size
        (a concurrent writer or a lost rename would show). Where the platform has no inode numbers
        the file is read back instead."""
        path = self._path(key)
        h, written = BackgroundSha256(), {}  # hashing overlaps the writes (measured: benchmarks/bench_dump.py)

        def write(f: BinaryIO) -> None:
            n = 0
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                h.update(view)
                f.write(view)
                n += view.nbytes
            f.flush()
            st = os.fstat(f.fileno())
            written.update(size=n, file=(st.st_dev, st.st_ino, st.st_size))

        try:
            with self._os_errors("put", key):
                atomic_write(path, write)
                st = os.stat(path)
        finally:
            h.close()
        size, sha = written["size"], h.hexdigest()
        if written["file"][1] == 0:  # no inode numbers here: prove it the slow way
            self.check_read_back(key, size, sha)
        elif (st.st_dev, st.st_ino, st.st_size) != written["file"] or st.st_size != size:
            raise CorruptObject(key, f"after upload: wrote {size} bytes, but {path} is another file "
                                     f"({st.st_size} bytes): replaced concurrently?", self.uri(key),
                                repair=False)
        return size, sha

    def get_bytes(self, key: str) -> bytes:
        with self._os_errors("get", key):
            return self._path(key).read_bytes()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with self._os_errors("get", key), open(self._path(key), "rb") as f:
            return os.pread(f.fileno(), max(0, end - start), start)

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def get_file(self, key: str, path: str | os.PathLike) -> None:
        with self._os_errors("get", key):
            src = open(self._path(key), "rb")
        with src:
            try:
                atomic_write(Path(path), lambda f: _copy_stream(src, f))
            except OSError as e:
                if disk_full(e):
                    raise StorageFull(f"get {self.uri(key)}: cannot write {path}", e) from e
                raise StoreError(f"get {self.uri(key)}: cannot write {path}: {e}") from e

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        with self._os_errors("get", key), open(self._path(key), "rb") as f:
            while chunk := f.read(chunk_size):
                yield chunk

    def size(self, key: str) -> int | None:
        p = self._path(key)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            if p.is_file():
                return p.stat().st_size
        return None

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        check_prefix(prefix)
        base = self.root / prefix.rpartition("/")[0]  # deepest directory that can hold matches
        out: dict[str, int] = {}
        for dirpath, _dirs, files in os.walk(base):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if TMP_MARK in name:
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):  # deleted while we listed
                        out[key] = os.stat(os.path.join(dirpath, name)).st_size
        return dict(sorted(out.items()))

    def list(self, prefix: str = "") -> list[str]:
        return list(self.list_sizes(prefix))

    def delete(self, key: str) -> None:
        with self._os_errors("delete", key):
            self._path(key).unlink(missing_ok=True)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        data = self.get_bytes(key)
        return data, sha256_hex(data)  # the content is the version: an equal one is the same state

    def put_if(self, key: str, data: bytes, version: str | None) -> bool:
        path = self._path(key)
        with self._os_errors("put", key), self._locked(path):
            try:
                current = sha256_hex(path.read_bytes())
            except FileNotFoundError:
                current = None
            if current != version:
                return False
            atomic_write(path, lambda f: f.write(data))
            return True

    @staticmethod
    @contextlib.contextmanager
    def _locked(path: Path):
        """An exclusive lock held by this process over `path`'s writers (flock on a lock file next
        to it; its name holds TMP_MARK, so it is never listed as an object)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f".{path.name}{TMP_MARK}lock"), "ab") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file is closed
            yield

    def delete_prefix(self, prefix: str) -> int:
        n = super().delete_prefix(prefix)
        self._prune_empty_dirs(self.root / prefix.rpartition("/")[0])
        return n

    def _prune_empty_dirs(self, top: Path) -> None:
        """Remove directories left empty (cosmetic; a concurrent writer just recreates them)."""
        if not top.is_dir():
            return
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -len(t[0])):
            if Path(dirpath) != self.root:
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)


