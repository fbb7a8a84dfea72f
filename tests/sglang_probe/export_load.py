"""Load our SGLang exports with SGLang's OWN draft model and run its forward: a script run by the
interpreter of the lite SGLang venv (`.venv-sglang/bin/python export_load.py < request.json`), with
tests/sglang_standins on PYTHONPATH and SGLANG_USE_CPU_ENGINE=1 (tests/fixtures/sglang_env.py). It
imports only the standard library, torch, safetensors, transformers and sglang, never the project.

Request (JSON on stdin):
  {"exports": [{"dir": <export dir>, "out": <safetensors file to write the forward into>}, ...],
   "model_dir": <dir whose config.json server-argument resolution reads (default: the first export)>,
   "inputs": <a .safetensors file holding input_ids [T] int64, positions [T] int64, hidden [T, 3*H]>
             | {"input_ids": [...], "positions": [...], "hidden": [[...], ...]}}
Answer (one JSON line on stdout; SGLang's own prints go to stderr):
  {"version": "0.5.23", "exports": [report | {"error": "...", "where": "...", "stage": "build|load|forward"}]}
  report = {"parameters": {sglang name: [shape]}, "unloaded": [names still all-NaN],
            "partly_unloaded": [names with some NaN], "mismatched": {name: why},
            "compared": {sglang name: [file keys]}, "unused_file_keys": [keys no parameter was compared with],
            "hot_token_id_ok": bool, "hot_token_id": [...], "fc_in_features": int,
            "num_aux_hidden_states": int, "forward": {"logits": [T, V_draft], "hidden": [T, H]} | {"error": ...}}
  The forward's tensors ("logits", "hidden" = pre-norm hidden) are written to the export's "out" file.

What runs is SGLang's: `LlamaForCausalLMEagle3(AutoConfig.from_pretrained(dir))`, its `load_weights` over
the file's items after every parameter is set to NaN (so a key SGLang silently skips leaves NaN), and
`draft.model(input_ids, positions, forward_batch)` in EXTEND mode. Only attention is ours: SGLang's
CPU attention needs sgl-kernel C++ ops this host lacks, so a causal SDPA backend (GQA, `layer.scaling`)
is installed through SGLang's own `forward_context`. Logits are `lm_head` over the normed hidden, as
SGLang's LogitsProcessor computes them for the draft vocab.
"""
import contextlib
import json
import math
import os
import socket
import sys
import traceback
from types import SimpleNamespace

# Export key -> how SGLang's parameter is made of file tensors (fused along dim 0, in this order).
FUSED = {
    "model.layers.0.self_attn.qkv_proj.weight": ["midlayer.self_attn.q_proj.weight",
                                                 "midlayer.self_attn.k_proj.weight",
                                                 "midlayer.self_attn.v_proj.weight"],
    "model.layers.0.mlp.gate_up_proj.weight": ["midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"],
}


def _error(err: BaseException, stage: str) -> dict:
    return {"error": f"{type(err).__name__}: {err}".strip()[:2000], "stage": stage,
            "where": traceback.format_exception(err)[-2].strip()[:500] if err.__traceback__ else ""}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_runtime(model_dir: str) -> None:
    """What 0.5.23 needs before a model is built on CPU: published server args (the draft reads
    speculative settings from them; resolution reads `model_dir`'s config.json) and a one-rank gloo
    parallel runtime (its layers ask for TP/PP groups)."""
    from sglang.srt.distributed.bootstrap import init_parallel_runtime
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(["--model-path", model_dir, "--device", "cpu", "--tp-size", "1", "--dtype", "float32"])
    publish(sa, role="test", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    init_parallel_runtime(server_args=sa, device="cpu", dist_port=_free_port())


class CausalSDPA:
    """The attention backend of the forward: causal scaled-dot-product attention over the extend's
    own tokens (one sequence, no KV cache), grouped-query heads repeated."""

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        import torch
        import torch.nn.functional as F

        t = q.shape[0]
        q = q.view(t, layer.tp_q_head_num, layer.qk_head_dim).transpose(0, 1)
        k = k.view(t, layer.tp_k_head_num, layer.qk_head_dim).transpose(0, 1)
        v = v.view(t, layer.tp_v_head_num, layer.v_head_dim).transpose(0, 1)
        groups = layer.tp_q_head_num // layer.tp_k_head_num
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling)
        return out.transpose(0, 1).reshape(t, layer.tp_q_head_num * layer.v_head_dim)


def read_inputs(spec):
    import torch

    if isinstance(spec, str):
        from safetensors.torch import load_file

        data = load_file(spec)
    else:
        data = {k: torch.tensor(v) for k, v in spec.items()}
    return (data["input_ids"].to(torch.int64), data["positions"].to(torch.int64),
            data["hidden"].to(torch.float32))


def build(export_dir: str):
    import torch
    from transformers import AutoConfig

    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    config = AutoConfig.from_pretrained(export_dir)
    with torch.device("cpu"):
        draft = LlamaForCausalLMEagle3(config)
    return draft.eval()


def load_and_compare(draft, export_dir: str) -> dict:
    import torch
    from safetensors.torch import load_file

    tensors = load_file(f"{export_dir}/model.safetensors")
    params = dict(draft.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(math.nan)
    draft.load_weights(iter(tensors.items()))  # SGLang's own loader, its own name mapping
    report = {"parameters": {n: list(p.shape) for n, p in params.items()}}
    report["unloaded"] = sorted(n for n, p in params.items() if torch.isnan(p).all())
    report["partly_unloaded"] = sorted(n for n, p in params.items()
                                       if torch.isnan(p).any() and not torch.isnan(p).all())
    # Which file tensors each parameter should equal: the fused ones by FUSED, the others by name
    # (SGLang's draft names = ours with 'midlayer' -> 'layers.0' and 'model.' in front, lm_head at top).
    mismatched, compared = {}, {}
    for name, param in params.items():
        if name in FUSED:
            keys = FUSED[name]
        else:
            short = name.removeprefix("model.").replace("layers.0.", "midlayer.")
            keys = [short]
        compared[name] = keys
        missing = [k for k in keys if k not in tensors]
        if missing:
            mismatched[name] = f"file lacks {missing} (our export's names; SGLang may have loaded it from another)"
            continue
        want = torch.cat([tensors[k].float() for k in keys], dim=0) if len(keys) > 1 else tensors[keys[0]].float()
        if tuple(want.shape) != tuple(param.shape):
            mismatched[name] = f"shape {list(param.shape)} in SGLang, file {list(want.shape)}"
        elif not torch.equal(param.detach().float(), want):
            diff = (param.detach().float() - want).abs()
            mismatched[name] = f"values differ (max abs diff {float(diff.nan_to_num(math.inf).max()):.3g})"
    report["mismatched"] = mismatched
    report["compared"] = compared
    used = {k for keys in compared.values() for k in keys} | {"d2t", "t2d"}
    report["unused_file_keys"] = sorted(set(tensors) - used)
    hot = draft.get_hot_token_id()
    d2t = tensors.get("d2t")
    report["hot_token_id"] = None if hot is None else [int(i) for i in hot.tolist()]
    report["hot_token_id_ok"] = (hot is not None and d2t is not None
                                 and torch.equal(hot.to(torch.int64), d2t.to(torch.int64) + torch.arange(len(d2t))))
    report["fc_in_features"] = int(draft.model.fc.in_features)
    report["num_aux_hidden_states"] = int(draft.model.num_aux_hidden_states)
    return report


def run_forward(draft, input_ids, positions, hidden) -> dict:
    import torch
    import torch.nn.functional as F

    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    t = int(input_ids.shape[0])
    fb = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, spec_info=SimpleNamespace(hidden_states=hidden),
        mm_input_embeds=None, contains_mm_inputs=lambda: False, moe_num_token_non_padded=None,
        global_num_token_non_padded_cpu=t, extend_seq_lens=torch.tensor([t]), extend_start_loc=torch.tensor([0]),
        batch_size=1, seq_lens=torch.tensor([t]), mha_return_lse=False)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=CausalSDPA()), forward_batch=fb):
        normed, aux = draft.model(input_ids, positions, fb)
        logits = F.linear(normed, draft.lm_head.weight)
    return {"logits": logits.float().contiguous(), "hidden": aux[0].float().contiguous()}


def one_export(case: dict, inputs) -> dict:
    from safetensors.torch import save_file

    try:
        draft = build(case["dir"])
    except BaseException as err:
        return _error(err, "build")
    try:
        report = load_and_compare(draft, case["dir"])
    except BaseException as err:  # e.g. a shape assertion inside SGLang's weight loader
        return _error(err, "load")
    try:
        out = run_forward(draft, *inputs)
        save_file(out, case["out"])
        report["forward"] = {k: list(v.shape) for k, v in out.items()}
    except BaseException as err:
        report["forward"] = _error(err, "forward")
    return report


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # exports are local directories: never reach a hub
    request = json.loads(sys.stdin.read() or "{}")
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # SGLang prints; only our JSON goes to stdout
        import sglang
        import torch

        torch.manual_seed(0)
        torch.set_num_threads(1)  # tiny shapes: threads only add barrier waits
        init_runtime(request.get("model_dir") or request["exports"][0]["dir"])
        inputs = read_inputs(request["inputs"])
        answer = {"version": sglang.__version__, "exports": [one_export(c, inputs) for c in request["exports"]]}
    out.write(json.dumps(answer) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
