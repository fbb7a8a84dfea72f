"""`s3://`: objects under s3://bucket/prefix/ (AWS, MinIO, Ceph RGW or any S3-compatible service).

The verified write (`put_stream`) sends each part's SHA256 (`x-amz-checksum-sha256`, which S3, MinIO
and Ceph check against the bytes they received) and checks the checksum and size the server
recorded for the finished object (HEAD, ChecksumMode=ENABLED); a server that records no checksum
is read back and hashed instead. The compare-and-swap (`put_if`) is a conditional PUT (`If-Match`
on the ETag, `If-None-Match: *` to create), which S3 evaluates atomically (since August/November
2024; MinIO and recent Ceph RGW too; a server that ignores the headers makes the write unconditional).

Retries come in two layers, on purpose:
- botocore's own retry loop ("standard" mode, `max_attempts` HTTP attempts per request, exponential
  backoff with jitter) handles throttling (SlowDown, 503, RequestLimitExceeded, Throttling) and 5xx
  per request, so one throttled part of a 10 GB multipart upload is retried alone;
- our `_retry` wrapper re-runs the whole operation when the connection itself failed after botocore
  gave up (endpoint restarting, connection reset, read timeout mid-stream): an S3-compatible server
  that restarts takes longer than botocore's sub-second connection backoff.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from drafter.backoff import backoff_delay
from drafter.errors import disk_full
from drafter.hashing import CHUNK
from drafter.store.base import MiB, ObjectStore, check_key, check_prefix
from drafter.store.errors import (
    BucketError, CorruptObject, CredentialsError, InvalidName, ObjectNotFound, OperationTimeout, StorageFull,
    StoreError)
from drafter.store.files import _open_local, atomic_write

log = logging.getLogger(__name__)

T = TypeVar("T")


class _DeadlinePassed(Exception):
    """Raised by our before-send hook inside botocore: stops its retry loop at the deadline."""


def _transient_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError, IncompleteReadError
    from s3transfer.exceptions import RetriesExceededError

    # EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError < botocore ConnectionError;
    # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError < HTTPClientError;
    # RetriesExceededError: s3transfer gave up re-reading a download stream.
    return (BotoConnectionError, HTTPClientError, IncompleteReadError, RetriesExceededError)


def _credential_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import (
        CredentialRetrievalError, NoCredentialsError, PartialCredentialsError, ProfileNotFound)

    return (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError, ProfileNotFound)


_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}
# A conditional PUT that lost: the object is no longer the version read (412), another conditional
# write to it is in flight (409), or it was deleted meanwhile (If-Match on a missing key: 404).
_LOST_RACE_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"} | _NOT_FOUND_CODES


class S3Store(ObjectStore):
    """Objects under s3://bucket/prefix/. Credentials come from the standard boto3 chain
    (env vars, profile, instance/pod role); `endpoint_url` targets MinIO, Ceph RGW or any
    S3-compatible service."""

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None,
                 region: str | None = None, multipart_threshold_mb: int = 64,
                 multipart_chunk_mb: int = 64, max_attempts: int = 5, *,
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 30.0,
                 operation_timeout_s: float = 300.0,
                 retry_mode: str = "standard", backoff_base_s: float = 0.5, backoff_max_s: float = 20.0,
                 max_concurrency: int = 8):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        if not bucket or "/" in bucket:
            raise StoreError(f"invalid bucket name {bucket!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.max_attempts = max_attempts
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.operation_timeout_s = operation_timeout_s
        self._deadline = threading.local()  # per calling thread: when the current operation gives up
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self._sleep = time.sleep  # tests swap this to observe the backoff
        self.list_page_size = 1000  # S3's maximum; tests lower it to exercise pagination
        extra: dict = {}
        if endpoint_url:
            # S3-compatible services: path-style addressing works without wildcard DNS, and many
            # (older MinIO, Ceph RGW) reject the streaming CRC trailers botocore >= 1.36 sends by
            # default. We verify sha256 ourselves one level up, so "when_required" loses nothing.
            extra = dict(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                         response_checksum_validation="when_required")
        # total_max_attempts counts the first try; botocore's "max_attempts" key would count retries.
        config = Config(retries={"mode": retry_mode, "total_max_attempts": max_attempts},
                        connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                        max_pool_connections=max(10, max_concurrency * 2), **extra)
        self._transient, self._no_credentials = _transient_errors(), _credential_errors()
        # A private session: boto3's default session is not thread-safe to create clients from.
        try:
            self.client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint_url, region_name=region, config=config)
        except self._no_credentials as e:  # AWS_PROFILE names a profile that does not exist
            raise self._credentials_error("connect", "", e) from e
        except ValueError as e:  # botocore: "Invalid endpoint: ..."
            raise InvalidName(f"storage.endpoint_url {endpoint_url!r}: {e} (use http(s)://host[:port])") from e
        # botocore's own retries are silent and know no total deadline: one hook logs each of them,
        # another stops the next request of an operation once its deadline has passed.
        self.client.meta.events.register("needs-retry.s3", self._log_request_retry)
        self.client.meta.events.register("before-send.s3", self._check_deadline)
        self.transfer_config = TransferConfig(
            multipart_threshold=multipart_threshold_mb * MiB, multipart_chunksize=multipart_chunk_mb * MiB,
            max_concurrency=max_concurrency, use_threads=True)
        self.read_concurrency = max_concurrency
        self.read_range_bytes = multipart_chunk_mb * MiB
        self._warned_no_checksum = False

    def __repr__(self) -> str:
        return f"S3Store({self.uri('')!r}, endpoint_url={self.endpoint_url!r})"

    def _full(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _full_prefix(self, prefix: str) -> str:
        check_prefix(prefix)
        return f"{self.prefix}/{prefix}" if self.prefix else prefix

    def uri(self, key: str) -> str:
        """The URI of a key or of a prefix ("a/" included: error messages of a listing name it)."""
        path = self._full_prefix(key) if key else self.prefix
        return f"s3://{self.bucket}/{path}"

    # ---- error handling

    def _where(self) -> str:
        return f"endpoint {self.endpoint_url or 'AWS'}"

    def _translate(self, err: Exception, op: str, key: str) -> StoreError:
        code = str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))
        if code in _NOT_FOUND_CODES:
            return ObjectNotFound(f"{op}: no such object {self.uri(key)}")
        if code == "NoSuchBucket":
            return BucketError(f"{op} {self.uri(key)}: bucket {self.bucket!r} does not exist ({self._where()}); "
                               f"create it or fix storage.root")
        if code in ("InvalidBucketName", "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId",
                    "SignatureDoesNotMatch"):
            return BucketError(f"{op} {self.uri(key)}: {code} ({self._where()}): check storage.root and the "
                               f"credentials (boto3 chain: AWS_ACCESS_KEY_ID, AWS_PROFILE, ...)")
        return StoreError(f"{op} {self.uri(key)}: {err}")

    def _credentials_error(self, op: str, key: str, err: Exception) -> CredentialsError:
        """One line naming the bucket, the endpoint and where credentials come from. botocore's
        own text is only kept where it cannot hold a secret (it names providers and variables)."""
        name = type(err).__name__
        if name == "NoCredentialsError":
            detail = "no credentials found"
        elif name in ("PartialCredentialsError", "ProfileNotFound"):
            detail = str(err)
        else:  # CredentialRetrievalError: its text may quote a credential process; name the provider
            detail = f"{name} from {getattr(err, 'kwargs', {}).get('provider', 'a credential provider')}"
        return CredentialsError(
            f"{op} {self.uri(key)}: {detail} ({self._where()}); provide credentials for bucket {self.bucket!r} "
            f"in the environment (AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY), AWS_PROFILE with "
            f"~/.aws/credentials, or an instance / pod role")

    def _timeout(self, op: str, key: str, attempts: int) -> OperationTimeout:
        return OperationTimeout(
            f"{op} {self.uri(key)}: no answer within storage.operation_timeout_s={self.operation_timeout_s:g}s "
            f"({attempts} attempts, connect timeout {self.connect_timeout_s:g}s, read timeout "
            f"{self.read_timeout_s:g}s; {self._where()}): is the endpoint up and reachable?")

    def _check_deadline(self, **_kw) -> None:
        deadline = getattr(self._deadline, "at", None)
        if deadline is not None and time.monotonic() >= deadline:
            raise _DeadlinePassed()

    def _log_request_retry(self, attempts: int = 0, caught_exception=None, response=None,
                           operation=None, **_kw) -> None:
        """Observe botocore's retry decision (never change it): one line per failed request."""
        status = response[0].status_code if response else None
        if caught_exception is None and (status is None or (status < 500 and status != 429)):
            return
        if attempts >= self.max_attempts or isinstance(caught_exception, _DeadlinePassed):
            return  # its last attempt: the error surfaces to our wrapper, which says what happens
        why = type(caught_exception).__name__ if caught_exception is not None else f"HTTP {status}"
        log.warning("s3 %s (%s): %s on request attempt %d of %d; botocore retries",
                    getattr(operation, "name", "?"), self._where(), why, attempts, self.max_attempts)

    @contextlib.contextmanager
    def _operation(self):
        """The deadline of one operation (nested calls keep the outer one)."""
        outer = getattr(self._deadline, "at", None)
        if outer is None:
            self._deadline.at = time.monotonic() + self.operation_timeout_s
        try:
            yield
        finally:
            if outer is None:
                self._deadline.at = None

    def _retry(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run `fn`, re-running it on connection-level failures with exponential backoff + jitter,
        until `max_attempts` or the operation's deadline; one log line per retry.
        Throttling/5xx were already retried per request by botocore; other errors are final."""
        from botocore.exceptions import ClientError

        with self._operation():
            for attempt in range(1, self.max_attempts + 1):
                started = time.monotonic()
                try:
                    return fn()
                except ClientError as e:
                    raise self._translate(e, op, key) from e
                except self._no_credentials as e:
                    raise self._credentials_error(op, key, e) from e
                except _DeadlinePassed:
                    raise self._timeout(op, key, attempt) from None
                except self._transient as e:
                    delay = backoff_delay(attempt, self.backoff_base_s, self.backoff_max_s)
                    if time.monotonic() - started >= self.operation_timeout_s:
                        # a long transfer that broke late, not a frozen endpoint: a fresh deadline
                        self._deadline.at = time.monotonic() + self.operation_timeout_s
                    if time.monotonic() + delay >= self._deadline.at:
                        raise self._timeout(op, key, attempt) from e
                    if attempt == self.max_attempts:
                        raise StoreError(f"{op} {self.uri(key)}: giving up after {attempt} attempts "
                                         f"({self._where()}): {e}") from e
                    log.warning("%s %s: %s; attempt %d of %d failed, retry in %.2fs", op, self.uri(key), e,
                                attempt, self.max_attempts, delay)
                    self._sleep(delay)
        raise AssertionError("unreachable")

    # ---- operations

    def put_bytes(self, key: str, data: bytes) -> None:
        full = self._full(key)
        self._retry("put", key, lambda: self.client.upload_fileobj(
            io.BytesIO(data), self.bucket, full, Config=self.transfer_config))

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        full = self._full(key)

        def upload() -> None:
            with _open_local(path, f"put {self.uri(key)}") as f:  # reopened: a retry starts at byte 0
                self.client.upload_fileobj(f, self.bucket, full, Config=self.transfer_config)

        self._retry("put", key, upload)

    def put_stream(self, key: str, chunks: Iterable[bytes | memoryview]) -> tuple[int, str]:
        """One PUT below the multipart threshold, else a multipart upload with up to
        `max_concurrency` parts in flight. Every request carries the SHA256 of its bytes, which the
        server checks; the finished object's recorded checksum (the whole object's, or for
        multipart the composite: sha256 of the parts' digests) and size are then compared with ours."""
        full = self._full(key)
        whole = hashlib.sha256()
        parts = _fixed_parts(chunks, self.transfer_config.multipart_chunksize, whole)
        head, buffered = [], 0
        for part in parts:  # read ahead up to the threshold: small objects take one PUT
            head.append(part)
            buffered += len(part)
            if buffered >= self.transfer_config.multipart_threshold:
                break
        else:
            data = b"".join(head)
            self._retry("put", key, lambda: self.client.put_object(
                Bucket=self.bucket, Key=full, Body=data, ChecksumAlgorithm="SHA256",
                ChecksumSHA256=_b64(hashlib.sha256(data).digest())))
            self._check_committed(key, len(data), whole.hexdigest(), _b64(whole.digest()))
            return len(data), whole.hexdigest()
        size, composite = self._multipart(key, full, _chain(head, parts))
        self._check_committed(key, size, whole.hexdigest(), composite)
        return size, whole.hexdigest()

    def _multipart(self, key: str, full: str, parts: Iterator[bytes]) -> tuple[int, str]:
        upload = self._retry("put", key, lambda: self.client.create_multipart_upload(
            Bucket=self.bucket, Key=full, ChecksumAlgorithm="SHA256"))["UploadId"]
        window = threading.BoundedSemaphore(self.transfer_config.max_concurrency)

        def send(number: int, body: bytes) -> dict:
            try:
                digest = hashlib.sha256(body).digest()
                resp = self._retry("put", key, lambda: self.client.upload_part(
                    Bucket=self.bucket, Key=full, UploadId=upload, PartNumber=number, Body=body,
                    ChecksumAlgorithm="SHA256", ChecksumSHA256=_b64(digest)))
                return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumSHA256": _b64(digest), "digest": digest}
            finally:
                window.release()

        try:
            size, futures = 0, []
            with ThreadPoolExecutor(self.transfer_config.max_concurrency, thread_name_prefix="s3-part") as pool:
                for number, body in enumerate(parts, 1):
                    window.acquire()  # at most max_concurrency parts in memory
                    size += len(body)
                    futures.append(pool.submit(send, number, body))
                done = [f.result() for f in futures]
            self._retry("put", key, lambda: self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload,
                MultipartUpload={"Parts": [{k: p[k] for k in ("PartNumber", "ETag", "ChecksumSHA256")}
                                           for p in done]}))
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload)
            raise
        return size, _b64(hashlib.sha256(b"".join(p["digest"] for p in done)).digest())

    def _check_committed(self, key: str, size: int, sha256: str, checksum: str) -> None:
        """The committed object must have our size and the checksum the server computed for it."""
        full = self._full(key)
        head = self._retry("head", key, lambda: self.client.head_object(
            Bucket=self.bucket, Key=full, ChecksumMode="ENABLED"))
        stored = head.get("ChecksumSHA256")
        if int(head["ContentLength"]) != size:
            raise CorruptObject(key, f"after upload: wrote {size} bytes, the store holds "
                                     f"{head['ContentLength']}", self.uri(key), repair=False)
        if stored is None:  # the server keeps no checksums: prove it the slow way
            if not self._warned_no_checksum:
                self._warned_no_checksum = True
                log.warning("%s records no SHA256 checksums: uploads are verified by reading them back",
                            self.endpoint_url or "S3")
            self.check_read_back(key, size, sha256)
        elif stored.split("-")[0] != checksum:
            raise CorruptObject(key, f"after upload: server checksum {stored}, expected {checksum}", self.uri(key),
                                repair=False)

    def get_bytes(self, key: str) -> bytes:
        return b"".join(self.iter_chunks(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        full = self._full(key)
        return self._retry("get", key, lambda: self.client.get_object(
            Bucket=self.bucket, Key=full, Range=f"bytes={start}-{end - 1}")["Body"].read())

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        """Stream with resume: after a broken connection continue at the byte we reached, pinned to
        the same version by If-Match on the ETag so we never splice two different objects."""
        from botocore.exceptions import ClientError

        full, pos, etag, total, attempt = self._full(key), 0, None, None, 1
        deadline, pos_at_deadline = None, -1
        while True:
            try:
                extra = {"Range": f"bytes={pos}-", "IfMatch": etag} if pos else {}
                # The deadline bounds the requests without progress; bytes received re-arm it.
                if pos != pos_at_deadline:
                    deadline, pos_at_deadline = time.monotonic() + self.operation_timeout_s, pos
                self._deadline.at = deadline
                try:
                    resp = self.client.get_object(Bucket=self.bucket, Key=full, **extra)
                finally:
                    self._deadline.at = None
                etag = etag or resp["ETag"]
                total = resp["ContentLength"] if total is None else total
                for chunk in resp["Body"].iter_chunks(chunk_size):
                    pos += len(chunk)
                    yield chunk
                return
            except ClientError as e:
                if pos and str(e.response.get("Error", {}).get("Code")) in ("PreconditionFailed", "412"):
                    raise StoreError(f"get {self.uri(key)}: object changed while reading") from e
                raise self._translate(e, "get", key) from e
            except self._no_credentials as e:
                raise self._credentials_error("get", key, e) from e
            except _DeadlinePassed:
                raise self._timeout("get", key, attempt) from None
            except self._transient as e:
                if total is not None and pos >= total:
                    return
                delay = backoff_delay(attempt, self.backoff_base_s, self.backoff_max_s)
                if pos == pos_at_deadline and time.monotonic() + delay >= deadline:
                    raise self._timeout("get", key, attempt) from e
                if attempt == self.max_attempts:
                    raise StoreError(f"get {self.uri(key)}: giving up after {attempt} attempts "
                                     f"({self._where()}): {e}") from e
                log.warning("get %s: %s at byte %d; attempt %d of %d failed, retry in %.2fs", self.uri(key), e,
                            pos, attempt, self.max_attempts, delay)
                self._sleep(delay)
                attempt += 1

    def get_file(self, key: str, path: str | os.PathLike) -> None:
        full = self._full(key)
        path = Path(path)

        def download() -> None:
            # download_fileobj runs parallel ranged GETs for large objects.
            atomic_write(path, lambda f: self.client.download_fileobj(
                self.bucket, full, f, Config=self.transfer_config))

        try:
            self._retry("get", key, download)
        except OSError as e:
            if disk_full(e):
                raise StorageFull(f"get {self.uri(key)}: cannot write {path}", e) from e
            raise StoreError(f"get {self.uri(key)}: cannot write {path}: {e}") from e

    def size(self, key: str) -> int | None:
        full = self._full(key)
        try:
            head = self._retry("head", key, lambda: self.client.head_object(Bucket=self.bucket, Key=full))
        except ObjectNotFound:
            return None
        return int(head["ContentLength"])

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        full_prefix = self._full_prefix(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0

        def listing() -> dict[str, int]:  # restarted from scratch on a connection failure
            out = {}
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full_prefix,
                PaginationConfig={"PageSize": self.list_page_size})
            for page in pages:
                for obj in page.get("Contents", []):
                    out[obj["Key"][strip:]] = int(obj["Size"])
            return out

        return dict(sorted(self._retry("list", prefix, listing).items()))

    def list(self, prefix: str = "") -> list[str]:
        return list(self.list_sizes(prefix))

    def delete(self, key: str) -> None:
        full = self._full(key)
        self._retry("delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=full))

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        full = self._full(key)

        def get() -> tuple[bytes, str]:  # the bytes and the ETag of the same response
            resp = self.client.get_object(Bucket=self.bucket, Key=full)
            return resp["Body"].read(), resp["ETag"]

        return self._retry("get", key, get)

    def put_if(self, key: str, data: bytes, version: str | None) -> bool:
        from botocore.exceptions import ClientError

        full = self._full(key)
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}

        def put() -> bool:
            try:
                self.client.put_object(Bucket=self.bucket, Key=full, Body=data, **condition)
            except ClientError as e:
                if str(e.response.get("Error", {}).get("Code")) in _LOST_RACE_CODES:
                    return False
                raise
            return True

        return self._retry("put", key, put)

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._full(k)} for k in keys[i:i + 1000]]
            resp = self._retry("delete", prefix, lambda: self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))
            if resp.get("Errors"):
                first = resp["Errors"][0]
                raise StoreError(f"delete under {self.uri(prefix or '')}: {len(resp['Errors'])} keys failed, "
                                 f"e.g. {first.get('Key')}: {first.get('Code')} {first.get('Message')}")
        return len(keys)


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


def _fixed_parts(chunks: Iterable[bytes | memoryview], size: int, whole) -> Iterator[bytes]:
    """Re-cut a byte stream into parts of exactly `size` bytes (the last one shorter), feeding
    `whole` (a hash) with every byte on the way."""
    buf = bytearray()
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        whole.update(view)
        while view.nbytes:
            take = min(size - len(buf), view.nbytes)
            buf += view[:take]
            view = view[take:]
            if len(buf) == size:
                yield bytes(buf)
                buf.clear()
    if buf:
        yield bytes(buf)


def _chain(first: list[bytes], rest: Iterator[bytes]) -> Iterator[bytes]:
    yield from first
    yield from rest

