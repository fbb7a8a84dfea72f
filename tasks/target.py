"""Make sure the target exists before any stage needs it (the demo builds its own)."""
from __future__ import annotations

from pathlib import Path

from prefect import task

from drafter.config import ConfigError, LifecycleConfig
from tasks.common import log


@task(name="ensure-target")
def ensure_target_task(cfg: LifecycleConfig) -> dict:
    if cfg.target.demo is not None:
        from drafter.demo_target import ensure_demo_target

        report = ensure_demo_target(cfg.target.demo, cfg.target.path)
        log().info("demo target at %s (eval loss %s)", cfg.target.path, report.get("eval_loss"))
        return {"path": cfg.target.path, "demo": True, "eval_loss": report.get("eval_loss")}
    if not (Path(cfg.target.path) / "config.json").is_file() and not cfg.target.path.startswith(("s3://", "hf://")):
        raise ConfigError([("target.path", f"no model directory with config.json at {cfg.target.path}")])
    return {"path": cfg.target.path, "demo": False}
