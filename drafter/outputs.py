"""What the store holds: committed stage outputs, for `drafter outputs` and run summaries. (What a
gate stage decided, as markdown, is drafter.stages.verdicts.)"""
from __future__ import annotations

from drafter.stage_output import MANIFEST_NAME, StageOutput
from drafter.store import ObjectStore


def list_outputs(store: ObjectStore) -> list[dict]:
    """One row per committed `<stage>/<fingerprint>/`, oldest first."""
    rows = []
    for key in store.list(""):
        parts = key.split("/")
        if len(parts) != 3 or parts[2] != MANIFEST_NAME:
            continue
        out = StageOutput(store, parts[0], parts[1])
        manifest = out.load_manifest()
        rows.append({"stage": out.stage, "fingerprint": out.fingerprint, "shards": len(manifest.shards),
                     "bytes": manifest.total_bytes, "created_at": manifest.created_at, "uri": out.uri})
    return sorted(rows, key=lambda r: r["created_at"])
