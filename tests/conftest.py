import os
import tempfile

# Nothing in the test suite may reach a model hub or phone home.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Weight-hash cache of drafter.target_identity: per test session, never the user's home.
os.environ.setdefault("DRAFTER_CACHE_DIR", tempfile.mkdtemp(prefix="drafter-cache-"))

pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.targets"]
