"""The interface every backend implements (`ObjectStore`) and the key rules they share."""
from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path

from drafter.hashing import CHUNK, hash_chunks
from drafter.store.errors import CorruptObject, InvalidName

MiB = 1024 * 1024
# Marks FileStore temp files. Keys may not contain it, so list() can always tell them apart.
TMP_MARK = ".drafter-tmp-"


def check_key(key: str) -> str:
    """Reject keys that could escape the root or collide with temp files; return the key."""
    if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/") or "\\" in key:
        raise InvalidName(f"invalid object key {key!r}: need a relative 'a/b/c' path")
    for part in key.split("/"):
        if part in ("", ".", "..") or TMP_MARK in part:
            raise InvalidName(f"invalid object key {key!r}: bad path segment {part!r}")
    return key


def check_prefix(prefix: str) -> str:
    """A list/delete prefix is a plain string prefix (S3 semantics), but never escapes the root."""
    if prefix and (prefix.startswith("/") or "\\" in prefix or ".." in prefix.split("/")):
        raise InvalidName(f"invalid prefix {prefix!r}")
    return prefix


class ObjectStore(ABC):
    """Flat key -> bytes store. Writes are atomic per object; reads of a missing key raise
    ObjectNotFound. `delete` of a missing key is a no-op (as on S3)."""

    @abstractmethod
    def uri(self, key: str) -> str: ...

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def put_file(self, key: str, path: str | os.PathLike) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def get_file(self, key: str, path: str | os.PathLike) -> None:
        """Download to `path` atomically (a partial download never sits under `path`)."""

    @abstractmethod
    def size(self, key: str) -> int | None: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys starting with `prefix` (recursive)."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """An object's bytes and its version (opaque) for `put_if`; ObjectNotFound if absent."""

    @abstractmethod
    def put_if(self, key: str, data: bytes, version: str | None) -> bool:
        """Compare-and-swap: write `data` only if the object still is `version` (from
        `get_versioned`; None: only if it is still absent). False, nothing written, if another
        writer changed (or created, or deleted) it in between."""

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    # Parallel range reads a reader may issue against one object, and their size (S3: the transfer
    # concurrency and the multipart part size).
    read_concurrency = 1
    read_range_bytes = 8 * MiB

    def put_stream(self, key: str, chunks: Iterable[bytes | memoryview]) -> tuple[int, str]:
        """Write the concatenated `chunks` under `key`; return (size, sha256 hex) of the committed
        object, hashed while writing and checked against what the backend committed. Backends
        override this to avoid holding the object in memory and to skip the read-back."""
        h, parts = hashlib.sha256(), []
        for chunk in chunks:
            h.update(chunk)
            parts.append(bytes(chunk))
        data = b"".join(parts)
        self.put_bytes(key, data)
        self.check_read_back(key, len(data), h.hexdigest())
        return len(data), h.hexdigest()

    def check_read_back(self, key: str, size: int, sha256: str) -> None:
        """The slow proof: read the committed object back and hash it."""
        got_size, got_sha = hash_chunks(self.iter_chunks(key))
        if (got_size, got_sha) != (size, sha256):
            raise CorruptObject(key, f"after upload: wrote {size} bytes sha256 {sha256}, the store holds "
                                     f"{got_size} bytes sha256 {got_sha}", self.uri(key), repair=False)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object (fewer if it is shorter)."""
        return self.get_bytes(key)[start:end]

    def local_path(self, key: str) -> Path | None:
        """A local file holding the object, readable in place (FileStore), else None."""
        return None

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """{key: size} for keys under prefix. Backends override this with one listing pass."""
        return {k: s for k in self.list(prefix) if (s := self.size(k)) is not None}

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        """Stream an object. Backends override this so large objects never sit in RAM."""
        data = self.get_bytes(key)
        for i in range(0, len(data), chunk_size):
            yield data[i:i + chunk_size]

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for k in keys:
            self.delete(k)
        return len(keys)


