"""`drafter smoke` on a profile served by real vLLM (CPU build): datagen through a vLLM server of the
target, the small dump, the overfit drafter, its vLLM (speculators) export served by vLLM with the layer
ids the installed version needs, a full draft block read from vLLM's /metrics counter deltas. Two vLLM
launches (~40-60 s each here)."""
from __future__ import annotations

import pytest

from drafter.config import load_config
from drafter.smoke import run_smoke
from tests.fixtures.bench import no_servers_left
from tests.fixtures.net import free_port
from tests.fixtures.smoke import smoke_profile, smoke_target  # noqa: F401  (fixture)
from tests.fixtures.vllm_env import vllm_py, vllm_serve_section  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_smoke_passes_on_vllm(smoke_target, vllm_py, tmp_path):
    serve = vllm_serve_section(vllm_py, free_port(), tmp_path / "logs")
    cfg = load_config(smoke_profile(tmp_path, smoke_target, serve))
    steps: list[str] = []
    report = run_smoke(cfg, on_step=steps.append)
    assert [s["step"] for s in report.steps] == ["prepare", "datagen", "dump", "capture", "train", "export", "serve"]
    assert report.engine == "vllm" and any(p["full_block"] for p in report.probes), report.probes
    full = [p for p in report.probes if p["full_block"]]
    assert all(p["draft_accept_length"] == pytest.approx(4.0) and p["verifies"] == 1 for p in full)
    assert report.line().startswith("smoke passed in ") and "engine vllm accepted a full block of 3 drafts" in report.line()
    no_servers_left(tmp_path / "logs")
    print(f"drafter smoke (vLLM CPU) took {report.seconds:.0f}s: {steps}")
