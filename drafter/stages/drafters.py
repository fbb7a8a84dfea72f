"""Which drafter a stage uses: one rule for bench, serve, champion and train.

In order:
- head to head (champion always; bench with `retrain.bench`): this run's export, the challenger,
  and the registry's champion it faces (Registry.opponent), when there is one;
- `champion` (`serve.draft_path`, `train.init_from`): the registry's champion export now (serving
  needs one; train without one trains from scratch: the first retrain);
- a local drafter directory: its files, named by their content;
- this run's export, when the table made it an upstream (`needs_export`);
- none: the target served alone, a baseline-only bench, training from scratch.

`resolve_drafter` reads the registry once (a stage's `inputs`); the fingerprints then name
`Drafters.identity`, so they stay pure.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from drafter.config import ConfigError, LifecycleConfig
from drafter.formats import EXPORT, download_export
from drafter.hashing import hash_file, short_hash
from drafter.retrain.registry import CHAMPION, Registry
from drafter.store import ObjectStore

DRAFTER_FILES = ("config.json", "model.safetensors")


@dataclass(frozen=True)
class Drafters:
    """The drafters a stage uses, by role: "" for one drafter, "challenger" / "champion" head to head."""

    exports: Mapping[str, str] = field(default_factory=dict)   # role -> export fingerprint
    local_dir: str | None = None                               # a drafter directory given by path
    local_identity: str | None = None                          # its content hash

    @property
    def identity(self) -> dict | None:
        """What a fingerprint names: which exports, or the directory's content; None without drafter."""
        if self.local_dir is not None:
            return {"draft_dir": self.local_identity}
        if not self.exports:
            return None
        return {"export": self.exports[""]} if set(self.exports) == {""} else dict(self.exports)

    @property
    def export(self) -> str | None:
        """The single drafter's export fingerprint (None: a directory, head to head, or none)."""
        return self.exports.get("")

    def local_paths(self, cfg: LifecycleConfig, store: ObjectStore) -> dict[str, str]:
        """role -> the directory the configured engine loads (exports fetched, in its format)."""
        if self.local_dir is not None:
            return {"": self.local_dir}
        return {role: export_dir(cfg, store, fp) for role, fp in self.exports.items()}


def needs_export(cfg: LifecycleConfig, stage: str) -> bool:
    """Whether the bench or the serve stage takes a drafter from this run's export (so the table
    makes it an upstream); the champion stage always does (its challenger)."""
    if stage == "bench":
        return cfg.retrain.bench or (bool(cfg.bench.speculative) and not cfg.serve.draft_path)
    if stage == "serve":
        return cfg.serve.speculative is not None and not cfg.serve.draft_path
    raise ValueError(f"needs_export: {stage!r} is neither bench nor serve")


def resolve_drafter(cfg: LifecycleConfig, store: ObjectStore, upstream: Mapping[str, str], *,
                    source: str | None, source_field: str, head_to_head: bool = False,
                    required: bool = True, identify: bool = True) -> Drafters:
    """The drafters named by `source` (`champion`, a directory, or None: this run's export).
    `required`: without a champion, a RegistryError (serving) instead of no drafter (training).
    `identify`: hash a directory's files (for a fingerprint; serving alone needs no hash)."""
    if head_to_head:
        challenger = upstream.get(EXPORT)
        if not challenger:
            raise ConfigError([(source_field, "a head-to-head needs this run's export as the challenger: "
                                              "no export upstream")])
        opponent = Registry.for_config(cfg, store).opponent(challenger)
        return Drafters({"challenger": challenger, **({"champion": opponent} if opponent else {})})
    if source == CHAMPION:
        registry = Registry.for_config(cfg, store)
        champion = registry.require_champion() if required else registry.champion_export()
        return Drafters({"": champion} if champion else {})
    if source:
        return Drafters(local_dir=source,
                        local_identity=directory_identity(source, source_field) if identify else None)
    return Drafters({"": upstream[EXPORT]} if EXPORT in upstream else {})


def directory_identity(path: str, source_field: str) -> str:
    """A content hash of a drafter directory's files (a path alone could change under us)."""
    files = [Path(path) / name for name in DRAFTER_FILES]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError([(source_field, f"not an SGLang-format drafter directory: missing {missing}")])
    return short_hash("".join(f"{f.name}:{hash_file(f)[1]}\n" for f in files))


def export_dir(cfg: LifecycleConfig, store: ObjectStore, export_fp: str) -> str:
    """An export as a local directory the configured engine loads, in that engine's format (vLLM's
    layer ids are one higher): `<serve.log_dir>/../drafters/export-<fp>[-vllm]/`, kept between
    runs (files re-verified, not re-fetched)."""
    from drafter.engine_registry import make_engine

    fmt = make_engine(cfg.serve.engine).export_format
    root = Path(cfg.serve.log_dir).parent / "drafters"
    name = f"export-{export_fp}" + ("-vllm" if fmt == "vllm" else "")
    return str(download_export(store, export_fp, root / name, fmt).resolve())
