"""Our reference inference server: a Hugging Face target with EAGLE-3 speculative decoding
behind SGLang-compatible flags, start-up log lines and endpoints (contract sections 3-5).

    python -m drafter.engines.reference.reference_server --model-path DIR --host H --port P \
        [--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR \
         --speculative-num-steps S --speculative-eagle-topk 1 --speculative-num-draft-tokens S+1 \
         [--simulate-accept-length A]] \
        [--fault hang:<phase> | crash:<phase> | slow:<phase>:<seconds> | refuse-generation | never-healthy]

Start-up follows SGLang's order: weights -> KV cache -> HTTP server -> warmup generation -> ready.
The port is only bound after loading, so it refuses connections while the model loads. Requests are
served one at a time by the engine (a lock), which keeps per-request accounting exact.
`/v1/chat/completions` with `return_token_ids: true` also answers the generated ids and the prompt
ids in vLLM's fields (`choices[0].token_ids`, `prompt_token_ids`), so one client reads both.

`--simulate-accept-length A` (the bench's accept-length curve, SGLang's SGLANG_SIMULATE_ACC_LEN in
spirit): every verify accepts A - 1 drafts on average instead of the ones the target agrees with
(drafter.engines.reference.speculative.ForcedAccepts), so cycles cost what real ones with accept length A
cost; the output is not the target's. Reported as `simulate_accept_length` in /get_server_info.

Faults (tests of the readiness gate; all off by default) act at the start of a phase:
  hang      no progress and no log line ever again; the process stays alive
  crash     an error line and a traceback, then exit 1
  slow      the phase takes that long, with a progress line about every second
  refuse-generation   ready and healthy, but every generation answers HTTP 500
  never-healthy       HTTP up, /health stays 503, no more log lines

The HTTP side (endpoints, request parsing, `ServerState`, `build_app`) is
drafter.engines.reference.reference_http; this module is the command line, the faults, loading and start-up.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from drafter.engines.reference.reference_http import WARMUP_TEXT, ServerState, build_app, encode, layer_id_convention

PHASES = ("load_weights", "kv_cache", "warmup")
GB = 1 << 30

log = logging.getLogger("drafter.reference_server")


# =========================================================================== flags and faults

@dataclass
class Faults:
    hang: set[str] = field(default_factory=set)
    crash: set[str] = field(default_factory=set)
    slow: dict[str, float] = field(default_factory=dict)
    refuse_generation: bool = False
    never_healthy: bool = False

    @classmethod
    def parse(cls, specs: list[str]) -> "Faults":
        faults = cls()
        for spec in specs:
            kind, _, rest = spec.partition(":")
            if kind in ("refuse-generation", "never-healthy") and not rest:
                setattr(faults, kind.replace("-", "_"), True)
                continue
            phase, _, seconds = rest.partition(":")
            if kind not in ("hang", "crash", "slow") or phase not in PHASES:
                raise ValueError(f"--fault {spec!r}: expected hang:<phase>, crash:<phase>, "
                                 f"slow:<phase>:<seconds>, refuse-generation or never-healthy; "
                                 f"phases: {', '.join(PHASES)}")
            if kind == "slow":
                try:
                    faults.slow[phase] = float(seconds)
                except ValueError:
                    raise ValueError(f"--fault {spec!r}: slow needs seconds, e.g. slow:{phase}:30") from None
            elif seconds:
                raise ValueError(f"--fault {spec!r}: {kind} takes no argument after the phase")
            else:
                getattr(faults, kind).add(phase)
        return faults

    def at(self, phase: str) -> None:
        """Apply the faults injected for this phase (called at its start)."""
        if phase in self.slow:
            end = time.monotonic() + self.slow[phase]
            while (left := end - time.monotonic()) > 0:
                log.info(f"[{phase}] still working (injected slow fault, {left:.1f} s left)")
                time.sleep(min(1.0, left))
        if phase in self.crash:
            try:
                raise RuntimeError(f"injected fault crash:{phase}")
            except RuntimeError:
                log.error(f"Scheduler hit an exception: {traceback.format_exc()}")
            log.error(f"Initialization failed in phase {phase}. Exiting with code 1.")
            _flush_and_exit(1)
        if phase in self.hang:
            while True:  # silent forever; SIGTERM still ends the process
                time.sleep(3600)


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)  # from any thread, even with uvicorn running


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m drafter.engines.reference.reference_server",
                                description="Reference HF server with EAGLE-3 speculative decoding")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--speculative-algorithm", default=None, choices=["EAGLE3"])
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--simulate-accept-length", type=float, default=None, metavar="A",
                   help="force A tokens per verify on average (bonus included; timing only, see the docstring)")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="fault injection for tests (repeatable), see the module docstring")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads on CPU (1 is fastest for tiny models on busy hosts)")
    # SGLang flags a launcher may pass; recorded in server_info, meaningless for this engine.
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-custom-all-reduce", action="store_true")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--log-level", default="info")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; every error exits with code 2 and says what is wrong."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.faults = Faults.parse(args.fault)
    except ValueError as err:
        parser.error(str(err))
    if args.tp_size != 1:
        parser.error(f"--tp-size {args.tp_size}: the reference engine runs on one device")
    spec = {"--speculative-num-steps": args.speculative_num_steps,
            "--speculative-eagle-topk": args.speculative_eagle_topk,
            "--speculative-num-draft-tokens": args.speculative_num_draft_tokens}
    given = [k for k, v in spec.items() if v is not None]
    if args.speculative_algorithm is None:
        if args.simulate_accept_length is not None:
            given.append("--simulate-accept-length")
        if given or args.speculative_draft_model_path:
            parser.error(f"{given + (['--speculative-draft-model-path'] if args.speculative_draft_model_path else [])} "
                         "given without --speculative-algorithm EAGLE3")
        return args
    if not args.speculative_draft_model_path:
        parser.error("--speculative-algorithm EAGLE3 needs --speculative-draft-model-path")
    if given and len(given) != 3:
        parser.error(f"set all of --speculative-num-steps, --speculative-eagle-topk and "
                     f"--speculative-num-draft-tokens or none (SGLang asserts); given: {given}")
    if not given:  # SGLang's choice for non-Llama-tree setups; topk 1 is all we support
        args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = 3, 1, 4
    s, k, d = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
    if s < 1:
        parser.error(f"--speculative-num-steps {s}: must be >= 1")
    if k != 1:
        parser.error(f"--speculative-eagle-topk {k}: the reference engine drafts a chain (topk 1 only)")
    if d != s + 1:
        parser.error(f"--speculative-num-draft-tokens {d}: with topk 1 it must be num_steps + 1 = {s + 1}")
    a = args.simulate_accept_length
    if a is not None and not 1.0 <= a <= s + 1:
        parser.error(f"--simulate-accept-length {a}: must be in [1, num_steps + 1 = {s + 1}] "
                     "(tokens per verify, bonus included)")
    return args



# =========================================================================== start-up

def _avail_mem_gb(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / GB
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GB
    except (ValueError, OSError):
        return float("nan")


def _log_load_end(device, start: float, before_gb: float, kind: str, dtype) -> None:
    """SGLang's "Load weight end." line for a load that began at `start` with `before_gb` free."""
    after = _avail_mem_gb(device)
    log.info(f"Load weight end. elapsed={time.perf_counter() - start:.2f} s, type={kind}, "
             f"dtype={dtype}, avail mem={after:.2f} GB, mem usage={max(before_gb - after, 0):.2f} GB.")


def load_engine(args: argparse.Namespace):
    """Weights (target, then draft) and the KV cache phase, with SGLang's log lines."""
    import torch

    from drafter.target import HFTarget, resolve_device

    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    device = resolve_device(args.device)
    faults: Faults = args.faults

    log.info(f"Load weight begin. avail mem={_avail_mem_gb(device):.2f} GB")
    faults.at("load_weights")
    start, before = time.perf_counter(), _avail_mem_gb(device)
    target = HFTarget(args.model_path, device=str(device), dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    if args.tokenizer_path:
        from transformers import AutoTokenizer

        target.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
    _log_load_end(device, start, before, target.architecture, target.dtype)

    drafter = None
    if args.speculative_algorithm:
        from drafter.model import ARCHITECTURE, load_drafter

        log.info(f"Load weight begin. avail mem={_avail_mem_gb(device):.2f} GB")
        start, before = time.perf_counter(), _avail_mem_gb(device)
        drafter = load_drafter(args.speculative_draft_model_path, device=device, dtype=target.dtype)
        _log_load_end(device, start, before, ARCHITECTURE, target.dtype)

    from drafter.engines.reference.speculative import SpeculativeEngine

    faults.at("kv_cache")
    engine = SpeculativeEngine(target, drafter, args.speculative_num_steps or 0,
                               forced_accept_length=args.simulate_accept_length)
    # Caches are allocated per request on demand; report what one full-context request takes.
    cfg = target.config
    head_dim = getattr(cfg, "head_dim", None) or target.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    tokens = target.max_position_embeddings
    size = tokens * target.num_layers * kv_heads * head_dim * torch.finfo(target.dtype).bits / 8 / GB
    log.info(f"KV Cache is allocated. #tokens: {tokens}, K size: {size:.2f} GB, V size: {size:.2f} GB")
    if drafter is not None:
        log.info(f"Speculative decoding: EAGLE3 num_steps={args.speculative_num_steps} topk=1 "
                 f"num_draft_tokens={args.speculative_num_draft_tokens}, aux layer ids {target.aux_layer_ids} "
                 f"({layer_id_convention()})")
        if args.simulate_accept_length is not None:
            log.info(f"Simulated acceptance: {args.simulate_accept_length} tokens per verify (timing only: "
                     f"outputs are not the target's)")
    log.info(f"Memory pool end. avail mem={_avail_mem_gb(device):.2f} GB")
    return engine


def warmup(state: ServerState, server) -> None:
    """After the port is open: one real generation, then the ready line (SGLang's order)."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    if state.faults.never_healthy:
        return  # HTTP up, /health stays 503, nothing more in the log
    with state.engine_lock:  # a slow or hung warmup occupies the engine, as a real one would
        state.faults.at("warmup")
    from drafter.engines.reference.speculative import SamplingParams

    try:
        result, _ = state.generate(encode(state, WARMUP_TEXT), SamplingParams(max_new_tokens=8, temperature=0.0),
                                   internal=True)
    except Exception:  # noqa: BLE001
        log.error(f"Initialization failed. warmup error: {traceback.format_exc()}")
        _flush_and_exit(1)
    state.ready = True
    log.info(f"End of warmup: {result.completion_tokens} tokens, {result.spec_verify_ct} verify steps.")
    log.info("The server is fired up and ready to roll!")


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)  # flushes every record
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.handlers[:] = [handler]  # idempotent: main() may run more than once in a process (tests)
    log.setLevel(level.upper())
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _setup_logging(args.log_level)

    server_ref: dict[str, Any] = {}

    def on_sigterm(signum, frame):
        # While loading (or hung): leave at once. While serving: let uvicorn drain and stop.
        server = server_ref.get("server")
        if server is None:
            raise SystemExit(0)
        server.should_exit = True
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigterm)

    log.info(f"server_args={vars(args) | {'faults': args.fault}}")
    try:
        return _serve(args, server_ref)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - say it in SGLang's words so a watchdog sees it at once
        log.error(f"Scheduler hit an exception: {traceback.format_exc()}")
        log.error("Initialization failed.")
        return 1


def _serve(args: argparse.Namespace, server_ref: dict[str, Any]) -> int:
    # The web stack first: a missing dependency must fail in a second, not after a long load.
    import fastapi  # noqa: F401
    import uvicorn

    engine = load_engine(args)
    state = ServerState(args, engine, args.served_model_name or args.model_path)

    class Server(uvicorn.Server):
        def capture_signals(self):  # our SIGTERM handler stays in charge
            import contextlib

            return contextlib.nullcontext()

    config = uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=5)
    server = Server(config)
    server_ref["server"] = server
    threading.Thread(target=warmup, args=(state, server), name="warmup", daemon=True).start()
    server.run()
    if not server.started:
        log.error(f"Initialization failed: could not serve on {args.host}:{args.port}")
        return 1
    log.info("Server shut down cleanly.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
