"""Fan-out: a stage whose work is independent shards (datagen, dump) split into contiguous ranges,
each computed by a child run somewhere else, the parent waiting for all of them.

The rule (the same for every stage that fans out):
- `split_ranges` cuts the stage's shard list (in plan order) into `workers` contiguous ranges of
  near-equal size. The cut depends only on the plan, so a re-run cuts the same ranges; a range
  whose shards all carry a verified marker for this plan is not launched again (the store says
  what is finished, not the orchestrator's memory).
- A child computes the pending shards of its range and writes them with their markers, exactly as
  a one-worker run does; it never commits. It refuses a plan other than the parent's (`plan`
  digest), so a child never writes shards planned differently.
- While it works, a child beats a lease in the store (`_fanout/<stage>/<fingerprint>/<range>-a<attempt>`),
  a counter the parent watches with its own clock (no clock is compared across machines). A child
  reported running whose lease has not moved for `lease_timeout_s` is lost (its machine died):
  the parent marks it so and launches the range again, up to `attempts` times. A child that failed
  (after its own retries) or was cancelled fails its range; the parent then fails naming the ranges.
- Where the children run is a `Launcher`'s business (tasks/fanout.py: Prefect deployments on a
  work pool); this module never imports Prefect.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from drafter.errors import DrafterError
from drafter.store import ObjectStore, StoreError

log = logging.getLogger(__name__)

LEASE_PREFIX = "_fanout"


@dataclass(frozen=True)
class ShardRange:
    """Shards [start, stop) of a stage's plan (`first`..`last` are their names, for people)."""

    index: int
    start: int
    stop: int
    first: str
    last: str

    @property
    def label(self) -> str:
        """What the range is called in the UI, the logs and errors: its shard positions."""
        return f"shards {self.start}-{self.stop - 1}" if self.stop - self.start > 1 else f"shard {self.start}"

    @property
    def slug(self) -> str:
        return f"r{self.start:05d}-{self.stop - 1:05d}"

    def to_dict(self) -> dict:
        return {"index": self.index, "start": self.start, "stop": self.stop, "first": self.first, "last": self.last}


def split_ranges(units: Sequence[str], workers: int) -> list[ShardRange]:
    """`units` cut into min(workers, len(units)) contiguous ranges, the first ones one longer."""
    n = min(workers, len(units))
    ranges, start = [], 0
    for i in range(n):
        stop = start + len(units) // n + (1 if i < len(units) % n else 0)
        ranges.append(ShardRange(i, start, stop, units[start], units[stop - 1]))
        start = stop
    return ranges


def plan_digest(units: Sequence[str], inputs: Sequence[str]) -> str:
    """The identity of a plan: its shard names and what each is computed from."""
    return hashlib.sha256(json.dumps([list(units), list(inputs)]).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FanOut:
    """One fanned-out build: what the launcher needs to start each range's child."""

    stage: str
    fingerprint: str
    upstream: Mapping[str, str]
    plan: str                       # plan_digest: a child refuses another plan
    ranges: Sequence[ShardRange]    # the ranges with pending shards (to launch)
    total_ranges: int               # all ranges of the plan, finished ones included


@dataclass(frozen=True)
class RangeTask:
    """What one child is asked: a range of the plan `plan` of output `fingerprint`, as attempt
    `attempt` (its lease key), beating every `lease_interval_s`."""

    part: ShardRange
    fingerprint: str
    plan: str
    attempt: int = 1
    lease_interval_s: float = 10.0

    def to_dict(self) -> dict:
        return {"part": self.part.to_dict(), "fingerprint": self.fingerprint, "plan": self.plan,
                "attempt": self.attempt, "lease_interval_s": self.lease_interval_s}

    @classmethod
    def from_dict(cls, d: Mapping) -> "RangeTask":
        return cls(ShardRange(**d["part"]), d["fingerprint"], d["plan"], int(d.get("attempt", 1)),
                   float(d.get("lease_interval_s", 10.0)))


class PlanChanged(DrafterError):
    """A child found a plan other than its parent's (the upstream or the reusable history changed
    between the two): it computes nothing; the parent's next run plans again."""


class RangesFailed(DrafterError):
    """Some ranges of a fanned-out stage failed after their retries: named in the message. Their
    finished shards stay; a re-run launches only the ranges that are not finished."""


def child_config(cfg, part: ShardRange):
    """A child's configuration: the parent's, its servers on port `serve.port + range index`
    (`serve.health_url` with them), so the children's own servers (datagen without `server_urls`)
    never collide on one host (on separate machines the offset is harmless; no fingerprint reads
    the port)."""
    return cfg.model_copy(update={"serve": cfg.serve.on_port(cfg.serve.port + part.index)})


# ------------------------------------------------------------------------------------- leases


def lease_key(stage: str, fingerprint: str, part: ShardRange, attempt: int) -> str:
    return f"{LEASE_PREFIX}/{stage}/{fingerprint}/{part.slug}-a{attempt}.json"


class Lease:
    """A child's heartbeat: a counter rewritten every `interval_s` in a thread, with where the child
    runs (host, pid, process group). Stopped (and removed) when the child's work ends."""

    def __init__(self, store: ObjectStore, key: str, interval_s: float):
        self.store, self.key, self.interval_s = store, key, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"lease {key}", daemon=True)
        self.beats = 0

    def __enter__(self) -> "Lease":
        self._write()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.store.delete(self.key)
        except StoreError as err:  # a lease left behind only costs its bytes
            log.warning("fan-out: could not remove lease %s: %s", self.key, err)

    def _write(self) -> None:
        self.beats += 1
        body = {"beat": self.beats, "host": socket.gethostname(), "pid": os.getpid(), "pgid": os.getpgid(0)}
        self.store.put_bytes(self.key, json.dumps(body).encode())

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write()
            except StoreError as err:  # one missed beat is not death; many are, and the parent says so
                log.warning("fan-out: lease %s not renewed: %s", self.key, err)


def read_lease(store: ObjectStore, key: str) -> dict | None:
    try:
        return json.loads(store.get_bytes(key))
    except (StoreError, ValueError):
        return None


# ------------------------------------------------------------------------------ the parent's loop


@dataclass(frozen=True)
class ChildState:
    """A child run as its launcher sees it. kind: waiting (queued for a worker), starting (a worker
    took it: its process or pod is coming up), running, done, failed (after its own retries), lost
    (crashed: its process or machine is gone), cancelled."""

    kind: str
    message: str = ""


class Launcher(Protocol):
    def launch(self, part: ShardRange, attempt: int) -> Any: ...
    def state(self, handle: Any) -> ChildState: ...
    def mark_lost(self, handle: Any, why: str) -> None: ...
    def cancel(self, handles: Sequence[Any]) -> None: ...


@dataclass
class _Range:
    part: ShardRange
    attempt: int = 1
    handle: Any = None
    state: ChildState = field(default_factory=lambda: ChildState("waiting"))
    beat: Any = None            # the last lease content seen
    beat_seen: float | None = None  # when (parent's monotonic clock) it last changed, while running
    kind_since: float | None = None  # when the child entered its present kind
    history: list[str] = field(default_factory=list)


def run_ranges(job: FanOut, launcher: Launcher, store: ObjectStore, *, attempts: int, lease_timeout_s: float,
               start_timeout_s: float = 900.0, poll_s: float = 1.0,
               on_status: Callable[[str], None] | None = None) -> dict:
    """Launch every range of `job`, relaunch lost ones, wait for all; raise RangesFailed naming the
    failed ones. Returns the fan-out's figures (ranges, attempts, wall time). Any error or
    interruption here cancels the children still running.

    A child is lost when it crashed, when it runs without moving its lease for `lease_timeout_s`, or
    when a worker took it but it has not started after `start_timeout_s` (the worker died between
    the two, or its pod never came up). A child queued for a worker is never lost: the pool is busy
    or has no worker, and the status line says how many wait."""
    started = time.monotonic()
    ranges = [_Range(p) for p in job.ranges]
    for r in ranges:
        r.handle = launcher.launch(r.part, r.attempt)
    last_line = None
    try:
        while True:
            for r in ranges:
                if r.state.kind in ("done", "failed", "cancelled"):
                    continue
                previous, r.state, now = r.state.kind, launcher.state(r.handle), time.monotonic()
                if r.kind_since is None or r.state.kind != previous:
                    r.kind_since = now
                if r.state.kind == "running":
                    _watch_lease(r, job, launcher, store, lease_timeout_s)
                if r.state.kind == "starting" and now - r.kind_since > start_timeout_s:
                    why = (f"taken by a worker but not started after {now - r.kind_since:.0f} s "
                           "(its worker died, or its infrastructure never came up)")
                    launcher.mark_lost(r.handle, why)
                    r.state = ChildState("lost", why)
                if r.state.kind == "lost":
                    _drop_lease(store, lease_key(job.stage, job.fingerprint, r.part, r.attempt))
                    _relaunch_or_fail(r, launcher, attempts)
            line = status_line(job, ranges)
            if line != last_line and on_status is not None:
                on_status(line)
            last_line = line
            if all(r.state.kind in ("done", "failed", "cancelled") for r in ranges):
                break
            time.sleep(poll_s)
    except BaseException:
        launcher.cancel([r.handle for r in ranges if r.state.kind not in ("done", "failed", "cancelled")])
        raise
    failed = [r for r in ranges if r.state.kind != "done"]
    if failed:
        raise RangesFailed(f"{job.stage}: {len(failed)} of {job.total_ranges} ranges failed: " + "; ".join(
            f"{r.part.label} ({r.state.kind}: {r.state.message or 'no message'})" for r in failed)
            + f"; {len(ranges) - len(failed)} launched ranges done")
    return {"ranges": job.total_ranges, "launched": len(ranges), "attempts": sum(r.attempt for r in ranges),
            "relaunched": [f"{r.part.label}: {h}" for r in ranges for h in r.history],
            "wall_s": round(time.monotonic() - started, 3)}


def _watch_lease(r: _Range, job: FanOut, launcher: Launcher, store: ObjectStore, timeout_s: float) -> None:
    now = time.monotonic()
    beat = read_lease(store, lease_key(job.stage, job.fingerprint, r.part, r.attempt))
    if r.beat_seen is None or beat != r.beat:
        r.beat, r.beat_seen = beat, now
        return
    if now - r.beat_seen > timeout_s:
        why = f"no lease beat for {now - r.beat_seen:.0f} s (its worker or machine is gone)"
        launcher.mark_lost(r.handle, why)
        r.state = ChildState("lost", why)


def _drop_lease(store: ObjectStore, key: str) -> None:
    """A lost child cannot remove its own lease: the parent does (a lease left only costs its bytes)."""
    try:
        store.delete(key)
    except StoreError as err:
        log.warning("fan-out: could not remove lease %s: %s", key, err)


def _relaunch_or_fail(r: _Range, launcher: Launcher, attempts: int) -> None:
    r.history.append(f"attempt {r.attempt} lost ({r.state.message or 'crashed'})")
    if r.attempt >= attempts:
        r.state = ChildState("failed", f"lost {attempts} times; last: {r.state.message or 'crashed'}")
        return
    r.attempt += 1
    log.warning("fan-out: %s %s", r.part.label, r.history[-1] + f"; launching attempt {r.attempt}")
    r.handle, r.beat, r.beat_seen, r.kind_since = launcher.launch(r.part, r.attempt), None, None, None
    r.state = ChildState("waiting")


def status_line(job: FanOut, ranges: Sequence[_Range]) -> str:
    """What the parent's state message says: ranges done, failed, running, waiting."""
    finished_before = job.total_ranges - len(ranges)
    kinds = [r.state.kind for r in ranges]
    done = kinds.count("done") + finished_before
    failed = kinds.count("failed") + kinds.count("cancelled")
    extra = [f"{kinds.count(k)} {k}" for k in ("running", "starting", "waiting") if kinds.count(k)]
    return _counts(job.stage, done, job.total_ranges, failed) + (f" ({', '.join(extra)})" if extra else "")


def done_line(stage: str, figures: dict) -> str:
    """The parent's state message once every range is done; `figures`: what run_ranges returned."""
    return _counts(stage, figures["ranges"], figures["ranges"], 0) + f" ({figures['launched']} launched here)"


def _counts(stage: str, done: int, total: int, failed: int) -> str:
    return f"{stage}: {done} of {total} ranges done, {failed} failed"
