"""ObjectStore contract, run identically against file:// and a real S3 protocol server (moto)."""
from __future__ import annotations

import hashlib
import os
import random
import time

import pytest

from drafter.config import StorageConfig
from drafter.store import (
    TMP_MARK, FileStore, ObjectNotFound, S3Store, StoreError, atomic_write, backoff_delay, open_store)

MiB = 1024 * 1024


def _blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def test_put_get_exists_size_roundtrip(any_store):
    key = "prepare/ab12/train.jsonl"
    any_store.put_bytes(key, b'{"a": 1}\n')
    assert any_store.get_bytes(key) == b'{"a": 1}\n'
    assert any_store.exists(key)
    assert any_store.size(key) == 9
    any_store.put_bytes("empty", b"")
    assert any_store.get_bytes("empty") == b"" and any_store.size("empty") == 0
    assert any_store.uri(key).endswith("/prepare/ab12/train.jsonl")
    assert any_store.uri(key).startswith("s3://" if isinstance(any_store, S3Store) else "file:///")


def test_overwrite_replaces_the_object(any_store):
    any_store.put_bytes("k", b"old content")
    any_store.put_bytes("k", b"new")
    assert any_store.get_bytes("k") == b"new" and any_store.size("k") == 3
    assert any_store.list() == ["k"]


def test_missing_key(any_store, tmp_path):
    assert not any_store.exists("nope/x")
    assert any_store.size("nope/x") is None
    with pytest.raises(ObjectNotFound, match="nope/x"):
        any_store.get_bytes("nope/x")
    with pytest.raises(ObjectNotFound, match="nope/x"):
        any_store.get_file("nope/x", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    any_store.delete("nope/x")  # deleting a missing key is a no-op, as on S3


def test_put_file_get_file_roundtrip(any_store, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(_blob(100_000))
    any_store.put_file("a/b/src.bin", src)
    dst = tmp_path / "deep" / "er" / "dst.bin"  # missing parents are created
    any_store.get_file("a/b/src.bin", dst)
    assert dst.read_bytes() == src.read_bytes()
    assert b"".join(any_store.iter_chunks("a/b/src.bin", 7_000)) == src.read_bytes()
    assert [p.name for p in dst.parent.iterdir()] == ["dst.bin"]  # no temp file left behind


def test_list_is_sorted_recursive_prefix_based_and_idempotent(any_store):
    keys = ["a/b/2", "z", "a/c", "ab/x", "a/b/1"]
    for i, k in enumerate(keys):
        any_store.put_bytes(k, b"x" * i)
    assert any_store.list() == sorted(keys)
    assert any_store.list() == any_store.list()  # listing changes nothing
    assert any_store.list("a/") == ["a/b/1", "a/b/2", "a/c"]
    assert any_store.list("a") == ["a/b/1", "a/b/2", "a/c", "ab/x"]  # string prefix, as on S3
    assert any_store.list("a/b/") == ["a/b/1", "a/b/2"]
    assert any_store.list("missing/") == []
    assert any_store.list_sizes("a/b/") == {"a/b/1": 4, "a/b/2": 0}


def test_list_paginates(any_store):
    pages = []
    if isinstance(any_store, S3Store):
        any_store.list_page_size = 3  # 8 keys -> 3 pages, same code path as 1000-key pages
        any_store.client.meta.events.register("before-call.s3.ListObjectsV2", lambda **kw: pages.append(1))
    keys = [f"many/{i:02d}" for i in range(8)]
    for k in keys:
        any_store.put_bytes(k, b"")
    assert any_store.list("many/") == keys
    assert len(pages) == (3 if isinstance(any_store, S3Store) else 0)
    assert any_store.delete_prefix("many/") == 8


def test_delete_and_delete_prefix(any_store):
    for k in ["s/1/a", "s/1/b", "s/1/c/d", "s/10/a", "t/a"]:
        any_store.put_bytes(k, b"1")
    any_store.delete("s/1/a")
    assert not any_store.exists("s/1/a")
    assert any_store.delete_prefix("s/1/") == 2
    assert any_store.list() == ["s/10/a", "t/a"]
    assert any_store.delete_prefix("s/1/") == 0


@pytest.mark.parametrize("bad", ["", "/abs", "../escape", "a/../../b", "a//b", "a/", "a/./b", "a\\b",
                                 f"a/x{TMP_MARK}1"])
def test_invalid_keys_are_rejected(any_store, bad):
    with pytest.raises(StoreError, match="invalid"):
        any_store.put_bytes(bad, b"x")


def test_large_object_uses_multipart_on_s3(any_store, tmp_path):
    data = _blob(12 * MiB + 123, seed=1)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    any_store.put_file("big/file.bin", src)
    any_store.put_bytes("big/bytes.bin", data)
    for key in ("big/file.bin", "big/bytes.bin"):
        assert any_store.size(key) == len(data)
        out = tmp_path / f"out-{key.replace('/', '_')}"
        any_store.get_file(key, out)
        assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(data).digest()
    assert any_store.get_bytes("big/bytes.bin") == data
    if isinstance(any_store, S3Store):
        # threshold 5 MB, chunk 5 MB: a multipart ETag is "<md5 of md5s>-<parts>"
        for key in ("big/file.bin", "big/bytes.bin"):
            head = any_store.client.head_object(Bucket=any_store.bucket, Key=any_store._full(key))
            assert head["ETag"].strip('"').endswith("-3"), head["ETag"]


def test_put_stream_hashes_while_writing_and_never_reads_back(any_store, monkeypatch):
    """The verified write: (size, sha256) of what was streamed, committed as is, in one pass (the
    read paths are disabled while it runs). On S3 the server holds the SHA256 checksums we sent:
    the whole object's for one PUT, the composite of the part digests for a multipart upload."""
    small, big = _blob(1000, seed=2), _blob(12 * MiB + 5, seed=3)  # s3 fixture: 5 MB parts -> 3 parts
    for op in ("iter_chunks", "get_bytes", "get_file", "get_range"):
        monkeypatch.setattr(any_store, op, lambda *a, **k: pytest.fail("read back"))
    pieces = [big[i:i + 3 * MiB + 7] for i in range(0, len(big), 3 * MiB + 7)]  # odd chunk sizes
    assert any_store.put_stream("s/small", [memoryview(small)]) == (1000, hashlib.sha256(small).hexdigest())
    assert any_store.put_stream("s/big", iter(pieces)) == (len(big), hashlib.sha256(big).hexdigest())
    monkeypatch.undo()
    assert any_store.get_bytes("s/small") == small and any_store.get_bytes("s/big") == big
    assert any_store.get_range("s/big", 5 * MiB - 3, 5 * MiB + 4) == big[5 * MiB - 3:5 * MiB + 4]
    if isinstance(any_store, S3Store):
        import base64

        b64 = lambda d: base64.b64encode(d).decode()
        head = lambda key: any_store.client.head_object(Bucket=any_store.bucket, Key=any_store._full(key),
                                                        ChecksumMode="ENABLED")
        assert head("s/small")["ChecksumSHA256"] == b64(hashlib.sha256(small).digest())
        parts = [big[i:i + 5 * MiB] for i in range(0, len(big), 5 * MiB)]
        composite = b64(hashlib.sha256(b"".join(hashlib.sha256(x).digest() for x in parts)).digest())
        assert head("s/big")["ChecksumSHA256"].split("-")[0] == composite


def test_s3_committed_object_is_checked_against_the_servers_record(s3_storage_config):
    """A server checksum that differs from ours is corruption; a server that records none is read
    back and hashed instead (S3-compatible services without checksum support)."""
    import base64

    from drafter.store import CorruptObject

    store = open_store(s3_storage_config)
    data = _blob(2000, seed=4)
    sha = hashlib.sha256(data).hexdigest()
    store.put_stream("k", [data])
    ours = base64.b64encode(hashlib.sha256(data).digest()).decode()
    with pytest.raises(CorruptObject, match="server checksum"):
        store._check_committed("k", len(data), sha, "A" * 43 + "=")
    store._check_committed("k", len(data), sha, ours)
    with pytest.raises(CorruptObject, match="wrote 1999 bytes, the store holds 2000"):
        store._check_committed("k", len(data) - 1, sha, ours)
    store.client.put_object(Bucket=store.bucket, Key=store._full("plain"), Body=data)  # no checksum kept
    store._check_committed("plain", len(data), sha, "unused")
    with pytest.raises(CorruptObject, match="after upload"):
        store._check_committed("plain", len(data), hashlib.sha256(b"other").hexdigest(), "unused")


# ---- file:// specifics


def test_filestore_stream_failing_midway_leaves_no_object_and_no_hash_thread(tmp_path):
    """The sha256 runs on its own thread beside the writes: a source that dies mid-stream leaves
    neither a half object nor that thread behind, and the old object stays."""
    import threading

    store = FileStore(tmp_path)
    store.put_bytes("k", b"old")

    def chunks():
        yield _blob(3 * MiB, seed=5)
        raise RuntimeError("the shard's source died")

    with pytest.raises(RuntimeError, match="source died"):
        store.put_stream("k", chunks())
    assert store.get_bytes("k") == b"old" and store.list() == ["k"]
    assert not [t for t in threading.enumerate() if t.name == "sha256"]


def test_background_sha256_equals_hashlib_over_many_chunks():
    from drafter.hashing import BackgroundSha256

    data = _blob(5 * MiB + 3, seed=6)
    h = BackgroundSha256(depth=2)
    for i in range(0, len(data), 65537):  # more chunks than the queue holds
        h.update(memoryview(data)[i:i + 65537])
    assert h.hexdigest() == hashlib.sha256(data).hexdigest()


def test_filestore_crash_before_rename_leaves_old_object(tmp_path, monkeypatch):
    store = FileStore(tmp_path)
    store.put_bytes("k", b"old")

    def crash(src, dst):
        raise KeyboardInterrupt("simulated crash between write and rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.put_bytes("k", b"new content")
    monkeypatch.undo()
    assert store.get_bytes("k") == b"old"
    assert os.listdir(tmp_path) == ["k"]  # the temp file was cleaned up


def test_filestore_never_lists_temp_files(tmp_path):
    store = FileStore(tmp_path)
    store.put_bytes("d/obj", b"1")
    (tmp_path / "d" / f".obj{TMP_MARK}abc123").write_bytes(b"half-writ")  # left by a kill -9
    assert store.list() == ["d/obj"]
    assert store.delete_prefix("d/") == 1


def test_atomic_write_failure_keeps_target_absent(tmp_path):
    def half(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError):
        atomic_write(tmp_path / "x", half)
    assert list(tmp_path.iterdir()) == []


def test_open_store_parses_roots(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = open_store(StorageConfig(root="file://runs/store"))
    assert isinstance(store, FileStore) and store.root == tmp_path / "runs" / "store"
    assert store.uri("a/b") == f"file://{tmp_path}/runs/store/a/b"
    abs_store = open_store(StorageConfig(root=f"file://{tmp_path}/abs"))
    assert abs_store.root == tmp_path / "abs"
    s3 = open_store(StorageConfig(root="s3://bkt/some/prefix/", endpoint_url="http://127.0.0.1:1",
                                  region="us-east-1"))
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix) == ("bkt", "some/prefix")
    assert s3.uri("x/y") == "s3://bkt/some/prefix/x/y"
    bare = open_store(StorageConfig(root="s3://bkt", region="us-east-1"))
    assert bare.uri("x") == "s3://bkt/x"


# ---- s3:// specifics: errors and retries against real sockets


@pytest.mark.s3
def test_s3_missing_bucket_is_a_clear_error(s3_endpoint):
    store = S3Store("no-such-bucket", "p", endpoint_url=s3_endpoint, region="us-east-1")
    with pytest.raises(StoreError, match="no-such-bucket"):
        store.put_bytes("k", b"x")


def test_backoff_delay_is_exponential_capped_and_jittered():
    top = [backoff_delay(a, 0.5, 5.0, rand=lambda: 1.0) for a in range(1, 7)]
    assert top == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff_delay(3, 0.5, 5.0, rand=lambda: 0.25) == 0.5
    rng = random.Random(0)
    samples = {backoff_delay(4, 0.5, 5.0, rand=rng.random) for _ in range(50)}
    assert len(samples) == 50 and all(0 <= s <= 4.0 for s in samples)


def _store_via(proxy, cfg: StorageConfig, max_attempts: int) -> S3Store:
    bucket, _, prefix = cfg.root.removeprefix("s3://").partition("/")
    store = S3Store(bucket, prefix, endpoint_url=proxy.url, region="us-east-1", max_attempts=max_attempts,
                    backoff_base_s=0.05)
    store.sleeps = []
    store._sleep = store.sleeps.append  # observe our wrapper's backoff without waiting
    return store


@pytest.mark.s3
def test_s3_throttling_is_retried_by_botocore(s3_fault_proxy, s3_storage_config):
    open_store(s3_storage_config).put_bytes("obj", b"payload")
    store = _store_via(s3_fault_proxy, s3_storage_config, max_attempts=5)
    s3_fault_proxy.inject("slowdown", "slowdown")
    assert store.get_bytes("obj") == b"payload"
    assert s3_fault_proxy.served == ["slowdown", "slowdown"]
    assert s3_fault_proxy.connections == 3

    # Control: the same fault without retries fails, so the success above came from retrying.
    no_retry = _store_via(s3_fault_proxy, s3_storage_config, max_attempts=1)
    s3_fault_proxy.inject("slowdown")
    with pytest.raises(StoreError, match="SlowDown"):
        no_retry.get_bytes("obj")


@pytest.mark.s3
def test_s3_dropped_connections_are_retried_by_our_wrapper(s3_fault_proxy, s3_storage_config):
    # botocore makes 2 attempts per call, both dropped; our wrapper backs off and re-runs the call.
    store = _store_via(s3_fault_proxy, s3_storage_config, max_attempts=2)
    s3_fault_proxy.inject("drop", "drop", "drop")
    store.put_bytes("obj", b"payload")
    assert s3_fault_proxy.served == ["drop"] * 3
    assert len(store.sleeps) == 1 and 0 <= store.sleeps[0] <= 0.05
    assert open_store(s3_storage_config).get_bytes("obj") == b"payload"

    # Four drops exhaust 2 wrapper attempts x 2 botocore attempts: a clear, final error.
    s3_fault_proxy.inject("drop", "drop", "drop", "drop")
    with pytest.raises(StoreError, match="giving up after 2 attempts"):
        store.size("obj")
    assert len(store.sleeps) == 2 and 0 <= store.sleeps[1] <= 0.05


@pytest.mark.s3
def test_s3_stream_cut_mid_body_resumes_where_it_stopped(s3_fault_proxy, s3_storage_config):
    data = _blob(2 * MiB, seed=2)
    open_store(s3_storage_config).put_bytes("obj", data)
    store = _store_via(s3_fault_proxy, s3_storage_config, max_attempts=3)
    s3_fault_proxy.inject("cut:300000")
    assert store.get_bytes("obj") == data
    assert s3_fault_proxy.served == ["cut:300000"]
    assert len(store.sleeps) == 1  # one resume, not a failure


@pytest.mark.s3
@pytest.mark.slow
def test_s3_frozen_endpoint_fails_at_the_deadline_with_one_line_per_retry(s3_fault_proxy, s3_storage_config, caplog):
    """An endpoint that accepts and never answers: before, ~50 minutes of silence per operation
    (120 s read timeout x 5 x 5); now the operation's deadline, and every retry is a log line."""
    from drafter.store import OperationTimeout

    open_store(s3_storage_config).put_bytes("obj", b"payload")
    bucket, _, prefix = s3_storage_config.root.removeprefix("s3://").partition("/")
    store = S3Store(bucket, prefix, endpoint_url=s3_fault_proxy.url, region="us-east-1", max_attempts=3,
                    connect_timeout_s=1, read_timeout_s=0.5, operation_timeout_s=2.0, backoff_base_s=0.05)
    s3_fault_proxy.inject(*["freeze"] * 40)
    caplog.set_level("WARNING", logger="drafter.store")
    for call in (lambda: store.get_bytes("obj"), lambda: store.size("obj")):
        caplog.clear()
        t0 = time.monotonic()
        with pytest.raises(OperationTimeout, match=r"no answer within storage.operation_timeout_s=2s .*"
                                                   r"read timeout 0.5s; endpoint http://127.0.0.1"):
            call()
        assert time.monotonic() - t0 < 15  # the deadline plus one request, not attempts x timeouts
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) >= 2 and all("attempt" in line for line in lines), lines
    assert OperationTimeout("x").retryable


def test_invalid_bucket_name_is_a_config_error_and_a_missing_bucket_is_final():
    from drafter.config import ConfigError, parse_config
    from drafter.store import BucketError

    with pytest.raises(ConfigError, match="invalid bucket name 'My_Bucket'"):
        parse_config({"target": {"path": "/t"}, "storage": {"root": "s3://My_Bucket/prefix"}})
    assert not BucketError("x").retryable


# ---- compare-and-swap (the registry's writes)


def test_put_if_writes_only_over_the_version_read(any_store):
    key = "_registry/t0/demo.json"
    assert any_store.put_if(key, b"v1", None)  # created
    assert not any_store.put_if(key, b"other", None)  # exists already: not created again
    data, v1 = any_store.get_versioned(key)
    assert data == b"v1"
    assert any_store.put_if(key, b"v2", v1)
    assert not any_store.put_if(key, b"stale", v1)  # written since v1 was read
    data, v2 = any_store.get_versioned(key)
    assert data == b"v2" and v2 != v1
    any_store.delete(key)
    assert not any_store.put_if(key, b"v3", v2)  # deleted since
    assert any_store.list("_registry/") == []
    with pytest.raises(ObjectNotFound):
        any_store.get_versioned(key)


def test_filestore_put_if_excludes_concurrent_writers(tmp_path):
    """Two threads read the same version; exactly one compare-and-swap wins."""
    import threading

    store = FileStore(tmp_path)
    store.put_bytes("doc", b"v0")
    _, v0 = store.get_versioned("doc")
    barrier, wins = threading.Barrier(8), []

    def write(i: int) -> None:
        barrier.wait()
        if store.put_if("doc", f"v{i}".encode(), v0):
            wins.append(i)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and store.get_bytes("doc") == f"v{wins[0]}".encode()
    assert store.list() == ["doc"]  # the lock file is never listed


# ---- s3:// configuration and credentials: one typed line, never a traceback, never a secret


@pytest.mark.s3
@pytest.mark.parametrize("env, says", [
    ({}, "no credentials found"),
    ({"AWS_ACCESS_KEY_ID": "AKIAVERYSECRETVALUE"}, "Partial credentials found in env, missing: AWS_SECRET_ACCESS_KEY"),
    ({"AWS_PROFILE": "nosuchprofile"}, "The config profile (nosuchprofile) could not be found"),
], ids=["none", "partial", "profile"])
def test_s3_missing_credentials_are_one_line_naming_bucket_endpoint_and_how(s3_endpoint, monkeypatch, env, says):
    from drafter.store import CredentialsError

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)

    store = lambda: S3Store("drafter-test", "p", endpoint_url=s3_endpoint, region="us-east-1", max_attempts=1)
    calls = [lambda: store().get_bytes("k"), lambda: store().put_bytes("k", b"x"),
             lambda: store().put_stream("k", [b"x"]), lambda: store().list("a/"), lambda: store().size("k"),
             lambda: store().put_if("k", b"x", None)]
    for call in calls:  # (partial credentials and a missing profile already fail when the client is made)
        with pytest.raises(CredentialsError) as err:
            call()
        text = str(err.value)
        assert says in text and "AWS_ACCESS_KEY_ID" in text and s3_endpoint in text, text
        assert "VERYSECRET" not in text and "\n" not in text
        assert not err.value.retryable and err.value.exit_code == 2


@pytest.mark.s3
def test_s3_missing_credentials_through_the_cli_is_one_line(s3_endpoint, tmp_path, monkeypatch, capsys):
    from tests.fixtures.cli import drafter, profile

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    path = profile(tmp_path, storage={"root": "s3://drafter-test/p", "endpoint_url": s3_endpoint, "max_attempts": 1})
    code, err = drafter(monkeypatch, capsys, "outputs", "-c", path)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [err.strip()]
    assert err.startswith(f"error (CredentialsError): list s3://drafter-test/p: no credentials found (endpoint "
                          f"{s3_endpoint}); provide credentials for bucket 'drafter-test' in the environment")


def test_s3_unreachable_endpoint_names_the_listing_and_an_invalid_endpoint_is_refused(monkeypatch):
    from drafter.store import InvalidName

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    store = S3Store("b", "p", endpoint_url="http://127.0.0.1:1", region="us-east-1", max_attempts=1,
                    connect_timeout_s=1)
    with pytest.raises(StoreError, match=r"list s3://b/p/a/: giving up after 1 attempts \(endpoint "
                                         r"http://127.0.0.1:1\)") as err:
        store.list("a/")
    assert err.value.retryable
    with pytest.raises(InvalidName, match="storage.endpoint_url 'localhost:9000'"):
        S3Store("b", endpoint_url="localhost:9000")
