"""The smoke run under Prefect (flows/smoke.py, tasks/smoke.py) on a local Prefect server: the
`drafter-smoke` flow passes with the reference engine and leaves its `smoke` artifact; the lifecycle
with `run_smoke_first` stops on a capture planted one layer off before any stage or the target runs."""
from __future__ import annotations

import asyncio

import pytest
from prefect.client.orchestration import get_client
from prefect.testing.utilities import prefect_test_harness

from drafter.config import load_config
from tests.fixtures.bench import no_servers_left
from tests.fixtures.net import free_port
from tests.fixtures.smoke import smoke_profile, smoke_target  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

REFERENCE = {"engine": "reference", "device": "cpu", "extra_args": ["--cpu-threads", "1"]}


@pytest.fixture(scope="module", autouse=True)
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect")
    mp = pytest.MonkeyPatch()
    mp.setenv("PREFECT_HOME", str(home))
    mp.setenv("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(home / "results"))
    with prefect_test_harness(server_startup_timeout=600):  # generous: returns once /health answers
        yield
    mp.undo()


def _artifact(key: str) -> str:
    async def latest():
        async with get_client() as client:
            from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

            found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
            return found[-1].data

    return asyncio.run(latest())


def test_the_smoke_flow_passes_and_publishes_its_artifact(smoke_target, tmp_path):
    from flows.smoke import drafter_smoke

    cfg = load_config(smoke_profile(tmp_path, smoke_target, {**REFERENCE, "port": free_port()}))
    state = drafter_smoke(config=cfg, return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    assert [s["step"] for s in report["steps"]][-1] == "serve" and report["engine"] == "reference"
    md = _artifact("smoke")
    assert md.startswith("# Smoke run\n\n**smoke passed in ") and "| capture | aux states are the outputs" in md
    no_servers_left(tmp_path / "logs")


def test_run_smoke_first_stops_the_lifecycle_on_a_broken_contract(smoke_target, tmp_path, monkeypatch):
    import drafter.capture.hf as hf
    from flows.lifecycle import drafter_lifecycle

    captured = hf.aux_from_hidden_states
    monkeypatch.setattr(hf, "aux_from_hidden_states", lambda states, ids: captured(states, [i + 1 for i in ids]))
    cfg = load_config(smoke_profile(tmp_path, smoke_target, {**REFERENCE, "port": free_port()}))
    state = drafter_lifecycle(config=cfg, run_smoke_first=True, return_state=True)
    assert state.is_failed()
    assert state.message.startswith("smoke run failed, no stage was run: error (SmokeFailed): smoke failed at "
                                     "capture: layer ids contract broken: "), state.message
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["smoke"]  # no stage of its own ran
