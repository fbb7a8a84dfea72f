"""The hidden-state shard: one safetensors file holding many samples, unpadded (written by the
dump stage, read by training).

Tensors (T = tokens of all samples in the shard, N = samples, H = target hidden size):
    input_ids          [T]        int64
    loss_mask          [T]        uint8   1 on assistant tokens (content + end-of-turn)
    aux_hidden_states  [T, 3, H]  model dtype  outputs of the aux layers, in `aux_layer_ids` order
                                  (aux[:, j] = output of decoder layer aux_layer_ids[j]; the
                                  drafter's `fc` input is aux.reshape(T, 3 * H))
    hidden_states      [T, H]     model dtype  the target's final hidden state AFTER its final norm,
                                  i.e. the input of lm_head: target logits = lm_head(hidden_states),
                                  which is what EAGLE-3 training distils from
    offsets            [N + 1]    int64   sample i = rows offsets[i]:offsets[i+1]
Metadata (JSON strings): format, format_version, sample_ids, aux_layer_ids, layer_id_convention.

fp8 storage (format_version 2, metadata `storage_dtype: float8_e4m3`, see drafter.contracts.fp8): the two
state tensors are float8_e4m3fn and two more tensors hold their per-row float32 scales,
`aux_scales` [T, 3] and `hidden_scales` [T]; metadata `dtype` names the dtype they decode to (the
capture dtype). `HiddenStateShard.sample` decodes; `sample(i, decode=False)` hands the stored
tensors to a reader that decodes later (the training reader, on its worker thread). Shards stored in
the capture dtype stay format_version 1, byte for byte what earlier versions wrote.

We write the safetensors container ourselves (it is a length-prefixed JSON header + raw bytes):
the reference writer serialises its metadata from a hash map whose order changes between
processes, which would break byte-identical resumes; ours sorts keys and never adds timestamps.
Samples are kept in memory as they arrive (views of the captured batches, no copy) and streamed out
by `chunks()` (header, then each tensor), so a shard is written once, hashed on the way; with a
`spool_dir` they are spooled to one temp file per tensor instead, for shards larger than memory.
"""
from __future__ import annotations

import json
import math
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from drafter.contracts import fp8
from drafter.errors import DrafterError

FORMAT = "drafter-hidden-states"
FORMAT_VERSION = 2  # the newest this module reads and writes (1: capture dtype, 2: fp8 + scales)
NUM_AUX = 3
TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")
SCALES = ("aux_scales", "hidden_scales")
STORAGE_DTYPES = ("model", "float8_e4m3")  # dump.storage_dtype: the capture dtype, or fp8 + scales
FINAL_HIDDEN = "after the final norm: the input of lm_head (target logits = lm_head(hidden_states))"

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_ST_DTYPES[fp8.STORAGE_DTYPE] = "F8_E4M3"


def format_version(storage_dtype: str) -> int:
    """The shard format version a storage dtype is written as."""
    return 1 if storage_dtype == "model" else 2


def tensor_names(storage_dtype: str) -> tuple[str, ...]:
    return TENSORS if storage_dtype == "model" else TENSORS + SCALES

if sys.byteorder != "little":  # safetensors is little-endian; we write raw host bytes
    raise ImportError("drafter.contracts.shards needs a little-endian host")


class ShardFormatError(DrafterError, ValueError):
    """A file that is not a hidden-state shard of a version we read."""


class ShardWriter:
    """Append samples, then `chunks()` (the shard's bytes, streamed) or `finish(path)`. Samples keep
    the order in which they were added. fp8 samples carry their scales (`aux_scales`,
    `hidden_scales`); the first sample (or `empty_like`) fixes which tensors the shard holds."""

    def __init__(self, spool_dir: str | Path | None = None, metadata: Mapping[str, object] | None = None):
        self._spool_dir = spool_dir
        self._dir: Path | None = None
        self._files: dict[str, object] = {}
        self._parts: dict[str, list[torch.Tensor]] = {}
        self._meta = dict(metadata or {})
        self._ids: list[str] = []
        self._offsets = [0]
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        if spool_dir is not None:
            self._dir = Path(tempfile.mkdtemp(prefix="shard-spool-", dir=spool_dir))

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._shapes)

    def add(self, sample_id: str, input_ids, loss_mask, aux_hidden_states: torch.Tensor,
            hidden_states: torch.Tensor, **scales: torch.Tensor) -> None:
        """One sample's per-token tensors (CPU tensors are kept as views, not copied: they must not
        change until the shard is written)."""
        tensors = {"input_ids": torch.as_tensor(input_ids, dtype=torch.int64),
                   "loss_mask": torch.as_tensor(loss_mask).to(torch.uint8),
                   "aux_hidden_states": aux_hidden_states, "hidden_states": hidden_states, **scales}
        unknown = set(scales) - set(SCALES)
        if unknown:
            raise ValueError(f"sample {sample_id}: unknown tensors {sorted(unknown)}")
        if self._shapes and set(tensors) != set(self._shapes):
            raise ValueError(f"sample {sample_id}: tensors {sorted(tensors)}, the shard holds {sorted(self._shapes)}")
        t = tensors["input_ids"].shape[0]
        for name, tensor in tensors.items():  # check everything before keeping anything
            tensor = tensors[name] = tensor.detach().to("cpu").contiguous()
            if tensor.shape[0] != t:
                raise ValueError(f"sample {sample_id}: {name} has {tensor.shape[0]} rows, input_ids {t}")
            shape, dtype = tuple(tensor.shape[1:]), tensor.dtype
            if self._shapes.setdefault(name, shape) != shape or self._dtypes.setdefault(name, dtype) != dtype:
                raise ValueError(f"sample {sample_id}: {name} is {dtype} {shape}, the shard holds "
                                 f"{self._dtypes[name]} {self._shapes[name]}")
        for name, tensor in tensors.items():
            if self._dir is None:
                self._parts.setdefault(name, []).append(tensor)
            else:
                if name not in self._files:
                    self._files[name] = open(self._dir / name, "wb")
                self._files[name].write(_raw(tensor))
        self._ids.append(str(sample_id))
        self._offsets.append(self._offsets[-1] + t)

    def chunks(self, empty_like: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] | None = None
               ) -> Iterator[memoryview | bytes]:
        """The shard file's bytes in order (header, then each tensor), without assembling them.
        `empty_like` gives dtype + row shape of each tensor when no sample was added (a shard whose
        samples were all quarantined). Checked now; the bytes come as the iterator is read."""
        for f in self._files.values():
            f.close()
        if not self._shapes:
            for name, (dtype, shape) in (empty_like or {}).items():
                self._dtypes[name], self._shapes[name] = dtype, tuple(shape)
        missing = [n for n in TENSORS if n not in self._dtypes]
        if missing:
            raise ValueError(f"empty shard: give dtype and row shape of {missing} via empty_like")
        fp8_storage = self._dtypes["aux_hidden_states"] == fp8.STORAGE_DTYPE
        names = [n for n in (*TENSORS, *SCALES) if n in self._shapes]
        offsets = torch.tensor(self._offsets, dtype=torch.int64)
        blobs: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
            (n, self._dtypes[n], (self.num_tokens, *self._shapes[n])) for n in names]
        blobs.append(("offsets", torch.int64, tuple(offsets.shape)))
        # Widest items first: every tensor then starts at a multiple of its item size (the data
        # section is 8-aligned), so memory-mapped views are aligned like the reference writer's.
        blobs.sort(key=lambda b: -_itemsize(b[1]))
        metadata = {**{k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in self._meta.items()},
                    "format": FORMAT, "format_version": str(2 if fp8_storage else 1),
                    "sample_ids": json.dumps(self._ids, ensure_ascii=False)}
        if fp8_storage:
            metadata["storage_dtype"] = "float8_e4m3"
        header: dict = {"__metadata__": dict(sorted(metadata.items()))}
        pos = 0
        for name, dtype, shape in blobs:
            size = math.prod(shape) * _itemsize(dtype)
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + size]}
            pos += size
        head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        head += b" " * (-len(head) % 8)  # safetensors aligns the data section to 8 bytes
        return self._stream(struct.pack("<Q", len(head)) + head, [b[0] for b in blobs], offsets)

    def _stream(self, head: bytes, names: list[str], offsets: torch.Tensor) -> Iterator[memoryview | bytes]:
        yield head
        for name in names:
            if name == "offsets":
                yield offsets.numpy().tobytes()
            elif self._dir is None:
                for tensor in self._parts.get(name, ()):
                    yield _raw(tensor)
            elif name in self._files:
                with open(self._dir / name, "rb") as f:
                    while chunk := f.read(16 << 20):
                        yield chunk

    def finish(self, path: str | Path,
               empty_like: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] | None = None) -> Path:
        """Write the shard to `path` and drop the samples (and spool). The spool is removed whatever
        happens."""
        path = Path(path)
        try:
            chunks = self.chunks(empty_like)
            with open(path, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
            return path
        finally:
            self.discard()

    def discard(self) -> None:
        for f in self._files.values():
            f.close()
        self._parts.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _raw(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def write_shard_file(path: str | Path, samples, metadata: Mapping[str, object] | None = None,
                     spool_dir: str | Path | None = None) -> Path:
    """Write samples (dicts with `id` and the four per-token tensors) as one shard file."""
    writer = ShardWriter(spool_dir, metadata)
    try:
        for s in samples:
            writer.add(s["id"], s["input_ids"], s["loss_mask"], s["aux_hidden_states"], s["hidden_states"],
                       **{k: s[k] for k in SCALES if k in s})  # fp8 samples carry their scales
    except BaseException:
        writer.discard()
        raise
    return writer.finish(path)


class HiddenStateShard:
    """Read side: tensors memory-mapped (safe_open), `sample(i)` returns zero-copy views (fp8
    shards: decoded copies; `sample(i, decode=False)`: the stored fp8 views and their scales)."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        from drafter.dtypes import dtype_of

        self.path = Path(path)
        with safe_open(str(self.path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ShardFormatError(f"{self.path} is not a {FORMAT} shard (format={meta.get('format')!r})")
            if int(meta.get("format_version", -1)) > FORMAT_VERSION:
                raise ShardFormatError(f"{self.path} has format_version {meta['format_version']}; "
                                       f"this reader knows up to {FORMAT_VERSION}")
            self.storage_dtype = meta.get("storage_dtype", "model")
            if self.storage_dtype not in STORAGE_DTYPES:
                raise ShardFormatError(f"{self.path}: unknown storage_dtype {self.storage_dtype!r}")
            self.names = tensor_names(self.storage_dtype)
            self.tensors = {name: f.get_tensor(name) for name in (*self.names, "offsets")}
        self.metadata = meta
        # What fp8 states decode to: the capture dtype the dump recorded.
        self.decode_dtype = dtype_of(meta.get("dtype"), torch.float32)
        self.sample_ids: list[str] = json.loads(meta["sample_ids"])
        self.offsets = self.tensors["offsets"].tolist()
        if len(self.offsets) != len(self.sample_ids) + 1:
            raise ShardFormatError(f"{self.path}: {len(self.sample_ids)} ids but {len(self.offsets)} offsets")

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def aux_layer_ids(self) -> list[int] | None:
        raw = self.metadata.get("aux_layer_ids")
        return None if raw is None else json.loads(raw)

    def sample(self, i: int, decode: bool = True) -> dict:
        a, b = self.offsets[i], self.offsets[i + 1]
        out = {name: self.tensors[name][a:b] for name in self.names}
        if decode:
            decode_states(out, self.decode_dtype)
        elif self.storage_dtype != "model":
            out["decode_dtype"] = self.decode_dtype
        out["id"] = self.sample_ids[i]
        return out

    def __iter__(self) -> Iterator[dict]:
        return (self.sample(i) for i in range(len(self)))


def decode_states(sample: dict, dtype: torch.dtype) -> dict:
    """Replace fp8 states and their scales by the decoded states, in place (no-op otherwise)."""
    if "aux_scales" in sample:
        sample["aux_hidden_states"] = fp8.decode(sample["aux_hidden_states"], sample.pop("aux_scales"), dtype)
        sample["hidden_states"] = fp8.decode(sample["hidden_states"], sample.pop("hidden_scales"), dtype)
    return sample


# ---- storage arithmetic


def bytes_per_token(hidden_size: int, dtype: str = "bfloat16", num_aux: int = NUM_AUX,
                    storage_dtype: str = "model") -> int:
    """Payload bytes per stored token: (aux + final) hidden states, int64 id, uint8 mask; fp8
    storage: one byte per value plus a float32 scale per state."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(_DTYPE_BYTES)}")
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage_dtype {storage_dtype!r}: expected one of {list(STORAGE_DTYPES)}")
    if storage_dtype == "float8_e4m3":
        return (num_aux + 1) * (hidden_size + 4) + 8 + 1
    return (num_aux + 1) * hidden_size * _DTYPE_BYTES[dtype] + 8 + 1


def _si(n: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{' ' if unit else ''}{prefix}{unit}"
    return f"{n:.0f}{' ' if unit else ''}{unit}"


def _binary(n: float) -> str:
    for scale, prefix in ((2 ** 40, "TiB"), (2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f} {prefix}"
    return f"{n:.0f} B"


def storage_projection(bytes_per_token: float, tokens: int, hidden_size: int | None = None,
                       dtype: str | None = None, num_aux: int = NUM_AUX) -> str:
    """'87.8M tokens at hidden 7168 (bfloat16, 3 aux + final, 57,353 B/token) -> 5.0 TB (4.6 TiB)'.
    TB is 10^12 bytes; TiB is what `du -h` shows (the seed run's "4.6 TB" was TiB)."""
    total = bytes_per_token * tokens
    shape = f" at hidden {hidden_size}" if hidden_size is not None else ""
    detail = [f"{dtype}, {num_aux} aux + final"] if dtype else []
    detail.append(f"{bytes_per_token:,.0f} B/token")
    return f"{_si(tokens)} tokens{shape} ({', '.join(detail)}) -> {_si(total, 'B')} ({_binary(total)})"


def project_corpus(tokens: int, hidden_size: int, dtype: str = "bfloat16", num_aux: int = NUM_AUX,
                   storage_dtype: str = "model") -> str:
    """The projection from shapes alone: 'your corpus of N tokens at hidden H -> X TB'."""
    return storage_projection(bytes_per_token(hidden_size, dtype, num_aux, storage_dtype), tokens, hidden_size,
                              storage_label(dtype, storage_dtype), num_aux)


def storage_label(dtype: str, storage_dtype: str) -> str:
    """'bfloat16', or 'float8_e4m3 (decodes to bfloat16)'."""
    return dtype if storage_dtype == "model" else f"{storage_dtype} (decodes to {dtype})"
