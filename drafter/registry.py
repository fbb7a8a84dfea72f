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
a reader sees the old or the new state, never half of one. One writer at a time is assumed (the
`retrain-nightly` deployment runs with a concurrency limit of 1).
"""
from __future__ import annotations

import json
import re
from datetime import datetime, timezone

from drafter.errors import DrafterError
from drafter.formats import EXPORT
from drafter.stage_output import StageOutput
from drafter.store import ObjectNotFound, ObjectStore

ROOT = "_registry"
CHAMPION = "champion"  # `serve.draft_path: champion`, `train.init_from: champion`
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class RegistryError(DrafterError):
    """A registry request that cannot be done (no champion, nothing to roll back to, an export
    that does not exist or belongs to another target). Never retried."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Registry:
    """The champion of one drafter name for one target."""

    def __init__(self, store: ObjectStore, target: str, name: str):
        if not _NAME.match(name):
            raise RegistryError(f"drafter name {name!r}: use letters, digits, '.', '_' or '-'")
        self.store, self.target, self.name = store, target, name
        self.key = f"{ROOT}/{target}/{name}.json"

    @classmethod
    def for_config(cls, cfg, store: ObjectStore) -> "Registry":
        """The registry entry a configuration reads and writes: its target, `retrain.drafter_name`
        (default: the profile's `name`)."""
        from drafter.target_identity import target_fingerprint

        return cls(store, target_fingerprint(cfg.target.path, cfg.target.revision),
                   cfg.retrain.drafter_name or cfg.name)

    @property
    def uri(self) -> str:
        return self.store.uri(self.key)

    def load(self) -> dict:
        try:
            doc = json.loads(self.store.get_bytes(self.key))
        except ObjectNotFound:
            return {"target": self.target, "name": self.name, "events": [], "decisions": []}
        except ValueError as err:
            raise RegistryError(f"unreadable registry {self.uri}: {err}") from None
        return doc

    def _save(self, doc: dict) -> None:
        self.store.put_bytes(self.key, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())

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
        if promoted is None or promoted["previous"] is None:
            return None
        return events[promoted["previous"]]["export"]

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
        """Make `export_fp` the champion; with `decision`, record that retrain verdict in the same write."""
        self.check_export(export_fp)
        doc = self.load()
        events = doc["events"]
        event = {"seq": len(events), "action": "promote", "export": export_fp, "at": _now(), "reason": reason,
                 "figures": figures or {}, "previous": events[-1]["seq"] if events else None}
        events.append(event)
        if decision is not None:
            doc["decisions"].append({**decision, "at": event["at"]})
        self._save(doc)
        return event

    def record_decision(self, decision: dict) -> None:
        """A verdict that left the champion as it was (a rejected challenger)."""
        doc = self.load()
        doc["decisions"].append({**decision, "at": _now()})
        self._save(doc)

    def rollback(self, reason: str = "manual rollback") -> dict:
        """Make the champion before the current one champion again."""
        doc = self.load()
        events = doc["events"]
        if not events:
            raise RegistryError(f"{self.name}: no champion yet, nothing to roll back")
        current = events[-1]
        if current["previous"] is None:
            raise RegistryError(f"{self.name}: champion {current['export']} is the first one, nothing to roll back to")
        back_to = events[current["previous"]]
        event = {"seq": len(events), "action": "rollback", "export": back_to["export"], "at": _now(),
                 "reason": f"{reason} (from {current['export']})", "figures": back_to["figures"],
                 "previous": back_to["previous"]}
        events.append(event)
        self._save(doc)
        return event


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
