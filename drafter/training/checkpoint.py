"""Training checkpoints in the object store: whole and verified, or absent.

Each checkpoint is its own committed StageOutput `train-checkpoints/<run>.step-<N>/`: the state
file is uploaded and read back (sha256) before `_SUCCESS.json` is written, so a run killed while
saving leaves an incomplete prefix that is never resumed from. It holds everything an exact resume
needs: drafter weights, fp32 masters and AdamW moments, the step, the data cursor, RNG states and
the metrics logged so far. `run` is the train stage's fingerprint: another configuration never
resumes from this one.
"""
from __future__ import annotations

import io
import logging
import re

import torch

from drafter.stage_output import StageOutput
from drafter.store import ObjectStore
from drafter.training.errors import CheckpointError

log = logging.getLogger(__name__)

STAGE = "train-checkpoints"
STATE_FILE = "state.pt"
_NAME = re.compile(r"^(?P<run>[0-9A-Za-z_-]+)\.step-(?P<step>\d{8})$")


def _output(store: ObjectStore, run: str, step: int) -> StageOutput:
    return StageOutput(store, STAGE, f"{run}.step-{step:08d}")


def list_checkpoints(store: ObjectStore, run: str) -> list[int]:
    """Steps of the complete checkpoints of `run`, ascending."""
    steps = set()
    for key in store.list(f"{STAGE}/"):
        parts = key.split("/")
        m = _NAME.match(parts[1]) if len(parts) == 3 and parts[2] == "_SUCCESS.json" else None
        if m and m["run"] == run:
            steps.add(int(m["step"]))
    return [s for s in sorted(steps) if _output(store, run, s).is_complete()]


def save_checkpoint(store: ObjectStore, run: str, step: int, state: dict, keep: int = 2) -> str:
    """Write, verify and commit; then delete all but the newest `keep`. Returns the URI."""
    buf = io.BytesIO()
    torch.save(state, buf)
    out = _output(store, run, step)
    if out.is_complete():  # the same step saved again (SIGTERM right after a periodic save)
        return out.uri
    out.write_shard(STATE_FILE, buf.getvalue(), meta={"step": step})
    out.commit({"run": run, "step": step})
    for old in list_checkpoints(store, run)[:-keep]:
        _output(store, run, old).reset()
    log.info("checkpoint step %d -> %s", step, out.uri)
    return out.uri


def load_checkpoint(store: ObjectStore, run: str, step: int) -> dict:
    out = StageOutput.committed(store, STAGE, f"{run}.step-{step:08d}")
    try:
        state = torch.load(io.BytesIO(out.read_shard(STATE_FILE)), map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt bytes are caught by read_shard; this is a bad payload
        raise CheckpointError(f"{out.uri}: unreadable checkpoint: {e}") from e
    if state.get("run") != run or state.get("step") != step:
        raise CheckpointError(f"{out.uri}: holds run {state.get('run')!r} step {state.get('step')}, "
                              f"expected {run!r} step {step}")
    return state


def latest_checkpoint(store: ObjectStore, run: str) -> dict | None:
    steps = list_checkpoints(store, run)
    return load_checkpoint(store, run, steps[-1]) if steps else None


def checkpoint_uri(store: ObjectStore, run: str, step: int) -> str:
    return _output(store, run, step).uri
