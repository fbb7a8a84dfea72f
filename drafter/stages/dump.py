"""The `dump` stage: conversations -> the target's hidden states, as shards in object storage.

Output (`dump/<fingerprint>/`): `hs-00000.safetensors`, ... (format: drafter.contracts.shards) and a manifest
whose meta records what a reader must agree with: target fingerprint, tokenizer and chat-template
hashes, dtype, `aux_layer_ids` + `layer_id_convention`, hidden size, counts, bytes per token, the
storage projection and the quarantined samples.

Shards follow the upstream's shards: each datagen shard (the prepare split, for `dump.upstream:
prepare`) is cut into pieces of S samples (S = dump.samples_per_shard) in order, and shard i holds
piece i, minus quarantined ones (bad record, template error, no assistant token, NaN/Inf states). Inside a shard
the batches are a pure function of the token lengths and dump.tokens_per_batch, so a resumed run
recomputes only the shards that were not verified yet, with the same float operations: the files
are byte-identical to an uninterrupted run's (tested on CPU; seen on 2 x H200 for the same GPU
model, see hf.warm_up_device).

Tokens: a datagen record whose answers carry `token_ids` (the ids the engine generated) is fed
exactly those ids after the template's prompt for each turn; a record without them (older
generations, servers that return none, `dump.upstream: prepare`) is re-tokenised from its text, as
before (drafter.tokenize). Each shard's marker counts its samples `from_token_ids`; the manifest
sums them (`samples_from_token_ids`).

Fingerprint: what determines the bytes' meaning (upstream, target, tokenizer, chat template, aux
ids + convention, resolved dtype, max_length, samples_per_shard, format version). Left out on
purpose: devices, tokens_per_batch, spool_dir, upload_queue, upload_threads, tokenize_processes. tokens_per_batch and
the GPU model can change the last bits of the floats (batch shapes pick kernels), never what they
mean, and re-dumping terabytes because a resume runs on other GPUs would be the wrong trade. Each
shard's marker records the device and tokens_per_batch that computed it. (The fields declare this
themselves: OperationalField in drafter.config.)

Incremental (drafter.contracts.reuse): each shard's marker records the digest of the records it was computed
from; a piece that an earlier dump of the same target and settings already computed is referenced
from that dump, not recomputed, so a retrain on a grown corpus computes only the new pieces.

The reader of this output (drafter.formats.iter_dump_samples) refuses a dump whose layer ids or
convention differ from what it expects.

Workers: one thread per device, each owning every n-th pending shard with its own model copy; per
device a tokenizer thread works a shard ahead and upload threads behind a bounded queue stream
finished shards to the store, so the device computes while earlier shards are copied, hashed and
written (drafter.capture.pipeline).

Storage: `dump.storage_dtype: float8_e4m3` (the default) stores the states in fp8 with a float32 scale
per token and state (drafter.contracts.fp8, ~half the bytes, format_version 2), encoded on the device;
`model` stores them in the capture dtype (format_version 1); readers decode to the capture dtype.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from drafter.capture.plan import DumpPlan, plan_dump, summarize as summarize_shards
from drafter.capture.workers import run_workers
from drafter.config import LifecycleConfig
from drafter.contracts import reuse
from drafter.errors import DrafterError
from drafter.formats import SPLITS, dump_pieces
from drafter.formats import DUMP as STAGE
from drafter.formats import hidden_state_shard_name as shard_name
from drafter.stage_output import StageOutput
from drafter.shard_plan import Reused, ShardPlan
from drafter.stages.base import Built, StageContext, Summary

log = logging.getLogger(__name__)


def needs(cfg: LifecycleConfig) -> tuple[str, ...]:
    return (cfg.dump.upstream,)


@dataclass(frozen=True)
class Inputs:
    ctx: StageContext
    plan: DumpPlan


def inputs(ctx: StageContext) -> Inputs:
    return Inputs(ctx, plan_dump(ctx.cfg, ctx.upstream))


def fingerprint(inputs: Inputs) -> str:
    return inputs.plan.fingerprint


@dataclass(frozen=True, kw_only=True)
class DumpShards(ShardPlan):
    """The plan (drafter.shard_plan) plus what computing reads: each shard's (split, piece index)
    and records, and the shard names per split."""

    jobs: Mapping[str, tuple[str, int]]
    pieces: Mapping[str, list[list[dict]]]
    names: Mapping[str, tuple[str, ...]]


def plan(inputs: Inputs, out: StageOutput) -> DumpShards:
    """Each upstream shard cut into pieces (drafter.formats.dump_pieces), train first, then the
    (small) held-out split the trainer evaluates on; shard i of a split is piece i, computed from
    its records (their digest); a piece an earlier dump of the same settings computed from the same
    records is reused from it."""
    store, dump = inputs.ctx.store, inputs.plan
    upstream_stage, upstream_fingerprint = dump.upstream_stage, dump.upstream_fingerprint
    pieces = {split: dump_pieces(store, upstream_stage, upstream_fingerprint, split,
                                 inputs.ctx.cfg.dump.samples_per_shard) for split in SPLITS}
    if not pieces["train"]:
        raise EmptyUpstream(f"{upstream_stage}/{upstream_fingerprint} holds no conversations")
    jobs = {shard_name(i, split): (split, i) for split in SPLITS for i in range(len(pieces[split]))}
    digests = {name: reuse.records_digest(pieces[split][i]) for name, (split, i) in jobs.items()}
    key = reuse.reuse_key(STAGE, dump.settings)
    earlier = reuse.earlier_outputs(store, STAGE, key, out.fingerprint)
    found = reuse.dump_index(earlier)
    return DumpShards(units=tuple(jobs), inputs=tuple(digests.values()), earlier=tuple(earlier), reuse_key=key,
                      reused=tuple(Reused(name, d, *found[d]) for name, d in digests.items() if d in found),
                      jobs=jobs, pieces=pieces,
                      names={split: tuple(n for n, (s, _) in jobs.items() if s == split) for split in SPLITS})


def compute(inputs: Inputs, out: StageOutput, plan: DumpShards, wanted: Sequence[str], pending: Sequence[str]) -> dict:
    """Capture the hidden states of the wanted shards on `dump.devices` (drafter.capture.workers)."""
    dump, mine, total = inputs.plan, [plan.jobs[n] for n in wanted], len(plan.units)
    log.info("dump %s: %d of %d shards to compute on %s", out.uri, len(mine), total,
             ", ".join(map(str, dump.devices[:len(mine)])))
    run_workers(dump, out, mine, {j: plan.pieces[j[0]][j[1]] for j in mine}, inputs.ctx.progress, total - len(mine),
                total)
    return {}


def finish(inputs: Inputs, out: StageOutput, plan: DumpShards, figures: dict, pending: Sequence[str]) -> Built:
    """The manifest meta, summed from the shard markers."""
    return Built(lambda shards: {**summarize_shards(inputs.plan, [shards[n] for n in plan.names["train"]],
                                                    [shards[n] for n in plan.names["eval"]]),
                                 "reuse": reuse.dump_reuse_meta(plan.earlier, shards.values()), **figures},
                 expect=list(plan.units))


class EmptyUpstream(DrafterError, ValueError):
    """The upstream output is committed but holds nothing to dump: re-running will not help."""



def summarize(inputs: Inputs, out: StageOutput) -> Summary:
    meta = out.manifest.meta
    q = meta["quarantined"]
    summary = [f"{meta['num_samples']} samples, {meta['num_tokens']} tokens ({meta['num_loss_tokens']} with loss), "
               f"{q['total']} quarantined {q['by_reason'] or ''}; {meta['bytes_per_token']:.0f} bytes/token; "
               f"storage: {meta['storage_projection']}"]
    if "samples_from_token_ids" in meta:
        summary.append(f"{meta['samples_from_token_ids']} samples from the target's own token ids, the others "
                       f"re-tokenized from text")
    r = meta.get("reuse") or {}
    if r.get("linked_shards"):
        summary.append(f"reused from earlier dumps: {r['linked_shards']} shards referenced ({r['linked_records']} "
                       f"records); computed {r['computed_shards']} shards ({r['computed_records']} records)")
    if meta.get("eval"):
        summary.append(f"held out (eval split): {meta['eval']['num_samples']} samples, "
                       f"{meta['eval']['num_tokens']} tokens in {meta['eval']['num_shards']} shards")
    table = [
        {"metric": "target", "value": f"{meta['target_fingerprint']} ({meta['dtype']}, hidden {meta['hidden_size']})"},
        {"metric": "aux layers", "value": f"{meta['aux_layer_ids']} ({meta['layer_id_convention']}) + final"},
        {"metric": "samples", "value": f"{meta['num_samples']} in {meta['num_shards']} shards"},
        {"metric": "tokens", "value": f"{meta['num_tokens']} ({meta['num_loss_tokens']} with loss), "
                                      f"{meta['truncated']} truncated"},
        {"metric": "quarantined", "value": f"{q['total']} {q['by_reason'] or ''}"},
        {"metric": "bytes", "value": f"{meta['bytes']} ({meta['bytes_per_token']:.0f} bytes/token)"},
        {"metric": "storage projection", "value": str(meta["storage_projection"])}]
    # The per-sample quarantine list stays in the manifest: a task result must stay small.
    meta = {**meta, "quarantined": {k: v for k, v in q.items() if k != "samples"}}
    return Summary(summary, table, meta=meta)

