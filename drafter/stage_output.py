"""Content-addressed stage outputs and the commit protocol.

Layout under the store root: `<stage>/<fingerprint>/`
    <shard names...>          the data, written one by one
    _parts/<shard>.json       a marker per shard, written only AFTER the shard was read back and
                              verified (size + sha256): the resume point of a killed stage
    _SUCCESS.json             the manifest, written LAST: the stage is complete iff it exists, parses,
                              and every shard it lists exists with the listed size
    _failed/<time>.json       a manifest `repair` set aside, with the verification failures that
                              made it (evidence; the next run of the stage redoes those shards)

A shard may be a reference (`ShardInfo.source`): bytes another output committed, listed here by
their key instead of copied (an incremental dump reuses terabytes that way, see drafter.contracts.reuse).
Completeness checks and reads follow the reference and verify the bytes against this manifest.

The fingerprint hashes everything that determines the output (stage config, upstream fingerprints,
format version), so a changed input lands in a new prefix and an old output is never reused by
mistake. Every read is checked against the recorded sha256: corruption raises CorruptObject, it is
never silently used.
"""
from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path, PurePath

from pydantic import BaseModel, Field, ValidationError

from drafter.errors import DrafterError
from drafter.hashing import CHUNK, canonical_json, hash_chunks, hash_file, sha256_hex, short_hash
from drafter.store import CorruptObject, InvalidName, ObjectNotFound, ObjectStore, StoreError, check_key

log = logging.getLogger(__name__)

# A stage's progress callback: (done, total or None, *info); a Prefect artifact, a terminal bar.
Progress = Callable[..., None]


def guarded_progress(progress: Progress | None, stage: str) -> Progress | None:
    """`progress` that never raises: a progress display must never stop hours of work. Its first
    failure is logged and the reports stop."""
    if progress is None:
        return None
    failed = False

    def report(*args) -> None:
        nonlocal failed
        if failed:
            return
        try:
            progress(*args)
        except Exception as err:
            failed = True
            log.warning("%s progress callback failed (%s); progress reports stop", stage, err)

    return report


FORMAT_VERSION = 1
MANIFEST_NAME = "_SUCCESS.json"
PARTS_DIR = "_parts"
FAILED_DIR = "_failed"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_fingerprint(value: str, what: str = "fingerprint") -> str:
    """A fingerprint (or stage name) is one plain path segment: letters, digits, '.', '_', '-',
    starting with a letter or digit. Anything path-like (`..`, `a/b`) is refused before it names a key."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise InvalidName(f"invalid {what} {value!r}: use letters, digits, '.', '_' or '-' "
                          f"(e.g. 0123456789abcdef), not a path")
    return value


class EmptyOutput(DrafterError):
    """A stage would commit an output with nothing in it (every row bad, every request failed):
    an error naming the reasons, unless the configuration allows an empty output."""


class AlreadyCommitted(StoreError):
    """A write or commit into an output that is committed and complete. In a stage run
    (drafter.stages.base) this means another run of the same output committed it meanwhile: the
    run reports the output as complete (skipped), never this error."""


class ManifestError(StoreError):
    """A `_SUCCESS.json` exists but cannot be used (bad JSON, wrong schema, wrong stage)."""

    retryable = False


# ---- fingerprints and hashing


def fingerprint(stage: str, config: dict, upstream: Iterable[str] = (),
                format_version: int = FORMAT_VERSION) -> str:
    """First 16 hex chars of sha256 over canonical JSON (sorted keys, no whitespace) of all inputs.
    Upstream order is kept: positional upstreams are not interchangeable."""
    payload = {"stage": stage, "config": config, "upstream": list(upstream),
                "format_version": format_version}
    return short_hash(canonical_json(payload))


def _file_chunks(name: str, path: os.PathLike) -> Iterable[bytes]:
    try:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk
    except OSError as e:
        raise StoreError(f"shard {name}: cannot read {path}: {e}") from e


# ---- JSONL shards (prepare, datagen)


def to_jsonl(rows: Iterable[dict]) -> bytes:
    """One JSON object per line, UTF-8 (non-ASCII kept as is)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def from_jsonl(data: bytes) -> list:
    # split("\n"), not splitlines(): the JSON text may hold raw U+2028 / U+0085 separators.
    return [json.loads(line) for line in data.decode("utf-8").split("\n") if line]


# ---- manifest models


class ShardInfo(BaseModel):
    name: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    meta: dict = Field(default_factory=dict)
    # The store key of the bytes when they belong to another output (a reference); None: ours.
    source: str | None = Field(None, exclude_if=lambda v: v is None)


class Manifest(BaseModel):
    stage: str
    fingerprint: str
    format_version: int = FORMAT_VERSION
    created_at: str = Field(description="ISO 8601, UTC")
    shards: list[ShardInfo] = Field(default_factory=list)
    meta: dict = Field(default_factory=dict, description="stage-specific: counts, layer ids, ...")

    def shard(self, name: str) -> ShardInfo:
        for s in self.shards:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)


# ---- the output of one stage run


class StageOutput:
    """One stage's output at `<stage>/<fingerprint>/` in `store`."""

    def __init__(self, store: ObjectStore, stage: str, fingerprint: str):
        check_fingerprint(stage, "stage")
        check_fingerprint(fingerprint)
        self.store = store
        self.stage = stage
        self.fingerprint = fingerprint
        self.prefix = f"{stage}/{fingerprint}"
        self._manifest: Manifest | None = None  # cached for shard reads; a commit never changes
        self._verified: set[tuple[str, str]] = set()  # (name, sha256) this object wrote and read back

    @classmethod
    def for_inputs(cls, store: ObjectStore, stage: str, config: dict, upstream: Iterable[str] = (),
                   format_version: int = FORMAT_VERSION) -> "StageOutput":
        return cls(store, stage, fingerprint(stage, config, upstream, format_version))

    @classmethod
    def committed(cls, store: ObjectStore, stage: str, manifest_or_fingerprint: "Manifest | str") -> "StageOutput":
        """A committed upstream output, its manifest loaded: raises ObjectNotFound if it was never
        committed (never read a half-written output) and ManifestError if the manifest is unusable."""
        fp = (manifest_or_fingerprint.fingerprint if isinstance(manifest_or_fingerprint, Manifest)
              else manifest_or_fingerprint)
        out = cls(store, stage, fp)
        out.load_manifest()
        return out

    def __repr__(self) -> str:
        return f"StageOutput({self.uri!r})"

    @property
    def uri(self) -> str:
        return self.store.uri(self.prefix)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _marker_key(self, name: str) -> str:
        return self.key(f"{PARTS_DIR}/{name}.json")

    @staticmethod
    def _check_name(name: str) -> None:
        check_key(name)
        if name.startswith("_"):
            raise StoreError(f"shard name {name!r}: names starting with '_' are reserved")

    # ---- state

    def load_manifest(self) -> Manifest:
        key = self.key(MANIFEST_NAME)
        try:
            raw = self.store.get_bytes(key)
        except ObjectNotFound:
            raise ObjectNotFound(f"{self.stage} is not committed: no manifest {self.store.uri(key)} "
                                 f"(run the {self.stage} stage with this configuration first)") from None
        try:
            manifest = Manifest.model_validate_json(raw)
        except (ValidationError, ValueError) as e:
            raise ManifestError(f"invalid manifest {self.store.uri(key)}: {e}") from e
        if (manifest.stage, manifest.fingerprint) != (self.stage, self.fingerprint):
            raise ManifestError(f"manifest {self.store.uri(key)} is for {manifest.stage}/"
                                f"{manifest.fingerprint}, expected {self.prefix}")
        self._manifest = manifest
        return manifest

    @property
    def manifest(self) -> Manifest:
        """The committed manifest, loaded once (a commit never changes)."""
        return self._manifest if self._manifest is not None else self.load_manifest()

    def is_complete(self) -> bool:
        """Manifest present and valid, every listed shard present with its listed size. Hashes are
        checked on read (hashing TBs here would make this check unusable). Storage outages still
        raise: answering False would make a caller wipe and recompute a good output."""
        try:
            manifest = self.load_manifest()
        except (ObjectNotFound, ManifestError):
            return False
        sizes = self.store.list_sizes(self.prefix + "/")
        return all(self._size_of(s, sizes) == s.size for s in manifest.shards)

    def data_key(self, info: ShardInfo) -> str:
        """Where a shard's bytes are: ours, or the other output's key for a reference."""
        return info.source or self.key(info.name)

    def _size_of(self, info: ShardInfo, own_sizes: dict[str, int]) -> int | None:
        """The stored size of a shard's bytes (a reference's is looked up where it points)."""
        return own_sizes.get(self.key(info.name)) if info.source is None else self.store.size(info.source)

    def completed_shards(self) -> dict[str, ShardInfo]:
        """Shards written and verified so far, by name (sorted). A marker only counts while its
        shard still exists with the recorded size."""
        sizes = self.store.list_sizes(self.prefix + "/")
        parts = self.key(PARTS_DIR) + "/"
        markers = [k for k in sizes if k.startswith(parts) and k.endswith(".json")]
        # One small GET per marker: run them concurrently, on S3 latency dominates (10k shards
        # read one by one at ~20 ms each would take minutes at every resume and commit).
        with ThreadPoolExecutor(max_workers=16) as pool:
            infos = list(pool.map(self._read_marker, markers))
        done: dict[str, ShardInfo] = {}
        for marker, info in zip(markers, infos):
            if info and self._marker_key(info.name) == marker and self._size_of(info, sizes) == info.size:
                done[info.name] = info
        return dict(sorted(done.items()))

    def _read_marker(self, marker: str) -> ShardInfo | None:
        try:
            return ShardInfo.model_validate_json(self.store.get_bytes(marker))
        except ObjectNotFound:
            return None  # removed while we listed
        except (ValidationError, ValueError) as e:
            log.warning("ignoring unreadable shard marker %s: %s", self.store.uri(marker), e)
            return None

    # ---- writing

    def write_shard(self, name: str, data: bytes | str | Path | Iterable[bytes | memoryview],
                    meta: dict | None = None) -> ShardInfo:
        """Upload one shard, hashed while it is written and checked against what the store committed
        (`ObjectStore.put_stream`), then record its marker. `data`: bytes, str (text, stored UTF-8), a
        Path/PathLike to a local file (streamed) or an iterable of byte chunks (streamed)."""
        self._check_name(name)
        self._uncommit_for_repair()
        key = self.key(name)
        # A stale marker must never vouch for the new bytes if we die mid-upload.
        self.store.delete(self._marker_key(name))
        if isinstance(data, str):
            data = data.encode("utf-8")
        if isinstance(data, (bytes, bytearray, memoryview)):
            chunks: Iterable = [data]
        elif isinstance(data, os.PathLike):
            chunks = _file_chunks(name, data)
        elif isinstance(data, Iterable):
            chunks = data
        else:
            raise TypeError(f"shard data must be bytes, str, a Path or byte chunks, not {type(data).__name__}")
        size, sha = self.store.put_stream(key, chunks)
        self._verified.add((name, sha))  # checked against what the store committed
        info = ShardInfo(name=name, size=size, sha256=sha, meta=meta or {})
        self.store.put_bytes(self._marker_key(name), info.model_dump_json().encode())
        return info

    def link_shard(self, name: str, source: "StageOutput", source_name: str, meta: dict | None = None) -> ShardInfo:
        """List a shard `source` committed (verified there when it was written) under `name`, by
        reference: no byte is copied. Its size is checked now; its sha256 on every read, as ours."""
        self._check_name(name)
        self._uncommit_for_repair()
        want = source.manifest.shard(source_name)
        key = source.data_key(want)
        if self.store.size(key) != want.size:
            raise CorruptObject(key, f"referenced shard has {self.store.size(key)} bytes, its manifest says "
                                     f"{want.size}", self.store.uri(key), repair=False)
        self.store.delete(self.key(name))  # bytes of an earlier attempt must not shadow the reference
        info = ShardInfo(name=name, size=want.size, sha256=want.sha256,
                         meta=want.meta if meta is None else meta, source=key)
        self.store.put_bytes(self._marker_key(name), info.model_dump_json().encode())
        # The commit does not re-hash it: `source` committed these bytes verified, and re-reading
        # every reused shard would make a retrain's cost grow with the whole corpus again. Every
        # read still checks the sha256, and `drafter verify` re-hashes references too.
        self._verified.add((name, want.sha256))
        return info

    def drop_shard(self, name: str) -> None:
        """Remove a shard of an unfinished output (its marker first, then its own bytes; a
        reference's bytes belong to another output and stay)."""
        self._check_name(name)
        self.store.delete(self._marker_key(name))
        self.store.delete(self.key(name))

    def _uncommit_for_repair(self) -> None:
        """Writing into a committed output: refuse if it is complete (AlreadyCommitted: a complete
        output is never changed; recomputing it means deleting it first, `reset()`); if the
        commit is broken (missing shard, bad manifest) remove the manifest first, so the output is
        visibly incomplete before any shard changes."""
        manifest_key = self.key(MANIFEST_NAME)
        if not self.store.exists(manifest_key):
            return
        if self.is_complete():
            raise AlreadyCommitted(f"{self.uri} is already committed and complete: nothing written (to recompute "
                                   f"it, delete it first: `reset()`)")
        log.warning("removing the broken commit %s before repairing it", self.store.uri(manifest_key))
        self.store.delete(manifest_key)
        self._manifest = None

    def commit(self, meta: dict | Callable[[dict[str, ShardInfo]], dict] | None = None,
               expect: Iterable[str] | None = None) -> Manifest:
        """Write `_SUCCESS.json` (last) listing every completed shard sorted by name. Idempotent:
        committing the same shards and meta again returns the existing manifest unchanged.
        `meta`: a dict, or a function of the completed shards (by name) that returns it, so meta
        summed from shard markers describes exactly the shards listed (one listing, not two).
        `expect`: shard names that must all be complete, else StoreError names the missing ones."""
        shards = self.completed_shards()
        if expect is not None:
            missing = sorted(set(expect) - set(shards))
            if missing:
                raise StoreError(f"cannot commit {self.uri}: {len(missing)} shards missing, "
                                 f"e.g. {missing[:5]}")
        self._verify_before_commit(shards)
        if callable(meta):
            meta = meta(shards)
        manifest = Manifest(stage=self.stage, fingerprint=self.fingerprint, format_version=FORMAT_VERSION,
                            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                            shards=list(shards.values()), meta=meta or {})
        try:
            existing = self.load_manifest()
        except (ObjectNotFound, ManifestError):
            existing = None
        if existing is not None:
            same = (existing.model_dump(mode="json", exclude={"created_at"})
                    == manifest.model_dump(mode="json", exclude={"created_at"}))
            if same:
                return existing
            if self.is_complete():
                raise AlreadyCommitted(f"{self.uri} is already committed (with other shards or meta): not "
                                       f"committed again (to recompute it, delete it first: `reset()`)")
        self.store.put_bytes(self.key(MANIFEST_NAME), manifest.model_dump_json(indent=2).encode())
        self._manifest = manifest
        return manifest

    def _hash_problem(self, info: ShardInfo) -> str | None:
        """Re-hash one stored shard (a reference: where it points) against what was recorded; None
        when it matches."""
        key = self.data_key(info)
        try:
            self._verify(key, info, *hash_chunks(self.store.iter_chunks(key)), when="on verify", repair=False)
        except CorruptObject as err:
            return str(err)
        except ObjectNotFound:
            return f"missing object {self.store.uri(key)}"
        return None

    def _verify_before_commit(self, shards: dict[str, ShardInfo]) -> None:
        """Sizes alone do not prove a shard: every shard this object did not just write and read
        back (a resumed run's, or all of them when only the manifest was missing) is re-hashed
        before `_SUCCESS.json` vouches for it. A bad one loses its marker, so a re-run redoes it."""
        unchecked = [info for info in shards.values() if (info.name, info.sha256) not in self._verified]
        if not unchecked:
            return
        with ThreadPoolExecutor(max_workers=8) as pool:
            problems = list(pool.map(self._hash_problem, unchecked))
        bad = [(info, problem) for info, problem in zip(unchecked, problems) if problem]
        for info, _ in bad:
            self.store.delete(self._marker_key(info.name))
        if bad:
            info, problem = bad[0]
            raise CorruptObject(self.key(info.name), f"{len(bad)} of {len(shards)} shards failed verification "
                                f"before commit (e.g. {problem}); their markers were removed: run the stage "
                                f"again to regenerate them", self.store.uri(self.key(info.name)), repair=False)
        self._verified.update((info.name, info.sha256) for info in unchecked)

    def verify(self, progress: Progress | None = None) -> dict:
        """Re-hash every shard of the committed output end to end (`drafter verify`):
        {"uri", "shards", "bytes", "problems": [one line per bad shard]}."""
        manifest = self.load_manifest()
        return self._report(manifest, self._failures(manifest, progress))

    def _failures(self, manifest: Manifest, progress: Progress | None) -> list[tuple[ShardInfo, str]]:
        failures = []
        for done, info in enumerate(manifest.shards, 1):
            problem = self._hash_problem(info)
            if problem:
                failures.append((info, problem))
            if progress is not None:
                progress(done, len(manifest.shards))
        return failures

    def _report(self, manifest: Manifest, failures: list[tuple[ShardInfo, str]]) -> dict:
        return {"uri": self.uri, "shards": len(manifest.shards), "bytes": manifest.total_bytes,
                "problems": [f"{info.name}: {problem}" for info, problem in failures]}

    def repair(self, progress: Progress | None = None) -> dict:
        """`drafter verify --repair`: verify the committed output; if shards fail, set it aside so
        that the next run of its stage redoes them (instead of skipping a complete-looking output
        and refusing to read it on every run). Setting aside moves `_SUCCESS.json` to
        `_failed/<time>.json` with the failures (the evidence) and removes the failed shards'
        markers; their bytes stay until the run rewrites them. A failed reference (the bytes of an
        earlier output) sets that output aside too, else the run would reference the same bytes again.
        Returns verify's report and "set_aside": the URIs of the evidence written (empty: all good)."""
        manifest = self.load_manifest()
        failures = self._failures(manifest, progress)
        report = {**self._report(manifest, failures), "set_aside": []}
        if not failures:
            return report
        report["set_aside"].append(self._set_aside(manifest, failures))
        owners: dict[tuple[str, str], list[tuple[str, str]]] = {}
        for info, problem in failures:
            if info.source is not None:
                stage, fp, name = info.source.split("/", 2)
                owners.setdefault((stage, fp), []).append((name, problem))
        for (stage, fp), shards in owners.items():
            owner = StageOutput(self.store, stage, fp)
            try:
                owner_manifest = owner.load_manifest()
            except (ObjectNotFound, ManifestError):
                continue  # no longer committed: nothing will reference it again
            names = {s.name for s in owner_manifest.shards}
            bad = [(owner_manifest.shard(name), f"referenced by {self.uri}: {problem}")
                   for name, problem in shards if name in names]
            if bad:
                report["set_aside"].append(owner._set_aside(owner_manifest, bad))
        return report

    def _set_aside(self, manifest: Manifest, failures: list[tuple[ShardInfo, str]]) -> str:
        """The evidence first, then the manifest goes (the output is visibly incomplete), then the
        failed shards' markers (so the resumed run redoes exactly those). Returns the evidence URI."""
        now = datetime.now(timezone.utc)
        key = self.key(f"{FAILED_DIR}/{now.strftime('%Y%m%dT%H%M%SZ')}-{uuid.uuid4().hex[:8]}.json")
        evidence = {"set_aside_at": now.isoformat(timespec="seconds"),
                    "problems": {info.name: problem for info, problem in failures},
                    "manifest": manifest.model_dump(mode="json")}
        self.store.put_bytes(key, (json.dumps(evidence, indent=1) + "\n").encode())
        self.store.delete(self.key(MANIFEST_NAME))
        self._manifest = None
        for info, _ in failures:
            self.store.delete(self._marker_key(info.name))
        log.warning("%s: %d shards failed verification; set aside (evidence %s): the next run of %s redoes them",
                    self.uri, len(failures), self.store.uri(key), self.stage)
        return self.store.uri(key)

    def reset(self) -> int:
        """Delete the whole output (forced re-run). The manifest goes first, so an interrupted
        reset leaves an incomplete output, never a 'complete' one with holes. Returns the count."""
        manifest_key = self.key(MANIFEST_NAME)
        had_manifest = self.store.exists(manifest_key)
        self.store.delete(manifest_key)
        self._manifest = None
        return int(had_manifest) + self.store.delete_prefix(self.prefix + "/")

    # ---- reading

    def _expected(self, name: str) -> ShardInfo:
        """What shard `name` must contain: from the manifest once committed, else its marker."""
        self._check_name(name)
        manifest = self._manifest
        if manifest is None:
            try:
                manifest = self.load_manifest()
            except ObjectNotFound:
                manifest = None
        if manifest is not None:
            try:
                return manifest.shard(name)
            except KeyError:
                raise ObjectNotFound(f"shard {name!r} is not in the manifest of {self.uri}") from None
        try:
            return ShardInfo.model_validate_json(self.store.get_bytes(self._marker_key(name)))
        except ObjectNotFound:
            raise ObjectNotFound(f"no verified shard {self.store.uri(self.key(name))} "
                                 f"(never completed, or still being written)") from None
        except (ValidationError, ValueError) as e:
            raise StoreError(f"unreadable marker for {self.store.uri(self.key(name))}: {e}") from e

    def _verify(self, key: str, want: ShardInfo, size: int, sha: str, when: str = "on read",
                repair: bool = True) -> None:
        uri = self.store.uri(key)
        if size != want.size:
            hint = " (truncated)" if size < want.size else ""
            raise CorruptObject(key, f"size mismatch {when}: expected {want.size} bytes, got {size}{hint}", uri,
                                repair)
        if sha != want.sha256:
            raise CorruptObject(key, f"sha256 mismatch {when}: expected {want.sha256}, got {sha}", uri, repair)

    def read_shard(self, name: str) -> bytes:
        """The verified bytes of a shard (small shards; use download_shard for big ones)."""
        want = self._expected(name)
        key = self.data_key(want)
        data = self.store.get_bytes(key)
        self._verify(key, want, len(data), sha256_hex(data))
        return data

    def read_jsonl(self, name: str) -> list:
        """The rows of a verified JSONL shard (see `to_jsonl`)."""
        return from_jsonl(self.read_shard(name))

    def download_shard(self, name: str, path: str | os.PathLike) -> Path:
        """Download to `path` (or into it, if it is a directory), streaming and verifying. A file
        that fails verification is removed, never left under `path`."""
        want = self._expected(name)
        key = self.data_key(want)
        path = Path(path)
        if path.is_dir():
            path = path / PurePath(name).name
        tmp = path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:8]}")
        try:
            self.store.get_file(key, tmp)
            self._verify(key, want, *hash_file(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path
