"""The `drafter` command: every stage can run from a terminal without Prefect."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from drafter.config import ConfigError, LifecycleConfig, config_to_yaml, load_config

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Train, export, serve and benchmark EAGLE-3 drafters.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect and validate configuration profiles.")
app.add_typer(config_app, name="config")
registry_app = typer.Typer(no_args_is_help=True, help="The drafter registry: champion per target and name.")
app.add_typer(registry_app, name="registry")

ConfigOpt = typer.Option(..., "--config", "-c", help="YAML profile, e.g. profiles/demo.yaml")
_DEBUG = False  # --debug: expected errors show their traceback too


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help="show the traceback of expected errors too")) -> None:
    global _DEBUG
    _DEBUG = debug


def _load(path: Path, options: dict | None = None) -> LifecycleConfig:
    """The profile, with the command-line options that were given (None = not given) applied on
    top and validated with it; a bad profile or option is one clean message, exit code 2."""
    overrides = {k: v for k, v in (options or {}).items() if v is not None}
    try:
        return load_config(path, overrides)
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None


@config_app.command("validate")
def config_validate(files: list[Path] = typer.Argument(..., help="profiles to check"),
                    offline: bool = typer.Option(False, "--offline",
                                                 help="do not check that local paths (target, sources, "
                                                      "drafter) exist")) -> None:
    """Print every problem in each profile. Exit 1 if any profile is invalid; exit 5 if they are valid
    but name local paths missing on this machine (a profile for a cluster checked on a laptop:
    warnings, not problems); 0 otherwise."""
    from drafter.config import path_problems
    from drafter.store import storage_problems
    from drafter.errors import EXIT_PATHS_MISSING
    from drafter.secrets import secret_looking_env

    failed = missing = 0
    for path in files:
        try:
            cfg = load_config(path)
            if not offline and (unusable := storage_problems(cfg)):
                raise ConfigError(unusable, str(path))
            decided = _engine_decides(cfg, path)
            absent = [] if offline else path_problems(cfg)
            missing += bool(absent)
            typer.echo(f"{path}: ok{decided}" + (f", but {len(absent)} path(s) missing here" if absent else ""))
            for field, msg in absent:
                typer.echo(f"  warning: {field}: {msg} (--offline skips this check)", err=True)
            for warning in secret_looking_env(cfg.serve.env):
                typer.echo(f"  warning: {warning}", err=True)
        except ConfigError as err:
            failed += 1
            typer.echo(f"{path}: {len(err.problems)} problem(s)", err=True)
            for field, msg in err.problems:
                typer.echo(f"  {field}: {msg}", err=True)
    raise typer.Exit(1 if failed else EXIT_PATHS_MISSING if missing else 0)


def _engine_decides(cfg: LifecycleConfig, path: Path) -> str:
    """What the configured engine says about every launch of the profile (`Engine.validate_profile`:
    the installed SGLang resolves them and names the layers it captures); a disagreement with our
    rules is a problem of the profile. Says which source decided."""
    from drafter.engine_registry import make_engine
    from drafter.server_errors import ServerConfigError

    try:
        return make_engine(cfg.serve.engine).validate_profile(cfg)
    except ServerConfigError as err:
        raise ConfigError([("serve", err.message)], str(path)) from None


@config_app.command("show")
def config_show(file: Path = typer.Argument(..., help="profile to resolve")) -> None:
    """Print the resolved configuration with every default filled in."""
    cfg = _load(file)
    typer.echo(config_to_yaml(cfg), nl=False)


@app.command("demo-target")
def demo_target(config: Path = ConfigOpt,
                force: bool = typer.Option(False, help="rebuild even if a matching target exists")) -> None:
    """Train (once) and cache the tiny demo target described by `target.demo`."""
    from drafter.demo_target import build_demo_target, ensure_demo_target

    cfg = _load(config)
    if cfg.target.demo is None:
        typer.echo(f"{config}: target.demo is not set; this profile uses an existing model", err=True)
        raise typer.Exit(2)
    bar = _progress_bar("demo target")
    build = build_demo_target if force else ensure_demo_target
    report = build(cfg.target.demo, cfg.target.path, progress=bar.update_to)
    bar.close()
    typer.echo(json.dumps({k: report[k] for k in report if k != "config"}, indent=2, default=str))


def _run_stage(name: str, cfg: LifecycleConfig, on_line=None):
    """Run one stage of the table with a progress bar; its upstream comes from the table too."""
    from drafter.stages import TABLE
    from drafter.store import open_store

    bar = _progress_bar(name, unit=TABLE[name].unit)
    try:
        result = TABLE.run(name, cfg, open_store(cfg.storage), progress=bar.update_to,
                           on_line=bar.around(on_line) if on_line else None)
    finally:
        bar.close()
    typer.echo(result.outcome())
    for line in result.summary:
        typer.echo(line)
    if result.headline:
        typer.echo(f"answer: {result.headline}")
    return result


def _stage_name(name: str) -> str:
    from drafter.stages import TABLE

    if name not in TABLE.names:
        raise typer.BadParameter(f"no stage {name!r}; stages: {', '.join(TABLE.names)}", param_hint="'STAGE'")
    return name


@app.command("run")
def run_stage(stage: str = typer.Argument(..., callback=_stage_name, metavar="STAGE",
                                          help="a stage of the table: prepare, datagen, dump, train, export, "
                                               "bench, champion, serve"),
              config: Path = ConfigOpt,
              quiet: bool = typer.Option(False, help="do not echo the stage's and its servers' lines")) -> None:
    """Run one stage of the table with the configuration's settings (its upstream outputs must be
    committed); the named commands below are this with their own options."""
    result = _run_stage(stage, _load(config), on_line=None if quiet else (lambda line: typer.echo(line, err=True)))
    typer.echo(json.dumps(result.meta, indent=2, default=str))


@app.command("prepare")
def prepare(config: Path = ConfigOpt) -> None:
    """Normalise, dedupe, filter and split the prompt corpus into the object store."""
    result = _run_stage("prepare", _load(config))
    typer.echo(json.dumps(result.meta, indent=2, default=str))


@app.command("datagen")
def datagen(config: Path = ConfigOpt,
            server: list[str] = typer.Option([], help="OpenAI-compatible base URL (repeatable); "
                                                      "default: datagen.server_urls, else start serve.engine")) -> None:
    """Regenerate the assistant turns of the prepared prompts (train and eval splits) with the target."""
    cfg = _load(config, {"datagen.server_urls": list(server) or None})
    result = _run_stage("datagen", cfg, on_line=lambda line: typer.echo(line, err=True))
    typer.echo(json.dumps(result.meta, indent=2, default=str))


@app.command("dump")
def dump(config: Path = ConfigOpt,
         device: list[str] = typer.Option([], help="device per worker (repeatable); default: dump.devices")) -> None:
    """Capture the target's aux + final hidden states as verified shards in the object store."""
    _run_stage("dump", _load(config, {"dump.devices": list(device) or None}))


@app.command("train")
def train(config: Path = ConfigOpt,
          nproc_per_node: Optional[int] = typer.Option(None, help="processes (GPUs); >1 launches torchrun "
                                                                  "(default: train.nproc_per_node)")) -> None:
    """Train the EAGLE-3 drafter on the dumped hidden states (resumes from its last checkpoint)."""
    cfg = _load(config, {"train.nproc_per_node": nproc_per_node})
    _run_stage("train", cfg, on_line=lambda line: typer.echo(line, err=True))


def _writable_folder(path: Path, hint: str) -> None:
    """A usage error unless `path` is (or can be made) a folder we can write into."""
    if path.exists() and not path.is_dir():
        raise typer.BadParameter(f"{path} exists and is not a folder", param_hint=hint)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".drafter-write-test"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise typer.BadParameter(f"cannot write into {path}: {err.strerror or err}", param_hint=hint) from None


@app.command("export")
def export(config: Path = ConfigOpt,
           out: Optional[Path] = typer.Option(None, help="also write the export here, one folder per format, "
                                                         "for a server to load")) -> None:
    """Export the trained drafter (SGLang + vLLM formats), check it key by key, judge it offline."""
    from drafter.stages.export import write_local
    from drafter.store import open_store

    cfg = _load(config)
    if out is not None:  # before the stage runs: a bad --out must not cost a judged export
        _writable_folder(out, "'--out'")
    result = _run_stage("export", cfg)
    if out is not None:
        for fmt, path in write_local(open_store(cfg.storage), result.fingerprint, out).items():
            typer.echo(f"{fmt}: {path}")


@app.command("bench")
def bench(config: Path = ConfigOpt) -> None:
    """Sweep speculative settings against the baseline measured in the same run; print the table."""
    _run_stage("bench", _load(config), on_line=None)


@app.command("demo-source")
def demo_source(folder: Path = typer.Option(Path("runs/demo-source"), "--dir", help="the growing source folder"),
                first: int = typer.Option(300, help="conversations in the first batch"),
                batch: int = typer.Option(30, help="conversations in every later batch")) -> None:
    """Append a batch of new ShareGPT prompts to a growing demo source folder (`make demo-retrain`)."""
    from drafter.retrain.demo_source import append_batch

    path, total = append_batch(folder, first, batch)
    typer.echo(f"wrote {path} ({total} conversations in {folder})")


@app.command("champion")
def champion(config: Path = ConfigOpt) -> None:
    """Judge this configuration's export against the registry's champion; promote it only when better."""
    _run_stage("champion", _load(config), on_line=lambda line: typer.echo(line, err=True))


def _registry(config: Path):
    from drafter.retrain.registry import Registry
    from drafter.store import open_store

    cfg = _load(config)
    return Registry.for_config(cfg, open_store(cfg.storage))


def _event_line(e: dict) -> str:
    return f"  #{e['seq']} {e['at']} {e['action']:<8} export {e['export']}  {e['reason']}"


@registry_app.command("list")
def registry_list(config: Path = ConfigOpt,
                  all_entries: bool = typer.Option(False, "--all", help="every target and name in the store")) -> None:
    """The champion and its history (this configuration's target and drafter name, or --all)."""
    from drafter.retrain.registry import list_registries
    from drafter.store import open_store

    if all_entries:
        cfg = _load(config)
        rows = list_registries(open_store(cfg.storage))
    else:
        reg = _registry(config)
        doc = reg.load()
        rows = [{"target": reg.target, "name": reg.name, "events": doc["events"],
                 "champion": doc["events"][-1]["export"] if doc["events"] else None}]
    for row in rows:
        typer.echo(f"{row['name']} (target {row['target']}): champion {row['champion'] or '(none yet)'}")
        for event in row["events"]:
            typer.echo(_event_line(event))


@registry_app.command("promote")
def registry_promote(export_fp: str = typer.Argument(..., metavar="EXPORT", help="export fingerprint"),
                     config: Path = ConfigOpt,
                     reason: str = typer.Option("manual promotion", help="recorded in the history")) -> None:
    """Make a committed export of this target the champion (a no-op when it already is)."""
    reg = _registry(config)
    already = reg.champion_export() == export_fp
    event = reg.promote(export_fp, reason)
    typer.echo(f"already the champion: {_event_line(event)}" if already else _event_line(event))


@registry_app.command("rollback")
def registry_rollback(config: Path = ConfigOpt,
                      reason: str = typer.Option("manual rollback", help="recorded in the history")) -> None:
    """Make the previous champion the champion again (`serve.draft_path: champion` then serves it)."""
    typer.echo(_event_line(_registry(config).rollback(reason)))


@app.command("storage-estimate")
def storage_estimate(tokens: float = typer.Option(..., help="corpus size in tokens, e.g. 87.8e6"),
                     hidden: int = typer.Option(..., help="target hidden size, e.g. 7168"),
                     dtype: str = typer.Option("bfloat16", help="stored dtype")) -> None:
    """How much object storage the hidden-state dump of a corpus needs (3 aux + final per token)."""
    from drafter.dtypes import DTYPES
    from drafter.contracts.shards import project_corpus

    if tokens < 1:
        raise typer.BadParameter(f"{tokens:g}: a corpus has at least 1 token", param_hint="'--tokens'")
    if hidden < 1:
        raise typer.BadParameter(f"{hidden}: a hidden size is at least 1", param_hint="'--hidden'")
    if dtype not in DTYPES:
        raise typer.BadParameter(f"{dtype!r} is not one of {sorted(DTYPES)}", param_hint="'--dtype'")
    typer.echo(project_corpus(int(tokens), hidden, dtype))


@app.command("serve")
def serve(config: Path = ConfigOpt,
          check: bool = typer.Option(False, "--check",
                                     help="start, gate, print one JSON line, tear down; exit 0 only if ready"),
          draft: Optional[str] = typer.Option(None, help="drafter directory (overrides serve.draft_path)"),
          fault: list[str] = typer.Option([], hidden=True, help="reference engine fault injection (tests)"),
          quiet: bool = typer.Option(False, help="do not echo server log lines")) -> None:
    """Run an inference server with validated speculative settings behind the readiness gate.
    The drafter: --draft, else serve.draft_path, else this configuration's export."""
    from drafter.serving.check import check_exit_code, check_server, serve_forever
    from drafter.stages import TABLE

    cfg = _load(config, {"serve.draft_path": draft})
    on_line = None if quiet else (lambda line: typer.echo(line, err=True))
    stage = TABLE["serve"].code  # the serve stage's rule for which drafter, without its gate-and-stop
    draft_path = stage.draft_path(stage.inputs(TABLE.context("serve", cfg)))
    if check:
        report = check_server(cfg, draft_path=draft_path, faults=tuple(fault), on_line=on_line)
        typer.echo(json.dumps(report, default=str))
        if report["status"] != "ready":  # the JSON line for programs, one line for a person
            first_line = (report["message"] or "").partition("\n")[0]
            typer.echo(f"error ({report['status']}): {first_line}", err=True)
        raise typer.Exit(check_exit_code(report))
    result = serve_forever(cfg, draft_path=draft_path, on_line=on_line)
    typer.echo(result["message"], err=True)
    raise typer.Exit(result.get("exit_code", 0))


@app.command("smoke")
def smoke(config: Path = ConfigOpt,
          verbose: bool = typer.Option(False, help="also echo the stages' and the servers' own lines")) -> None:
    """The lifecycle's contracts end to end in minutes, on this profile: a few prompts through datagen,
    a small dump (re-checked layer by layer), a drafter overfit on them, export, the profile's engine
    serving it, and a full draft block accepted on a training prompt. Outputs under <storage.root>/smoke;
    a failure is one line naming the step and the contract it broke."""
    from drafter.smoke import run_smoke

    cfg = _load(config)
    if cfg.target.demo is not None:  # as the lifecycle does: the demo target built once, then cached
        from drafter.demo_target import ensure_demo_target

        bar = _progress_bar("demo target")
        ensure_demo_target(cfg.target.demo, cfg.target.path, progress=bar.update_to)
        bar.close()
    echo = lambda line: typer.echo(line, err=True)  # noqa: E731
    report = run_smoke(cfg, on_step=echo, on_line=echo if verbose else None)
    typer.echo(report.line())


@app.command("outputs")
def outputs(config: Path = ConfigOpt) -> None:
    """List every committed stage output in the configured store (stage, fingerprint, size, URI)."""
    from drafter.outputs import list_outputs
    from drafter.store import open_store

    cfg = _load(config)
    store = open_store(cfg.storage)
    rows = list_outputs(store)
    typer.echo(f"store: {cfg.storage.root}")
    if not rows:
        typer.echo("  (no committed outputs yet)")
    for row in rows:
        typer.echo(f"  {row['stage']:<10} {row['fingerprint']}  {row['shards']:>4} shards "
                   f"{row['bytes'] / 1e6:>10.2f} MB  {row['created_at']}  {row['uri']}")


@app.command("lineage")
def lineage(output: str = typer.Argument(..., metavar="OUTPUT", help="STAGE/FINGERPRINT or a fingerprint "
                                                                     "(prefix), as `drafter outputs` lists them"),
            config: Path = ConfigOpt,
            as_json: bool = typer.Option(False, "--json", help="print the record as JSON")) -> None:
    """An output's whole chain: corpus sources and hashes, each stage's fingerprint and recorded
    settings, the target, code and engine versions, the commands to re-run it and, for a drafter,
    its judgement, bench verdicts and registry events."""
    from drafter.lineage import lineage as build_lineage, to_text
    from drafter.retrain.registry import list_registries
    from drafter.secrets import Redactor, secret_values
    from drafter.store import open_store

    cfg = _load(config)
    store = open_store(cfg.storage, create=False)
    redact = Redactor(secret_values(cfg.serve.env, cfg.serve.extra_args))
    record = build_lineage(store, output, profile=str(config), redact=redact, registries=list_registries(store))
    typer.echo(json.dumps(record, indent=1, sort_keys=True) if as_json else to_text(record).rstrip("\n"))


@app.command("verify")
def verify(target: str = typer.Argument(..., help="a stage name (its output for --config) or an output URI, "
                                                 "e.g. file:///data/store/dump/ab12cd34ef56ab78"),
           config: Optional[Path] = typer.Option(None, "--config", "-c",
                                                 help="YAML profile (needed for a stage name; its storage "
                                                      "settings are used for s3:// URIs)"),
           repair: bool = typer.Option(False, "--repair", help="set a failed output aside (its evidence kept "
                                                               "under _failed/) so the next run of its stage "
                                                               "redoes the bad shards")) -> None:
    """Re-hash a committed output end to end against its manifest; exit 4 if any shard is bad
    (with --repair: set it aside and exit 0, the next run of the stage redoes it)."""
    from drafter.stage_output import CorruptObject, StageOutput
    from drafter.stages import TABLE
    from drafter.store import open_store

    cfg = _load(config) if config is not None else None
    if "://" in target:
        root, _, rest = target.rstrip("/").rpartition("/")
        root, _, stage = root.rpartition("/")
        fingerprint = rest
        if stage not in TABLE.names or not fingerprint or "://" not in root:
            raise typer.BadParameter(f"{target}: an output URI is ROOT/STAGE/FINGERPRINT, e.g. "
                                     f"file:///data/store/dump/ab12cd34ef56ab78 (stages: {', '.join(TABLE.names)})",
                                     param_hint="'TARGET'")
        storage = cfg.storage.model_copy(update={"root": root}) if cfg else None
        from drafter.config import StorageConfig

        # a read: a store that is not there is said so, never created
        out = StageOutput(open_store(storage or StorageConfig(root=root), create=False), stage, fingerprint)
    else:
        if target not in TABLE.names or cfg is None:
            typer.echo(f"verify {target}: give a stage ({', '.join(TABLE.names)}) with --config, or an "
                       f"output URI", err=True)
            raise typer.Exit(2)
        store = open_store(cfg.storage, create=False)  # a read: a store that is not there is said so
        fingerprint = TABLE.fingerprints(cfg, store=store)[TABLE[target].name]
        if fingerprint is None:
            typer.echo(f"verify {target}: this stage stores no output", err=True)
            raise typer.Exit(2)
        out = StageOutput(store, target, fingerprint)
    bar = _progress_bar(f"verify {out.stage}")
    try:
        report = (out.repair if repair else out.verify)(progress=bar.update_to)
    finally:
        bar.close()
    for problem in report["problems"]:
        typer.echo(f"  {problem}", err=True)
    if repair and report["problems"]:
        for uri in report["set_aside"]:
            typer.echo(f"  set aside: {uri}", err=True)
        typer.echo(f"{out.uri}: {len(report['problems'])} of {report['shards']} shards failed; set aside: run "
                   f"{out.stage} again to redo them")
        return
    if report["problems"]:
        raise CorruptObject(out.prefix, f"{len(report['problems'])} of {report['shards']} shards failed "
                                        f"verification", out.uri)
    typer.echo(f"{out.uri}: {report['shards']} shards, {report['bytes'] / 1e6:.2f} MB verified (sha256): ok")


class _Bar:
    """A tqdm bar fed by library progress callbacks `(done, total, *info)`."""

    def __init__(self, desc: str, unit: str):
        from tqdm import tqdm

        self._bar = tqdm(desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)

    def update_to(self, done: int, total: int | None = None, *info) -> None:
        if total is not None and self._bar.total != total:
            self._bar.total = total
        self._bar.n = done
        if info:
            self._bar.set_postfix_str(", ".join(_fmt(i) for i in info))
        self._bar.refresh()

    def around(self, echo):
        """`echo` with the bar cleared first and redrawn after: a line never lands on the bar's line."""
        def write(line: str) -> None:
            with self._bar.external_write_mode(file=sys.stderr):
                echo(line)
        return write

    def close(self) -> None:
        self._bar.close()


def _fmt(value) -> str:
    if isinstance(value, dict):  # e.g. the trainer's {loss, accept_length, tokens_per_s}
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _progress_bar(desc: str, unit: str = "it") -> _Bar:
    return _Bar(desc, unit)


def _click_exceptions() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(usage errors, aborts) of every click the app may raise: typer >= 0.29 raises those of its own
    vendored copy (typer._click), older typer those of click itself."""
    import importlib

    usage, aborts = [], []
    for errors, abort in (("typer._click.exceptions", "typer.exceptions"), ("click.exceptions", "click.exceptions")):
        try:
            usage.append(importlib.import_module(errors).ClickException)
            aborts.append(importlib.import_module(abort).Abort)
        except (ImportError, AttributeError):
            continue
    return tuple(usage), tuple(aborts)


def main() -> None:
    """Console entry point, the one error boundary: an expected failure (any DrafterError: bad
    input, a missing upstream output, a corrupt shard, a server that would not start...) is one
    line on stderr and a documented exit code (drafter.errors), its traceback only with --debug (so
    is a full disk, ENOSPC / EDQUOT, wherever it is hit: exit 4, never retried);
    Ctrl-C / SIGTERM exit 130 / 143; anything else is a bug and keeps its traceback."""
    import signal

    from drafter.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, DrafterError, describe, disk_full, exit_code
    from drafter.serving.session import Terminated

    def terminate(signum, frame):  # SIGTERM's default skips `finally`: every command cleans up instead
        raise Terminated(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminate)
    Terminated.seen = False  # this run's SIGTERM only (main() runs more than once inside the tests)
    usage_errors, aborts = _click_exceptions()
    try:
        code = app(standalone_mode=False)
    except usage_errors as err:  # usage: bad option, missing argument, unknown command (exit 2)
        err.show()
        code = err.exit_code
    except (*aborts, KeyboardInterrupt):  # click wraps KeyboardInterrupt (and Terminated) in Abort
        code = EXIT_INTERRUPTED
        if not Terminated.seen:
            typer.echo("interrupted", err=True)
    except DrafterError as err:
        if _DEBUG:
            import traceback

            traceback.print_exc()
        typer.echo(describe(err), err=True)
        code = exit_code(err)
    except OSError as err:  # a full disk anywhere (a checkpoint, a scratch folder): expected, not a bug
        if not disk_full(err):
            raise
        if _DEBUG:
            import traceback

            traceback.print_exc()
        typer.echo(describe(err), err=True)
        code = exit_code(err)
    if Terminated.seen:  # however the command reported it (a stage or typer may have absorbed it)
        typer.echo("terminated (SIGTERM)", err=True)
        code = EXIT_TERMINATED
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
