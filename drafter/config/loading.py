"""Reading a configuration: YAML profile -> validated `LifecycleConfig`, every problem named by its
field (pydantic's `loc`); the local paths it needs; back to YAML."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from drafter.config.base import ConfigError
from drafter.config.lifecycle import LifecycleConfig, port_problems


def _problems(err: ValidationError) -> list[tuple[str, str]]:
    out = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (not part of the configuration schema)"
        if field:
            out.append((field, msg))
        else:  # cross-field checks report "field: message" lines
            out.extend(tuple(line.split(": ", 1)) if ": " in line else ("<root>", line)
                       for line in msg.splitlines())
    return out


def parse_config(data: dict[str, Any], source: str | None = None) -> LifecycleConfig:
    """A profile's data -> the validated configuration, with the checks of a whole profile
    (`port_problems`) that a fan-out child's derived configuration is not put through again."""
    try:
        cfg = LifecycleConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_problems(err), source) from None
    problems = port_problems(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> LifecycleConfig:
    """Load a YAML profile. Relative paths in it stay relative to the current directory."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([("<file>", f"no such file: {path}")], str(path))
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError([("<file>", f"not UTF-8 text (byte {err.start}: {err.reason}); "
                                      f"is this a YAML profile?")], str(path)) from None
    except yaml.YAMLError as err:
        raise ConfigError([("<yaml>", yaml_problem(err))], str(path)) from None
    except OSError as err:
        raise ConfigError([("<file>", f"cannot read: {err.strerror}")], str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError([("<root>", "the file must hold a mapping")], str(path))
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    return parse_config(data, str(path))


def path_problems(cfg: LifecycleConfig) -> list[tuple[str, str]]:
    """Local paths the configuration needs that do not exist here (`config validate` reports
    them; `--offline` skips this on a machine without the data). A target that is not local
    (a hub id like `org/name`) is left to the engine."""
    problems: list[tuple[str, str]] = []

    def need(field: str, path: str | None, kind: str = "path") -> None:
        if path is None:
            return
        p = Path(path).expanduser()
        ok = p.is_dir() if kind == "directory" else p.is_file() if kind == "file" else p.exists()
        if not ok:
            problems.append((field, f"no such {kind}: {path}"))

    target = cfg.target.path
    looks_local = target.startswith(("/", ".", "~")) or Path(target).parent.is_dir() or "/" not in target
    if cfg.target.demo is None and looks_local:  # a demo target is built by `drafter demo-target`
        need("target.path", target, "directory")
    for i, src in enumerate(cfg.data.sources):
        if src.path is not None and not src.path.startswith("s3://"):
            if src.kind == "jsonl" and Path(src.path).expanduser().is_dir():
                continue  # a folder of *.jsonl files: a growing source
            need(f"data.sources.{i}.path", src.path, "directory" if src.kind == "hf_disk" else "file")
    for field, value in (("serve.draft_path", cfg.serve.draft_path), ("train.init_from", cfg.train.init_from)):
        if value != "champion":  # the drafter registry's champion, resolved when the stage runs
            need(field, value, "directory")
    return problems


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def yaml_problem(err: yaml.YAMLError) -> str:
    """Line and column of a YAML error and PyYAML's description of the problem, with anything it
    quotes from the file (a character, an alias, a tag, the line itself) left out: a profile may
    hold text that must not reach a log."""
    if not isinstance(err, yaml.MarkedYAMLError):
        return f"not valid YAML ({type(err).__name__}; the file's content is not shown)"
    mark = err.problem_mark or err.context_mark
    at = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
    problem = re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", err.problem or err.context or "a syntax error")
    return f"{at}: not valid YAML: {problem} (the file's content is not shown)"


def config_to_yaml(cfg: LifecycleConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
