"""The reference server as a real process on loopback: endpoints, readiness, faults, SIGTERM."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.fixtures.speculative import build_random_target, build_successor_drafter, build_successor_target
from tests.fixtures.net import free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 300.0  # a server start (torch, the model): generous, returned from at the ready line


class ServerProcess:
    """A server subprocess whose log lines and /health answers are recorded with timestamps.

    Watching from background threads lets a test assert what happened during a phase
    (e.g. "every connection during loading was refused") whenever the test itself runs."""

    def __init__(self, model: Path, *extra: str, draft: Path | None = None, steps: int = 3):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "drafter.engines.reference.reference_server", "--model-path", str(model),
                "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "tiny",
                "--device", "cpu", "--cpu-threads", "1", *extra]
        if draft is not None:
            argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
                     "--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1",
                     "--speculative-num-draft-tokens", str(steps + 1)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self.polls: list[tuple[float, float, int | str]] = []  # (start, end, status or "refused")
        self._stop = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._poll, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def _poll(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.is_set() and self.proc.poll() is None:
                start = time.monotonic()
                try:
                    status: int | str = client.get(self.url + "/health").status_code
                except httpx.ConnectError:
                    status = "refused"
                except httpx.HTTPError as err:
                    status = type(err).__name__
                self.polls.append((start, time.monotonic(), status))
                time.sleep(0.2)

    @property
    def log(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def line_time(self, pattern: str) -> float | None:
        return next((t for t, line in self.lines if re.search(pattern, line)), None)

    def wait_line(self, pattern: str, timeout: float = START_TIMEOUT) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (t := self.line_time(pattern)) is not None:
                return t
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the reader drain
                if (t := self.line_time(pattern)) is not None:
                    return t
                raise AssertionError(f"exited {self.proc.returncode} before {pattern!r}:\n{self.log}")
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.log}")

    def wait_ready(self) -> None:
        self.wait_line("The server is fired up and ready to roll!")

    def terminate(self, timeout: float = 15.0) -> int:
        self._stop.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"did not exit within {timeout} s of SIGTERM:\n{self.log}")


@pytest.fixture(scope="module")
def models(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("server_models")
    target = build_successor_target(tiny_target, root / "succ_target")
    return {"succ_target": target, "succ_draft": build_successor_drafter(target, root / "succ_draft"),
            "random_target": build_random_target(tiny_target, root / "random_target")}


@pytest.fixture(scope="module")
def servers(models):
    """All servers of this module start together: on 2 cores parallel start-ups save ~20 s."""
    procs = {
        "main": ServerProcess(models["succ_target"], "--fault", "slow:warmup:2", draft=models["succ_draft"]),
        "slow_refuse": ServerProcess(models["random_target"], "--fault", "slow:load_weights:3",
                                     "--fault", "refuse-generation"),
        "hang": ServerProcess(models["random_target"], "--fault", "hang:kv_cache"),
        "crash_load": ServerProcess(models["random_target"], "--fault", "crash:load_weights"),
        "crash_warmup": ServerProcess(models["random_target"], "--fault", "crash:warmup"),
        "never_healthy": ServerProcess(models["random_target"], "--fault", "never-healthy"),
    }
    yield procs
    for proc in procs.values():
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()


@pytest.fixture(scope="module")
def main_server(servers):
    servers["main"].wait_ready()
    return servers["main"]


def _generate(url: str, prompt: list[int], max_new: int = 20, **params) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, **params}}
    resp = httpx.post(url + "/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


# ----------------------------------------------------------------------------- flags

@pytest.mark.parametrize("flags, words", [
    (["--speculative-eagle-topk", "4"], "topk 1 only"),
    (["--speculative-num-draft-tokens", "3"], "must be num_steps \\+ 1 = 4"),
    (["--simulate-accept-length", "4.5"], "--simulate-accept-length 4.5: must be in \\[1, num_steps \\+ 1 = 4\\]"),
])
def test_bad_speculative_flags_exit_2(tmp_path, flags, words):
    spec = {"--speculative-num-steps": "3", "--speculative-eagle-topk": "1", "--speculative-num-draft-tokens": "4"}
    spec.update(dict(zip(flags[::2], flags[1::2])))
    argv = [sys.executable, "-m", "drafter.engines.reference.reference_server", "--model-path", str(tmp_path),
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(tmp_path)]
    for key, value in spec.items():
        argv += [key, value]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and re.search(words, done.stderr), done.stderr


def test_bad_fault_and_partial_speculative_flags_exit_2(tmp_path):
    base = [sys.executable, "-m", "drafter.engines.reference.reference_server", "--model-path", str(tmp_path)]
    done = subprocess.run(base + ["--fault", "hang:graph_capture"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "phases: load_weights, kv_cache, warmup" in done.stderr
    done = subprocess.run(base + ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "x",
                                  "--speculative-num-steps", "2"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "set all of" in done.stderr
    done = subprocess.run(base + ["--simulate-accept-length", "2"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "['--simulate-accept-length'] given without --speculative-algorithm" in done.stderr


# ----------------------------------------------------------------------------- the main server

def test_starts_in_sglang_order_and_is_503_until_warm(main_server):
    order = [r"Load weight begin", r"Load weight end.*type=LlamaForCausalLM,", r"Load weight begin",
             r"Load weight end.*type=LlamaForCausalLMEagle3", r"KV Cache is allocated\. #tokens: \d+",
             r"Memory pool end", r"Uvicorn running on http://127\.0\.0\.1:\d+", r"\[warmup\] still working",
             r"The server is fired up and ready to roll!"]
    position = 0
    lines = [line for _, line in main_server.lines]
    for pattern in order:
        position = next((i for i in range(position, len(lines)) if re.search(pattern, lines[i])), None)
        assert position is not None, f"{pattern!r} missing or out of order:\n{main_server.log}"
        position += 1
    up = main_server.line_time("Uvicorn running on")
    ready = main_server.line_time("ready to roll")
    # the port refused while loading, answered 503 while warming up, 200 only once ready
    assert all(status == "refused" for start, end, status in main_server.polls if end < up - 0.3)
    assert any(status == 503 for start, end, status in main_server.polls if start > up and end < ready)
    assert not any(status == 200 for start, end, status in main_server.polls if end < up)
    assert httpx.get(main_server.url + "/health").status_code == 200


def test_info_endpoints(main_server, models):
    url = main_server.url
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["tiny"]
    info = httpx.get(url + "/get_model_info").json()
    assert info["model_path"] == str(models["succ_target"]) and info["is_generation"] is True
    for path in ("/get_server_info", "/server_info"):
        server = httpx.get(url + path).json()
        assert server["speculative_algorithm"] == "EAGLE3"
        assert (server["speculative_num_steps"], server["speculative_eagle_topk"],
                server["speculative_num_draft_tokens"]) == (3, 1, 4)
        assert server["speculative_draft_model_path"] == str(models["succ_draft"])
        assert server["speculative_aux_hidden_state_layer_ids"] == [0, 1, 2]
        assert "avg_spec_accept_length" in server["internal_states"][0]
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200


def test_generate_text_batch_and_openai_endpoints(main_server):
    url = main_server.url
    one = httpx.post(url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert len(one["output_ids"]) == 6 and isinstance(one["text"], str)
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6} and meta["prompt_tokens"] >= 2
    batch = httpx.post(url + "/generate", json={"input_ids": [[0, 150], [0, 398]],
                                                "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert batch[0]["output_ids"] == list(range(151, 159))
    assert batch[1]["output_ids"] == [399, 400, 4] and batch[1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 4}
    comp = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [0, 150], "max_tokens": 5,
                                                      "temperature": 0}).json()
    assert comp["choices"][0]["finish_reason"] == "length"
    assert comp["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    chat = httpx.post(url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7, "temperature": 0}).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 7 and chat["usage"]["prompt_tokens"] > 5
    bad = httpx.post(url + "/generate", json={"input_ids": [0, 1], "sampling_params": {"max_new_tokenz": 3}})
    assert bad.status_code == 400 and "max_new_tokenz" in bad.text
    sampled = _generate(url, [0, 150], 10, temperature=0.8, seed=5)
    assert sampled == {**sampled, "output_ids": _generate(url, [0, 150], 10, temperature=0.8, seed=5)["output_ids"]}


def test_chat_returns_the_generated_token_ids_in_vllms_fields(main_server, models):
    """`return_token_ids`: the ids the engine generated (what /generate gives for the same prompt,
    the stop token included) and the template's prompt ids, where vLLM puts them."""
    from transformers import AutoTokenizer

    url = main_server.url
    messages = [{"role": "user", "content": "Hi"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 512, "temperature": 0}
    chat = httpx.post(url + "/v1/chat/completions", json={**body, "return_token_ids": True}, timeout=120).json()
    choice = chat["choices"][0]
    tok = AutoTokenizer.from_pretrained(models["succ_target"])
    prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    assert chat["prompt_token_ids"] == prompt
    assert choice["token_ids"] == _generate(url, prompt, 512)["output_ids"]
    # the successor target counts up to 400, then stops on its eos (4): the stop token is returned
    assert choice["token_ids"][-2:] == [400, 4] and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
    assert chat["usage"]["completion_tokens"] == len(choice["token_ids"])
    plain = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain
    assert plain["choices"][0]["message"] == choice["message"]


def test_accept_length_reported_equals_client_computation(main_server):
    url = main_server.url
    assert httpx.post(url + "/flush_cache").status_code == 200
    prompts = [[0, 17, 150], [0, 190], [0, 402], [0, 99, 99], [0, 391]]
    answers = [_generate(url, p, 30) for p in prompts]
    for answer in answers:
        meta = answer["meta_info"]
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
    client = sum(a["meta_info"]["completion_tokens"] for a in answers) / sum(a["meta_info"]["spec_verify_ct"] for a in answers)
    server = httpx.get(url + "/get_server_info").json()["internal_states"][0]
    assert server["avg_spec_accept_length"] == pytest.approx(client)
    assert server["num_requests"] == len(prompts)
    assert client > 1.5  # the crafted drafter is accepted often
    assert answers[2]["meta_info"]["spec_accept_length"] > 3.5  # fixed point: all 3 drafts + bonus


def test_concurrent_requests_match_sequential(main_server):
    url = main_server.url
    prompts = [[0, 10 + 37 * i, 150 + i] for i in range(8)]
    sequential = [_generate(url, p, 25)["output_ids"] for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(lambda p: _generate(url, p, 25)["output_ids"], prompts))
    assert concurrent == sequential


def test_flush_cache_refused_while_a_request_runs(main_server):
    url = main_server.url
    # 99 -> 100.. is outside the crafted draft vocab: one token per verify, a long request
    runner = threading.Thread(target=_generate, args=(url, [0, 99], 400))
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while httpx.get(url + "/get_server_info").json()["internal_states"][0]["num_running_reqs"] == 0:
            assert time.monotonic() < deadline and runner.is_alive()
            time.sleep(0.01)
        refused = httpx.post(url + "/flush_cache")
    finally:
        runner.join()
    assert refused.status_code == 400 and "running" in refused.text
    assert httpx.post(url + "/flush_cache").status_code == 200
    assert httpx.get(url + "/get_server_info").json()["internal_states"][0]["spec_verify_ct"] == 0


def test_sigterm_exits_cleanly(main_server):
    assert main_server.terminate() == 0
    assert "Server shut down cleanly." in main_server.log


# ----------------------------------------------------------------------------- faults

def test_slow_load_refuses_connections_then_refuse_generation(servers):
    srv = servers["slow_refuse"]
    srv.wait_ready()
    begin, end = srv.line_time("Load weight begin"), srv.line_time("Load weight end")
    progress = [t for t, line in srv.lines if "[load_weights] still working" in line]
    assert len(progress) >= 3 and end - begin >= 2.9
    assert max(b - a for a, b in zip(progress, progress[1:])) < 2.0  # a line about every second
    during = [status for start, stop, status in srv.polls if start > begin and stop < end]
    assert len(during) >= 5 and set(during) == {"refused"}
    url = srv.url
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 200
    gen = httpx.post(url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert gen.status_code == 500 and "refuse-generation" in gen.text
    chat = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 500
    assert httpx.get(url + "/health_generate").status_code == 503
    assert srv.terminate() == 0


def _quiet_for(srv: ServerProcess, seconds: float) -> None:
    """Wait until the last log line is at least `seconds` old (servers started long ago)."""
    while (quiet := time.monotonic() - srv.lines[-1][0]) < seconds:
        time.sleep(seconds - quiet)


def test_hang_stops_all_progress(servers):
    srv = servers["hang"]
    srv.wait_line("Load weight end")
    _quiet_for(srv, 3.0)
    assert srv.proc.poll() is None
    assert "KV Cache is allocated" not in srv.log and "Uvicorn running" not in srv.log
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health")
    assert srv.terminate() == 0  # SIGTERM ends a hung load too


@pytest.mark.parametrize("name, after", [("crash_load", "Load weight begin"), ("crash_warmup", "Uvicorn running on")])
def test_crash_logs_a_traceback_and_exits_1(servers, name, after):
    srv = servers[name]
    assert srv.proc.wait(START_TIMEOUT) == 1
    time.sleep(0.2)
    log = srv.log
    assert re.search(after, log)
    assert "Scheduler hit an exception" in log and "Traceback (most recent call last)" in log
    assert "RuntimeError: injected fault crash:" in log and "ready to roll" not in log


def test_unloadable_model_says_initialization_failed(tmp_path, capsys):
    """In-process (a new interpreter costs seconds): main() returns 1 with SGLang's fatal lines."""
    from drafter.engines.reference import reference_server

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = reference_server.main(["--model-path", str(tmp_path / "no_such_model"), "--device", "cpu",
                                      "--port", str(free_port())])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert code == 1
    assert "Scheduler hit an exception" in err and "Initialization failed." in err and "no_such_model" in err


def test_never_healthy_serves_http_but_stays_503_silently(servers):
    srv = servers["never_healthy"]
    up = srv.wait_line("Uvicorn running on")
    while time.monotonic() < up + 2.0:
        time.sleep(0.1)
    assert httpx.get(srv.url + "/v1/models").status_code == 200
    statuses = [status for start, _, status in srv.polls if start > up + 0.1]
    assert len(statuses) >= 5 and set(statuses) == {503}
    assert not [line for t, line in srv.lines if t > up + 0.5]  # nothing logged after start-up
    assert httpx.get(srv.url + "/health_generate").status_code == 503
    assert srv.terminate() == 0


def test_health_generate_answers_503_at_once_when_generation_fails():
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from drafter.engines.reference.reference_server import Faults, ServerState, build_app

    class FailingEngine:
        drafter = None
        target = SimpleNamespace(tokenizer=lambda text: SimpleNamespace(input_ids=[1, 2]))

        def generate(self, *args, **kwargs):
            raise RuntimeError("engine broke")

    state = ServerState(SimpleNamespace(faults=Faults()), FailingEngine(), "tiny")
    state.ready = True
    with TestClient(build_app(state)) as client:
        start = time.monotonic()
        assert client.get("/health_generate").status_code == 503
    assert time.monotonic() - start < 10.0  # not the 20 s wait for a generation that never ends
