"""The bench stage on real vLLM (CPU build): the export stage's vLLM files served by vLLM in a small
sweep (baseline and 3/1/4, two interleaved rounds), and vLLM's own accept length (its spec-decode
counters) agreeing with the offline judge within export.judge_agreement_tolerance. Two vLLM launches
(~40-60 s each here)."""
from __future__ import annotations

import json

import pytest

from drafter.config import parse_config
from drafter.stage_output import StageOutput
from drafter.stages import TABLE
from drafter.store import FileStore
from tests.fixtures.export_upstreams import commit_upstreams
from tests.fixtures.layered import AUX, layered_pair  # noqa: F401  (fixture)
from tests.fixtures.net import free_port
from tests.fixtures.vllm_env import vllm_py, vllm_serve_section  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_bench_on_vllm_measures_the_accept_length_the_judge_predicted(layered_pair, tiny_conversations, vllm_py,
                                                                     tmp_path):
    target, draft = layered_pair
    store = FileStore(tmp_path / "store")
    upstream = commit_upstreams(store, tmp_path, target, draft, tiny_conversations[200:], aux=AUX)
    s314 = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
    cfg = parse_config({
        "target": {"path": str(target), "dtype": "float32"}, "dump": {"aux_layer_ids": AUX},
        "train": {"draft_vocab_size": 256},
        "export": {"eval_prompts": 4, "judge_max_new_tokens": 40, "judge_num_steps": 3, "device": "cpu",
                   "judge_bucket_edges": [8, 16, 32]},
        "serve": vllm_serve_section(vllm_py, free_port(), tmp_path / "logs", speculative=s314),
        # both servers alive at once (CPU: nothing to share), so two launches for the whole sweep
        "bench": {"speculative": [s314], "batch_sizes": [1], "num_prompts": 4, "max_tokens": 40, "repeats": 2,
                  "warmup_requests": 1, "interleave": "concurrent", "drift_tolerance": 0.9},
        "storage": {"root": f"file://{tmp_path}/store"}})
    exported = TABLE.run("export", cfg, store, upstream=upstream)
    judged = exported.meta["judge"]["accept_length"]
    bench = TABLE.run("bench", cfg, store, upstream={"prepare": upstream["prepare"], "export": exported.fingerprint})
    assert bench.status == "done"
    assert bench.meta["launches"] == 2 and not bench.meta["failed"]
    report = json.loads(StageOutput.committed(store, "bench", bench.fingerprint).read_shard("report.json"))
    row = next(r for r in report["summary"]["rows"] if r["key"] == "eagle3-s3-k1-d4")
    assert row["rounds"] == 2
    served = row["accept_length"]["mean"]  # from vLLM's spec-decode counters, not from our judge
    assert served == pytest.approx(judged, abs=cfg.export.judge_agreement_tolerance), (served, judged)
    launches = [json.loads(StageOutput.committed(store, "bench", bench.fingerprint).read_shard(s.name))
                for s in StageOutput.committed(store, "bench", bench.fingerprint).manifest.shards
                if s.name.startswith("launches/")]
    assert {launch.get("engine_version") for launch in launches} == {"0.32.0"}
