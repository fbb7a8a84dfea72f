"""Training checkpoints in the object store: whole and verified, or absent.

Each checkpoint is its own committed StageOutput `train-checkpoints/<run>.step-<N>/`: the state
file is uploaded and read back (sha256) before `_SUCCESS.json` is written, so a run killed while
saving leaves an incomplete prefix that is never resumed from. A complete one whose bytes no longer
verify is skipped: the run resumes from the newest that does (and rewrites the bad one when it gets
there). It holds everything an exact resume
needs: drafter weights, fp32 masters and AdamW moments, the step, the data cursor, RNG states and
the metrics logged so far. `run` is the train stage's fingerprint: another configuration never
resumes from this one.
"""
from __future__ import annotations

import io
import logging
import re
import shlex

import torch

from drafter.stage_output import StageOutput
from drafter.store import CorruptObject, ObjectNotFound, ObjectStore
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
    if out.is_complete():
        if not out.verify()["problems"]:  # the same step saved again (SIGTERM right after a periodic save)
            return out.uri
        log.warning("checkpoint %s does not verify: writing it again", out.uri)  # skipped at resume
        out.reset()
    out.write_shard(STATE_FILE, buf.getvalue(), meta={"step": step})
    out.commit({"run": run, "step": step})
    for old in list_checkpoints(store, run)[:-keep]:
        _output(store, run, old).reset()
    log.info("checkpoint step %d -> %s", step, out.uri)
    return out.uri


def load_checkpoint(store: ObjectStore, run: str, step: int) -> dict:
    out = StageOutput.committed(store, STAGE, f"{run}.step-{step:08d}")
    data = out.read_shard(STATE_FILE)  # corrupt bytes: CorruptObject
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # verified bytes, bad payload
        raise CheckpointError(f"{out.uri}: unreadable checkpoint: {e}") from e
    if state.get("run") != run or state.get("step") != step:
        raise CheckpointError(f"{out.uri}: holds run {state.get('run')!r} step {state.get('step')}, "
                              f"expected {run!r} step {step}")
    return state


def latest_checkpoint(store: ObjectStore, run: str) -> dict | None:
    """The newest checkpoint of `run` that verifies (None: there is none). A newer one that does
    not is skipped with a warning saying why: one bad save costs the steps since the one before,
    not the run. When none verifies, CheckpointError says what to delete to start afresh."""
    skipped = []
    for step in reversed(list_checkpoints(store, run)):
        try:
            state = load_checkpoint(store, run, step)
        except (CorruptObject, ObjectNotFound, CheckpointError) as err:  # not transient storage errors
            skipped.append((step, _why(err)))
            log.warning("skipping checkpoint step %d of run %s: %s", step, run, skipped[-1][1])
            continue
        if skipped:
            log.warning("resuming run %s from step %d, the newest checkpoint that verifies (skipped steps %s)",
                        run, step, [s for s, _ in skipped])
        return state
    if skipped:
        raise CheckpointError(_none_verifies(store, run, skipped))
    return None


def _why(err: Exception) -> str:
    if isinstance(err, CorruptObject):  # its own text may suggest a stage repair, which checkpoints are not
        return f"{err.uri} does not match its recorded size / sha256"
    return str(err)


def _none_verifies(store: ObjectStore, run: str, skipped: list) -> str:
    uris = [checkpoint_uri(store, run, step) for step, _ in skipped]
    if all(u.startswith("file://") for u in uris):
        fix = "rm -r " + " ".join(shlex.quote(u[len("file://"):]) for u in uris)
    else:
        fix = "; ".join(f"aws s3 rm --recursive {shlex.quote(u + '/')}" for u in uris)
        fix += " (with --endpoint-url for an endpoint other than AWS)"
    why = "; ".join(f"step {step}: {reason}" for step, reason in skipped)
    return (f"no checkpoint of train run {run} verifies ({why}). To train it from step 0, delete them "
            f"and re-run: {fix}")


def checkpoint_uri(store: ObjectStore, run: str, step: int) -> str:
    return _output(store, run, step).uri
