"""What identifies a target model in stage fingerprints.

Generations and hidden states depend on the target's WEIGHTS, not on its path or its file sizes:
a retrained checkpoint of the same architecture has the same names and sizes. So the identity is
a content hash of config.json, the tokenizer files and every weight file. Hashing is paid once per
file: results are cached under ~/.cache/drafter-lifecycle (keyed by absolute path, size and
mtime), so a 500 GB target is hashed once per machine, not once per run. A user who already has a
trusted identity (a hub revision, a registry digest) sets `target.revision` and nothing is hashed.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from drafter.hashing import hash_file, short_hash

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "tokenizer.model", "chat_template.jinja")
_lock = threading.Lock()


def cache_path() -> Path:
    root = os.environ.get("DRAFTER_CACHE_DIR") or Path.home() / ".cache" / "drafter-lifecycle"
    return Path(root) / "file-sha256.json"


def _cached_sha256(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    cache_file = cache_path()
    with _lock:
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        if key in cache:
            return cache[key]
    _, digest = hash_file(path)
    with _lock:
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        cache[key] = digest
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=0, sort_keys=True))
        os.replace(tmp, cache_file)  # a crash never leaves a half-written cache
    return digest


def target_files(model_path: str | Path) -> list[Path]:
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target {path}: no config.json")
    weights = [f for f in path.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES)]
    if not weights:
        raise FileNotFoundError(f"target {path}: no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    extra = [path / name for name in IDENTITY_FILES if (path / name).is_file()]
    return sorted(set(weights + extra))


def target_fingerprint(model_path: str | Path, revision: str | None = None) -> str:
    """16 hex chars naming the target's content (or the user's revision when given)."""
    if revision:
        return short_hash(f"revision:{revision}")
    return short_hash("".join(f"{f.name}:{_cached_sha256(f)}\n" for f in target_files(model_path)))


def target_identity(target) -> dict:
    """For fingerprints: content hash when the weights are local, else what the config names.
    `target` is a drafter.config.TargetConfig."""
    if target.revision or (Path(target.path) / "config.json").is_file():
        return {"target": target_fingerprint(target.path, target.revision)}
    # Remote-only target (datagen against given server URLs): the name is all we know.
    return {"served_name": target.served_name, "path": target.path}
