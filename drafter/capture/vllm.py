"""The `vllm` capture backend (`dump.backend: vllm`): the target runs in vLLM, which can shard it
over several GPUs (`dump.tp_size`; the field notes' 1T model needs 8 per copy), and returns per-layer
hidden states through its `extract_hidden_states` speculative method and a KV-transfer connector.

vLLM lives in its own environment (`dump.python`, else `serve.python`): a worker process
(drafter/capture/vllm_worker.py, run by that interpreter) keeps one `vllm.LLM` loaded for the whole
dump and answers batches over a pipe. What comes back is put into OUR form here, so the shards are
those of the `hf` backend (drafter.capture.hf.capture_batch):
- layer ids: ours converted with drafter.layers.engine_layer_ids (vLLM id = ours + 1), plus id N
  (the last layer's output, which vLLM returns BEFORE the final norm);
- the final hidden state: that output through the target's own final RMSNorm (weight and eps read
  from the target's files), which is what `hidden_states` holds in our shards (the input of lm_head).
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafter.capture.base import CaptureShape
from drafter.dtypes import dtype_name
from drafter.errors import DrafterError
from drafter.layers import check_aux_layer_ids, engine_layer_ids

WORKER = Path(__file__).with_name("vllm_worker.py")


class VLLMCaptureError(DrafterError):
    """The vLLM capture worker failed to start or to answer; the message carries its log tail."""

    retryable = True


def _final_norm(target_path: str) -> tuple[torch.Tensor, float]:
    """The target's final RMSNorm weight and eps, read from its files (no model load)."""
    from safetensors import safe_open

    data = json.loads((Path(target_path) / "config.json").read_text())
    text = data.get("text_config", data)
    for f in sorted(Path(target_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            keys = [k for k in fh.keys() if k.endswith("model.norm.weight") and "mtp" not in k]
            if keys:
                return fh.get_tensor(sorted(keys, key=len)[0]), float(text.get("rms_norm_eps", 1e-6))
    raise VLLMCaptureError(f"{target_path}: no '*model.norm.weight' in its safetensors files: cannot normalise "
                           "the final hidden state as the hf backend does")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm as transformers computes it (in float32, then back to the input dtype)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(torch.float32) * h if weight.dtype == torch.float32 else (weight * h.to(x.dtype))


@dataclass
class VLLMCaptureModel(CaptureShape):
    """A capture model backed by a vLLM worker process."""

    vllm_layer_ids: list[int]
    engine_version: str
    rule: str
    norm_weight: torch.Tensor
    norm_eps: float
    proc: subprocess.Popen
    results: object
    work_dir: Path
    log_path: Path
    backend: str = "vllm"
    _tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=60))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _fail(self, what: str) -> VLLMCaptureError:
        tail = "\n    ".join(self._tail) or "(no output)"
        return VLLMCaptureError(f"vLLM capture worker {what} (log {self.log_path}); last lines:\n    {tail}")

    def _answer(self) -> dict:
        line = self.results.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise self._fail(f"exited with code {self.proc.returncode}")
        return json.loads(line)

    def capture_batch(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence: (aux [T, 3, H], final [T, H]) on the CPU, as drafter.capture.hf.capture_batch."""
        from safetensors.torch import load_file

        with self._lock:
            self.proc.stdin.write(json.dumps({"sequences": [list(map(int, s)) for s in sequences]}) + "\n")
            self.proc.stdin.flush()
            answer = self._answer()
        if "error" in answer:
            raise self._fail(f"failed on a batch: {answer['error']}")
        out = []
        for seq, path in zip(sequences, answer["files"]):
            data = load_file(path)
            for p in (path, path + ".lock"):
                Path(p).unlink(missing_ok=True)
            hidden, ids = data["hidden_states"], data["token_ids"]
            if hidden.shape[:2] != (len(seq), len(self.vllm_layer_ids)) or ids.tolist() != list(seq):
                raise self._fail(f"answered {tuple(hidden.shape)} for a {len(seq)}-token sequence at "
                                 f"{len(self.vllm_layer_ids)} layers (or for other tokens)")
            hidden = hidden.to(self.dtype)
            final = rms_norm(hidden[:, -1], self.norm_weight, self.norm_eps).to(self.dtype)
            out.append((hidden[:, :-1].contiguous(), final.contiguous()))
        return out

    def close(self) -> None:
        """Stop the worker (stdin closed = done; then SIGTERM / SIGKILL of its process group)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            for sig in (15, 9):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=20)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        finally:
            self.results.close()
            shutil.rmtree(self.work_dir, ignore_errors=True)


def vllm_python(cfg) -> str:
    return cfg.dump.python or cfg.serve.python or sys.executable


def load_vllm_capture(cfg, dtype: torch.dtype, aux_layer_ids: list[int], work_root: str | None = None,
                      on_line=None) -> VLLMCaptureModel:
    """Start the worker and wait until vLLM has loaded the target (its log lines go to `on_line`)."""
    from transformers import AutoTokenizer

    from drafter.engines.layer_check import installed_version, target_architecture

    t = cfg.target
    shape = t.resolved_shape()
    num_layers, hidden = int(shape["num_hidden_layers"]), int(shape["hidden_size"])
    ours = check_aux_layer_ids(aux_layer_ids, num_layers)
    python = vllm_python(cfg)
    version = installed_version("vllm", python)
    if version is None:
        raise VLLMCaptureError(f"dump.backend vllm: vLLM is not importable with {python} (set dump.python or "
                               "serve.python to the vLLM environment's interpreter; `make vllm-env` builds one)")
    mapped = engine_layer_ids(ours, "vllm", version, target_architecture(t.path) or "?")
    layer_ids = mapped.ids + [num_layers]  # + the last layer's output (pre-norm), for the final state
    weight, eps = _final_norm(t.path)
    tok = AutoTokenizer.from_pretrained(t.path, trust_remote_code=t.trust_remote_code)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    work = Path(tempfile.mkdtemp(prefix="drafter-vllm-capture-", dir=work_root))
    log_path = work / "worker.log"
    read_fd, write_fd = os.pipe()
    # Run through runpy, not as `python drafter/capture/vllm_worker.py`: a script's directory goes first on
    # sys.path, and drafter/tokenize.py would shadow the standard library's tokenize in the vLLM process.
    run_script = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    argv = [python, "-c", run_script, str(WORKER), "--model", t.path, "--layer-ids", json.dumps(layer_ids),
            "--out-dir", str(work / "hs"), "--dtype", dtype_name(dtype), "--tensor-parallel-size", str(cfg.dump.tp_size),
            "--max-model-len", str(cfg.dump.max_length + 1), "--result-fd", str(write_fd),
            "--engine-args", json.dumps(cfg.dump.vllm_args)]
    if t.trust_remote_code:
        argv.append("--trust-remote-code")
    env = {**os.environ, **cfg.serve.env}
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            pass_fds=(write_fd,), env=env, start_new_session=True)
    os.close(write_fd)
    cm = VLLMCaptureModel(
        tokenizer=tok, device=torch.device("cpu"), dtype=dtype, aux_layer_ids=ours, num_layers=num_layers,
        hidden_size=hidden, pad_id=int(pad), vllm_layer_ids=layer_ids, engine_version=version, rule=mapped.rule,
        norm_weight=weight, norm_eps=eps, proc=proc, results=os.fdopen(read_fd, "r"), work_dir=work,
        log_path=log_path)

    def pump() -> None:  # the worker's log: to a file, the caller and the tail for error messages
        with open(log_path, "a", encoding="utf-8") as log:
            for line in proc.stdout:
                log.write(line)
                cm._tail.append(line.rstrip())
                if on_line is not None:
                    on_line(line.rstrip())

    threading.Thread(target=pump, name="vllm-capture-log", daemon=True).start()
    try:
        if not cm._answer().get("ready"):
            raise cm._fail("did not report ready")
    except BaseException:
        cm.close()
        raise
    return cm
