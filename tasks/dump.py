"""Prefect task around drafter.dump.run_dump."""
from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.tasks import exponential_backoff

from drafter.config import LifecycleConfig
from drafter.dump import run_dump
from drafter.store import open_store
from tasks.common import ProgressArtifact, log, retry_transient


@task(name="dump-hidden-states", retries=3, retry_delay_seconds=exponential_backoff(10),
      retry_jitter_factor=0.5, retry_condition_fn=retry_transient)
def dump_task(cfg: LifecycleConfig, upstream_stage: str, upstream_fingerprint: str) -> dict:
    """Capture the target's hidden states for a committed `prepare` or `datagen` output. A retry
    resumes at the first unverified shard. Returns the stage's URI and manifest meta, never data."""
    result = run_dump(cfg, open_store(cfg.storage), upstream_stage, upstream_fingerprint,
                      progress=ProgressArtifact("dump-progress", "hidden-state shards"))
    meta = result.manifest.meta
    logger = log()
    if result.skipped:
        logger.info("dump: skipped, output already complete at %s", result.uri)
    else:
        logger.info("dump: wrote %s", result.uri)
    logger.info("dump: %s samples, %s tokens (%s loss tokens), %s quarantined; %.0f bytes/token; storage: %s",
                meta["num_samples"], meta["num_tokens"], meta["num_loss_tokens"], meta["quarantined"]["total"],
                meta["bytes_per_token"], meta["storage_projection"])
    if not result.skipped:
        q = meta["quarantined"]
        create_markdown_artifact(key="dump-summary", description=f"dump {result.uri}", markdown="\n".join([
            f"### Hidden states: {result.uri}",
            f"- target `{meta['target_fingerprint']}`, dtype {meta['dtype']}, hidden {meta['hidden_size']}",
            f"- aux layers {meta['aux_layer_ids']} ({meta['layer_id_convention']}) + final hidden state",
            f"- {meta['num_samples']} samples in {meta['num_shards']} shards, {meta['num_tokens']} tokens "
            f"({meta['num_loss_tokens']} with loss), {meta['truncated']} truncated",
            f"- quarantined: {q['total']} {q['by_reason'] or ''}",
            f"- {meta['bytes']} bytes, {meta['bytes_per_token']:.0f} bytes/token",
            f"- storage: {meta['storage_projection']}"]))
    return {"stage": "dump", "uri": result.uri, "fingerprint": result.manifest.fingerprint,
            "skipped": result.skipped, "meta": {k: v for k, v in meta.items() if k != "quarantined"}
            | {"quarantined": {k: v for k, v in meta["quarantined"].items() if k != "samples"}}}
