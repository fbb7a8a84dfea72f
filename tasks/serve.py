"""The serve stage: start the configured engine, gate it on a real generation, read back the
speculative settings it actually uses, tear it down. Retried only for crashed / stalled /
health-timeout starts; configuration errors fail at once."""
from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.tasks import exponential_backoff

from drafter.config import LifecycleConfig
from drafter.serving.check import check_server
from drafter.serving.errors import is_retryable
from tasks.common import log, retry_if


def reap_left_servers(flow, flow_run, state) -> None:
    """on_cancellation / on_crashed hook (it runs in ANOTHER process): kill every server whose pid
    file is still in the run's log directory, i.e. one the cancelled run could not tear down."""
    from pathlib import Path

    from drafter.config import load_config
    from drafter.serving.launcher import reap

    params = flow_run.parameters or {}
    config = params.get("config") or params.get("cfg")
    if config is not None:
        cfg = config if isinstance(config, LifecycleConfig) else LifecycleConfig.model_validate(config)
    else:
        cfg = load_config(params.get("profile", "profiles/demo.yaml"))
    for pid_path in sorted(Path(cfg.serve.log_dir).glob("*.pid.json")):
        print(f"reaping {pid_path}: {reap(pid_path)}", flush=True)


retry_server_start = retry_if(is_retryable)


@task(name="serve-check", retries=2, retry_delay_seconds=exponential_backoff(15), retry_jitter_factor=0.5,
      retry_condition_fn=retry_server_start)
def serve_task(cfg: LifecycleConfig, draft_path: str | None = None) -> dict:
    logger = log()
    # Server output never reaches the UI by itself: stream every line into the run log.
    # check_server tears the server down in its own `finally`, also on cancellation (SIGTERM).
    report = check_server(cfg, draft_path=draft_path, on_line=lambda line: logger.info("[server] %s", line),
                          raise_on_failure=True)
    logger.info("%s", report["message"])
    create_markdown_artifact(key="serve-report", description="serve stage", markdown="\n".join([
        f"### {report['engine']}: {report['status']} in {report.get('seconds_to_ready', 0):.1f}s",
        f"- base url: {report['base_url']}", f"- log: {report['log_path']}",
        f"- launch environment: {report['launch_path']}",
        f"- settings read back: `{report['settings']}`",
        f"- phases: {', '.join(str(p) for p in report['phases'])}"]))
    return report
