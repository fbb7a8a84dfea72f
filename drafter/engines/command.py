"""Any server program: `serve.command` with placeholders plus a health URL (engine `command`)."""
from __future__ import annotations

import os
from urllib.parse import urlsplit

import httpx

from drafter.engines.base import (Engine, GenerateStyle, LaunchSpec, Phase, _forced, _launch_env, _no_faults,
                                  _probe_host, _rx, keep_secret_placeholders, speculative_flags)
from drafter.engines.sglang import sglang_server_info, sglang_settings_from_info
from drafter.server_errors import ServerConfigError

GENERIC_PHASES: tuple[Phase, ...] = (
    Phase("launch", None),
    Phase("http_server", _rx(r"Uvicorn running on https?://", r"Application startup complete",
                             r"[Ll]istening on https?://", r"Running on https?://")),
)


class CommandEngine(Engine):
    """`serve.command` as given, with {host} {port} {model_path} {served_model_name}
    {draft_path} placeholders filled in; ready when `serve.health_url` answers and the
    OpenAI-compatible listing and a 1-token completion work."""

    name = "command"
    # the bench appends SGLang's speculative flags to serve.command (drafter.bench.plan.server_config)
    per_batch_note = ("Engine command: the speculative arguments are appended to serve.command, as the bench "
                      "launched it; one server per batch size.")
    generate_style: GenerateStyle = "openai"
    phases = GENERIC_PHASES
    # what the stages ask (drafter.engines.base.Engine): a user's own server
    flush_cache = None           # SGLang's /flush_cache: tried
    checks_draft_dir = False     # a user's own server may take another draft format
    not_streaming_note = "engine command: TTFT and inter-token latency are not measured (no known streaming API)"

    def serve_problem(self, serve):
        if not serve.command:
            return "engine 'command' needs `command` (the server command line)"
        return None

    def client_style(self, settings):
        # SGLang's /generate when the command answered SGLang's /get_server_info (read_settings)
        return "sglang" if settings else "openai"

    def servers_share_no_gpu(self, serve):
        return True

    def bench_serve_update(self, serve, spec, draft_path):
        # no placeholder for the speculative settings: SGLang's speculative flags are appended to
        # serve.command (as the reference engine takes them), so the command must accept them
        return {"command": list(serve.command or []) + speculative_flags(spec, draft_path)}

    def build_launch(self, cfg, draft_path=None, log_dir=None, *, faults=(), forced_accept_length=None):
        _no_faults(self.name, faults)
        s, t = cfg.serve, cfg.target
        _forced(self, s.speculative, draft_path, forced_accept_length)  # refused: no known knob
        if not s.command:
            raise ServerConfigError("engine 'command' needs serve.command")
        if s.extra_args:
            raise ServerConfigError("serve.extra_args is not used by engine 'command': "
                                    "put the flags into serve.command")
        values = {"host": s.host, "port": str(s.port), "model_path": t.path,
                  "served_model_name": t.served_name, "draft_path": draft_path or ""}
        try:
            # {secret:NAME} stays for the session, which resolves serve.secrets at launch
            argv = [keep_secret_placeholders(arg).format(**values) if "{" in arg else arg for arg in s.command]
        except (KeyError, IndexError, ValueError) as err:
            raise ServerConfigError(f"serve.command: bad placeholder {err} "
                                    f"(known: {', '.join('{' + k + '}' for k in values)})") from None
        health = s.health_url or f"http://{_probe_host(s.host)}:{s.port}/health"
        parts = urlsplit(health)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ServerConfigError(f"serve.health_url: not an http(s) URL: {health!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        env, overrides = _launch_env(cfg)
        return LaunchSpec(
            engine=self.name, argv=argv, env=env, env_overrides=overrides, cwd=os.getcwd(),
            host=parts.hostname, port=port, base_url=f"{parts.scheme}://{parts.netloc}",
            health_url=health, served_model_name=t.served_name, generate_style=self.generate_style,
            model_path=None, draft_path=draft_path, log_dir=str(log_dir) if log_dir else None)

    def read_settings(self, client, log_text=""):
        # Best effort: an SGLang-compatible command answers /get_server_info; anything else
        # reports nothing, and check_speculative_settings then says it could not verify.
        try:
            return sglang_settings_from_info(sglang_server_info(client))
        except (RuntimeError, httpx.HTTPError, ValueError):
            return {}
