"""A growing demo source: a folder of JSONL batches of ShareGPT conversations, as a daily export
of production requests would be. The first call writes the base corpus, every later call appends
one batch of conversations not used before (deterministic: ShareGPT's file order)."""
from __future__ import annotations

import json
from pathlib import Path

from drafter.contracts.sharegpt import load_sharegpt


def append_batch(folder: str | Path, first: int, batch: int) -> tuple[Path, int]:
    """Write `batch-NNNN.jsonl` (the first `first` conversations when the folder has no batch yet,
    else the next `batch`); returns the file and how many conversations the folder holds now."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    existing = sorted(folder.glob("batch-*.jsonl"))
    have = sum(f.read_bytes().count(b"\n") for f in existing)  # one conversation per line
    want = first if not existing else batch
    rows = load_sharegpt(have + want)[have:]
    path = folder / f"batch-{len(existing):04d}.jsonl"
    tmp = path.with_suffix(".partial")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tmp.rename(path)  # a reader never sees half a batch (the source lists *.jsonl only)
    return path, have + len(rows)
