"""A `file://` store root that cannot be one (a file, a path under a file), a store that does not
exist, and a full disk: each a clean one-line error with its documented exit code, never a
traceback, and a read never creates the store it looks for (issue 32, items 6 and 10)."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from drafter.errors import EXIT_CONFIG, EXIT_FAILED, describe, disk_full, exit_code, is_retryable
from drafter.store import (
    FileStore, ObjectNotFound, StorageFull, StoreError, StoreRootError, local_root_problem, open_store)
from drafter.config import StorageConfig
from tests.fixtures.cli import drafter, profile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def a_file(tmp_path) -> Path:
    f = tmp_path / "a-file"
    f.write_text("not a folder\n")
    return f


# ---- the rule


def test_the_root_rule(tmp_path, a_file):
    assert local_root_problem(tmp_path) is None
    assert local_root_problem(tmp_path / "new" / "deeper") is None  # creatable
    assert local_root_problem(a_file) == "is a file, not a directory"
    assert local_root_problem(a_file / "store" / "x") == f"cannot be created: {a_file} is a file, not a directory"
    assert local_root_problem("/dev/null") == "is not a directory"


@pytest.mark.parametrize("under", ["", "store", "store/deeper"])
def test_a_root_that_is_a_file_or_under_one_is_refused_at_open(a_file, under):
    root = a_file / under if under else a_file
    with pytest.raises(StoreRootError, match=f"storage root file://{a_file}.* (is|cannot be created: "
                                             f"{a_file} is) a file, not a directory") as err:
        open_store(StorageConfig(root=f"file://{root}"))
    assert not err.value.retryable and exit_code(err.value) == EXIT_CONFIG


def test_a_read_only_open_creates_nothing(tmp_path):
    missing = tmp_path / "no" / "store"
    with pytest.raises(ObjectNotFound, match=f"no store at file://{missing}: the directory does not exist"):
        FileStore(missing, create=False)
    assert not (tmp_path / "no").exists()
    FileStore(missing)  # the writers' default creates it
    assert missing.is_dir()
    assert FileStore(missing, create=False).list() == []


# ---- the command line


def test_every_command_on_a_file_root_is_one_line_exit_2(tmp_path, a_file, monkeypatch, capsys):
    path = profile(tmp_path, storage={"root": f"file://{a_file}/store"})
    for argv in (["outputs"], ["prepare"], ["registry", "list"], ["verify", "prepare"]):
        code, err = drafter(monkeypatch, capsys, *argv, "-c", path)
        assert code == EXIT_CONFIG and "Traceback" not in err, (argv, err)
        assert err.strip().splitlines()[-1] == (f"error (StoreRootError): storage root file://{a_file}/store "
                                                f"cannot be created: {a_file} is a file, not a directory"), argv


def test_config_validate_refuses_a_root_it_cannot_use(tmp_path, a_file, monkeypatch, capsys):
    bad = profile(tmp_path, storage={"root": f"file://{a_file}/store"})
    code, err = drafter(monkeypatch, capsys, "config", "validate", bad)
    assert code == 1 and "Traceback" not in err
    assert (f"storage.root: file://{a_file}/store cannot be created: {a_file} is a file, not a directory"
            in err), err
    code, _ = drafter(monkeypatch, capsys, "config", "validate", "--offline", bad)  # another machine's root
    assert code == 0
    good = profile(tmp_path, storage={"root": f"file://{tmp_path}/fresh/store"})
    code, err = drafter(monkeypatch, capsys, "config", "validate", good)
    assert code == 0, err
    assert not (tmp_path / "fresh").exists()  # checked, not created
    code, err = drafter(monkeypatch, capsys, "config", "validate", "--offline",
                        profile(tmp_path, storage={"root": "file://"}))
    assert code == 1 and "storage.root: Value error, " not in err and "file:// root needs a directory" in err


def test_verify_of_a_path_under_a_file_is_one_line(monkeypatch, capsys):
    """The reported case: `drafter verify file:///../../etc/passwd/dump/abc` was a 46-line traceback."""
    code, err = drafter(monkeypatch, capsys, "verify", "file:///../../etc/passwd/dump/abc")
    assert code == EXIT_CONFIG and "Traceback" not in err
    assert err.strip() == ("error (StoreRootError): storage root file:///etc/passwd is a file, not a directory")


def test_verify_of_a_store_that_does_not_exist_says_so_and_creates_nothing(tmp_path, monkeypatch, capsys):
    code, err = drafter(monkeypatch, capsys, "verify", f"file://{tmp_path}/nowhere/store/dump/ab12cd34")
    assert code == EXIT_FAILED and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"error (ObjectNotFound): no store at file://{tmp_path}/nowhere/store: "
                                            f"the directory does not exist")
    path = profile(tmp_path, storage={"root": f"file://{tmp_path}/elsewhere/store"})
    code, err = drafter(monkeypatch, capsys, "verify", "prepare", "-c", path)
    assert code == EXIT_FAILED and "no store at file://" in err and "Traceback" not in err
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "elsewhere").exists()


# ---- a full disk


def test_a_full_disk_is_never_retried():
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/x")
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    for err in (full, quota):
        assert disk_full(err) and not is_retryable(err) and exit_code(err) == EXIT_FAILED
        assert "the disk is full (or a quota is exhausted)" in describe(err)
    try:  # wrapped in an error that is otherwise retryable (a store write, a download)
        try:
            raise full
        except OSError as e:
            raise StoreError(f"put file:///data/x: {e}") from e
    except StoreError as wrapped:
        assert wrapped.retryable and disk_full(wrapped)
        assert not is_retryable(wrapped) and exit_code(wrapped) == EXIT_FAILED
    import pickle  # a task's error crosses processes (Prefect results): still not retried there

    stored = pickle.loads(pickle.dumps(StorageFull("put file:///data/x", full)))
    assert not is_retryable(stored) and exit_code(stored) == EXIT_FAILED and "the disk is full" in str(stored)
    other = OSError(errno.EIO, "I/O error")
    assert not disk_full(other) and is_retryable(StoreError("x")) and not disk_full(StoreError("x"))


def _unshare_tmpfs() -> bool:
    """A private mount namespace with a tiny tmpfs: a real full filesystem, no root needed where user
    namespaces are allowed."""
    if shutil.which("unshare") is None or sys.platform != "linux":
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=16k tmpfs /mnt 2>/dev/null "
                                                          "|| mount -t tmpfs -o size=16k tmpfs /tmp"],
                           capture_output=True, timeout=60)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_tmpfs(), reason="no user + mount namespaces here for a small tmpfs")
def test_a_store_write_to_a_full_filesystem_is_one_line_and_not_retried(tmp_path):
    """`drafter prepare` into a 32 KiB tmpfs (a real ENOSPC from the kernel): exit 4, one line that
    says the disk is full; it used to be a retryable StoreError (exit 3), so a Prefect retry
    repeated the work."""
    full = tmp_path / "full"
    full.mkdir()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join('{"prompt": "question %d: %s"}\n' % (i, "lorem ipsum dolor sit amet " * 20)
                              for i in range(400)))
    path = profile(tmp_path, data={"sources": [{"kind": "jsonl", "path": str(corpus)}]},
                   storage={"root": f"file://{full}/store"})
    drafter_bin = Path(sys.executable).with_name("drafter")
    script = (f"mount -t tmpfs -o size=32k tmpfs {full} && {drafter_bin} prepare -c {path}; echo rc=$?; "
              f"{sys.executable} -c \"from drafter.store import FileStore, StorageFull; from drafter.errors import "
              f"is_retryable\ntry: FileStore('{full}/s2').put_bytes('a/b', bytes(1 << 16))\n"
              f"except StorageFull as e: print('retryable', is_retryable(e))\"")
    out = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "rc=4" in out.stdout, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error (StorageFull): put file://{full}/store/prepare/") and \
        "No space left on device: the disk is full" in last, last
    assert "retryable False" in out.stdout, out
