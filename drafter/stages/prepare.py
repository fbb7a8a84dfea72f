"""The `prepare` stage: sources -> normalised, filtered, deduplicated, split conversations.

Output (`prepare/<fingerprint>/`): `train.jsonl`, `eval.jsonl` (one `{"id", "messages"}` per line)
and `quarantine.jsonl` (`{source, row_index, id?, reason, detail}` per bad row), committed with a
manifest whose meta holds every count. The fingerprint covers the `data` config section and a cheap
identity of each input file, so an unchanged corpus is never read twice.
"""
from __future__ import annotations

from dataclasses import dataclass

from drafter.config import LifecycleConfig, fingerprint_fields
from drafter.formats import PREPARE as STAGE
from drafter.formats import SPLITS, split_file
from drafter.hashing import sha256_hex
from drafter.prepare.corpus import prepare_conversations
from drafter.prepare.sources import source_identity
from drafter.stage_output import EmptyOutput, StageOutput, to_jsonl
from drafter.stage_output import fingerprint as stage_fingerprint
from drafter.stages.base import Built, StageContext, Summary

OUTPUT_FILES = (*(split_file(s) for s in SPLITS), "quarantine.jsonl")


def needs(cfg: LifecycleConfig) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class Inputs:
    ctx: StageContext
    sources: list  # identity (version/size or sha256) of every input; no row is parsed


def inputs(ctx: StageContext) -> Inputs:
    return Inputs(ctx, [source_identity(s) for s in ctx.cfg.data.sources])


def fingerprint(inputs: Inputs) -> str:
    """Config section + identity of every input."""
    return stage_fingerprint(STAGE, {"data": fingerprint_fields(inputs.ctx.cfg.data), "inputs": inputs.sources})


def build(inputs: Inputs, out: StageOutput) -> Built:
    """Normalise, dedupe, filter and split the sources."""
    cfg = inputs.ctx.cfg
    prepared = prepare_conversations(cfg.data, inputs.ctx.progress)
    meta = prepared.meta
    if meta["kept"] == 0 and not cfg.data.allow_empty:
        raise EmptyOutput(f"prepare kept 0 conversations of {meta['read']} rows read (quarantined "
                          f"{meta['quarantined']}, filtered {meta['filtered']}, {meta['duplicates']} duplicates); "
                          f"check data.sources, or set data.allow_empty: true")
    done = out.completed_shards()  # a killed earlier run: keep shards that are already identical
    for name, rows in zip(OUTPUT_FILES, (prepared.train, prepared.eval, prepared.quarantine)):
        blob = to_jsonl(rows)
        if name in done and done[name].sha256 == sha256_hex(blob):
            continue
        out.write_shard(name, blob, meta={"rows": len(rows)})
    return Built(prepared.meta, expect=OUTPUT_FILES)


def summarize(inputs: Inputs, out: StageOutput) -> Summary:
    meta = out.manifest.meta
    line = (f"{meta['kept']} conversations kept of {meta['read']} read: {meta['train']} train, "
            f"{meta['eval']} eval; {meta['duplicates']} duplicates, {meta['quarantined_total']} quarantined")
    return Summary([line], [{"metric": k, "value": str(v)} for k, v in meta.items()])
