"""The hidden-state shard: one safetensors file holding many samples, unpadded.

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

We write the safetensors container ourselves (it is a length-prefixed JSON header + raw bytes):
the reference writer serialises its metadata from a hash map whose order changes between
processes, which would break byte-identical resumes; ours sorts keys and never adds timestamps.
Samples are spooled to one temp file per tensor as they arrive, so memory stays at one batch even
for shards of tens of GB.
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

from drafter.errors import DrafterError

FORMAT = "drafter-hidden-states"
FORMAT_VERSION = 1
NUM_AUX = 3
TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")
FINAL_HIDDEN = "after the final norm: the input of lm_head (target logits = lm_head(hidden_states))"

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

if sys.byteorder != "little":  # safetensors is little-endian; we write raw host bytes
    raise ImportError("drafter.shards needs a little-endian host")


class ShardFormatError(DrafterError, ValueError):
    """A file that is not a hidden-state shard of a version we read."""


class ShardWriter:
    """Append samples, then `finish(path)`. Samples keep the order in which they were added."""

    def __init__(self, spool_dir: str | Path | None = None, metadata: Mapping[str, object] | None = None):
        self._dir = Path(tempfile.mkdtemp(prefix="shard-spool-", dir=spool_dir))
        self._files = {name: open(self._dir / name, "wb") for name in TENSORS}
        self._meta = dict(metadata or {})
        self._ids: list[str] = []
        self._offsets = [0]
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, torch.dtype] = {}

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def add(self, sample_id: str, input_ids, loss_mask, aux_hidden_states: torch.Tensor,
            hidden_states: torch.Tensor) -> None:
        tensors = {"input_ids": torch.as_tensor(input_ids, dtype=torch.int64),
                   "loss_mask": torch.as_tensor(loss_mask).to(torch.uint8),
                   "aux_hidden_states": aux_hidden_states, "hidden_states": hidden_states}
        t = tensors["input_ids"].shape[0]
        for name in TENSORS:  # check everything before writing anything: the spools stay aligned
            tensor = tensors[name] = tensors[name].detach().to("cpu").contiguous()
            if tensor.shape[0] != t:
                raise ValueError(f"sample {sample_id}: {name} has {tensor.shape[0]} rows, input_ids {t}")
            shape, dtype = tuple(tensor.shape[1:]), tensor.dtype
            if self._shapes.setdefault(name, shape) != shape or self._dtypes.setdefault(name, dtype) != dtype:
                raise ValueError(f"sample {sample_id}: {name} is {dtype} {shape}, the shard holds "
                                 f"{self._dtypes[name]} {self._shapes[name]}")
        for name in TENSORS:
            self._files[name].write(tensors[name].view(torch.uint8).numpy().data)  # raw bytes, no copy
        self._ids.append(str(sample_id))
        self._offsets.append(self._offsets[-1] + t)

    def finish(self, path: str | Path,
               empty_like: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] | None = None) -> Path:
        """Write the shard to `path` and drop the spool. `empty_like` gives dtype + row shape of
        each tensor when no sample was added (a shard whose samples were all quarantined). The
        spool is removed whatever happens."""
        try:
            return self._write(Path(path), empty_like)
        finally:
            self.discard()

    def _write(self, path: Path, empty_like: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] | None) -> Path:
        for f in self._files.values():
            f.close()
        for name, (dtype, shape) in (empty_like or {}).items():
            self._dtypes.setdefault(name, dtype)
            self._shapes.setdefault(name, tuple(shape))
        missing = [n for n in TENSORS if n not in self._dtypes]
        if missing:
            raise ValueError(f"empty shard: give dtype and row shape of {missing} via empty_like")
        offsets = torch.tensor(self._offsets, dtype=torch.int64)
        blobs: list[tuple[str, torch.dtype, tuple[int, ...], Path | bytes]] = [
            (n, self._dtypes[n], (self.num_tokens, *self._shapes[n]), self._dir / n) for n in TENSORS]
        blobs.append(("offsets", torch.int64, tuple(offsets.shape), offsets.numpy().tobytes()))
        # Widest items first: every tensor then starts at a multiple of its item size (the data
        # section is 8-aligned), so memory-mapped views are aligned like the reference writer's.
        blobs.sort(key=lambda b: -_itemsize(b[1]))
        metadata = {**{k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in self._meta.items()},
                    "format": FORMAT, "format_version": str(FORMAT_VERSION),
                    "sample_ids": json.dumps(self._ids, ensure_ascii=False)}
        header: dict = {"__metadata__": dict(sorted(metadata.items()))}
        pos = 0
        for name, dtype, shape, _src in blobs:
            size = math.prod(shape) * _itemsize(dtype)
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + size]}
            pos += size
        head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        head += b" " * (-len(head) % 8)  # safetensors aligns the data section to 8 bytes
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(head)))
            out.write(head)
            for _name, _dtype, _shape, src in blobs:
                if isinstance(src, bytes):
                    out.write(src)
                else:
                    with open(src, "rb") as f:
                        shutil.copyfileobj(f, out, 16 << 20)
        return path

    def discard(self) -> None:
        for f in self._files.values():
            f.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def write_shard_file(path: str | Path, samples, metadata: Mapping[str, object] | None = None,
                     spool_dir: str | Path | None = None) -> Path:
    """Write samples (dicts with `id` and the four per-token tensors) as one shard file."""
    writer = ShardWriter(spool_dir, metadata)
    try:
        for s in samples:
            writer.add(s["id"], s["input_ids"], s["loss_mask"], s["aux_hidden_states"], s["hidden_states"])
    except BaseException:
        writer.discard()
        raise
    return writer.finish(path)


class HiddenStateShard:
    """Read side: tensors memory-mapped (safe_open), `sample(i)` returns zero-copy views."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        with safe_open(str(self.path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ShardFormatError(f"{self.path} is not a {FORMAT} shard (format={meta.get('format')!r})")
            if int(meta.get("format_version", -1)) > FORMAT_VERSION:
                raise ShardFormatError(f"{self.path} has format_version {meta['format_version']}; "
                                       f"this reader knows up to {FORMAT_VERSION}")
            self.tensors = {name: f.get_tensor(name) for name in (*TENSORS, "offsets")}
        self.metadata = meta
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

    def sample(self, i: int) -> dict:
        a, b = self.offsets[i], self.offsets[i + 1]
        out = {name: self.tensors[name][a:b] for name in TENSORS}
        out["id"] = self.sample_ids[i]
        return out

    def __iter__(self) -> Iterator[dict]:
        return (self.sample(i) for i in range(len(self)))


# ---- storage arithmetic


def bytes_per_token(hidden_size: int, dtype: str = "bfloat16", num_aux: int = NUM_AUX) -> int:
    """Payload bytes per stored token: (aux + final) hidden states, int64 id, uint8 mask."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(_DTYPE_BYTES)}")
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


def project_corpus(tokens: int, hidden_size: int, dtype: str = "bfloat16", num_aux: int = NUM_AUX) -> str:
    """The projection from shapes alone: 'your corpus of N tokens at hidden H -> X TB'."""
    return storage_projection(bytes_per_token(hidden_size, dtype, num_aux), tokens, hidden_size, dtype, num_aux)
