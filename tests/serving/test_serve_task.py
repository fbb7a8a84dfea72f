"""The serve stage as a Prefect task: retried only for crashed/stalled/health-timeout starts."""
import socket
import sys
from pathlib import Path

import pytest
from prefect import flow
from prefect.testing.utilities import prefect_test_harness

import drafter.stages.serve as serve_module
from drafter.config import parse_config
from drafter.server_errors import ServerConfigError, ServerStalled
from drafter.stages import TABLE
from tasks.stage import stage_task
from tests.fixtures.net import free_port
from tests.fixtures.servers import FAKE


@pytest.fixture(scope="module", autouse=True)
def prefect_server(tmp_path_factory, monkeypatch_module):
    home = tmp_path_factory.mktemp("prefect")
    monkeypatch_module.setenv("PREFECT_HOME", str(home))
    monkeypatch_module.setenv("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(home / "results"))
    with prefect_test_harness(server_startup_timeout=600):  # generous: returns once /health answers
        yield


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture
def attempts(monkeypatch):
    calls = []
    real = serve_module.check_server

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(serve_module, "check_server", counting)
    return calls


def fake_config(tmp_path, *fake_args, port=None):
    port = port or free_port()
    return parse_config({
        "target": {"path": str(tmp_path), "name": "fake-model", "num_hidden_layers": 8, "vocab_size": 1000},
        "train": {"draft_vocab_size": 100}, "dump": {"aux_layer_ids": [1, 3, 4]},
        "serve": {"engine": "command", "port": port, "log_dir": str(tmp_path / "logs"),
                  "command": [sys.executable, str(FAKE), "--port", "{port}",
                              "--served-model-name", "{served_model_name}", *fake_args],
                  "health_url": f"http://127.0.0.1:{port}/health",
                  "stall_timeout_s": 1.0, "startup_timeout_s": 20.0}})


@flow
def serve_once(cfg):
    task = stage_task(TABLE["serve"], TABLE).with_options(retry_delay_seconds=0, retry_jitter_factor=None)
    return task(cfg, {})


def test_ready_server_passes(tmp_path, attempts):
    result = serve_once(fake_config(tmp_path))
    assert result["status"] == "ready" and len(attempts) == 1
    assert Path(result["meta"]["launch_path"]).is_file()


def test_stalled_start_is_retried_then_fails(tmp_path, attempts):
    with pytest.raises(ServerStalled):
        serve_once(fake_config(tmp_path, "--hang-in", "cuda_graph"))
    assert len(attempts) == 3  # first try + 2 retries


def test_config_error_is_never_retried(tmp_path, attempts):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerConfigError, match="port"):
            serve_once(fake_config(tmp_path, port=port))
    assert len(attempts) == 1
