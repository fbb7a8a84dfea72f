"""Prefect task around drafter.datagen.run_datagen.

Servers: `datagen.server_urls` when given; otherwise the task starts the configured engine itself
(the reference engine in the demo), serving the target alone, and always tears it down. A complete
output is detected first, so a finished stage never waits minutes for a server it does not need.

Retries: only what a later attempt can fix: a server that crashed / stalled / never turned healthy
while starting, a server that went down mid-run (`DatagenServerDown`: every finished shard is
committed, the retry resumes after them), transient storage trouble. Configuration errors and
corrupted data fail at once.
"""
from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.tasks import exponential_backoff

from drafter.config import LifecycleConfig
from drafter.datagen import DatagenResult, DatagenServerDown, datagen_output, run_datagen, target_server
from drafter.serving.errors import ServerStartError, is_retryable
from drafter.store import open_store
from tasks import common
from tasks.common import NEVER_RETRY, ProgressArtifact, log, retry_if


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, NEVER_RETRY):
        return False
    if isinstance(exc, ServerStartError):  # typed start failures: bad flags / port taken never heal
        return is_retryable(exc)
    return isinstance(exc, DatagenServerDown) or common.is_transient(exc)


retry_datagen = retry_if(is_transient)


@task(name="datagen", retries=2, retry_delay_seconds=exponential_backoff(30), retry_jitter_factor=0.5,
      retry_condition_fn=retry_datagen)
def datagen_task(cfg: LifecycleConfig, prepare_fingerprint: str, split: str = "train") -> dict:
    """Regenerate the prepared `split` with the target. Returns URIs and manifest meta, never data."""
    logger = log()
    store = open_store(cfg.storage)
    progress = ProgressArtifact(f"datagen-{split}-progress", f"regenerating {split} answers with the target")
    servers = list(cfg.datagen.server_urls)
    server_log = None
    if servers or datagen_output(cfg, store, prepare_fingerprint, split).is_complete():
        result = run_datagen(cfg, store, prepare_fingerprint, servers, progress, split)
    else:
        started = False

        def on_line(line: str) -> None:
            # Start-up lines go to the run log (a hang must be visible in the UI); once serving,
            # per-request lines would flood it: they stay in the server's own log file.
            if not started:
                logger.info("[server] %s", line)

        with target_server(cfg, on_line) as served:
            started = True
            servers, server_log = [served.base_url], served.log_path
            logger.info("datagen: %s ready in %.1fs (log %s)", served.base_url, served.seconds_to_ready,
                        served.log_path)
            try:
                result = run_datagen(cfg, store, prepare_fingerprint, servers, progress, split)
            except DatagenServerDown as err:
                err.add_note(f"server log: {served.log_path}")
                raise
    _summarise(result, servers)
    return {"stage": "datagen", "split": split, "uri": result.uri, "fingerprint": result.manifest.fingerprint,
            "skipped": result.skipped, "server_urls": servers, "server_log": server_log,
            "meta": result.manifest.meta}


def _summarise(result: DatagenResult, servers: list[str]) -> None:
    meta = result.manifest.meta
    if result.skipped:
        log().info("datagen: skipped, output already complete at %s", result.uri)
        return
    t = meta.get("throughput") or {}
    log().info("datagen: wrote %s: %s conversations, %s errors %s, %.2f req/s, %.1f tok/s",
               result.uri, meta["generated"], meta["errors"], meta["errors_by_reason"],
               t.get("requests_per_s", 0.0), t.get("tokens_per_s", 0.0))
    rows = [{"metric": k, "value": str(meta[k])} for k in (
        "conversations", "generated", "errors", "errors_by_reason", "turns", "completion_tokens",
        "finish_reasons", "shards", "resumed_shards")]
    rows += [{"metric": f"throughput.{k}", "value": str(v)} for k, v in t.items() if k != "servers"]
    rows.append({"metric": "servers", "value": ", ".join(servers)})
    create_table_artifact(key=f"datagen-{meta['split']}-summary", description=f"datagen {result.uri}", table=rows)
