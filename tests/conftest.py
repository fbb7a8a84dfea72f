import os
import tempfile

import pytest

# Nothing in the test suite may reach a model hub or phone home.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Weight-hash cache of drafter.target_identity: per test session, never the user's home.
os.environ.setdefault("DRAFTER_CACHE_DIR", tempfile.mkdtemp(prefix="drafter-cache-"))

pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.targets"]


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Tiny models: op dispatch dominates, and intra-op threads only add barrier waits (20x slower
    on a busy 2-core machine). Restored afterwards for other modules. Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_cpu_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# How long a Prefect test server (prefect_test_harness) may take to answer /health: minutes under
# load, returned from as soon as it answers (tests/serving/test_serve_task.py has its own, the same).
PREFECT_TEST_SERVER_START_S = 600


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """One Prefect test server (its own home and result storage) for a module's flow runs (~11 s
    to start idle). Its start-up budget is generous (the harness returns as soon as /health
    answers): a fixed 60 s missed on a loaded 2-core machine."""
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("prefect")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_HOME", str(home))
        mp.setenv("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(home / "results"))
        with prefect_test_harness(server_startup_timeout=PREFECT_TEST_SERVER_START_S):
            yield


# Test tiers: `pytest -m fast` (`make test-fast`, ~2 min on 2 cores) and the full suite (`make test`).
# The classification lives here only: every test is `fast` unless its module is listed in
# SLOW_MODULES, it uses a fixture listed in SLOW_FIXTURES, or it carries `@pytest.mark.slow` (a single
# slow test inside an otherwise fast module). Slow tests run in `make test` only.
SLOW_MODULES = {
    # Real engines in their own venvs (DRAFTER_VLLM_PYTHON / DRAFTER_SGLANG_PYTHON).
    "test_vllm_capture", "test_vllm_engine", "test_vllm_judge", "test_bench_vllm",
    "test_sglang_export", "test_sglang_rules", "test_sglang_server",
    # Prefect end to end (the fan-out over 3 process workers), the serve task's retries through its
    # own Prefect test server, the Kubernetes pool template against a real Prefect server.
    "test_e2e_prefect", "test_serve_task", "test_fanout_prefect", "test_k8s_pool",
    # Real server processes on loopback: launch, stall watchdog, teardown, reaping; bench sweeps.
    "test_launcher", "test_server_lifecycle", "test_bench_sweep", "test_bench_hardening", "test_hostile_user",
    # Two real CLI runs of one datagen / dump output at once (the per-output lock).
    "test_one_run_per_output",
    # Real multi-process training (torchrun, gloo): DDP/FSDP parity, kill -9 / SIGTERM of `drafter train`.
    "test_training_distributed", "test_train_hardening",
    # The smoke run: every stage, a datagen server and a drafter server (reference engine, real vLLM).
    "test_smoke", "test_smoke_vllm",
}
SLOW_FIXTURES = {
    "prefect_server",  # a Prefect test server (~11 s to start) and flow runs through it
    "servers",  # tests/engines/test_reference_server.py: six real reference-server processes (~50 s)
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""
        slow = (module in SLOW_MODULES or item.get_closest_marker("slow") is not None
                or not SLOW_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())))
        if not slow:
            item.add_marker(pytest.mark.fast)
