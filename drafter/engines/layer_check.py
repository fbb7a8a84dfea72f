"""Before a drafter is served: are the layer ids in its config the ones THIS engine, at the version
installed, needs for the layers it was trained on? (drafter.layers.engine_layer_ids; field note 4.)
And does that version read the drafter's EAGLE 3.1 flags (drafter.eagle31)?

The installed version is asked from the engine's own interpreter (`serve.python`), without starting
it. When the engine is not importable there (a remote or containerised engine), the version the
export was written for is used, and the report says so.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from drafter.eagle31 import eagle31_engine_problem, flags_kind
from drafter.layers import READ_VERSIONS, UnknownLayerIdRule, engine_layer_ids
from drafter.server_errors import ServerConfigError

PROVENANCE_KEY = "drafter_lifecycle"  # where the export records our ids (drafter.export.sglang)
_PROBE = """
import importlib.metadata as md, importlib.util, sys
module, dists = sys.argv[1], sys.argv[2:]
if importlib.util.find_spec(module) is None:
    raise SystemExit(0)
for d in dists:
    try:
        print(md.version(d)); break
    except md.PackageNotFoundError:
        pass
"""


def installed_version(engine: str, python: str, timeout_s: float = 60.0) -> str | None:
    """The version of `engine` importable by `python`, or None (not installed / interpreter missing, or
    an engine without `version_packages`)."""
    from drafter.engine_registry import ENGINES, engine_class

    packages = engine_class(engine).version_packages if engine in ENGINES else None
    if packages is None:
        return None
    module, dists = packages
    try:
        out = subprocess.run([python, "-c", _PROBE, module, *dists], capture_output=True, text=True,
                             timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = out.stdout.strip().splitlines()
    return version[-1] if out.returncode == 0 and version else None


def _draft_ids(config: dict) -> list[int] | None:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")  # SGLang layout
    if ids is None:
        ids = config.get("eagle_aux_hidden_state_layer_ids")                            # speculators layout
    return [int(i) for i in ids] if ids is not None else None


def target_architecture(target_path: str) -> str | None:
    try:
        return (json.loads((Path(target_path) / "config.json").read_text()).get("architectures") or [None])[0]
    except (OSError, ValueError):
        return None


def check_draft_layer_ids(engine: str, draft_path: str | None, target_path: str, python: str) -> dict[str, Any]:
    """What was checked, for the serve report: {engine_version, version_source, aux_layer_ids, ids,
    rule} (or {"checked": False, "why": ...}). Raises ServerConfigError when the draft's ids are not
    the ones this engine version needs, or when no rule is known for the combination. The engine
    named `engine` decides (`Engine.check_layer_ids`, the layer-id rule hook)."""
    from drafter.engine_registry import make_engine

    return make_engine(engine).check_layer_ids(draft_path, target_path, python)


def check_versioned(engine: str, draft_path: str, target_path: str, python: str) -> dict[str, Any]:
    """The rule of an engine that reads the ids by its version (drafter.layers.engine_layer_ids),
    at the version installed for `python` (else the one the export was written for)."""
    version = installed_version(engine, python)
    try:
        config = json.loads((Path(draft_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {"checked": False, "why": f"{draft_path}/config.json unreadable (preflight reports it)"}
    record = config.get(PROVENANCE_KEY) or {}
    if version is not None:
        source = f"installed ({python})"
    else:
        version = record.get("engine_version") or READ_VERSIONS[engine]
        source = (f"{engine} not importable with {python}: the version the export was written for"
                  if record.get("engine_version") else
                  f"{engine} not importable with {python}: the version our rules were read in")
    if (problem := eagle31_engine_problem(flags_kind(config), engine, version)) is not None:
        raise ServerConfigError(f"{draft_path}: {problem} ({source})", engine=engine)
    ours, written = record.get("aux_layer_ids"), _draft_ids(config)
    base = {"engine": engine, "engine_version": version, "version_source": source}
    if ours is None or written is None:
        return {**base, "checked": False,
                "why": "the drafter does not record the layers it was trained on (not one of our exports)"}
    arch = target_architecture(target_path)
    try:
        mapped = engine_layer_ids(ours, engine, version, arch or "?")
    except UnknownLayerIdRule as err:
        raise ServerConfigError(f"{engine}: {err}", engine=engine) from None
    if written != mapped.ids:
        raise ServerConfigError(
            f"{engine} {version} ({source}) needs draft-config layer ids {mapped.ids} to capture the outputs of "
            f"layers {list(ours)} the drafter was trained on ({mapped.rule}); {draft_path} has {written}: it would "
            f"be served on the wrong layers. Re-export with export.{engine}_version: {version}", engine=engine)
    return {**base, "checked": True, "aux_layer_ids": list(ours), "ids": written, "rule": mapped.rule}


def check_reference(draft_path: str, target_path: str) -> dict[str, Any]:
    """Our reference engine reads draft-config ids in our convention (output of layer i): they must be
    the ids the export records it was trained on, and inside the target."""
    from drafter.layers import aux_layer_id_problem

    try:
        config = json.loads((Path(draft_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {"checked": False, "why": f"{draft_path}/config.json unreadable (preflight reports it)"}
    ours, written = (config.get(PROVENANCE_KEY) or {}).get("aux_layer_ids"), _draft_ids(config)
    base = {"engine": "reference", "engine_version": "ours", "version_source": "this project"}
    if written is None:
        return {**base, "checked": False, "why": "the draft config names no aux layer ids (the target's default applies)"}
    if ours is not None and [int(i) for i in ours] != written:
        raise ServerConfigError(
            f"reference: {draft_path} has draft-config layer ids {written} but records it was trained on the "
            f"outputs of layers {list(ours)}; the reference engine reads the ids as our own, so it would serve "
            "the wrong layers. Serve this export with the engine it was written for, or re-export", engine="reference")
    try:
        layers = json.loads((Path(target_path) / "config.json").read_text()).get("num_hidden_layers")
    except (OSError, ValueError):
        layers = None
    if layers is not None and (problem := aux_layer_id_problem(written, int(layers))) is not None:
        raise ServerConfigError(f"reference: {draft_path} layer ids {problem}", engine="reference")
    return {**base, "checked": True, "aux_layer_ids": list(ours if ours is not None else written), "ids": written,
            "rule": "the reference engine reads ids in our convention: written unchanged"}
