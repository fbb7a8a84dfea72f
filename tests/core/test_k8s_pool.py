"""The Kubernetes work-pool base job template (infra/k8s/base-job-template.json), no cluster needed.

Render: a fan-out child's `job_variables` go through `KubernetesWorkerJobConfiguration
.resolve_for_flow_run`, the call prefect-kubernetes' worker makes for each flow run it submits
(`from_template_and_values` on the pool's template, then `prepare_for_flow_run`); the manifest it
builds is what the worker hands to `create_namespaced_job`.

Real server: infra/prefect-up.sh in a temporary PREFECT_HOME (no worker), `prefect work-pool create --type
kubernetes --base-job-template infra/k8s/base-job-template.json` (the README's command), the pool
read back; then a deployment on the pool and a child flow run with its job variables, which the
server validates against the pool's variables schema, rendered through the real client.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from pathlib import Path

import pytest
from prefect.client.schemas.objects import Flow, FlowRun, WorkPool
from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration  # the test extra

from tests.fixtures.local_prefect import local_prefect

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_PATH = "infra/k8s/base-job-template.json"
PREFECT = ROOT / ".venv" / "bin" / "prefect"
POOL = "drafter-gpu-test"
H200 = {"nvidia.com/gpu.product": "NVIDIA-H200"}
CHILD = {"gpus": 8, "node_selector": H200, "shm_size": "128Gi"}

pytestmark = pytest.mark.e2e


def load_template() -> dict:
    return json.loads((ROOT / TEMPLATE_PATH).read_text())


class _NoServer:
    """The two reads `resolve_for_flow_run` makes, answered without a server (a flow run of no
    deployment, as a child created by `run_deployment` reads its deployment: see the server test)."""

    async def read_flow(self, flow_id):
        return Flow(id=flow_id, name="datagen-range")

    async def read_deployment(self, deployment_id):
        raise AssertionError("no deployment here")


def render(job_variables: dict) -> tuple[dict, FlowRun]:
    """The job manifest the worker would create for a flow run carrying `job_variables`."""
    template = load_template()
    flow_run = FlowRun(id=uuid.uuid4(), name="child-range-0", flow_id=uuid.uuid4(),
                       job_variables=job_variables)
    pool = WorkPool(name=POOL, type="kubernetes", base_job_template=template)
    config = asyncio.run(KubernetesWorkerJobConfiguration.resolve_for_flow_run(
        flow_run, client=_NoServer(), work_pool=pool, worker_name="test-worker"))
    return config.job_manifest, flow_run


def pod_spec(manifest: dict) -> dict:
    return manifest["spec"]["template"]["spec"]


def assert_gpu_pod(manifest: dict, gpus: int, shm: str) -> None:
    spec = pod_spec(manifest)
    (container,) = spec["containers"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}} in spec["volumes"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    # Every placeholder was filled (a `{{ var }}` the values lack is dropped, never left in).
    assert "{{" not in json.dumps(manifest)


def test_child_job_variables_render_into_the_job():
    manifest, flow_run = render(CHILD)
    assert_gpu_pod(manifest, gpus=8, shm="128Gi")
    assert pod_spec(manifest)["nodeSelector"] == H200
    (container,) = pod_spec(manifest)["containers"]
    assert container["image"] == "drafter-lifecycle:latest"
    assert container["args"] == ["prefect", "flow-run", "execute"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PREFECT__FLOW_RUN_ID"] == str(flow_run.id)
    assert manifest["metadata"]["generateName"] == "child-range-0-"
    assert manifest["metadata"]["labels"]["prefect.io/work-pool-name"] == POOL


def test_defaults_render_one_gpu_64gi_shm_and_an_empty_node_selector():
    manifest, _ = render({})
    assert_gpu_pod(manifest, gpus=1, shm="64Gi")
    # The variable's default is {}: `{{ node_selector }}` renders to an empty map (only a
    # placeholder with no value at all drops its key). Kubernetes reads `nodeSelector: {}` as no
    # constraint, the same as an absent one.
    assert pod_spec(manifest)["nodeSelector"] == {}
    # Variables defaulting to null drop their keys instead.
    assert "serviceAccountName" not in pod_spec(manifest)
    assert "ttlSecondsAfterFinished" not in manifest["spec"]


# --- a real Prefect server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The suite's one way to a real Prefect server (tests/fixtures/local_prefect.py: infra/prefect-up.sh
    in a temporary PREFECT_HOME, infra/prefect-down.sh after, checked), without a worker: nothing
    here runs a flow. Its start waits as long as the server makes progress, never a short fixed
    deadline (a fixed 45 s here missed by 0.16 s on a loaded machine)."""
    with local_prefect(tmp_path_factory.mktemp("prefect-k8s") / "home", DRAFTER_WORKERS="0") as env:
        yield {"env": env, "api_url": env["PREFECT_API_URL"]}


def prefect_cli(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(PREFECT), *args], env=server["env"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def pool(server):
    created = prefect_cli(server, "work-pool", "create", POOL, "--type", "kubernetes",
                          "--base-job-template", TEMPLATE_PATH)
    assert created.returncode == 0, created.stdout + created.stderr
    return created


@pytest.mark.slow
def test_work_pool_create_accepts_the_template(server, pool):
    inspected = prefect_cli(server, "work-pool", "inspect", POOL, "--output", "json")
    assert inspected.returncode == 0, inspected.stdout + inspected.stderr
    stored = json.loads(inspected.stdout)
    assert stored["type"] == "kubernetes"
    template = stored["base_job_template"]
    assert template == load_template()  # stored as given, nothing dropped or rewritten
    props = template["variables"]["properties"]
    assert props["gpus"]["type"] == "integer" and props["gpus"]["default"] == 1
    assert props["shm_size"]["default"] == "64Gi"
    assert props["node_selector"]["type"] == "object"
    assert props["node_selector"]["additionalProperties"] == {"type": "string"}
    assert props["node_selector"]["default"] == {}
    spec = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == "{{ node_selector }}"
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert spec["volumes"][0]["emptyDir"]["sizeLimit"] == "{{ shm_size }}"


async def _child_manifest(api_url: str, child_vars: dict) -> tuple[dict, str]:
    """A deployment on the pool and a child flow run of it with `child_vars` (as `run_deployment`
    creates one), rendered the worker's way through the real client."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        async with get_client() as client:
            flow_id = await client.create_flow_from_name("datagen-range")
            deployment_id = await client.create_deployment(
                flow_id=flow_id, name=f"range-{uuid.uuid4().hex[:8]}", work_pool_name=POOL,
                entrypoint="flows/datagen.py:datagen_range", job_variables={"image": "drafter-lifecycle:test"})
            flow_run = await client.create_flow_run_from_deployment(deployment_id, job_variables=child_vars)
            work_pool = await client.read_work_pool(POOL)
            config = await KubernetesWorkerJobConfiguration.resolve_for_flow_run(
                flow_run, client=client, work_pool=work_pool, worker_name="test-worker")
            return config.job_manifest, str(flow_run.id)


@pytest.mark.slow
def test_child_flow_run_on_the_pool_renders_its_job(server, pool):
    manifest, flow_run_id = asyncio.run(_child_manifest(server["api_url"], CHILD))
    assert_gpu_pod(manifest, gpus=8, shm="128Gi")
    assert pod_spec(manifest)["nodeSelector"] == H200
    (container,) = pod_spec(manifest)["containers"]
    assert container["image"] == "drafter-lifecycle:test"  # the deployment's variable, kept
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PREFECT__FLOW_RUN_ID"] == flow_run_id
    assert env["PREFECT_API_URL"] == server["api_url"]
    assert manifest["metadata"]["labels"]["prefect.io/deployment-name"].startswith("range-")


@pytest.mark.slow
@pytest.mark.parametrize("child_vars, reason", [
    ({"node_selector": {"nvidia.com/gpu.count": 8}}, r"node_selector.*8 is not of type"),
    ({"gpus": "eight"}, r"gpus.*'eight' is not valid"),
])
def test_server_rejects_child_job_variables_outside_the_schema(server, pool, child_vars, reason):
    from prefect.exceptions import PrefectHTTPStatusError

    with pytest.raises(PrefectHTTPStatusError, match=f"422.*{reason}"):
        asyncio.run(_child_manifest(server["api_url"], child_vars))
