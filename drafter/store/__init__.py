"""Object storage behind one small interface: `file://` (embedded default) and `s3://`.

Keys are relative to the store root and always use "/" ("prepare/ab12/train.jsonl"). Both backends
guarantee that an object is either absent or complete under its final name: FileStore writes a temp
file next to the target and renames it, S3 makes an object visible only once its upload finished.
Integrity (sha256) is recorded and checked on read one level up, in `drafter.stage_output`.

`put_stream` is the verified write: it hashes the bytes while writing them (one pass, no read-back)
and checks the committed object where the backend can vouch for it: FileStore checks that the name
now points at the very file it wrote (same inode, same size); S3Store sends each part's SHA256
(`x-amz-checksum-sha256`, which S3, MinIO and Ceph check against the bytes they received) and checks
the checksum and size the server recorded for the finished object (HEAD, ChecksumMode=ENABLED). A
backend that cannot vouch (a server that records no checksum) is read back and hashed instead.

`get_versioned` + `put_if` are the compare-and-swap of small documents that several processes update
(the drafter registry): `put_if` writes only while the object is still the version that was read
(or still absent). FileStore holds an exclusive `flock` on a lock file next to the object while it
compares the content's sha256 and renames; S3Store sends a conditional PUT (`If-Match` on the ETag,
`If-None-Match: *` to create), which S3 evaluates atomically (since August/November 2024; MinIO
and recent Ceph RGW too; a server that ignores the headers makes the write unconditional).

Retries on S3 come in two layers (botocore's per request, ours per operation): see `drafter.store.s3`.

Modules: `errors` (what may be retried), `base` (the `ObjectStore` interface, key rules), `files`
(atomic local writes), `local` (FileStore), `s3` (S3Store); `open_store` picks one from the config,
`storage_problems` is what `config validate` reports of its store root.
"""
from __future__ import annotations

from drafter.backoff import backoff_delay
from drafter.config import LifecycleConfig, StorageConfig
from drafter.store.base import MiB, TMP_MARK, ObjectStore, check_key, check_prefix
from drafter.store.errors import (
    BucketError, CorruptObject, CredentialsError, InvalidName, ObjectNotFound, OperationTimeout, StorageFull,
    StoreError, StoreRootError, repair_hint)
from drafter.store.files import atomic_write
from drafter.store.local import FileStore, local_root_problem
from drafter.store.s3 import S3Store

__all__ = ["MiB", "TMP_MARK", "ObjectStore", "check_key", "check_prefix", "BucketError", "CorruptObject",
           "CredentialsError", "InvalidName", "ObjectNotFound", "OperationTimeout", "StorageFull", "StoreError",
           "StoreRootError", "repair_hint", "atomic_write", "FileStore", "S3Store", "open_store",
           "local_root_problem", "storage_problems", "backoff_delay"]


def open_store(cfg: StorageConfig, *, create: bool = True) -> ObjectStore:
    """file://DIR (relative to the current directory, resolved now) or s3://BUCKET[/PREFIX].
    A local root that is a file or cannot be created is `StoreRootError` (exit 2); `create=False`
    (a read of an existing store: `drafter verify`) creates nothing and makes a missing local root
    `ObjectNotFound`."""
    root = cfg.root
    if root.startswith("file://"):
        path = root[len("file://"):]
        if not path:
            raise StoreRootError("storage.root: file:// needs a directory")
        return FileStore(path, create=create)
    if root.startswith("s3://"):
        bucket, _, prefix = root[len("s3://"):].partition("/")
        return S3Store(bucket, prefix, endpoint_url=cfg.endpoint_url, region=cfg.region,
                       multipart_threshold_mb=cfg.multipart_threshold_mb,
                       multipart_chunk_mb=cfg.multipart_chunk_mb, max_attempts=cfg.max_attempts,
                       connect_timeout_s=cfg.connect_timeout_s, read_timeout_s=cfg.read_timeout_s,
                       operation_timeout_s=cfg.operation_timeout_s)
    raise StoreError(f"storage.root: unsupported scheme in {root!r} (use file:// or s3://)")


def storage_problems(cfg: LifecycleConfig) -> list[tuple[str, str]]:
    """A `file://` store root this machine cannot use (a file, a path under a file, a folder we may
    not write into or create): every command would fail on it, so `config validate` reports it as a
    problem (`--offline` skips it with the other local checks). The rule is the store's own
    (`local_root_problem`), which also refuses such a root when a store is opened."""
    root = cfg.storage.root
    if not root.startswith("file://"):
        return []
    problem = local_root_problem(root[len("file://"):], writable=True)
    return [] if problem is None else [("storage.root", f"{root} {problem}")]
