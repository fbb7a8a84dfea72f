"""Which failures the stage tasks retry, decided by the error's type (one predicate for every
stage): transient storage trouble, typed server start failures and a server that went down yes;
configuration errors, corrupted objects and missing upstream outputs never."""

import pytest

from drafter.config import ConfigError
from drafter.chat_client import DatagenServerDown
from drafter.server_errors import ServerConfigError, ServerStalled
from drafter.stage_output import ManifestError
from drafter.store import CorruptObject, ObjectNotFound, StoreError
from tasks.common import retry_retryable

retry_transient = retry_datagen = retry_server_start = retry_retryable  # one policy for every stage


class FailedState:
    def __init__(self, exc):
        self.exc = exc

    def result(self, raise_on_failure=True):
        return self.exc


@pytest.mark.parametrize("exc, retried", [
    (StoreError("connection reset talking to the store"), True),
    (ConnectionError("refused"), True),
    (ConfigError([("dump.aux_layer_ids", "bad")]), False),
    (CorruptObject("dump/x/hs-00000.safetensors", "sha256 mismatch"), False),
    (ObjectNotFound("datagen is not committed: no manifest datagen/abc/_SUCCESS.json"), False),
    (ManifestError("invalid manifest datagen/abc/_SUCCESS.json"), False),
    (ValueError("a bug"), False),
])
def test_stage_retry_policy(exc, retried):
    assert retry_transient(None, None, FailedState(exc)) is retried


def test_datagen_retries_a_server_that_went_down_but_not_bad_config():
    assert retry_datagen(None, None, FailedState(DatagenServerDown("http://x", "500", 10)))
    assert retry_datagen(None, None, FailedState(ServerStalled("stuck", phase="cuda_graph")))
    assert not retry_datagen(None, None, FailedState(ServerConfigError("port taken")))
    assert not retry_datagen(None, None, FailedState(ObjectNotFound("prepare is not committed")))


def test_serve_retries_only_typed_start_failures():
    assert retry_server_start(None, None, FailedState(ServerStalled("stuck", phase="cuda_graph")))
    assert not retry_server_start(None, None, FailedState(ServerConfigError("bad flags")))
    assert not retry_server_start(None, None, FailedState(RuntimeError("other")))
