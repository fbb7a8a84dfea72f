"""The smoke run (drafter.smoke) as one Prefect task: its lines into the run log, its report as a
markdown artifact, its servers owned by this run (a cancelled run's hooks reap them)."""
from __future__ import annotations

from prefect import task
from prefect.tasks import exponential_backoff
from prefect.artifacts import create_markdown_artifact

from drafter.config import LifecycleConfig
from drafter.errors import DrafterError, describe
from drafter.serving.launcher import ServerLine
from drafter.smoke import SmokeReport, run_smoke
from tasks.common import log, retry_retryable, this_run_owns_its_servers

ARTIFACT_KEY = "smoke"


def markdown(report: SmokeReport | None, error: BaseException | None = None) -> str:
    lines = ["# Smoke run", "", f"**{describe(error) if error is not None else report.line()}**", ""]
    if report is not None:
        lines += ["| step | outcome | seconds |", "|---|---|---|"]
        lines += [f"| {s['step']} | {s['outcome']} | {s['seconds']} |" for s in report.steps]
    return "\n".join(lines) + "\n"


# Retried as a stage is, when the error says a later attempt can succeed (a server start that crashed).
@task(name="smoke", retries=2, retry_delay_seconds=exponential_backoff(10), retry_jitter_factor=0.5,
      retry_condition_fn=retry_retryable)
def smoke_task(cfg: LifecycleConfig) -> dict:
    """Run the smoke of `cfg`; its failure (SmokeFailed, one line) fails the task."""
    logger = log()

    def on_line(line: str) -> None:
        logger.info("[server] %s" if isinstance(line, ServerLine) else "%s", line)

    try:
        with this_run_owns_its_servers():
            report = run_smoke(cfg, on_step=logger.info, on_line=on_line)
    except DrafterError as err:
        logger.error("%s", describe(err))
        create_markdown_artifact(key=ARTIFACT_KEY, markdown=markdown(None, err), description="smoke run: failed")
        raise
    logger.info("%s", report.line())
    create_markdown_artifact(key=ARTIFACT_KEY, markdown=markdown(report), description="smoke run: passed")
    return report.to_dict()
