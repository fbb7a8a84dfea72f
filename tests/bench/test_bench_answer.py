"""The bench's answer in front of the user (drafter.bench.answer) and each engine's configuration for a
setting per batch size (Engine.per_batch_size): pure functions on synthetic sweeps."""
from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from drafter.bench.answer import COLUMNS, answer, best_per_batch, deploy, deploy_section, ordered, setting_lines
from drafter.bench.plan import BASELINE, plan_sweep
from drafter.bench.report import table_rows
from drafter.bench.stats import summarize
from drafter.config import SpeculativeConfig, parse_config
from drafter.engines import BatchSetting, make_engine

S314 = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
S112 = {"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 2}
SERVERS = [(BASELINE, "baseline (no speculation)"), ("eagle3-s3-k1-d4", "EAGLE3 3/1/4"),
           ("eagle3-s1-k1-d2", "EAGLE3 1/1/2")]
PLAN = {"engine": "vllm", "servers": [
    {"key": BASELINE, "config": "baseline (no speculation)", "speculative": None},
    {"key": "eagle3-s3-k1-d4", "config": "EAGLE3 3/1/4", "speculative": S314},
    {"key": "eagle3-s1-k1-d2", "config": "EAGLE3 1/1/2", "speculative": S112}]}


def _m(key, bs, r, tps, accept=None, cycle=None, step=0.01):
    return {"key": key, "batch_size": bs, "round": r, "output_tok_s": tps, "latency_s": 1.0, "ttft_s": 0.1,
            "itl_s": 0.01, "accept_length": accept, "draft_acceptance": None, "step_time_s": step,
            "cycle_time_s": cycle}


def sweep(speeds: dict[int, dict[str, float]], rounds: int = 4, drift: float = 0.0) -> dict:
    """A summary where, at each batch size, each setting runs at `speeds[bs][key]` x the baseline
    (with a little paired noise); `drift`: the machine slows by this fraction per round."""
    noise = [1.01, 0.99, 1.02, 0.98, 1.0, 1.0]
    ms = []
    for bs, by_key in speeds.items():
        for r in range(rounds):
            base = 100.0 * (1 - drift * r)
            ms.append(_m(BASELINE, bs, r, base))
            for key, ratio in by_key.items():
                ms.append(_m(key, bs, r, base * ratio * noise[r], accept=2.31, cycle=0.0155))
    return json.loads(json.dumps(summarize(ms, SERVERS, sorted(speeds), confidence=0.95)))  # as report.json has it


def test_table_columns_read_speedup_verdict_and_accept_vs_break_even_first():
    """report.json is written with sorted keys: read back, the table came out `ITL ms`, `TTFT s`,
    `accept length`, ... (Prefect's UI takes the first row's key order). `ordered` restores ours."""
    rows = table_rows(sweep({1: {"eagle3-s3-k1-d4": 1.5}}), {})
    stored = json.loads(json.dumps(rows, sort_keys=True))
    assert list(stored[0])[:2] == ["ITL ms", "TTFT s"]  # what the UI showed
    for row in ordered(stored):
        assert list(row)[:6] == ["config", "batch", "speedup [CI]", "verdict", "accept length", "break-even accept"]
        assert list(row) == [c for c in COLUMNS if c in row]
    assert ordered([{"new": 1, "verdict": "x", "config": "c"}]) == [{"config": "c", "verdict": "x", "new": 1}]


def test_each_setting_line_has_its_speedup_verdict_and_accept_length_vs_break_even():
    s = sweep({1: {"eagle3-s3-k1-d4": 1.5, "eagle3-s1-k1-d2": 0.7}})
    lines = setting_lines(s, PLAN, {})
    assert lines[0] == "baseline (no speculation) @ batch 1: 100.0 tok/s (the reference)"
    assert lines[1].startswith("EAGLE3 3/1/4 @ batch 1: 1.50x [")
    assert "] faster, accept length 2.31 vs break-even 1.55 (150" in lines[1]
    assert "] slower, accept length 2.31 vs break-even 1.55" in lines[2]
    assert len(lines) == 3


def test_the_answer_says_faster_or_not_by_how_much_with_the_interval_on_which_engine():
    faster = answer(sweep({1: {"eagle3-s3-k1-d4": 1.5, "eagle3-s1-k1-d2": 1.2}}), PLAN, 0.95)
    assert faster.startswith("faster on engine vllm at batch 1: EAGLE3 3/1/4 at 1.50x [")
    assert faster.endswith("] (speedup over no speculation, 95% interval)")
    slower = answer(sweep({1: {"eagle3-s3-k1-d4": 0.72, "eagle3-s1-k1-d2": 0.8}}), PLAN)
    assert slower.startswith("not faster on engine vllm at batch 1: the best setting, EAGLE3 1/1/2, at 0.80x [")
    assert "], slower (speedup over no speculation)" in slower
    drifting = answer(sweep({1: {"eagle3-s3-k1-d4": 1.5}}, drift=0.1), PLAN)
    assert drifting.startswith("undecided on engine vllm at batch 1: the best setting, EAGLE3 3/1/4, at 1.")
    assert "the baseline moved -" in drifting and "re-run" in drifting and drifting.count("undecided") == 1
    choices = best_per_batch(sweep({1: {"eagle3-s3-k1-d4": 1.5}}, drift=0.1), PLAN)
    assert choices[0]["key"] is None and choices[0]["undecided"]
    assert deploy_section(choices, "vllm", {"one_server": ()})[2].startswith(
        "- batch 1: no speculation (undecided: the baseline moved -")
    several = answer(sweep({1: {"eagle3-s3-k1-d4": 1.5}, 8: {"eagle3-s3-k1-d4": 0.9}}), PLAN)
    assert several.startswith("on engine vllm (speedup over no speculation): batch 1 faster: EAGLE3 3/1/4 at 1.50x [")
    assert "; batch 8 not faster: the best setting, EAGLE3 3/1/4, at 0.90x [" in several


def test_a_forced_acceptance_server_is_never_the_answer():
    plan = {**PLAN, "servers": PLAN["servers"][:2] + [
        {"key": "eagle3-s1-k1-d2", "config": "EAGLE3 1/1/2 forced accept 2", "speculative": S112,
         "forced_accept_length": 2.0}]}
    s = sweep({1: {"eagle3-s3-k1-d4": 1.2, "eagle3-s1-k1-d2": 1.8}})
    (choice,) = best_per_batch(s, plan)
    assert choice["key"] == "eagle3-s3-k1-d4" and choice["speedup"]["speedup"] == pytest.approx(1.2, rel=0.02)
    assert [line.split(" @")[0] for line in setting_lines(s, plan)] == ["baseline (no speculation)", "EAGLE3 3/1/4"]


def _cfg(engine: str, batch_sizes=(1, 4, 16)):
    serve = {"engine": engine, "port": 31000}
    if engine == "command":
        serve.update(command=["srv", "--port", "{port}"], health_url="http://127.0.0.1:31000/health")
    return parse_config({"target": {"path": "/nonexistent/tiny", "num_hidden_layers": 8, "vocab_size": 64000},
                         "serve": serve, "bench": {"speculative": [S314, S112], "batch_sizes": list(batch_sizes)}})


def test_the_report_ends_with_the_best_setting_per_batch_size_as_vllm_configures_it():
    s = sweep({1: {"eagle3-s3-k1-d4": 1.5, "eagle3-s1-k1-d2": 1.2}, 4: {"eagle3-s3-k1-d4": 1.05,
               "eagle3-s1-k1-d2": 1.3}, 16: {"eagle3-s3-k1-d4": 0.8, "eagle3-s1-k1-d2": 0.95}})
    plan = plan_sweep(_cfg("vllm"), {"": "/d/vllm"})
    d = deploy(s, plan)
    assert [(c["batch_size"], c["config"]) for c in d["choices"]] == [(1, "EAGLE3 3/1/4"), (4, "EAGLE3 1/1/2"),
                                                                      (16, None)]
    flag, conf = d["config"]["one_server"]
    assert flag == "--speculative-config" and d["config"]["per_batch"] == {}
    assert json.loads(conf) == {"method": "eagle3", "model": "/d/vllm", "num_speculative_tokens": 3,
                                "num_speculative_tokens_per_batch_size": [[1, 3, 3], [4, 15, 1], [16, 16, 0]]}
    md = "\n".join(deploy_section(d["choices"], "vllm", d["config"]))
    assert md.startswith("## Deployable settings per batch size\n\n- batch 1: EAGLE3 3/1/4, 1.50x [")
    assert "- batch 16: no speculation (nothing is significantly faster)" in md
    assert f"\n```\n--speculative-config '{conf}'\n```\n" in md and "num_speculative_tokens_per_batch_size" in md


def test_engines_with_one_setting_per_server_get_launch_arguments_per_batch_size():
    s314, s112 = SpeculativeConfig(**S314), SpeculativeConfig(**S112)
    chosen = [BatchSetting(1, s314, "/d/sglang"), BatchSetting(4, s112, "/d/sglang"), BatchSetting(16)]
    for engine in ("sglang", "reference", "command"):
        conf = make_engine(engine).per_batch_size(chosen)
        assert conf.one_server is None and conf.note
        assert conf.per_batch == {
            1: ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d/sglang",
                "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"),
            4: ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d/sglang",
                "--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"),
            16: ()}
    md = "\n".join(deploy_section([{"batch_size": 16, "key": None, "why": "nothing is significantly faster"}],
                                  "sglang", make_engine("sglang").per_batch_size(chosen).to_dict()))
    assert "- batch 1: `--speculative-algorithm EAGLE3 --speculative-draft-model-path /d/sglang" in md
    assert "- batch 16: no speculative arguments (no speculation)" in md


def test_vllm_without_one_schedule_falls_back_to_a_server_per_batch_size():
    s314 = SpeculativeConfig(**S314)
    vllm = make_engine("vllm")
    nothing = vllm.per_batch_size([BatchSetting(1), BatchSetting(8)])
    assert nothing.one_server == () and "without --speculative-config" in nothing.note
    two = vllm.per_batch_size([BatchSetting(1, s314, "/a"), BatchSetting(8, s314, "/b")])
    assert two.one_server is None and "different drafters" in two.note
    assert json.loads(two.per_batch[8][1]) == {"method": "eagle3", "model": "/b", "num_speculative_tokens": 3}


@pytest.mark.slow
def test_vllm_reads_our_schedule_as_we_meant_it(tmp_path):
    """vLLM 0.32's own command-line parser and schedule lookup (the scheduler's) on the argument we
    write: the draft-token count at each measured batch size, and between and above them."""
    from tests.fixtures.vllm_env import vllm_python

    s314, s112 = SpeculativeConfig(**S314), SpeculativeConfig(**S112)
    conf = make_engine("vllm").per_batch_size([BatchSetting(1, s314, "/d"), BatchSetting(4, s112, "/d"),
                                               BatchSetting(16)])
    script = f"""
import dataclasses, json
from vllm.config.speculative import SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", "x", *{list(conf.one_server)!r}])
spec = args.speculative_config
assert "num_speculative_tokens_per_batch_size" in {{f.name for f in dataclasses.fields(SpeculativeConfig)}}
lookup = build_dynamic_sd_schedule_lookup(spec["num_speculative_tokens_per_batch_size"], 32,
                                          spec["num_speculative_tokens"])
print(json.dumps({{"k": lookup[1:], "model": spec["model"]}}))
"""
    out = subprocess.run([vllm_python(), "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["model"] == "/d" and got["k"] == [3, 3, 3] + [1] * 12 + [0] * 17, shlex.join(conf.one_server)


def _report(s: dict, plan: dict, deployed: dict | None = None) -> dict:
    """A report.json as the bench stage writes it (sorted keys)."""
    report = {"summary": s, "table": ordered(table_rows(s, {})), "plan": plan, "failures": {}, "deploy": deployed,
              "settings": {"confidence": 0.95}, "head_to_head": []}
    return json.loads(json.dumps(report, sort_keys=True))


def test_the_bench_stage_summary_reads_the_table_in_order_and_answers(tmp_path):
    """A committed report.json (sorted keys, as written): the stage's table in reading order, one line
    per setting with accept length vs break-even, the engine's configuration per batch size, the answer."""
    from drafter.stage_output import StageOutput
    from drafter.stages import bench
    from drafter.store import FileStore

    s = sweep({1: {"eagle3-s3-k1-d4": 1.5, "eagle3-s1-k1-d2": 1.2}, 8: {"eagle3-s3-k1-d4": 0.9,
               "eagle3-s1-k1-d2": 0.95}})
    plan = plan_sweep(_cfg("vllm", (1, 8)), {"": "/d/vllm"})
    out = StageOutput(FileStore(tmp_path), "bench", "0123456789abcdef")
    out.write_shard("report.json", json.dumps(_report(s, plan.to_dict(), deploy(s, plan)), sort_keys=True))
    out.commit({})
    got = bench.summarize(None, out)
    assert [list(row)[:4] for row in got.table] == [["config", "batch", "speedup [CI]", "verdict"]] * 6
    assert got.lines[1].startswith("EAGLE3 3/1/4 @ batch 1: 1.50x [") and "vs break-even 1.55" in got.lines[1]
    conf = json.dumps({"method": "eagle3", "model": "/d/vllm", "num_speculative_tokens": 3,
                       "num_speculative_tokens_per_batch_size": [[1, 7, 3], [8, 8, 0]]}, separators=(",", ":"))
    assert f"deploy: one vllm server for every batch size: --speculative-config '{conf}'" in got.lines
    assert got.headline.startswith("on engine vllm (speedup over no speculation, 95% interval): batch 1 faster: "
                                   "EAGLE3 3/1/4 at 1.50x [")
    assert got.lines[-1] == f"report: {out.store.uri(out.key('report.md'))}"


def test_the_report_answers_first_lists_each_setting_and_ends_with_the_deployable_settings():
    from drafter.bench.answer import with_answer
    from drafter.bench.report import markdown

    s = sweep({1: {"eagle3-s3-k1-d4": 1.5}, 8: {"eagle3-s3-k1-d4": 0.9}})
    plan = plan_sweep(_cfg("sglang", (1, 8)), {"": "/d"})
    deployed = deploy(s, plan)
    rows = ordered(table_rows(s, {}))
    md = markdown(s, rows, plan=plan.to_dict(), failures={}, launches=[], hardware={"cpu_count": 2},
                  settings={"num_prompts": 4, "max_tokens": 8, "ignore_eos": True, "warmup_requests": 1,
                            "confidence": 0.95})
    md = with_answer(md, answer(s, plan.to_dict(), 0.95), setting_lines(s, plan.to_dict()),
                     deploy_section(deployed["choices"], "sglang", deployed["config"]))
    titles = [line for line in md.splitlines() if line.startswith("## ")]
    assert titles[:4] == ["## Answer", "## Recommendation", "## Results", "## Each setting"]
    assert titles[-1] == "## Deployable settings per batch size"
    assert "\n## Answer\n\non engine sglang (speedup over no speculation, 95% interval): batch 1 faster: " in md
    assert "| config | batch | speedup [CI] | verdict | accept length | break-even accept | output tok/s |" in md
    assert "\n- EAGLE3 3/1/4 @ batch 8: 0.90x [" in md and "slower, accept length 2.31 vs break-even 1.55" in md
    assert md.rstrip().splitlines()[-1].startswith("SGLang 0.5.23 takes one speculative setting per server")
    assert ("- batch 1: `--speculative-algorithm EAGLE3 --speculative-draft-model-path /d --speculative-num-steps 3 "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4`") in md
    assert "- batch 8: no speculative arguments (no speculation)" in md
