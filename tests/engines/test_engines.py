"""Engines: command lines from configs, log-phase regexes on real log lines, settings read-back,
acceptance counters, typed errors. Pure unit tests: no processes, no network."""
from __future__ import annotations

import json
import pickle
import sys

import httpx
import pytest

from drafter.config import SpeculativeConfig, parse_config
from drafter.errors import is_retryable
from drafter.engines import (
    check_speculative_settings, counters_delta, make_engine, parse_prometheus, sglang_accept_length,
    sglang_avg_accept_length, sglang_settings_from_info, vllm_accept_length, vllm_settings_from_log,
    vllm_spec_counters)
from drafter.server_errors import (
    HealthCheckTimeout, ServerConfigError, ServerCrashed, ServerStalled, ServerStartError)

NCCL = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_P2P_LEVEL": "SYS", "NCCL_MAX_NCHANNELS": "16",
        "NCCL_BUFFSIZE": "16777216", "NCCL_NTHREADS": "512"}


def kimi_config(engine: str = "sglang", **serve):
    """The field-notes deployment: Kimi-K2.5 on 8 PCIe RTX PRO 6000 GPUs, TP 8, no NVLink."""
    return parse_config({
        "name": "kimi-k2.5-pcie",
        "target": {"path": "/models/Kimi-K2.5", "name": "kimi-k2.5", "trust_remote_code": True,
                   "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840},
        "serve": {"engine": engine, "host": "0.0.0.0", "port": 30000, "tp_size": 8,
                  "disable_custom_all_reduce": True, "mem_fraction_static": 0.88, "cuda_graph_max_bs": 8,
                  "env": NCCL, "draft_path": "/drafters/kimi-eagle3",
                  "speculative": {"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3},
                  "extra_args": ["--context-length", "32768"], **serve},
    })


def small_config(engine: str = "sglang", **serve):
    return parse_config({"target": {"path": "/models/llama", "num_hidden_layers": 32, "vocab_size": 64000},
                         "serve": {"engine": engine, "port": 31000, **serve}})


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


# ---------------------------------------------------------------------------------------------
# Command lines
# ---------------------------------------------------------------------------------------------

def test_sglang_kimi_on_8_pcie_gpus(tmp_path):
    cfg = kimi_config()
    spec = make_engine("sglang").build_launch(cfg, cfg.serve.draft_path, tmp_path)
    argv = spec.argv
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == "/models/Kimi-K2.5"
    assert flag(argv, "--served-model-name") == "kimi-k2.5"
    assert flag(argv, "--tp-size") == "8"
    assert "--disable-custom-all-reduce" in argv and "--trust-remote-code" in argv
    assert flag(argv, "--speculative-algorithm") == "EAGLE3"
    assert flag(argv, "--speculative-draft-model-path") == "/drafters/kimi-eagle3"
    assert flag(argv, "--speculative-num-steps") == "2"
    assert flag(argv, "--speculative-eagle-topk") == "1"
    assert flag(argv, "--speculative-num-draft-tokens") == "3"
    assert flag(argv, "--mem-fraction-static") == "0.88"
    assert flag(argv, "--cuda-graph-max-bs") == "8"
    assert argv[-2:] == ["--context-length", "32768"]  # extra args last: they can override
    assert "--disable-cuda-graph" not in argv
    for key, value in NCCL.items():
        assert spec.env[key] == value
    assert spec.env_overrides == {"NCCL_NVLS_ENABLE": "0", **NCCL}  # NVLS off unless the profile says
    assert spec.env["PATH"]  # the rest of the environment is inherited
    # wildcard host: probes go to loopback
    assert spec.base_url == "http://127.0.0.1:30000" and spec.health_url.endswith("/health")
    assert spec.generate_style == "sglang"


def test_sglang_baseline_and_auto_settings(tmp_path):
    engine = make_engine("sglang")
    base = engine.build_launch(small_config(), None, tmp_path).argv
    assert not any(a.startswith("--speculative") for a in base)
    assert "--trust-remote-code" not in base and "--dtype" not in base
    # a draft without S/K/D: SGLang auto-picks them, we pass none of the three
    auto = engine.build_launch(small_config(), "/drafters/d", tmp_path).argv
    assert flag(auto, "--speculative-algorithm") == "EAGLE3"
    assert "--speculative-num-steps" not in auto and "--speculative-num-draft-tokens" not in auto


def test_speculative_settings_without_draft_is_a_config_error(tmp_path):
    cfg = small_config(speculative={"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4})
    for name in ("sglang", "vllm", "reference"):
        with pytest.raises(ServerConfigError, match="no draft path"):
            make_engine(name).build_launch(cfg, None, tmp_path)


def test_vllm_command_line(tmp_path):
    cfg = kimi_config("vllm", disable_cuda_graph=True, max_running_requests=16)
    spec = make_engine("vllm").build_launch(cfg, cfg.serve.draft_path, tmp_path)
    argv = spec.argv
    assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/Kimi-K2.5"]
    assert flag(argv, "--tensor-parallel-size") == "8"
    assert flag(argv, "--served-model-name") == "kimi-k2.5"
    assert json.loads(flag(argv, "--speculative-config")) == {
        "method": "eagle3", "model": "/drafters/kimi-eagle3", "num_speculative_tokens": 2}
    assert flag(argv, "--gpu-memory-utilization") == "0.88"
    assert flag(argv, "--max-cudagraph-capture-size") == "8"
    assert flag(argv, "--max-num-seqs") == "16"
    assert {"--enforce-eager", "--disable-custom-all-reduce", "--trust-remote-code"} <= set(argv)
    assert all(spec.env[k] == v for k, v in NCCL.items())
    assert spec.generate_style == "openai"


def test_vllm_rejects_tree_drafts(tmp_path):
    cfg = small_config("vllm", speculative={"num_steps": 3, "eagle_topk": 4, "num_draft_tokens": 8})
    with pytest.raises(ServerConfigError, match="eagle_topk"):
        make_engine("vllm").build_launch(cfg, "/drafters/d", tmp_path)


def test_reference_command_line_with_faults(tmp_path):
    cfg = small_config("reference", device="cpu", speculative={"num_steps": 3, "eagle_topk": 1,
                                                                "num_draft_tokens": 4})
    spec = make_engine("reference").build_launch(cfg, "/drafters/d", tmp_path,
                                                 faults=["hang:load_weights", "crash:kv_cache"])
    argv = spec.argv
    assert argv[:3] == [sys.executable, "-m", "drafter.engines.reference.reference_server"]
    assert flag(argv, "--model-path") == "/models/llama"
    assert flag(argv, "--served-model-name") == "llama"
    assert flag(argv, "--device") == "cpu" and flag(argv, "--dtype") == "auto"
    assert flag(argv, "--port") == "31000" and flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--speculative-num-steps") == "3"
    assert flag(argv, "--speculative-num-draft-tokens") == "4"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--fault"] == ["hang:load_weights", "crash:kv_cache"]
    with pytest.raises(ServerConfigError, match="reference engine"):
        make_engine("sglang").build_launch(cfg, "/drafters/d", tmp_path, faults=["hang:x"])


def test_reference_refuses_tensor_parallel(tmp_path):
    with pytest.raises(ServerConfigError, match="tp_size"):
        make_engine("reference").build_launch(small_config("reference", tp_size=2), None, tmp_path)


def test_each_engine_forces_an_accept_length_with_its_own_knob(tmp_path):
    """The bench's accept-length curve: reference our flag, SGLang its environment variable, vLLM
    its synthetic rejection sampler in --speculative-config; the command engine has no known knob.
    Every knob is saved with the launch (argv / env_overrides)."""
    s314 = {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
    ref = make_engine("reference").build_launch(small_config("reference", speculative=s314), "/drafters/d",
                                                tmp_path, forced_accept_length=2.5)
    assert flag(ref.argv, "--simulate-accept-length") == "2.5"
    sgl = make_engine("sglang").build_launch(small_config("sglang", speculative=s314), "/drafters/d", tmp_path,
                                             forced_accept_length=2.5)
    assert "--simulate-accept-length" not in sgl.argv
    want = {"SGLANG_SIMULATE_ACC_LEN": "2.5", "SGLANG_SIMULATE_ACC_METHOD": "match-expected"}
    assert {k: sgl.env_overrides[k] for k in want} == want and {k: sgl.env[k] for k in want} == want
    vll = make_engine("vllm").build_launch(small_config("vllm", speculative=s314), "/drafters/d", tmp_path,
                                           forced_accept_length=2.5)
    assert json.loads(flag(vll.argv, "--speculative-config")) == {
        "method": "eagle3", "model": "/drafters/d", "num_speculative_tokens": 3,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5}
    # off: nothing of it anywhere
    plain = make_engine("sglang").build_launch(small_config("sglang", speculative=s314), "/drafters/d", tmp_path)
    assert "SGLANG_SIMULATE_ACC_LEN" not in plain.env_overrides
    with pytest.raises(ServerConfigError, match=r"out of reach of 3 draft steps: it must be in \[1, 4\]"):
        make_engine("vllm").build_launch(small_config("vllm", speculative=s314), "/drafters/d", tmp_path,
                                         forced_accept_length=4.5)
    with pytest.raises(ServerConfigError, match="needs a drafter and explicit speculative settings"):
        make_engine("reference").build_launch(small_config("reference"), "/drafters/d", tmp_path,
                                              forced_accept_length=2.0)
    cmd = small_config("command", command=["srv", "--port", "{port}"], speculative=s314)
    with pytest.raises(ServerConfigError, match="'command' has no known way to force an accept length"):
        make_engine("command").build_launch(cmd, "/drafters/d", tmp_path, forced_accept_length=2.0)


def test_phases_are_name_regex_budget_tuples():
    for name in ("sglang", "vllm", "reference", "command"):
        phases = make_engine(name).phases
        assert phases[0].name == "launch" and phases[0].pattern is None
        for phase_name, pattern, budget in phases[1:]:
            assert pattern.search is not None and (budget is None or budget > 0)


def test_command_engine(tmp_path):
    cfg = small_config("command", command=["my-server", "--port", "{port}", "--draft", "{draft_path}"],
                       health_url="http://127.0.0.1:{}/ping".format(31000), env={"FOO": "1"})
    spec = make_engine("command").build_launch(cfg, "/drafters/d", tmp_path)
    assert spec.argv == ["my-server", "--port", "31000", "--draft", "/drafters/d"]
    assert spec.health_url == "http://127.0.0.1:31000/ping"
    assert spec.base_url == "http://127.0.0.1:31000" and spec.port == 31000
    assert spec.env["FOO"] == "1" and spec.model_path is None
    bad = small_config("command", command=["srv"], extra_args=["--x"])
    with pytest.raises(ServerConfigError, match="extra_args"):
        make_engine("command").build_launch(bad, None, tmp_path)


def test_unknown_engine():
    with pytest.raises(ServerConfigError, match="unknown engine"):
        make_engine("tgi")


# ---------------------------------------------------------------------------------------------
# Log lines (literal lines from SGLang / vLLM logs)
# ---------------------------------------------------------------------------------------------

SGLANG_LINES = [
    ("[2025-05-02 16:14:20 TP0] Load weight begin. avail mem=78.68 GB", "load_weights"),
    ("[2025-05-02 16:14:31 TP0] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, "
     "avail mem=63.50 GB, mem usage=15.18 GB.", "kv_cache"),
    ("[2025-05-02 16:14:33 TP0] KV Cache is allocated. #tokens: 1710976, K size: 0.82 GB, V size: 0.82 GB",
     "kv_cache"),
    ("[2025-05-02 16:14:33] Memory pool end. avail mem=0.00 GB", "kv_cache"),
    ("[2025-05-02 16:14:40 TP0] Load weight end. type=LlamaForCausalLMEagle3, dtype=torch.bfloat16, "
     "avail mem=60.10 GB, mem usage=3.40 GB.", "kv_cache"),
    ("[2025-05-02 16:14:33] Capture cuda graph begin. This can take up to several minutes. avail mem=0.00 GB",
     "cuda_graph"),
    ("[2026-03-04 16:46:41 TP4] Capture cuda graph begin. This can take up to several minutes. avail mem=15.30 GB",
     "cuda_graph"),
    ("[2025-05-02 16:14:33] Capture cuda graph bs [1, 2, 4, 8]", "cuda_graph"),
    ("[2026-06-05 18:12:34] Capture cuda graph end. Time elapsed: 1.23 s. mem usage=0.41 GB. avail mem=20.26 GB.",
     "post_capture"),
    ("[2026-06-05 18:12:35 TP0] Capture draft cuda graph begin. This can take up to several minutes.", "cuda_graph"),
    ("INFO:     Uvicorn running on http://0.0.0.0:30000 (Press CTRL+C to quit)", "http_server"),
    ("[2026-05-06 19:11:22] The server is fired up and ready to roll!", "ready"),
    ("[2026-05-06 19:11:47 TP0] Prefill batch, #new-seq: 1, #new-token: 256, #cached-token: 0", None),
]


@pytest.mark.parametrize("engine_name", ["sglang", "reference"])
@pytest.mark.parametrize("line,phase", SGLANG_LINES)
def test_sglang_phase_lines(engine_name, line, phase):
    got, _, fatal, _ = make_engine(engine_name).classify(line)
    assert got == phase and not fatal


def test_sglang_ready_fatal_and_noise_lines():
    engine = make_engine("sglang")
    assert engine.classify("[2026-05-06 19:11:22] The server is fired up and ready to roll!")[1]
    for fatal in ["[2026-05-06 19:12:07] Subprocess scheduler_3 (pid=22856) crashed with exit code -6.",
                  "[2025-01-01 00:00:00 TP3] Scheduler hit an exception: Traceback (most recent call last):",
                  "[2025-01-01 00:00:00] Initialization failed. warmup error: Traceback"]:
        assert engine.classify(fatal)[2], fatal
    # our own probes in the access log are not the server making progress
    assert engine.classify('INFO:     127.0.0.1:50412 - "GET /health HTTP/1.1" 503 Service Unavailable')[3]
    assert not engine.classify("[2025-05-02 16:14:33] Capture cuda graph bs [1, 2, 4, 8]")[3]


# The end of SGLang 0.5.23's log for an EAGLE-3 launch on a CPU without AMX (tests/engines/test_sglang_server.py
# makes it for real), and for a scheduler SIGKILLed during start-up.
SGLANG_EAGLE_ON_CPU_LOG = [
    "[2026-12-02 00:05:10] The current platform does not support Intel AMX, will fallback to torch_native backend.",
    "[2026-12-02 00:05:30] Memory pool end. avail mem=21.30 GB",
    "[2026-12-02 00:05:31] Scheduler hit an exception: Traceback (most recent call last):",
    '  File "/venv/lib/python3.11/site-packages/sglang/srt/speculative/draft_utils.py", line 64, in _create_backend',
    "    raise ValueError(error_template.format(backend_type=backend_type))",
    "ValueError: EAGLE is not supported in decode attention backend torch_native",
    "[2026-12-02 00:05:31] Received sigquit from a child process. It usually means the child failed.",
    "[2026-12-02 00:05:31] kill_process_tree called: parent_pid=4062, include_parent=True, pid=4062",
]
SGLANG_SCHEDULER_KILLED_LOG = [
    "[2026-12-02 00:06:20] Load weight begin. avail mem=21.24 GB",
    "RuntimeError: Rank 0 scheduler died during initialization (exit code: -9). If exit code is -9 (SIGKILL), "
    "a common cause is the OS OOM killer. Run `dmesg -T | grep -i oom` to check.",
]


def test_a_line_saying_the_host_cannot_run_the_configuration_is_a_config_error_not_a_crash():
    engine = make_engine("sglang")
    why = engine.config_error(SGLANG_EAGLE_ON_CPU_LOG)
    assert why is not None and "attention backend torch_native has no EAGLE support" in why
    assert "intel_amx" in why and "AMX" in why  # names the CPU backend that is missing here
    # draft extend's wording ("in attention backend X") and ANSI colour codes are recognised too
    assert "backend torch_native" in engine.config_error(
        ["\x1b[31mValueError: EAGLE is not supported in attention backend torch_native\x1b[0m"])
    assert engine.config_error(SGLANG_SCHEDULER_KILLED_LOG) is None  # a crash: a retry may work
    assert engine.classify(SGLANG_SCHEDULER_KILLED_LOG[1])[2]  # ... and a fatal line
    assert make_engine("vllm").config_error(SGLANG_EAGLE_ON_CPU_LOG) is None  # per engine


class _DeadServer:
    """What the gate reads of a server process that already exited with `log`."""

    def __init__(self, log: list[str], fatal: int | None, exit_code: int = -9):
        self.log, self.exit_code, self.phase, self.started_at = log, exit_code, "kv_cache", 0.0
        self.fatal_line = log[fatal] if fatal is not None else None

    def poll(self):
        return self.exit_code

    def wait_output(self, timeout=2.0):
        return True

    def log_tail(self, n=40):
        return self.log[-n:]

    def log_text(self):
        return "\n".join(self.log) + "\n"


def test_the_gate_raises_a_config_error_for_eagle_on_a_cpu_and_a_crash_otherwise():
    from types import SimpleNamespace

    from drafter.serving.gate import start_failure, wait_until_ready

    engine, spec = make_engine("sglang"), SimpleNamespace(base_url="http://127.0.0.1:9")
    with pytest.raises(ServerConfigError) as err:
        wait_until_ready(_DeadServer(SGLANG_EAGLE_ON_CPU_LOG, fatal=2), engine, spec, 60, 60)
    assert not is_retryable(err.value) and err.value.status == "config_error"
    assert "torch_native has no EAGLE support" in err.value.message and "intel_amx" in err.value.message
    assert "exited with code -9" in err.value.message  # what the gate saw is kept
    assert (err.value.exit_code, err.value.phase, err.value.log_tail) == (-9, "kv_cache", SGLANG_EAGLE_ON_CPU_LOG)
    crashed = start_failure(_DeadServer(SGLANG_SCHEDULER_KILLED_LOG, fatal=1), engine, "sglang exited")
    assert type(crashed) is ServerCrashed and is_retryable(crashed) and crashed.exit_code == -9
    # the pickled error (a Prefect result) keeps its type and fields
    back = pickle.loads(pickle.dumps(err.value))
    assert type(back) is ServerConfigError and back.exit_code == -9 and back.log_tail == SGLANG_EAGLE_ON_CPU_LOG


VLLM_LINES = [
    ("(EngineCore_DP0 pid=212) INFO 10-06 12:00:20 [gpu_model_runner.py:2338] Starting to load model "
     "meta-llama/Llama-3.1-8B-Instruct...", "load_weights"),
    ("(EngineCore_DP0 pid=212) INFO 10-06 12:00:30 [gpu_model_runner.py:2370] Model loading took 14.9889 GiB "
     "and 5.121512 seconds", "compile"),
    ("INFO 11-03 15:47:40 [default_loader.py:262] Loading weights took 4.12 seconds", "compile"),
    ("(EngineCore_DP0 pid=212) INFO 10-06 12:00:31 [gpu_worker.py:298] Available KV cache memory: 12.15 GiB",
     "kv_cache"),
    ("(EngineCore_DP0 pid=212) INFO 10-06 12:00:31 [kv_cache_utils.py:1087] GPU KV cache size: 49,152 tokens",
     "kv_cache"),
    ("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|██████████| 11/11 [00:02<00:00,  4.12it/s]",
     "cuda_graph"),
    ("(EngineCore_DP0 pid=212) INFO 10-06 12:00:40 [gpu_model_runner.py:3480] Graph capturing finished in 8 secs, "
     "took 0.31 GiB", "http_server"),
    ("INFO 11-03 15:47:45 [llm_engine.py:428] init engine (profile, create kv cache, warmup model) took 28.44 seconds",
     "http_server"),
    ("INFO 10-06 12:00:41 [api_server.py:1971] Starting vLLM API server 0 on http://0.0.0.0:8000", "http_server"),
    ("INFO:     Application startup complete.", "ready"),
]


@pytest.mark.parametrize("line,phase", VLLM_LINES)
def test_vllm_phase_lines(line, phase):
    assert make_engine("vllm").classify(line)[0] == phase


def test_vllm_ready_and_fatal_lines():
    engine = make_engine("vllm")
    assert engine.classify("INFO:     Application startup complete.")[1]
    assert engine.classify("RuntimeError: Engine core initialization failed. See root cause above. "
                           "Failed core proc(s): {}")[2]
    assert engine.classify("(EngineCore_DP0 pid=212) ERROR 10-06 12:00:20 [core.py:708] EngineCore failed to start.")[2]


# ---------------------------------------------------------------------------------------------
# Settings read back from the server
# ---------------------------------------------------------------------------------------------

SERVER_INFO = {"model_path": "/models/llama", "served_model_name": "llama", "tp_size": 1,
               "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/drafters/d",
               "speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
               "internal_states": [{"avg_spec_accept_length": 2.9}], "version": "0.5.4"}


def mock_client(routes: dict[str, tuple[int, object]]) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        status, body = routes.get(request.url.path, (404, {"detail": "Not Found"}))
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)
    return httpx.Client(base_url="http://server", transport=httpx.MockTransport(handler))


def test_sglang_read_settings_falls_back_to_server_info():
    with mock_client({"/server_info": (200, SERVER_INFO)}) as client:  # newer SGLang renamed it
        got = make_engine("sglang").read_settings(client)
    assert got["algorithm"] == "EAGLE3" and got["draft_path"] == "/drafters/d"
    assert (got["num_steps"], got["eagle_topk"], got["num_draft_tokens"]) == (3, 1, 4)
    with mock_client({"/get_server_info": (200, SERVER_INFO)}) as client:
        assert make_engine("reference").read_settings(client)["num_draft_tokens"] == 4
        assert make_engine("sglang").metrics_snapshot(client) == {"avg_spec_accept_length": 2.9}


def test_sglang_baseline_reports_no_algorithm():
    got = sglang_settings_from_info({"speculative_algorithm": None, "model_path": "/m"})
    assert got["algorithm"] is None
    assert check_speculative_settings(None, got) == []


VLLM_LOG = """\
INFO 10-06 12:00:09 [utils.py:328] non-default args: {'model': '/models/llama'}
INFO 10-06 12:00:10 [core.py:77] Initializing a V1 LLM engine (v0.11.0) with config: model='/models/llama', \
speculative_config=SpeculativeConfig(method='eagle3', model='/drafters/d', num_spec_tokens=3), \
tokenizer='/models/llama', skip_tokenizer_init=False, dtype=torch.bfloat16
"""


def test_vllm_read_settings_from_log_and_models():
    routes = {"/v1/models": (200, {"data": [{"id": "llama", "root": "/models/llama", "max_model_len": 8192}]}),
              "/metrics": (200, "vllm:spec_decode_num_drafts_total{engine=\"0\"} 0.0\n")}
    with mock_client(routes) as client:
        got = make_engine("vllm").read_settings(client, VLLM_LOG)
    assert got["algorithm"] == "EAGLE3" and got["draft_path"] == "/drafters/d"
    assert (got["num_steps"], got["eagle_topk"], got["num_draft_tokens"]) == (3, 1, 4)
    assert got["served_models"] == ["llama"] and got["spec_decode_metrics"] is True
    requested = SpeculativeConfig(num_steps=3, eagle_topk=1, num_draft_tokens=4)
    assert check_speculative_settings(requested, got, "/drafters/d") == []
    assert vllm_settings_from_log("... speculative_config=None, tokenizer='x'") == {"algorithm": None}


def test_settings_mismatch_detection():
    requested = SpeculativeConfig(num_steps=3, eagle_topk=1, num_draft_tokens=4)
    actual = sglang_settings_from_info(SERVER_INFO)
    assert check_speculative_settings(requested, actual, "/drafters/d") == []
    # field note 3: "--speculative-num-steps 1" quietly capped the draft tokens
    rewritten = {**actual, "num_steps": 1, "num_draft_tokens": 2}
    problems = check_speculative_settings(requested, rewritten, "/drafters/d")
    assert len(problems) == 2
    assert any("num_steps: requested 3, server uses 1" in p for p in problems)
    assert any("num_draft_tokens: requested 4, server uses 2" in p for p in problems)
    # speculation silently off
    off = check_speculative_settings(requested, {**actual, "algorithm": None}, "/drafters/d")
    assert any("speculation is off" in p for p in off)
    # a different drafter than the one we launched with
    assert any("draft_path" in p for p in check_speculative_settings(requested, actual, "/drafters/other"))
    # baseline requested, speculation on
    assert any("no speculation was requested" in p for p in check_speculative_settings(None, actual))
    # nothing readable is itself a finding
    assert check_speculative_settings(requested, {}) != []
    assert "could not read" in check_speculative_settings(requested, {"error": "HTTP 500"})[0]
    # auto S/K/D: only the algorithm and the draft are checked
    assert check_speculative_settings(None, actual, "/drafters/d") == []


# ---------------------------------------------------------------------------------------------
# Acceptance counters
# ---------------------------------------------------------------------------------------------

METRICS_BEFORE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="llama"} 100.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="llama"} 1.7591e+09
vllm:spec_decode_num_drafts_total{engine="1",model_name="llama"} 50.0
vllm:spec_decode_num_drafts_created{engine="1",model_name="llama"} 1.7591e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="llama"} 300.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="llama"} 150.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="llama"} 150.0
vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="llama"} 1.7591e+09
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="llama"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama",position="0"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama",position="1"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="llama",position="2"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="llama",position="0"} 1.7591e+09
vllm:num_requests_running{engine="0",model_name="llama"} 0.0
"""


def _after() -> str:
    # +200 drafts, +300 accepted (engine 0 only), positions +150/+100/+50
    return (METRICS_BEFORE
            .replace('engine="0",model_name="llama"} 100.0', 'engine="0",model_name="llama"} 300.0')
            .replace('engine="0",model_name="llama"} 150.0\nvllm:spec_decode_num_accepted_tokens_created',
                     'engine="0",model_name="llama"} 450.0\nvllm:spec_decode_num_accepted_tokens_created')
            .replace('position="0"} 80.0', 'position="0"} 230.0')
            .replace('position="1"} 50.0', 'position="1"} 150.0')
            .replace('position="2"} 20.0', 'position="2"} 70.0'))


def test_prometheus_parsing_ignores_created_and_sums_engines():
    before = vllm_spec_counters(METRICS_BEFORE)
    assert before["drafts"] == 150.0  # 100 + 50, the 1.7e9 `_created` timestamps ignored
    assert before["draft_tokens"] == 450.0 and before["accepted_tokens"] == 210.0
    assert before["accepted_per_position"] == {0: 80.0, 1: 50.0, 2: 20.0}
    samples = parse_prometheus('x{a="1,}",b="q\\"z"} 3.5 1700000000\n# c\nbad line\n')
    assert samples == [("x", {"a": "1,}", "b": 'q\\"z'}, 3.5)]


def test_vllm_accept_length_from_deltas():
    engine = make_engine("vllm")
    before, after = vllm_spec_counters(METRICS_BEFORE), vllm_spec_counters(_after())
    delta = counters_delta(before, after)
    assert delta["drafts"] == 200.0 and delta["accepted_tokens"] == 300.0
    assert delta["accepted_per_position"] == {0: 150.0, 1: 100.0, 2: 50.0}
    assert vllm_accept_length(delta) == pytest.approx(2.5)  # 1 + 300/200
    assert engine.accept_length(before, after) == pytest.approx(2.5)
    # the cumulative totals would have said 1 + 510/350: deltas matter
    assert vllm_accept_length(after) != pytest.approx(2.5)
    with pytest.raises(ValueError, match="backwards"):
        counters_delta(after, before)
    assert vllm_accept_length(counters_delta(before, before)) is None


def test_sglang_accept_length():
    responses = [{"text": "a", "meta_info": {"completion_tokens": 30, "spec_verify_ct": 10}},
                 {"text": "b", "meta_info": {"completion_tokens": 20, "spec_verify_ct": 10}}]
    assert sglang_accept_length(responses) == pytest.approx(2.5)
    assert sglang_accept_length([{"meta_info": {"completion_tokens": 5, "spec_verify_ct": 0}}]) is None
    assert sglang_avg_accept_length(SERVER_INFO) == 2.9
    assert make_engine("sglang").accept_length(None, {"avg_spec_accept_length": 2.9}, responses) == pytest.approx(2.5)


# ---------------------------------------------------------------------------------------------
# Typed errors
# ---------------------------------------------------------------------------------------------

def test_error_types_and_retry_policy():
    crashed = ServerCrashed("boom", engine="sglang", phase="load_weights", exit_code=3, log_tail=["x"])
    stalled = ServerStalled("hung", engine="sglang", phase="cuda_graph", seconds=601.0)
    timeout = HealthCheckTimeout("slow", failing=["generation"])
    config = ServerConfigError("port 30000 in use")
    assert all(isinstance(e, ServerStartError) for e in (crashed, stalled, timeout, config))
    assert [is_retryable(e) for e in (crashed, stalled, timeout, config)] == [True, True, True, False]
    assert not is_retryable(ValueError("x"))
    assert [e.status for e in (crashed, stalled, timeout, config)] == [
        "crashed", "stalled", "health_timeout", "config_error"]
    # they cross process boundaries (Prefect results) with their fields intact
    back = pickle.loads(pickle.dumps(crashed))
    assert (type(back), back.exit_code, back.phase, back.log_tail) == (ServerCrashed, 3, "load_weights", ["x"])
    assert pickle.loads(pickle.dumps(timeout)).failing == ["generation"]
    assert "x" in str(crashed)  # the log tail is part of the message a person reads


def test_vllm_refuses_an_sglang_format_drafter(tmp_path):
    """vLLM reads aux ids as "input of layer i": an SGLang-format directory would be served one
    layer off, so the engine refuses it and points at the vLLM export; a speculators one passes."""
    import json

    sglang_dir, vllm_dir = tmp_path / "sglang", tmp_path / "vllm"
    sglang_dir.mkdir()
    vllm_dir.mkdir()
    (sglang_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}))
    (vllm_dir / "config.json").write_text(json.dumps({"architectures": ["Eagle3Speculator"],
                                                      "speculators_model_type": "eagle3"}))
    cfg = parse_config({"target": {"path": "/models/llama", "num_hidden_layers": 32, "vocab_size": 1000},
                        "train": {"draft_vocab_size": 100},
                        "serve": {"engine": "vllm", "speculative": {"num_steps": 3, "eagle_topk": 1,
                                                                    "num_draft_tokens": 4}}})
    with pytest.raises(ServerConfigError, match=r"SGLang-format drafter.*\[1, 15, 28\] one layer off.*DIR/vllm"):
        make_engine("vllm").build_launch(cfg, str(sglang_dir), tmp_path)
    argv = make_engine("vllm").build_launch(cfg, str(vllm_dir), tmp_path).argv
    assert any(str(vllm_dir) in a for a in argv)
