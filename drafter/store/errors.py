"""The store's errors: what a caller may retry (`StoreError.retryable`) and what a person must fix."""
from __future__ import annotations

import re

from drafter.errors import DISK_FULL_HINT, EXIT_CONFIG, DrafterError


class StoreError(DrafterError):
    """A storage operation failed (after retries, where retrying made sense): a later attempt may work."""

    retryable = True


class StoreRootError(StoreError):
    """A `file://` root that is not a directory and cannot be made one (a file, a path under a
    file, a folder we may not create): fix `storage.root` (or the output URI). Refused when the
    store is opened, before anything is read or written."""

    retryable = False
    exit_code = EXIT_CONFIG


class StorageFull(StoreError):
    """A local write failed because the disk is full or a quota is exhausted (ENOSPC / EDQUOT).
    Never retried: the same work would fail at the same place; a person must free space."""

    retryable = False

    def __init__(self, what: str, err: OSError | None = None):
        # (one argument: the whole message, as unpickling replays it across processes)
        super().__init__(what if err is None else f"{what}: {err.strerror or err}: {DISK_FULL_HINT}")


class OperationTimeout(StoreError):
    """No answer within the operation's deadline (`storage.operation_timeout_s`): a frozen or
    unreachable endpoint. A later attempt may work."""


class BucketError(StoreError):
    """The bucket does not exist or we may not use it: fix `storage.root` or the credentials."""

    retryable = False


class CredentialsError(BucketError):
    """No usable S3 credentials (none found, a partial set, a profile that does not exist): fix the
    environment. The message names the bucket and the endpoint, never a secret."""

    exit_code = EXIT_CONFIG


class InvalidName(StoreError):
    """A key, prefix, stage or fingerprint that could escape its place in the store (`..`, `/`,
    `\\`, ...), or an endpoint URL that names no server: a usage error, refused before anything is
    read or written."""

    retryable = False
    exit_code = EXIT_CONFIG


class ObjectNotFound(StoreError):
    """The key does not exist (e.g. an upstream stage that was never committed: run it first;
    waiting will not help)."""

    retryable = False


class CorruptObject(StoreError):
    """An object's bytes do not match what was recorded for it (sha256 or size): a person must look.

    A key inside a stage output (`<stage>/<fingerprint>/...`) is a committed output that failed a
    read or a verification: the message names the command that sets the output aside so that the
    next run of the stage redoes it (`StageOutput.repair`). `repair=False` where a re-run alone
    fixes it (an upload the store committed wrongly, a shard whose marker was just removed)."""

    retryable = False

    def __init__(self, key: str, detail: str, uri: str | None = None, repair: bool = True):
        self.key = key
        self.uri = uri or key
        hint = repair_hint(key) if repair else None
        super().__init__(f"corrupt object {self.uri}: {detail}" + (f"; {hint}" if hint else ""))


# A committed stage output's key: `<stage>/<fingerprint>[/<shard>]` (drafter.stage_output), a stage
# name being plain lowercase letters. Other prefixes (`train-checkpoints/`, `_reuse/`, `_registry/`)
# are not stage outputs. The store knows this layout, not the stage table (which builds on the store).
_STAGE_OUTPUT_KEY = re.compile(r"^([a-z]+)/[A-Za-z0-9][A-Za-z0-9._-]*(/|$)")


def repair_hint(key: str) -> str | None:
    """The command that repairs the committed stage output holding `key`, None outside one."""
    match = _STAGE_OUTPUT_KEY.match(key)
    if match is None:
        return None
    stage = match.group(1)
    return (f"to redo it, run `drafter verify --repair {stage} -c PROFILE` (the profile that made it), "
            f"then run {stage} again")

