"""An output's lineage: its whole chain, read from what the store records (`drafter lineage OUTPUT`,
and the Prefect markdown artifact of every lifecycle run).

The chain is walked through the upstream links the manifests record (datagen's `prepare_fingerprint`,
dump's `upstream`, train's `dump_fingerprint` / `train_dump` / `eval_dump`, export's
`export.train_fingerprint`, a bench's `report.json` `drafters`); each stage's settings are those its
manifest records. For a drafter (a train or export output) the record adds its offline judgement
(the export's `judge`), the verdicts of the bench outputs that measured it and the registry events
that name it. Nothing is invented: what a manifest does not record is absent from the record.

The code version is that of the checkout reading the record (the package version and its git
commit, or 'unknown'): the manifests do not record the code that wrote them.
"""
from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from drafter.errors import EXIT_CONFIG, DrafterError
from drafter.stage_output import MANIFEST_NAME, Manifest, StageOutput, check_fingerprint
from drafter.store import InvalidName, ObjectNotFound, ObjectStore

PACKAGE = "drafter-lifecycle"
DEPLOYMENT = "drafter-lifecycle/stage"  # deployments/prefect.yaml: selected stages of the table
# What each stage's manifest meta records of its settings (the rest are counts and figures).
SETTINGS = {
    "prepare": ("sources", "limit_reached"),
    "datagen": ("generation", "shard_size"),
    "dump": ("target_path", "target_fingerprint", "tokenizer_hash", "chat_template_hash", "dtype", "storage_dtype",
             "aux_layer_ids", "layer_id_convention", "max_length", "samples_per_shard", "shard_format"),
    "train": ("drafter", "steps", "planned_steps", "peak_lr", "tokens_per_step", "draft_vocab_size", "vocab_source",
              "init_from", "init_from_champion", "aux_layer_ids", "layer_id_convention", "world_size", "parallel"),
    "export": ("export.format_version", "export.dtype", "export.layer_ids", "export.draft_vocab"),
    "bench": ("engine", "interleave", "rounds", "batch_sizes", "configs", "prompts"),
}
DRAFTER_STAGES = ("train", "export")


class LineageError(DrafterError):
    """An OUTPUT that names no committed output (unknown, ambiguous, malformed): a usage error."""

    exit_code = EXIT_CONFIG


# ---- finding the output


def committed_outputs(store: ObjectStore) -> list[tuple[str, str]]:
    """Every committed (stage, fingerprint) in the store."""
    found = []
    for key in store.list(""):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == MANIFEST_NAME and not parts[0].startswith("_"):
            found.append((parts[0], parts[1]))
    return found


def resolve_output(store: ObjectStore, ref: str) -> StageOutput:
    """`<stage>/<fingerprint>` or a fingerprint (prefix) of a committed output."""
    ref = ref.strip().strip("/")
    stage, _, fp = ref.rpartition("/")
    try:
        if stage:
            check_fingerprint(stage, "stage")
        check_fingerprint(fp)
    except InvalidName as err:
        raise LineageError(f"lineage {ref!r}: {err}") from None
    if stage and len(fp) == 16:  # a whole STAGE/FINGERPRINT: no listing of the store
        try:
            return StageOutput.committed(store, stage, fp)
        except ObjectNotFound:
            pass
    outputs = committed_outputs(store)
    matches = [(s, f) for s, f in outputs if (not stage or s == stage) and f.startswith(fp)]
    if stage and (stage, fp) in matches:
        matches = [(stage, fp)]
    if not matches:
        raise LineageError(f"lineage {ref!r}: no committed output in {store.uri('')} matches "
                           f"(`drafter outputs --config PROFILE` lists them)")
    if len(matches) > 1:
        names = ", ".join(f"{s}/{f}" for s, f in sorted(matches))
        raise LineageError(f"lineage {ref!r}: ambiguous, it matches {names}: give more of the fingerprint "
                           f"or STAGE/FINGERPRINT")
    return StageOutput.committed(store, *matches[0])


# ---- what the manifests record


def _get(meta: dict, dotted: str):
    value = meta
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _report(out: StageOutput) -> dict:
    """A bench output's report.json (its `drafters`), or {} when it has none."""
    if not any(s.name == "report.json" for s in out.manifest.shards):
        return {}
    try:
        return json.loads(out.read_shard("report.json"))
    except (ValueError, DrafterError):
        return {}


def upstream_links(out: StageOutput) -> list[tuple[str, str]]:
    """The (stage, fingerprint) this output's manifest records as read, in the recorded order."""
    meta, stage = out.manifest.meta, out.stage
    links: list[tuple[str, str]] = []
    up = meta.get("upstream")
    if isinstance(up, dict) and up.get("stage") and up.get("fingerprint"):
        links.append((up["stage"], up["fingerprint"]))
    if meta.get("prepare_fingerprint") and stage == "datagen":
        links.append(("prepare", meta["prepare_fingerprint"]))
    if stage == "train":
        links += [("dump", meta[k]) for k in ("dump_fingerprint", "train_dump", "eval_dump") if meta.get(k)]
    if stage == "export" and _get(meta, "export.train_fingerprint"):
        links.append(("train", _get(meta, "export.train_fingerprint")))
    if stage == "bench":
        drafters = _report(out).get("drafters") or {}
        links += [("export", fp) for role, fp in sorted(drafters.items())
                  if role != "draft_dir" and isinstance(fp, str)]
    if stage == "champion" and isinstance(meta.get("challenger"), str):
        links.append(("export", meta["challenger"]))
    seen, unique = set(), []
    for link in links:
        if link not in seen:
            seen.add(link)
            unique.append(link)
    return unique


def recorded_settings(stage: str, manifest: Manifest) -> dict:
    keys = SETTINGS.get(stage)
    if keys is None:  # a stage without a list: its meta's plain values
        return {k: v for k, v in manifest.meta.items() if isinstance(v, (str, int, float, bool))}
    return {k: v for k in keys if (v := _get(manifest.meta, k)) is not None}


def _engine_versions(meta, path: str = "") -> dict:
    """Every engine version a manifest records: `engine_version` / `engine_versions` keys, by where."""
    found = {}
    if isinstance(meta, dict):
        for k, v in meta.items():
            where = f"{path}.{k}" if path else k
            if k in ("engine_version", "engine_versions") and v:
                found[where] = v
            elif isinstance(v, (dict, list)):
                found.update(_engine_versions(v, where))
    elif isinstance(meta, list):
        for i, v in enumerate(meta):
            found.update(_engine_versions(v, f"{path}[{i}]"))
    return found


def _target(chain: list[dict]) -> dict:
    """The target's identity as the chain's manifests record it."""
    target = {}
    for node in chain:
        meta = node["meta"]
        if node["stage"] == "datagen" and isinstance(meta.get("generation"), dict):
            gen = meta["generation"]
            target.update({k: gen[k] for k in ("model", "target_path") if gen.get(k)})
        if node["stage"] == "dump":
            target.update({k: meta[k] for k in ("target_path", "target_fingerprint", "tokenizer_hash",
                                                 "chat_template_hash", "dtype") if meta.get(k)})
        if node["stage"] == "export" and isinstance(_get(meta, "export.target"), dict):
            target.update({f"export.{k}": v for k, v in _get(meta, "export.target").items()})
    return target


# ---- code version


def code_version(repo: Path | None = None) -> dict:
    """This checkout's package version and git commit ('unknown' when not a git checkout)."""
    try:
        version = metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        version = "unknown"
    repo = repo or Path(__file__).resolve().parents[1]
    commit, dirty = "unknown", None
    try:
        run = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if run.returncode == 0 and run.stdout.strip():
            commit = run.stdout.strip()
            status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10)
            dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"package": PACKAGE, "version": version, "git_commit": commit, "git_dirty": dirty,
            "note": "the checkout reading this record; manifests do not record the code that wrote them"}


# ---- the record


def _node(out: StageOutput) -> dict:
    m = out.manifest
    return {"stage": out.stage, "fingerprint": out.fingerprint, "uri": out.uri, "created_at": m.created_at,
            "upstream": [f"{s}/{f}" for s, f in upstream_links(out)],
            "settings": recorded_settings(out.stage, m), "meta": m.meta,
            "shards": {s.name: s.sha256 for s in m.shards}}


def _walk(store: ObjectStore, out: StageOutput) -> tuple[list[dict], list[str]]:
    """The output and everything upstream of it, each after what it read (older first among
    siblings); the recorded links that are not in the store."""
    nodes: dict[tuple[str, str], dict] = {}
    order: list[tuple[str, str]] = []
    missing: set[str] = set()

    def visit(cur: StageOutput) -> None:
        key = (cur.stage, cur.fingerprint)
        nodes[key] = _node(cur)
        ups = []
        for stage, fp in upstream_links(cur):
            if (stage, fp) in nodes:
                continue
            try:
                ups.append(StageOutput.committed(store, stage, fp))
            except (ObjectNotFound, InvalidName, DrafterError):
                missing.add(f"{stage}/{fp}")
        for up in sorted(ups, key=lambda o: o.manifest.created_at):
            if (up.stage, up.fingerprint) not in nodes:
                visit(up)
        order.append(key)

    visit(out)
    return [nodes[k] for k in order], sorted(missing)


def _corpus(chain: list[dict]) -> dict | None:
    for node in chain:
        if node["stage"] == "prepare":
            sources = node["meta"].get("sources") or []
            return {"output": f"prepare/{node['fingerprint']}",
                    "sources": [{k: s.get(k) for k in ("label", "kind", "path", "rows_read", "kept") if k in s}
                                for s in sources if isinstance(s, dict)],
                    "hashes": {name: sha for name, sha in sorted(node["shards"].items())}}
    return None


def _drafter(store: ObjectStore, out: StageOutput, outputs: list[tuple[str, str]], registries: list[dict]) -> dict:
    """A train or export output's judgement, bench verdicts and registry events, where they exist."""
    if out.stage == "export":
        exports = [out]
    else:
        exports = [StageOutput.committed(store, "export", fp) for s, fp in outputs if s == "export"]
        exports = [e for e in exports if _get(e.manifest.meta, "export.train_fingerprint") == out.fingerprint]
    fps = {e.fingerprint for e in exports}
    judgements = {e.fingerprint: {k: v for k, v in e.manifest.meta["judge"].items() if isinstance(v, (str, int, float, bool))}
                  for e in exports if isinstance(e.manifest.meta.get("judge"), dict)}
    benches = []
    for s, fp in outputs:
        if s != "bench":
            continue
        bench = StageOutput.committed(store, s, fp)
        measured = {f for st, f in upstream_links(bench) if st == "export"} & fps
        if measured:
            m = bench.manifest.meta
            benches.append({"output": f"bench/{fp}", "exports": sorted(measured), "created_at": bench.manifest.created_at,
                            **{k: m[k] for k in ("engine", "verdicts", "recommendation", "engine_versions") if k in m}})
    events = []
    for reg in registries:
        for e in reg["events"]:
            if e.get("export") in fps:
                events.append({"registry": f"{reg['target']}/{reg['name']}",
                               **{k: e.get(k) for k in ("seq", "action", "export", "at", "reason")}})
    return {"exports": sorted(fps), "judgement": judgements, "bench": benches, "registry_events": events}


def lineage(store: ObjectStore, ref: str | StageOutput, profile: str | None = None,
            redact: Callable[[str], str] | None = None, registries: list[dict] = ()) -> dict:
    """The whole record of one output (a plain dict, JSON-ready); `profile` names the re-run
    commands' --config; `redact` (a drafter.secrets.Redactor) is applied to every string;
    `registries`: the store's registry entries (drafter.retrain.registry.list_registries, which the
    caller reads: the retrain package stands above this module)."""
    out = ref if isinstance(ref, StageOutput) else resolve_output(store, ref)
    out.load_manifest()
    chain, missing = _walk(store, out)
    engines = {f"{n['stage']}/{n['fingerprint']}": v for n in chain if (v := _engine_versions(n["meta"]))}
    stages = [n["stage"] for n in chain]
    ordered = list(dict.fromkeys(stages))
    config = profile or "PROFILE"
    record = {
        "output": f"{out.stage}/{out.fingerprint}", "uri": out.uri,
        "chain": [{k: n[k] for k in ("stage", "fingerprint", "created_at", "upstream", "settings", "uri")}
                  for n in chain],
        "missing_upstream": missing,
        "corpus": _corpus(chain),
        "target": _target(chain),
        "code": code_version(),
        "engine_versions": engines,
        "rerun": {
            "cli": [f"drafter run {s} --config {config}" for s in ordered],
            "prefect": f"prefect deployment run {DEPLOYMENT} --param profile={config} "
                       f"--param 'stages={json.dumps(ordered)}'",
            "note": ("the fingerprints above are reproduced only with the settings that made them"
                     + ("" if profile else "; PROFILE: the profile that made this output")),
        },
    }
    if out.stage in DRAFTER_STAGES:
        record["drafter"] = _drafter(store, out, committed_outputs(store), list(registries))
    if redact is not None:
        from drafter.secrets import redact_obj

        record = redact_obj(record, redact)
    return record


# ---- text


def _value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


def to_text(record: dict, markdown: bool = False) -> str:
    """The record for a person: plain text (`drafter lineage`) or markdown (the Prefect artifact)."""
    h = (lambda t: f"### {t}") if markdown else (lambda t: f"{t}:")
    item = "- " if markdown else "  "
    sub = "  - " if markdown else "      "
    code = (lambda t: f"`{t}`") if markdown else (lambda t: t)
    lines = [f"## lineage of {record['output']}" if markdown else f"lineage of {record['output']}",
             f"{item}where: {code(record['uri'])}", ""]
    lines.append(h("chain (oldest first)"))
    for n in record["chain"]:
        up = f" <- {', '.join(n['upstream'])}" if n["upstream"] else ""
        lines.append(f"{item}{code(n['stage'] + '/' + n['fingerprint'])}  {n['created_at']}{up}")
        for k, v in n["settings"].items():
            lines.append(f"{sub}{k}: {_value(v)}")
    if record["missing_upstream"]:
        lines.append(f"{item}recorded but not in the store: {', '.join(record['missing_upstream'])}")
    lines.append("")
    corpus = record["corpus"]
    lines.append(h("corpus"))
    if corpus is None:
        lines.append(f"{item}(no prepare output in the recorded chain)")
    else:
        for s in corpus["sources"]:
            lines.append(f"{item}source {_value(s)}")
        for name, sha in corpus["hashes"].items():
            lines.append(f"{item}{corpus['output']}/{name} sha256 {sha}")
    lines += ["", h("target")]
    lines += [f"{item}{k}: {_value(v)}" for k, v in record["target"].items()] or [f"{item}(not recorded)"]
    c = record["code"]
    dirty = " (uncommitted changes)" if c.get("git_dirty") else ""
    lines += ["", h("code"), f"{item}{c['package']} {c['version']}, git {c['git_commit']}{dirty} ({c['note']})"]
    lines += ["", h("engine versions")]
    lines += [f"{item}{out} {where}: {_value(v)}" for out, found in record["engine_versions"].items()
              for where, v in found.items()] or [f"{item}(none recorded)"]
    d = record.get("drafter")
    if d is not None:
        lines += ["", h("drafter")]
        lines.append(f"{item}exports: {', '.join(d['exports']) or '(none)'}")
        for fp, judge in d["judgement"].items():
            lines.append(f"{item}offline judgement export/{fp}: {_value(judge)}")
        for b in d["bench"]:
            versions = f", engine versions {', '.join(map(str, b['engine_versions']))}" if b.get("engine_versions") else ""
            lines.append(f"{item}{b['output']} ({b.get('engine', '?')}{versions}): verdicts "
                         f"{_value(b.get('verdicts', {}))}")
            for bs, rec in (b.get("recommendation") or {}).items():
                text = rec.get("text") if isinstance(rec, dict) else rec
                lines.append(f"{sub}batch {bs}: {text}")
        if not d["bench"]:
            lines.append(f"{item}bench: (no bench output measured it)")
        for e in d["registry_events"]:
            lines.append(f"{item}registry {e['registry']} #{e['seq']} {e['action']} {e['export']} at {e['at']}: "
                         f"{e['reason']}")
        if not d["registry_events"]:
            lines.append(f"{item}registry: (no events name it)")
    r = record["rerun"]
    lines += ["", h("re-run")]
    fence = ["```"] if markdown else []
    lines += fence + [("" if markdown else "  ") + cmd for cmd in [*r["cli"], r["prefect"]]] + fence
    lines.append(f"{item}{r['note']}")
    return "\n".join(lines) + "\n"
