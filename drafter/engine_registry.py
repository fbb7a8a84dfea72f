"""Every inference engine by its `serve.engine` name: one line per engine.

Adding an engine is its module (a subclass of drafter.engines.base.Engine that answers every
question callers ask: how to launch it, its log lines, which export format it loads, whether it
streams, ...) plus its line in `ENGINES`. The names are written as "module:Class" and imported only
when an engine is made, so this module imports no engine: the configuration validates
`serve.engine` against `ENGINES` without importing the engines (which import the configuration).
Tests add an engine the same way (`monkeypatch.setitem(ENGINES, name, "module:Class")`).
"""
from __future__ import annotations

import importlib

# name -> "module:Class", in the order the configuration lists them
ENGINES: dict[str, str] = {
    "reference": "drafter.engines.reference:ReferenceEngine",
    "sglang": "drafter.engines.sglang:SGLangEngine",
    "vllm": "drafter.engines.vllm:VLLMEngine",
    "command": "drafter.engines.command:CommandEngine",
}


def engine_names() -> tuple[str, ...]:
    return tuple(ENGINES)


def unknown_engine(name: object) -> str:
    """The one line a user gets for an engine name nobody registered."""
    return f"unknown engine {name!r} (known: {', '.join(sorted(ENGINES))})"


def engine_class(name: str) -> type:
    """The engine class named `name` (a drafter.engines.base.Engine subclass), imported now."""
    try:
        where = ENGINES[name]
    except (KeyError, TypeError):
        from drafter.server_errors import ServerConfigError

        raise ServerConfigError(unknown_engine(name)) from None
    module, _, cls = where.partition(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(name: str):
    """The engine named `name`, a drafter.engines.base.Engine (ServerConfigError, one line, for a
    name not in `ENGINES`)."""
    return engine_class(name)()
