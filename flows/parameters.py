"""What the lifecycle flows make of their parameters before any stage runs: the configuration (the
`config` parameter, else the `profile` file read and validated) and the stages to run.

A parameter the run cannot use ends the run `Failed` with one line, its state message, and the same
line as the run log's error: no traceback (it is not a bug), and nothing of the file's content. A
YAML syntax error is named by its line and column only: PyYAML's own message quotes the offending
line, and a profile may hold secret-looking text (a token typed into `serve.env`) that must not reach
the run log, Prefect's database or the UI. A field that does not validate is named with the line
it is on.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence, Union

import yaml

from drafter.config import ConfigError, LifecycleConfig, load_config


class Refused(Exception):
    """A parameter the run cannot use; `str()` is the run's one line."""


def stages_or_refuse(stages: Sequence[str], names: Sequence[str]) -> list[str]:
    """The selected stages; none selected is refused (a run that does nothing must not end Completed)."""
    if not stages:
        raise Refused(f"no stages selected: parameter stages is empty; choose one or more of "
                      f"{', '.join(names)}")
    return list(stages)


def config_or_refuse(profile: str, config: Optional[LifecycleConfig]) -> LifecycleConfig:
    """`config` when given, else the profile file read and validated."""
    if config is not None:
        return config
    where = _named(profile)
    try:
        text = Path(profile).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        text = None  # load_config names what is wrong with the file
    try:
        return load_config(profile)
    except ConfigError as err:
        raise Refused(f"bad profile {where}: {_problems(err, text)}") from None


def _named(profile: str) -> str:
    """The profile as given, and where a relative path was looked for (the flow run's directory)."""
    if Path(profile).is_absolute():
        return profile
    return f"{profile} (in {os.getcwd()})"


def _problems(err: ConfigError, text: Optional[str]) -> str:
    """Each field's problem on one line, with the line of the profile it is on."""
    root = _compose(text)
    parts = []
    for field, message in err.problems:
        line = _line_of(root, field) if not field.startswith("<") else None
        where = f"line {line}: " if line is not None else ""
        subject = f"{field}: " if not field.startswith("<") else ""
        parts.append(f"{where}{subject}{' '.join(str(message).split())}")
    return "; ".join(parts) or "invalid configuration"


def _compose(text: Optional[str]) -> Optional[yaml.Node]:
    if text is None:
        return None
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None


def _line_of(node: Optional[yaml.Node], field: str) -> Optional[int]:
    """The 1-based line of `field` (`serve.port`, `data.sources.0.path`) in the composed YAML: the
    deepest part of it present in the file (a missing field: the line of the section it belongs in)."""
    line = None
    for part in field.split("."):
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            break
    return line


def resolve(profile: str, config: Optional[LifecycleConfig], stages: Sequence[str],
            names: Sequence[str]) -> Union[tuple[LifecycleConfig, list[str]], Refused]:
    """The configuration and the stages, or why the run cannot start (its one line)."""
    try:
        selected = stages_or_refuse(stages, names)
        return config_or_refuse(profile, config), selected
    except Refused as refused:
        return refused
