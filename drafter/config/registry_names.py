"""The one rule for drafter registry names (`retrain.drafter_name`, else the profile's `name`).

A name is one segment of the registry's key, `_registry/<target>/<name>.json`: letters, digits,
'.', '_' and '-', starting with a letter or digit, at most 100 characters (no spaces, no '/', no
'..'). `drafter config validate` and the registry both ask `registry_name_problem`, so a name the
registry would refuse is refused before any stage runs, not at the champion stage after all the
expensive ones. It lives with the configuration (which the registry, drafter.retrain.registry, may
import; the configuration imports no stage). Only the standard library.
"""
from __future__ import annotations

import re

REGISTRY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def registry_name_problem(name: object) -> str | None:
    """None when `name` can name a registry entry, else why not."""
    if isinstance(name, str) and REGISTRY_NAME.match(name):
        return None
    return (f"drafter name {name!r} cannot name a registry entry: use 1-100 letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit (no spaces or '/')")
