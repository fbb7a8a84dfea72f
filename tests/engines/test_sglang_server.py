"""SGLang as a real engine: SGLang 0.5.23 from the lite CPU venv (`.venv-sglang`, `make sglang-env`),
started through the one server session (preflight, readiness gate, stall watchdog, process-group
teardown) on the crafted layered target of tests/fixtures/layered.py, WITHOUT speculation: on this
CPU (no AMX) SGLang has no attention backend for EAGLE, and the EAGLE-3 launch is shown to fail
as a configuration error, not a crash.

One module-scoped server covers the gate and its phases, the settings read back, datagen (and the
dump) through its OpenAI API, and then a scheduler killed while serving (which ends it). The stall, the
start-up crash and the EAGLE-3 launch are each one cut-short launch (SIGSTOP of the group at its
first weight-loading line / SIGKILL of `sglang::scheduler` as soon as it exists / SGLang's own
ValueError once target and draft are loaded).

Cost here (2 cores, shared): the module ~3.5 min in all (3 min 37 s measured, load average 1-2 from
other work): the served launch ~50 s with the session-scoped tiny target (~10 s), datagen + dump
~15 s, the serving crash ~6 s, the stall ~45 s, the start-up crash ~35 s, the EAGLE-3 launch ~55 s.
Every launch includes ~12 s of the serve preflight asking SGLang's own interpreter how it resolves
the argv (drafter.engines.sglang_rules). Each SGLang process takes ~1.3 GB of RAM; the KV cache is
kept at 4096 tokens (`--max-total-tokens`; SGLang otherwise sizes it from free RAM).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from drafter.config import parse_config
from drafter.errors import is_retryable
from drafter.engines import (SGLANG_PHASES, SGLangEngine, check_speculative_settings,
                                     sglang_settings_from_info)
from drafter.server_errors import ServerConfigError, ServerCrashed, ServerStalled
from drafter.serving.ownership import group_members
from drafter.serving.session import ServerSession, serve_until_interrupted
from tests.fixtures.layered import AUX, export_pair, layered_pair  # noqa: F401  (fixture)
from tests.fixtures.net import free_port
from tests.fixtures.sglang_env import SGLANG_VERSION, sglang_env, sglang_py  # noqa: F401  (fixture)
from tests.fixtures.stall import stop_group_after_launch

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # the dump's in-process capture

SERVED = "layered"
# On a CPU: the device, and a small KV cache (else sized from free RAM: 14 GB, half a minute).
SGLANG_CPU_ARGS = ["--device", "cpu", "--max-total-tokens", "4096"]


def _cfg(target: Path, python: str, tmp: Path, **serve):
    section = {"engine": "sglang", "python": python, "port": free_port(), "disable_cuda_graph": True,
               "env": sglang_env(cpu_engine=True), "extra_args": list(SGLANG_CPU_ARGS),
               "startup_timeout_s": 600, "stall_timeout_s": 300, "log_dir": str(tmp / "logs")}
    section.update(serve)
    return parse_config({"target": {"path": str(target), "name": SERVED, "dtype": "float32"},
                         "dump": {"aux_layer_ids": AUX}, "train": {"draft_vocab_size": 256}, "serve": section})


def _title(pid: int) -> str:
    """The process title (SGLang names its children with setproctitle: `sglang::scheduler`)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _titles(pgid: int) -> dict[int, str]:
    return {pid: _title(pid) for pid in group_members(pgid)}


def _wait_for(predicate, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def server(layered_pair, sglang_py, tmp_path_factory):
    """One real SGLang server (no speculation) for the module; its group's processes as seen once ready."""
    target, _ = layered_pair
    cfg = _cfg(target, sglang_py, tmp_path_factory.mktemp("sglang-server"))
    session = ServerSession(cfg, target_only=True, strict_settings=True)
    with session as served:
        # the gate passes on HTTP; SGLang logs its ready line right after its own warm-up request
        assert _wait_for(lambda: served.process.ready_line_seen), served.process.log_tail(20)
        yield cfg, session, served, _titles(served.process.pgid)
    assert session.teardown is not None and session.teardown.ok, session.teardown
    assert group_members(served.process.pgid) == []


def test_gate_passes_on_a_real_generation_with_phases_from_real_log_lines(server):
    cfg, session, served, titles = server
    assert served.engine == "sglang" and served.sample is not None  # the gate's 1-token /generate answered
    # no cuda-graph phase on a CPU; each phase entered by SGLang's own line
    assert [p["phase"] for p in session.phases] == ["launch", "load_weights", "kv_cache", "http_server", "ready"]
    log = served.process.log_text()
    for line in ("Load weight begin.", "Load weight end.", "KV Cache is allocated.", "Memory pool end.",
                 f"Uvicorn running on http://127.0.0.1:{cfg.serve.port}", "The server is fired up and ready to roll!"):
        assert line in log, line
    assert {"sglang::scheduler", "sglang::detokenizer"} <= set(titles.values()), titles
    assert served.process.pgid in titles  # the launcher leads the group teardown kills
    resp = httpx.get(served.base_url + "/v1/models", timeout=60, trust_env=False).json()
    assert [m["id"] for m in resp["data"]] == [SERVED]


def test_settings_read_back_from_get_server_info(server, layered_pair):
    cfg, session, served, _ = server
    s = served.settings
    assert served.settings_mismatch == []
    assert (s["algorithm"], s["served_model_name"], s["tp_size"], s["version"]) == (None, SERVED, 1, SGLANG_VERSION)
    assert s["model_path"] == str(layered_pair[0]) and s["disable_cuda_graph"] is True
    with httpx.Client(base_url=served.base_url, timeout=60, trust_env=False) as client:
        info = client.get("/get_server_info").json()
        assert SGLangEngine().read_settings(client) == sglang_settings_from_info(info) == s
    # the CPU reasons of the EAGLE-3 test below, as SGLang reports them
    assert info["speculative_algorithm"] is None and info["attention_backend"] == "torch_native"
    assert info["device"] == "cpu" and info["max_total_num_tokens"] == 4096
    # a server that runs without speculation is recognised as such when speculation was asked for
    from drafter.config import SpeculativeConfig

    asked = SpeculativeConfig(num_steps=3, eagle_topk=1, num_draft_tokens=4)
    problems = check_speculative_settings(asked, s)
    assert problems[0] == "algorithm: EAGLE3 was requested but speculation is off on the server"
    assert "num_steps: requested 3, the server did not report it" in problems  # null when speculation is off


def test_datagen_keeps_sglangs_own_token_ids_and_they_reach_the_dump(server, layered_pair, tmp_path):
    """datagen against the running server asks `return_token_ids`; SGLang 0.5.23 answers
    `choices[0].response_token_ids` (stop token included). The crafted target walks its successor map,
    so the ids are known; their text does not re-tokenize to them (byte tokens decode to U+FFFD), so
    ids equal to the walk in the dump can only have come from the server."""
    from transformers import AutoTokenizer

    from drafter.config import DumpConfig, StorageConfig, TargetConfig
    from drafter.formats import iter_dump_samples, iter_generations
    from drafter.stages import TABLE
    from drafter.store import open_store
    from tests.fixtures.datagen_fakes import make_cfg, prepared, run_datagen, sharegpt
    from tests.fixtures.speculative import EOS, succ_map

    target, _ = layered_pair
    _, _, served, _ = server
    cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"), [sharegpt(0), sharegpt(1)],
                   max_tokens=256, request_timeout_s=300, concurrency_per_server=1, shard_size=8)
    cfg = cfg.model_copy(update={"target": TargetConfig(path=str(target), name=SERVED, dtype="float32")})
    store = open_store(cfg.storage)
    result = run_datagen(cfg, store, prepared(cfg, store), [served.base_url])
    records = list(iter_generations(store, result.manifest))
    assert [r["id"] for r in records] == ["c000", "c001"] and all(r["finish_reasons"] == ["stop"] for r in records)
    assert all(r["gen"]["model"] == SERVED for r in records)
    assert result.manifest.shard("gen-00000.jsonl").meta["servers"] == {served.base_url: 2}

    tok = AutoTokenizer.from_pretrained(target)
    answers = {}
    for r in records:
        user = [m for m in r["messages"] if m["role"] == "user"]
        prompt = tok(tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False).input_ids
        step, walk = succ_map(len(tok)), [prompt[-1]]
        while walk[-1] != EOS:
            walk.append(step[walk[-1]])
        (answer,) = [m for m in r["messages"] if m["role"] == "assistant"]
        assert answer["token_ids"] == walk[1:] and answer["token_ids"][-1] == EOS  # the server's ids
        assert r["usage"]["completion_tokens"] == len(answer["token_ids"])          # stop token counted
        assert answer["content"] == tok.decode(answer["token_ids"], skip_special_tokens=True)
        assert tok(answer["content"], add_special_tokens=False).input_ids != answer["token_ids"][:-1]
        answers[r["id"]] = answer["token_ids"]
    meta = result.manifest.meta
    assert (meta["token_ids"]["turns_with_ids"], meta["token_ids"]["turns_without_ids"]) == (2, 0)
    assert meta["retokenize_agreement"] < 0.95
    assert any(line.startswith("WARNING: re-tokenizing the answers' text reproduces only") for line in result.summary)

    dump_cfg = cfg.model_copy(update={
        "dump": DumpConfig(upstream="datagen", aux_layer_ids=AUX, devices=["cpu"], max_length=512),
        "train": cfg.train.model_copy(update={"draft_vocab_size": 256})})
    dumped = TABLE.run("dump", dump_cfg, store, upstream={"datagen": result.manifest.fingerprint})
    assert dumped.manifest.meta["samples_from_token_ids"] == 2
    samples = list(iter_dump_samples(store, dumped.manifest, expect_aux_layer_ids=AUX))
    assert sorted(s["id"] for s in samples) == ["c000", "c001"]
    for sample in samples:
        learned = [t for t, m in zip(sample["input_ids"].tolist(), sample["loss_mask"].tolist()) if m]
        assert learned == answers[sample["id"]]


def test_a_scheduler_killed_while_serving_is_seen_by_the_session(server):
    """The last test of the module's server: it ends it (before the launches below, which then
    have the machine to themselves). SGLang's launcher logs
    "Subprocess scheduler_0 (pid=N) crashed with exit code -9"; the session raises ServerCrashed."""
    cfg, session, served, titles = server
    (scheduler,) = [pid for pid, title in titles.items() if title == "sglang::scheduler"]
    os.kill(scheduler, signal.SIGKILL)
    with pytest.raises(ServerCrashed) as err:
        serve_until_interrupted(served, poll_s=0.2)
    assert err.value.phase == "serving" and is_retryable(err.value)
    assert f"Subprocess scheduler_0 (pid={scheduler}) crashed with exit code -9" in served.process.fatal_line
    session.__exit__(type(err.value), err.value, None)  # what `with` does on the error: the teardown
    assert session.teardown is not None and session.teardown.ok, session.teardown.problems
    assert group_members(served.process.pgid) == []


def test_a_stalled_real_sglang_is_detected_and_torn_down(layered_pair, sglang_py, tmp_path):
    """SIGSTOP of the whole process group on its first weight-loading line: no more progress."""
    target, _ = layered_pair
    # the launch phase (imports, tokenizer, the scheduler's start) keeps a generous budget; every
    # later phase gets the short stall timeout
    cfg = _cfg(target, sglang_py, tmp_path, stall_timeout_s=10)
    stopped: list[int] = []
    on_line = stop_group_after_launch(lambda: session, stopped)
    session = ServerSession(cfg, on_line=on_line, phase_budgets={"launch": 300}, grace_s=2.0,
                            check_teardown=False)
    with pytest.raises(ServerStalled) as err:
        with session:
            pass
    assert stopped and err.value.status == "stalled" and is_retryable(err.value)
    assert err.value.phase in {p.name for p in SGLANG_PHASES} - {"launch", "ready"} and err.value.budget_s == 10
    assert "Load weight begin." in session.process.log_text()
    assert session.teardown is not None and session.teardown.ok, session.teardown.problems
    assert "SIGKILL" in session.teardown.signals  # a stopped process ignores SIGTERM
    assert group_members(stopped[0]) == []


def test_a_scheduler_killed_during_start_up_is_a_crash_and_torn_down(layered_pair, sglang_py, tmp_path):
    """SIGKILL of `sglang::scheduler` as soon as it shows among the group's processes."""
    target, _ = layered_pair
    cfg = _cfg(target, sglang_py, tmp_path)
    killed = []

    def on_line(line: str) -> None:
        proc = session.process
        if killed or proc is None or proc.pgid is None:
            return
        for pid, title in _titles(proc.pgid).items():
            if title == "sglang::scheduler":
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return

    session = ServerSession(cfg, on_line=on_line, grace_s=5.0, check_teardown=False)
    with pytest.raises(ServerCrashed) as err:
        with session:
            pass
    assert killed, "no sglang::scheduler process was seen"
    assert type(err.value) is ServerCrashed and is_retryable(err.value)
    # SGLang's launcher notices: "RuntimeError: Rank 0 scheduler died during initialization (exit code: -9)"
    assert any("scheduler died during initialization (exit code: -9)" in line for line in err.value.log_tail)
    assert session.teardown is not None and session.teardown.ok, session.teardown.problems
    assert group_members(session.process.pgid) == []


def test_eagle3_on_this_cpu_is_a_config_error_naming_the_missing_attention_backend(layered_pair, sglang_py,
                                                                                   tmp_path):
    """Our SGLang export is loaded by the real server (LlamaForCausalLMEagle3), then SGLang stops:
    `ValueError: EAGLE is not supported in decode attention backend torch_native`. No retry can fix it."""
    target, draft = layered_pair
    sglang_dir, _ = export_pair(target, draft, tmp_path / "export")
    cfg = _cfg(target, sglang_py, tmp_path, speculative={"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4})
    session = ServerSession(cfg, draft_path=str(sglang_dir), grace_s=5.0, check_teardown=False)
    with pytest.raises(ServerConfigError) as err:
        with session:
            pass
    e = err.value
    assert e.status == "config_error" and not is_retryable(e) and e.phase != "preflight"
    assert "attention backend torch_native has no EAGLE support" in e.message and "intel_amx" in e.message
    assert "ValueError: EAGLE is not supported in decode attention backend torch_native" in e.log_tail
    log = session.process.log_text()
    assert "type=LlamaForCausalLMEagle3" in log  # the draft loaded before the backend check
    assert "The current platform does not support Intel AMX, will fallback to torch_native backend." in log
    assert session.layer_ids.get("checked") and session.layer_ids["engine_version"] == SGLANG_VERSION
    assert session.teardown is not None and session.teardown.ok, session.teardown.problems
    assert group_members(session.process.pgid) == []
