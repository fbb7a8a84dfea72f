"""How each stage's committed output is named and read: the prepared corpus, the generations and
the hidden states. Stages depend on these formats (and the core), never on each other, so adding
a stage never stacks one stage module on another.

Every reader opens a COMMITTED output (`StageOutput.committed`: ObjectNotFound if the upstream was
never committed, ManifestError if its manifest is unusable) and verifies each shard's sha256.
"""
from __future__ import annotations

import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from drafter.errors import DrafterError
from drafter.layers import LAYER_ID_CONVENTION
from drafter.stage_output import MANIFEST_NAME, Manifest, ManifestError, StageOutput
from drafter.store import ObjectNotFound, ObjectStore

PREPARE, DATAGEN, DUMP = "prepare", "datagen", "dump"

# ---- prepare: `train.jsonl`, `eval.jsonl`, `quarantine.jsonl` of {"id", "messages"} rows

SPLITS = ("train", "eval")


def split_file(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return f"{split}.jsonl"


def load_prepared(store: ObjectStore, manifest_or_fingerprint: Manifest | str,
                  split: Literal["train", "eval"]) -> list[dict]:
    """The prepared conversations of one split, read with size + sha256 verification."""
    name = split_file(split)
    return StageOutput.committed(store, PREPARE, manifest_or_fingerprint).read_jsonl(name)


# Later stages keep the two splits apart inside one output: a shard of the held-out (eval) split
# carries the prefix `eval-`, a training shard none (so outputs without eval shards read as before).


def split_prefix(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return "" if split == "train" else f"{split}-"


def shards_of_split(manifest: Manifest, kind: str, split: str = "train") -> list[str]:
    """The names of a committed output's `kind` shards (`gen`, `errors`, `hs`) of one split."""
    prefix = f"{split_prefix(split)}{kind}-"
    return [s.name for s in manifest.shards if s.name.startswith(prefix)]


# ---- datagen: `[eval-]gen-NNNNN.jsonl` (records), `[eval-]errors-NNNNN.jsonl` (failed conversations)


def gen_shard_name(index: int, split: str = "train") -> str:
    return f"{split_prefix(split)}gen-{index:05d}.jsonl"


def error_shard_name(index: int, split: str = "train") -> str:
    return f"{split_prefix(split)}errors-{index:05d}.jsonl"


def iter_generations(store: ObjectStore, manifest_or_fingerprint: Manifest | str,
                     errors: bool = False, split: str = "train") -> Iterator[dict]:
    """The committed records (or, with `errors`, the error records) of `split` in shard order, verified."""
    out = StageOutput.committed(store, DATAGEN, manifest_or_fingerprint)
    for name in shards_of_split(out.manifest, "errors" if errors else "gen", split):
        yield from out.read_jsonl(name)


def read_conversations(store: ObjectStore, stage: str, fp: str, split: str = "train") -> list[dict]:
    """Conversations of `split` in order from an upstream output: prepare's split, or datagen's
    generations (shard order); both refuse an uncommitted upstream."""
    if stage == PREPARE:
        return load_prepared(store, fp, split)
    if stage == DATAGEN:
        return list(iter_generations(store, fp, split=split))
    raise ValueError(f"no conversations in a {stage!r} output (expected {PREPARE} or {DATAGEN})")


# ---- dump: `[eval-]hs-NNNNN.safetensors` (format: drafter.contracts.shards)


def dump_pieces(store: ObjectStore, upstream_stage: str, upstream_fp: str, split: str, size: int) -> list[list[dict]]:
    """The records of one split cut into dump pieces of at most `size`, never across an upstream
    shard (datagen's shards; prepare's split is one shard), so a referenced datagen shard yields the
    pieces it yielded before (what lets a dump reuse earlier shards: drafter.contracts.reuse)."""
    if upstream_stage == DATAGEN:
        out = StageOutput.committed(store, DATAGEN, upstream_fp)
        blocks = [out.read_jsonl(name) for name in shards_of_split(out.manifest, "gen", split)]
    else:
        blocks = [read_conversations(store, upstream_stage, upstream_fp, split)]
    return [block[i:i + size] for block in blocks for i in range(0, len(block), size)]


def hidden_state_shard_name(index: int, split: str = "train") -> str:
    return f"{split_prefix(split)}hs-{index:05d}.safetensors"


class DumpMismatch(DrafterError, ValueError):
    """The dump was made with other layer ids or another convention than the reader expects."""


def check_dump_manifest(manifest: Manifest, expect_aux_layer_ids: list[int],
                        expect_layer_id_convention: str = LAYER_ID_CONVENTION) -> None:
    """Refuse hidden states captured at other layers than the caller will train / serve with
    (field note 4: trained on [2, 30, 58], served expecting [-1, 2, 30])."""
    if manifest.stage != DUMP:
        raise DumpMismatch(f"expected a {DUMP!r} manifest, got stage {manifest.stage!r}")
    meta = manifest.meta
    got_conv, got_ids = meta.get("layer_id_convention"), meta.get("aux_layer_ids")
    problems = []
    if got_conv != expect_layer_id_convention:
        problems.append(f"layer_id_convention: dump has {got_conv!r}, expected {expect_layer_id_convention!r}")
    if got_ids is None or [int(i) for i in got_ids] != [int(i) for i in expect_aux_layer_ids]:
        problems.append(f"aux_layer_ids: dump has {got_ids}, expected {list(expect_aux_layer_ids)}")
    if problems:
        raise DumpMismatch(f"hidden states {DUMP}/{manifest.fingerprint} do not match: " + "; ".join(problems))


def iter_dump_samples(store: ObjectStore, manifest: Manifest | str, *, expect_aux_layer_ids: list[int],
                      expect_layer_id_convention: str = LAYER_ID_CONVENTION,
                      workdir: str | Path | None = None, split: str = "train") -> Iterator[dict]:
    """Samples of one split of a committed dump, shard by shard in manifest order: dicts with `id`, `input_ids`,
    `loss_mask`, `aux_hidden_states` [T, 3, H], `hidden_states` [T, H] (memory-mapped views).
    Each shard is downloaded and checked against its sha256 (the next one downloads while the
    current one is read); the manifest is checked against the expected layer ids first."""
    from drafter.contracts.shards import HiddenStateShard  # torch: only for readers of hidden states

    out = StageOutput.committed(store, DUMP, manifest)
    manifest = out.manifest
    check_dump_manifest(manifest, expect_aux_layer_ids, expect_layer_id_convention)
    with tempfile.TemporaryDirectory(prefix="dump-read-", dir=workdir) as tmp, \
            ThreadPoolExecutor(max_workers=1) as pool:
        fetch = lambda name: out.download_shard(name, Path(tmp) / name)
        names = shards_of_split(manifest, "hs", split)
        future = pool.submit(fetch, names[0]) if names else None
        for k, name in enumerate(names):
            path = future.result()
            future = pool.submit(fetch, names[k + 1]) if k + 1 < len(names) else None
            shard = HiddenStateShard(path)
            if shard.aux_layer_ids != manifest.meta["aux_layer_ids"]:
                raise DumpMismatch(f"{name}: shard aux_layer_ids {shard.aux_layer_ids} differ from the "
                                   f"manifest's {manifest.meta['aux_layer_ids']}")
            yield from shard
            del shard
            path.unlink()  # views already handed out stay valid: the mapping outlives the name


# ---- train: the trained drafter in SGLang's layout, its metrics and curves

TRAIN = "train"
TRAINED_DRAFTER_FILES = ("drafter/config.json", "drafter/model.safetensors")
TRAIN_METRICS, TRAIN_CURVES = "metrics.jsonl", "curves.png"


def download_trained_drafter(store: ObjectStore, manifest_or_fingerprint: Manifest | str,
                             directory: str | Path) -> Path:
    """The committed drafter of a train output, verified, as a local SGLang-format directory
    (`config.json` + `model.safetensors`, loadable with drafter.model.load_drafter)."""
    out = StageOutput.committed(store, TRAIN, manifest_or_fingerprint)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in TRAINED_DRAFTER_FILES:
        out.download_shard(name, directory)
    return directory


# ---- export: the drafter in each engine's layout, checked, plus the export manifest and judgement

EXPORT = "export"
EXPORT_FORMATS = ("sglang", "vllm")


def download_export(store: ObjectStore, manifest_or_fingerprint: Manifest | str, directory: str | Path,
                    fmt: str = "sglang") -> Path:
    """One format of a committed export (`<fmt>/...` shards), verified, as a local directory a
    server loads (`--speculative-draft-model-path DIR`). Files already there with the committed
    size and sha256 are kept (a reused directory costs one hash, not a download)."""
    from drafter.hashing import hash_file

    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    out = StageOutput.committed(store, EXPORT, manifest_or_fingerprint)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = [s.name for s in out.manifest.shards if s.name.startswith(f"{fmt}/")]
    if not names:
        raise ObjectNotFoundInOutput(f"{out.uri} holds no {fmt!r} export (formats: export.formats)")
    for name in names:
        dest = directory / Path(name).name
        info = out.manifest.shard(name)
        if not (dest.is_file() and hash_file(dest) == (info.size, info.sha256)):
            out.download_shard(name, dest)
    return directory


class ObjectNotFoundInOutput(DrafterError):
    """A committed output lacks what was asked of it (e.g. an export without the vLLM format)."""


# ---- champion: the retrain verdict (`decision.json`) and accept length across retrains

CHAMPION = "champion"
BENCH, BENCH_REPORT = "bench", "report.json"  # the bench stage's report (the champion stage reads its head-to-head)


def stored_accept_curves(store: ObjectStore, engine: str, target: dict) -> list[dict]:
    """Every committed bench output's accept-length curves (drafter.bench.predict; manifest meta
    `accept_curve`) measured with `engine` on `target` (drafter.target_identity.target_identity),
    newest output first, each with `bench` (the output's fingerprint) and `created_at`. Reads the
    manifests only."""
    found = []
    for key in store.list(f"{BENCH}/"):
        parts = key.split("/")
        if len(parts) != 3 or parts[2] != MANIFEST_NAME:
            continue
        try:
            manifest = StageOutput.committed(store, BENCH, parts[1]).manifest
        except (ObjectNotFound, ManifestError):
            continue  # removed meanwhile, or unreadable: not a curve to predict from
        stored = manifest.meta.get("accept_curve")
        if stored and stored.get("engine") == engine and stored.get("target") == target:
            found.append((manifest.created_at, parts[1], stored["curves"]))
    return [{**c, "bench": fp, "created_at": at} for at, fp, curves in sorted(found, reverse=True) for c in curves]
CHAMPION_DECISION, CHAMPION_PLOT = "decision.json", "accept-length.png"
