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


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """One Prefect test server (its own home and result storage) for a module's flow runs (~11 s
    to start)."""
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("prefect")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_HOME", str(home))
        mp.setenv("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(home / "results"))
        with prefect_test_harness(server_startup_timeout=60):
            yield
