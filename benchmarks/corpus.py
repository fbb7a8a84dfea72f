"""The benchmarks' one reader of a conversation corpus file (what `bench_drafter_quality.py
--write-corpus` writes): {"id", "messages": [{"role", "content"}, ...]} per conversation, as JSONL,
gzipped JSONL (`.gz`) or one JSON list."""
from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path
from typing import Iterator


def read_conversations(path: Path) -> Iterator[dict]:
    """The conversations one by one (a JSONL file is read only as far as the caller iterates)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        first = f.read(1)
        while first.isspace():
            first = f.read(1)
        if first == "[":
            yield from json.loads(first + f.read())
            return
        for line in itertools.chain([first + f.readline()], f):
            if line.strip():
                yield json.loads(line)
