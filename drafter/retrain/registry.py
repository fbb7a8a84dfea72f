"""The drafter registry: per target and drafter name, which export is the champion, and its history.

One JSON document per (target, name) in the store, `_registry/<target fingerprint>/<name>.json`:

    {"target": ..., "name": ..., "events": [...], "decisions": [...]}

- `events`: every change of the champion, oldest first: `{"seq", "action" (promote | rollback),
  "export", "at", "reason", "figures", "previous"}`. The champion is the last event's export.
  `previous` is the seq of the event whose champion this one replaced, so `rollback` returns to it
  and a second rollback walks one further back.
- `decisions`: every retrain's verdict (promoted or rejected, with the figures), for the report
  and the plot of accept length across retrains.

Updates rewrite the whole document with one put (an atomic rename on local files, one PUT on S3):
a reader sees the old or the new state, never half of one. Writers may run concurrently (a manual
`drafter registry promote` during a retrain, several CLI runs): every update is a compare-and-swap
(`ObjectStore.put_if`: a lock on local files, a conditional PUT on S3). A writer that lost the race
re-reads the document and applies its change to the new state, up to `WRITE_ATTEMPTS` times, then
fails with RegistryConflict. An update that changes nothing (promoting the current champion) writes
nothing.
"""
from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TypeVar

from drafter.config.registry_names import registry_name_problem
from drafter.errors import DrafterError
from drafter.formats import EXPORT
from drafter.stage_output import StageOutput, check_fingerprint
from drafter.store import InvalidName, ObjectNotFound, ObjectStore

log = logging.getLogger(__name__)
T = TypeVar("T")

ROOT = "_registry"
CHAMPION = "champion"  # `serve.draft_path: champion`, `train.init_from: champion`
# A write loses the race at most once per other writer that wrote meanwhile: 16 covers 16 writers.
WRITE_ATTEMPTS = 16
_sleep = time.sleep  # tests make the pause between attempts instant
_EVENT_KEYS = ("seq", "action", "export", "at", "reason", "previous")
_ACTIONS = ("promote", "rollback")
_DECISION_KEYS = ("at", "verdict", "challenger")
_SHAPE = ('a JSON object {"events": [{"seq", "action", "export", "at", "reason", "previous", ...}, ...], '
          '"decisions": [{"at", "verdict", "challenger", ...}, ...]}')


class RegistryError(DrafterError):
    """A registry request that cannot be done (no champion, nothing to roll back to, an export
    that does not exist or belongs to another target, a registry file that is not one). Never retried."""


class RegistryConflict(RegistryError):
    """Other writers changed the registry every time we tried to update it: a later attempt may work."""

    retryable = True


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _encode(doc: dict) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def _shape_problem(doc) -> str | None:
    """What is wrong with a parsed registry document, None if it has the registry's shape."""
    if not isinstance(doc, dict):
        return f"a JSON {type(doc).__name__ if doc is not None else 'null'}"
    for field in ("events", "decisions"):
        if not isinstance(doc.get(field), list):
            return f"{field!r}: {type(doc.get(field)).__name__ if field in doc else 'missing'}"
    for what, items, check in (("event", doc["events"], _event_problem), ("decision", doc["decisions"], _decision_problem)):
        for i, item in enumerate(items):
            if (problem := check(item, i)) is not None:
                return f"{what} {i}: {problem}: {json.dumps(item)[:80]}"
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fingerprint_problem(value, field: str) -> str | None:
    """An export is named by its fingerprint, one plain segment of the store's keys: never a path."""
    try:
        check_fingerprint(value, field)
    except InvalidName:
        return f"{field} {value!r} is not an export fingerprint"
    return None


def _event_problem(event, i: int) -> str | None:
    """What is wrong with event `i`, None if nothing: it has every field, its seq is its position,
    its action is one we write, its export a fingerprint (never a path), `at` and `reason` text,
    and `previous` an earlier event (or None)."""
    if not isinstance(event, dict):
        return "not an object"
    missing = [k for k in _EVENT_KEYS if k not in event]
    if missing:
        return f"missing {', '.join(missing)}"
    if not _is_int(event["seq"]) or event["seq"] != i:
        return f"seq {event['seq']!r} is not its position {i}"
    if event["action"] not in _ACTIONS:
        return f"action {event['action']!r} is not one of {', '.join(_ACTIONS)}"
    if (problem := _fingerprint_problem(event["export"], "export")) is not None:
        return problem
    for field in ("at", "reason"):
        if not isinstance(event[field], str):
            return f"{field} is not text"
    previous = event["previous"]
    if not (previous is None or (_is_int(previous) and 0 <= previous < i)):
        return f"previous {previous!r} is not an earlier event"
    if not isinstance(event.get("figures", {}), dict):
        return "figures is not an object"
    return None


def _decision_problem(decision, i: int) -> str | None:
    """What is wrong with a recorded verdict, None if nothing (the report and the plot read them)."""
    if not isinstance(decision, dict):
        return "not an object"
    missing = [k for k in _DECISION_KEYS if k not in decision]
    if missing:
        return f"missing {', '.join(missing)}"
    if not isinstance(decision["at"], str) or not isinstance(decision["verdict"], str):
        return "at and verdict must be text"
    return _fingerprint_problem(decision["challenger"], "challenger")


def _before(events: list[dict], event: dict) -> dict | None:
    """The champion `event`'s champion replaced, skipping events of the same export (a registry
    written by an earlier version may hold one champion twice in a row); None if there is none."""
    prior = event
    while prior["previous"] is not None:
        prior = events[prior["previous"]]
        if prior["export"] != event["export"]:
            return prior
    return None


class Registry:
    """The champion of one drafter name for one target."""

    def __init__(self, store: ObjectStore, target: str, name: str):
        if (problem := registry_name_problem(name)) is not None:
            raise RegistryError(problem)
        check_fingerprint(target, "target fingerprint")
        self.store, self.target, self.name = store, target, name
        self.key = f"{ROOT}/{target}/{name}.json"

    @classmethod
    def for_config(cls, cfg, store: ObjectStore) -> "Registry":
        """The registry entry a configuration reads and writes: its target, `retrain.drafter_name`
        (default: the profile's `name`)."""
        from drafter.target_identity import target_fingerprint

        return cls(store, target_fingerprint(cfg.target.path, cfg.target.revision), cfg.registry_name())

    @property
    def uri(self) -> str:
        return self.store.uri(self.key)

    def load(self) -> dict:
        return self._read()[0]

    def _read(self) -> tuple[dict, str | None]:
        """The document and its version (None: there is none yet), its shape checked."""
        try:
            raw, version = self.store.get_versioned(self.key)
        except ObjectNotFound:
            return {"target": self.target, "name": self.name, "events": [], "decisions": []}, None
        try:
            doc = json.loads(raw)
        except ValueError as err:
            raise RegistryError(f"unreadable registry {self.uri}: {err}") from None
        problem = _shape_problem(doc)
        if problem:
            raise RegistryError(f"registry {self.uri} is not a registry document: expected {_SHAPE}, "
                                f"got {problem}")
        return doc, version

    def _update(self, change: Callable[[dict], T]) -> T:
        """Compare-and-swap: `change` edits the document in place and returns the result; it runs
        again on the re-read document whenever another writer got there first."""
        result, after = None, None
        for attempt in range(1, WRITE_ATTEMPTS + 1):
            doc, version = self._read()
            if after is not None and _encode(doc) == after:
                return result  # our write did land (a retried PUT whose first answer was lost)
            before = _encode(doc)
            result = change(doc)
            after = _encode(doc)
            if after == before or self.store.put_if(self.key, after, version):
                return result
            log.info("registry %s changed while we updated it (attempt %d of %d): applying ours again",
                     self.uri, attempt, WRITE_ATTEMPTS)
            _sleep(random.uniform(0, 0.02 * attempt))  # apart from the writers we raced with
        raise RegistryConflict(f"registry {self.uri} was changed by other writers each of the "
                               f"{WRITE_ATTEMPTS} times we tried to update it; try again")

    def champion(self) -> dict | None:
        """The event that made the current champion (its `export` fingerprint), None without one."""
        events = self.load()["events"]
        return events[-1] if events else None

    def champion_export(self) -> str | None:
        champ = self.champion()
        return champ["export"] if champ else None

    def require_champion(self) -> str:
        """The champion's export fingerprint, or RegistryError saying there is none yet."""
        champ = self.champion_export()
        if champ is None:
            raise RegistryError(f"no champion drafter {self.name!r} for target {self.target} yet ({self.uri}): "
                                f"run a retrain or `drafter registry promote EXPORT`")
        return champ

    def opponent(self, challenger: str) -> str | None:
        """The champion `challenger` is judged and benched against: the current champion, or, when
        `challenger` already is the champion, the one its promotion replaced (None if it was the
        first). So a re-run of a retrain that promoted finds the same pair (the same fingerprints)
        and skips, instead of judging the champion against itself."""
        events = self.load()["events"]
        if not events:
            return None
        current = events[-1]
        if current["export"] != challenger:
            return current["export"]
        promoted = next((e for e in reversed(events) if e["action"] == "promote" and e["export"] == challenger), None)
        prior = _before(events, promoted) if promoted is not None else None
        return prior["export"] if prior is not None else None

    def history(self) -> list[dict]:
        return self.load()["events"]

    def decisions(self) -> list[dict]:
        return self.load()["decisions"]

    def check_export(self, export_fp: str) -> StageOutput:
        """A committed export of this registry's target, or RegistryError naming why not."""
        try:
            out = StageOutput.committed(self.store, EXPORT, export_fp)
        except ObjectNotFound:
            raise RegistryError(f"no committed export {export_fp} in {self.store.uri(EXPORT)}") from None
        got = ((out.manifest.meta.get("export") or {}).get("target") or {}).get("fingerprint")
        if got != self.target:
            raise RegistryError(f"export {export_fp} was made for target {got}, this registry is for {self.target}")
        return out

    def promote(self, export_fp: str, reason: str, figures: dict | None = None, decision: dict | None = None) -> dict:
        """Make `export_fp` the champion; with `decision`, record that retrain verdict in the same write.
        If it already is the champion, no event is added and the event that made it champion is
        returned (a `decision` is still recorded)."""
        check_fingerprint(export_fp, "export fingerprint")
        self.check_export(export_fp)

        def change(doc: dict) -> dict:
            events, at = doc["events"], _now()
            if events and events[-1]["export"] == export_fp:
                event = events[-1]
            else:
                event = {"seq": len(events), "action": "promote", "export": export_fp, "at": at, "reason": reason,
                         "figures": figures or {}, "previous": events[-1]["seq"] if events else None}
                events.append(event)
            if decision is not None:
                doc["decisions"].append({**decision, "at": at})
            return event

        return self._update(change)

    def record_decision(self, decision: dict) -> None:
        """A verdict that left the champion as it was (a rejected challenger)."""
        self._update(lambda doc: doc["decisions"].append({**decision, "at": _now()}))

    def rollback(self, reason: str = "manual rollback") -> dict:
        """Make the champion before the current one champion again."""

        def change(doc: dict) -> dict:
            events = doc["events"]
            if not events:
                raise RegistryError(f"{self.name}: no champion yet, nothing to roll back")
            current = events[-1]
            back_to = _before(events, current)
            if back_to is None:
                raise RegistryError(f"{self.name}: champion {current['export']} is the first one, "
                                    f"nothing to roll back to")
            event = {"seq": len(events), "action": "rollback", "export": back_to["export"], "at": _now(),
                     "reason": f"{reason} (from {current['export']})", "figures": back_to.get("figures", {}),
                     "previous": back_to["previous"]}
            events.append(event)
            return event

        return self._update(change)


def list_registries(store: ObjectStore) -> list[dict]:
    """Every registry entry in the store: target, name, champion export, number of changes."""
    rows = []
    for key in store.list(f"{ROOT}/"):
        parts = key.split("/")
        if len(parts) != 3 or not parts[2].endswith(".json"):
            continue
        reg = Registry(store, parts[1], parts[2].removesuffix(".json"))
        doc = reg.load()
        champ = doc["events"][-1] if doc["events"] else None
        rows.append({"target": reg.target, "name": reg.name, "champion": champ["export"] if champ else None,
                     "since": champ["at"] if champ else None, "changes": len(doc["events"]),
                     "decisions": len(doc["decisions"]), "events": doc["events"]})
    return rows
