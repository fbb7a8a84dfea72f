"""Hashes: file and stream sha256, short content ids, and the canonical JSON fingerprints use."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import PurePath
from typing import Any

CHUNK = 8 * 1024 * 1024  # streaming reads: large enough for throughput, small enough for memory
SHORT = 16               # hex chars of a short id: 64 bits, no collision in any realistic store


def sha256_hex(data: bytes | str) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def short_hash(data: bytes | str) -> str:
    """The first 16 hex chars of sha256: ids of fingerprints, tokenizers, templates."""
    return sha256_hex(data)[:SHORT]


def hash_chunks(chunks: Iterable[bytes]) -> tuple[int, str]:
    """(size, sha256 hex) of a byte stream, without holding it in memory."""
    h, n = hashlib.sha256(), 0
    for chunk in chunks:
        h.update(chunk)
        n += len(chunk)
    return n, h.hexdigest()


def hash_file(path: str | os.PathLike) -> tuple[int, str]:
    with open(path, "rb") as f:
        return hash_chunks(iter(lambda: f.read(CHUNK), b""))


def _jsonable(obj: Any) -> Any:
    from pydantic import BaseModel

    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, PurePath):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    # Falling back to str() could hash memory addresses (unstable) or hide a bug: refuse instead.
    raise TypeError(f"fingerprint: {type(obj).__name__} is not JSON-serializable: {obj!r}")


def canonical_json(payload: Any) -> str:
    """Sorted keys, no whitespace, ASCII, no NaN: equal inputs give equal text on every machine."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False, default=_jsonable)
