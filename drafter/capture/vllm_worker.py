"""Runs INSIDE the vLLM environment (serve.python / dump.python), started by drafter.capture.vllm.

Imports only the standard library, torch, safetensors and vllm: it is run as a script by the vLLM
interpreter, where the drafter package is not installed. Protocol: one JSON request per line on
stdin ({"sequences": [[token ids], ...]}), one JSON answer per line on the result fd
({"files": [path per sequence]} or {"error": "..."}); each file holds `hidden_states`
[T, len(layer_ids), H] at vLLM's layer ids (id i = input of layer i; id N = the last layer's
output before the final norm) and the `token_ids` it was computed for. Logs go to stdout/stderr.

The stock ExampleHiddenStatesConnector copies through CUDA streams, events and pinned memory; the
CPU subclass below extracts and writes synchronously (contract section 9: it works on CPU).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys


def _cpu_connector_module(directory: str) -> str:
    """Write the CPU connector as an importable module (vLLM loads it by module path in its
    engine process) and return the module name."""
    source = '''
import fcntl, os
import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)


class _Done:
    def query(self):
        return True

    def synchronize(self):
        pass


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Synchronous extraction: no CUDA stream, event or pinned buffer."""

    def _submit_async_write(self, pending):
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        n = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots, n).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": hidden.contiguous(), "token_ids": pending.token_ids.clone()},
                      pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
'''
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "drafter_cpu_hs_connector.py"), "w") as fh:
        fh.write(source)
    sys.path.insert(0, directory)
    os.environ["PYTHONPATH"] = directory + os.pathsep + os.environ.get("PYTHONPATH", "")
    return "drafter_cpu_hs_connector"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layer-ids", required=True, help="JSON list of vLLM layer ids to extract")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--result-fd", type=int, required=True)
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--engine-args", default="{}", help="JSON dict of extra vllm.LLM arguments")
    args = ap.parse_args()
    result = os.fdopen(args.result_fd, "w", buffering=1)

    import torch
    from safetensors.torch import load_file  # noqa: F401  (the connector's writer needs it too)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    layer_ids = [int(i) for i in json.loads(args.layer_ids)]
    on_cpu = not torch.cuda.is_available()
    connector = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                 "kv_connector_extra_config": {"shared_storage_path": args.out_dir}}
    if on_cpu:
        connector.update(kv_connector="CpuHiddenStatesConnector",
                         kv_connector_module_path=_cpu_connector_module(os.path.join(args.out_dir, "_module")))
    llm = LLM(model=args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
              max_model_len=args.max_model_len, trust_remote_code=args.trust_remote_code,
              enable_prefix_caching=False, enforce_eager=on_cpu,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}},
              kv_transfer_config=connector, **json.loads(args.engine_args))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    result.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            sequences = json.loads(line)["sequences"]
            outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
            files = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
            if any(f is None for f in files):
                raise RuntimeError("vLLM returned no hidden_states_path (is the KV connector active?)")
            for f in files:  # written after the request finished: wait for the writer's lock, as vLLM's reader does
                with open(f + ".lock") as lock:
                    fcntl.flock(lock, fcntl.LOCK_SH)
            result.write(json.dumps({"files": files}) + "\n")
        except Exception as err:  # reported to the caller, which raises with the log tail
            result.write(json.dumps({"error": f"{type(err).__name__}: {err}"}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
