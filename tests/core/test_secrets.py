"""Secrets by reference, masked by allow-list, never at rest: a real server launch with a planted
secret, then every file the run wrote is searched for it (the Prefect database is searched by the
e2e test). ~3 s."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from drafter.config import ConfigError, parse_config
from drafter.secrets import MASK, Redactor, SecretError, mask_argv, mask_env, secret_values
from drafter.serving.check import check_server
from tests.fixtures.servers import FAKE
from tests.fixtures.net import free_port

PLANTED = "planted-Secret-9f3c1e77"


def test_masking_is_by_allow_list():
    env = {"NCCL_ALGO": "Ring", "CUDA_VISIBLE_DEVICES": "0,1", "WANDB_KEY": PLANTED, "OPENAI_KEY": PLANTED,
           "GH_PAT": PLANTED, "HF_AUTH": PLANTED, "VLLM_API_KEY": PLANTED, "MY_SETTING": PLANTED,
           "DATABASE_URL": f"postgres://app:{PLANTED}@db:5432/x",
           "SGLANG_REMOTE": f"https://user:{PLANTED}@host/path?token={PLANTED}&x=1"}
    masked = mask_env(env)
    assert masked["NCCL_ALGO"] == "Ring" and masked["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert masked["SGLANG_REMOTE"] == f"https://user:{MASK}@host/path?token={MASK}&x=1"
    assert PLANTED not in json.dumps(masked)
    argv = ["sglang", "--api-key", PLANTED, f"--hf-token={PLANTED}", "--tp-size", "8",
            f"--endpoint=s3://k:{PLANTED}@minio:9000"]
    assert mask_argv(argv) == ["sglang", "--api-key", MASK, f"--hf-token={MASK}", "--tp-size", "8",
                               f"--endpoint=s3://k:{MASK}@minio:9000"]
    redact = Redactor(secret_values({"WANDB_KEY": PLANTED, "NCCL_ALGO": "Ring"}, argv))
    assert redact(f"server_args=ServerArgs(api_key='{PLANTED}', algo=Ring)") == f"server_args=ServerArgs(api_key='{MASK}', algo=Ring)"


def secret_profile(tmp_path: Path, reference: str) -> dict:
    port = free_port()
    # sh prints what the server received, then execs the fake server; `--api-key ...` reaches sh's argv
    script = f'echo "received token=$HF_TOKEN"; exec {sys.executable} {FAKE} --port {port} --served-model-name fake-model'
    return {"target": {"path": str(tmp_path), "name": "fake-model", "num_hidden_layers": 8, "vocab_size": 1000},
            "serve": {"engine": "command", "port": port, "log_dir": str(tmp_path / "logs"),
                      "command": ["sh", "-c", script, "sh", "--api-key", "{secret:HF_TOKEN}"],
                      "health_url": f"http://127.0.0.1:{port}/health", "secrets": {"HF_TOKEN": reference},
                      "env": {"NCCL_ALGO": "Ring"}, "stall_timeout_s": 10, "startup_timeout_s": 20}}


def test_a_secret_reaches_the_server_and_no_file_we_write(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANTED_FOR_TEST", PLANTED)
    cfg = parse_config(secret_profile(tmp_path, "env:PLANTED_FOR_TEST"))
    assert PLANTED not in cfg.model_dump_json()  # the configuration holds the reference only
    seen: list[str] = []
    result = check_server(cfg, on_line=seen.append, poll_s=0.1)
    assert result["status"] == "ready", result["message"]
    # the server got the value (its line shows it arrived non-empty, masked on the way to us)
    assert f"received token={MASK}" in seen
    assert PLANTED not in json.dumps(result, default=str) and not any(PLANTED in line for line in seen)
    written = [p for p in (tmp_path / "logs").rglob("*") if p.is_file()]
    assert {p.suffix for p in written} >= {".log", ".json"}
    for path in written:
        assert PLANTED.encode() not in path.read_bytes(), path
        assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"
    launch = json.loads(next((tmp_path / "logs").glob("*.launch.json")).read_text())
    # NCCL_NVLS_ENABLE=0 is our own GPU-host default (drafter/launch_env.py), safe to show
    assert launch["env_from_config"] == {"HF_TOKEN": MASK, "NCCL_ALGO": "Ring", "NCCL_NVLS_ENABLE": "0"}
    assert launch["argv"][-2:] == ["--api-key", MASK]


def test_unresolvable_or_literal_secrets_are_refused_before_any_launch(tmp_path, monkeypatch):
    monkeypatch.delenv("PLANTED_FOR_TEST", raising=False)
    cfg = parse_config(secret_profile(tmp_path, "env:PLANTED_FOR_TEST"))
    with pytest.raises(SecretError, match="serve.secrets.HF_TOKEN: environment variable PLANTED_FOR_TEST is not set"):
        check_server(cfg)
    assert not list((tmp_path / "logs").glob("*.pid.json"))
    with pytest.raises(ConfigError, match="serve: secrets.HF_TOKEN: not a secret reference") as info:
        parse_config(secret_profile(tmp_path, PLANTED))
    assert PLANTED not in str(info.value)
    # outside Prefect (the tasks register the prefect: resolver when they are imported)
    monkeypatch.setattr("drafter.secrets._RESOLVERS", {})
    with pytest.raises(SecretError, match="prefect: references resolve only inside a Prefect run"):
        check_server(parse_config(secret_profile(tmp_path, "prefect:hf-token")))


def test_counts_and_paths_are_not_secrets():
    """Whole words only: a saved launch record must reproduce the command (the draft-token count)."""
    argv = ["--speculative-num-draft-tokens", "4", "--max-total-tokens", "4096", "--tokenizer-path", "/m",
            "--api-key", PLANTED, "--token", PLANTED, "--ssl-keyfile-password", PLANTED]
    assert mask_argv(argv) == ["--speculative-num-draft-tokens", "4", "--max-total-tokens", "4096",
                               "--tokenizer-path", "/m", "--api-key", MASK, "--token", MASK,
                               "--ssl-keyfile-password", MASK]


def test_a_secret_after_a_harmless_looking_flag_is_masked_by_value(tmp_path, monkeypatch):
    """Issue 32: `--extra-x {secret:MYTOK}` and `--header=Authorization: Bearer {secret:MYTOK}` were
    saved resolved (only `--hf-token` style flags were masked): the value is masked wherever it stands,
    in the launch record, the pid file (read while the server runs) and every file of the run."""
    from drafter.serving.ownership import pid_file
    from drafter.serving.session import ServerSession

    monkeypatch.setenv("PLANTED_FOR_TEST", PLANTED)
    raw = secret_profile(tmp_path, "env:PLANTED_FOR_TEST")
    raw["serve"]["secrets"] = {"MYTOK": "env:PLANTED_FOR_TEST"}
    raw["serve"]["command"] = raw["serve"]["command"][:4] + [
        "--extra-x", "{secret:MYTOK}", "--header=Authorization: Bearer {secret:MYTOK}"]
    cfg = parse_config(raw)
    with ServerSession(cfg, poll_s=0.1, grace_s=3.0) as served:
        assert served.process.spec.argv[-2] == PLANTED  # the server got the value itself
        pid_text = pid_file(served.log_path).read_text()
        launch = json.loads(served.launch_path.read_text())
    assert launch["argv"][-3:] == ["--extra-x", MASK, "--header=Authorization: Bearer " + MASK]
    assert PLANTED not in pid_text and json.loads(pid_text)["argv"][-2] == MASK
    for path in (tmp_path / "logs").rglob("*"):
        assert PLANTED.encode() not in path.read_bytes(), path


def test_serve_env_warnings_by_name_and_by_url_credentials():
    """Issue 32: TOKENIZERS_PARALLELISM is a tuning flag (no warning, its value kept in records); a
    URL carrying a password is a secret whatever the variable's name."""
    from drafter.secrets import secret_looking_env

    warnings = secret_looking_env({"TOKENIZERS_PARALLELISM": "false", "DATABASE_URL": "postgres://u:PASSWORD@h/db",
                                   "CACHE_URL": "https://cache.example/x", "HF_TOKEN": "hf_x",
                                   "FEED": "https://h/feed?token=abc123"})
    assert [w.split(" ", 1)[0] for w in warnings] == ["serve.env.DATABASE_URL", "serve.env.FEED", "serve.env.HF_TOKEN"]
    assert "URL carrying credentials" in warnings[0] and "PASSWORD" not in " ".join(warnings)
    assert mask_env({"TOKENIZERS_PARALLELISM": "false"}) == {"TOKENIZERS_PARALLELISM": "false"}
    assert mask_env({"HF_TOKEN": "x", "TOKENIZER_SECRET": "y"}) == {"HF_TOKEN": MASK, "TOKENIZER_SECRET": MASK}
