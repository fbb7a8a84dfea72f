"""What a drafter's offline accept length predicts before any server runs it: the newest stored
accept-length curve per setting and batch size for the configuration's engine and target
(drafter.formats.stored_accept_curves, drafter.bench.predict), as the lines the export and champion
stages print."""
from __future__ import annotations

from drafter.bench.predict import newest_curves, prediction_lines
from drafter.config import LifecycleConfig
from drafter.formats import stored_accept_curves
from drafter.store import ObjectStore, StoreError
from drafter.target_identity import target_identity


def predicted_speedup_lines(cfg: LifecycleConfig, store: ObjectStore, accept_length: float, num_steps: int,
                            what: str = "") -> list[str]:
    """One line per stored curve at `num_steps` for `serve.engine` and the target, or why there is none."""
    try:
        stored = stored_accept_curves(store, cfg.serve.engine, target_identity(cfg.target))
    except StoreError as err:  # a forecast is a figure to read, never a reason to fail the stage
        return [f"{what + ' ' if what else ''}predicted speedup: the stored curves could not be read ({err})"]
    return prediction_lines(newest_curves(stored), accept_length, num_steps, cfg.serve.engine, what)
