"""The schema's building blocks: strict sections, the output / operational field declarations that
decide what a stage's fingerprint covers, and the error every invalid configuration raises."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from drafter.errors import EXIT_CONFIG, DrafterError


def _declared(default: Any, fingerprint: bool, kw: dict[str, Any]) -> Any:
    if "default_factory" not in kw:
        kw["default"] = default
    return Field(json_schema_extra={"fingerprint": fingerprint}, **kw)


def OutputField(default: Any = ..., **kw: Any) -> Any:
    """A field that changes what its stage produces: part of the stage's fingerprint."""
    return _declared(default, True, kw)


def OperationalField(default: Any = ..., **kw: Any) -> Any:
    """A field that changes how fast or where a stage runs, never what it produces (concurrency,
    timeouts, devices, progress intervals): left out of the fingerprint, so changing it reuses
    finished outputs."""
    return _declared(default, False, kw)


def is_output_field(info: Any) -> bool | None:
    """True / False as the field declares (OutputField / OperationalField), None if undeclared."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return extra.get("fingerprint")


def fingerprint_fields(section: BaseModel) -> dict[str, Any]:
    """The section's values that change its stage's output (JSON mode), by the fields' declarations;
    an undeclared field counts as output (the safe side: a new output is never a wrong reuse)."""
    names = {n for n, info in type(section).model_fields.items() if is_output_field(info) is not False}
    return section.model_dump(mode="json", include=names)


class Strict(BaseModel):
    """Unknown fields are errors: a typo must never be silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(DrafterError):
    """Invalid configuration. Never retried (exit 2, wherever it is raised: at load, or by a stage
    that finds the configuration cannot serve it). `problems` is a list of (field, message)."""

    exit_code = EXIT_CONFIG

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"{field}: {msg}" for field, msg in problems]
        super().__init__(f"invalid configuration{where}:\n  " + "\n  ".join(lines))

