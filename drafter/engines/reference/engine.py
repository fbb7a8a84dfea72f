"""Our reference engine (drafter/engines/reference/reference_server.py) as a launched server: its command line.
It speaks SGLang's flags, start-up lines and endpoints, so everything else is SGLang's."""
from __future__ import annotations

import sys

from drafter.engines.base import ForcedAcceptance, _forced, _with_forced, speculative_flags
from drafter.engines.sglang import SGLangEngine
from drafter.server_errors import ServerConfigError


class ReferenceEngine(SGLangEngine):
    """Our Hugging Face based server (drafter/engines/reference/reference_server.py): SGLang flags,
    SGLang start-up lines and SGLang-compatible endpoints, so it shares the SGLang readers."""

    name = "reference"
    # SGLang's API and /flush_cache, but no streaming; its layer ids are ours (check_layer_ids) and it
    # has no installed version to ask, and no SGLang to resolve its flags (launch_rules, validate_profile)
    streams = False
    version_packages = None
    not_streaming_note = "the reference engine does not stream: TTFT and inter-token latency are not measured"
    per_batch_note = ("The reference engine takes one speculative setting per server: launch one server per batch "
                      "size, or the one for the batch size it will serve.")

    def build_launch(self, cfg, draft_path=None, log_dir=None, *, faults=(), forced_accept_length=None):
        s, t = cfg.serve, cfg.target
        forced = _forced(self, s.speculative, draft_path, forced_accept_length)
        if s.tp_size != 1:
            raise ServerConfigError(f"the reference engine runs on one device; serve.tp_size={s.tp_size} "
                                    f"cannot be honoured")
        argv = [sys.executable, "-m", "drafter.engines.reference.reference_server",
                "--model-path", t.path, "--host", s.host, "--port", str(s.port),
                "--served-model-name", t.served_name, "--device", s.device, "--dtype", t.dtype]
        argv += speculative_flags(s.speculative, draft_path)
        for fault in faults:  # test-only fault injection, e.g. "hang:load_weights"
            argv += ["--fault", fault]
        argv += list(s.extra_args)
        return _with_forced(self._host_port_spec(cfg, argv, draft_path, log_dir), forced)

    def forced_acceptance(self, accept_length, num_steps):
        # reference_server.py --simulate-accept-length -> speculative.py ForcedAccepts
        return ForcedAcceptance(accept_length, args=("--simulate-accept-length", str(float(accept_length))),
                                source="drafter/engines/reference/reference_server.py --simulate-accept-length")

    def runs_without_gpu(self, serve):
        return serve.device == "cpu"

    def speculative_problem(self, spec):
        if spec.is_set and spec.eagle_topk != 1:
            return (f"the reference engine drafts a chain: eagle_topk must be 1, got {spec.eagle_topk} "
                    f"(its server would exit at start)")
        return None

    def check_layer_ids(self, draft_path, target_path, python):
        from drafter.engines.layer_check import check_reference

        if draft_path is None:
            return {"checked": False, "why": "no drafter"}
        return check_reference(draft_path, target_path)

    def launch_rules(self, cfg, argv, env, python, layer_ids, *, speculating):
        return {}

    def validate_profile(self, cfg):
        return ""
