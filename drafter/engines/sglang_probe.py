"""Ask an installed SGLang how it reads our settings: run as a script by SGLang's own interpreter
(`python sglang_probe.py < request.json`), never imported by the project (it imports only the
standard library and sglang, so it runs in the engine's environment, not ours).

Request (JSON on stdin):
  {"resolve": [argv, ...],            # launch_server arguments (without `python -m sglang.launch_server`)
   "layers": [{"architecture": "LlamaForCausalLM", "num_layers": 32, "ids": [1, 15, 28]}, ...]}
Answer (one JSON line on stdout; SGLang's own prints go to stderr):
  {"version": "0.5.23",
   "resolve": [{"resolved": {field: value}, "overrides": [[handler, {field: value}]], "warnings": [...]}
               | {"error": "ValueError: ..."}],
   "layers": [{"layers_to_capture": [...], "capture": "input-of-layer"} | {"error": ...}]}

Resolution is SGLang's own: prepare_server_args(argv) + resolve_once() + check_server_args(), read
through resolved_view (plain attributes keep the values as given). `--device cpu` is added when the
argv has no --device, because resolution needs a device and a CPU-only host has none; the fields
compared (speculative S/K/D, max running requests) do not depend on it.

Layer ids: SGLang's own `set_eagle3_layers_to_capture` of the architecture's model class, called on a
stand-in `self` (it only reads pp_group, config and model): no model is built. `layers_to_capture`
entry c is the hidden state entering decoder layer c, i.e. the output of layer c - 1.
"""
import contextlib
import dataclasses
import io
import json
import logging
import os
import sys
import traceback
from types import SimpleNamespace

# Run as a script, this file's directory (drafter/engines/, which holds our own sglang.py) comes first
# on sys.path and would shadow the installed sglang package: it is dropped before anything imports it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

# SGLang model module and class per architecture (KimiK25 delegates to its language model, a DeepseekV3).
MODEL_CLASSES = {
    "LlamaForCausalLM": ("sglang.srt.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("sglang.srt.models.mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("sglang.srt.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("sglang.srt.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("sglang.srt.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "KimiK25ForConditionalGeneration": ("sglang.srt.models.kimi_k25", "KimiK25ForConditionalGeneration"),
}
_DELEGATES = {"KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM"}


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _error(err: BaseException) -> dict:
    return {"error": f"{type(err).__name__}: {err}".strip()[:2000],
            "where": traceback.format_exception(err)[-2].strip()[:500] if err.__traceback__ else ""}


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def resolve(argv: list) -> dict:
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.server_args import prepare_server_args

    argv = list(argv)
    if "--device" not in argv:
        argv += ["--device", "cpu"]
    catcher = _Warnings()
    logging.getLogger("sglang").addHandler(catcher)  # not root: SGLang may reconfigure the root logger
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):  # argparse explains a rejected flag on stderr, then exits
            sa = prepare_server_args(argv)
        sa.resolve_once()
        sa.check_server_args()
        view = resolved_view(sa)
        names = getattr(type(sa), "__struct_fields__", None) or [f.name for f in dataclasses.fields(sa)]
        resolved = {f: _jsonable(getattr(view, f, None)) for f in names if not f.startswith("_")}
        overrides = [[name, _jsonable(changes)] for name, changes in getattr(sa, "_resolved_overrides", [])]
        return {"resolved": resolved, "overrides": overrides, "warnings": catcher.messages}
    except SystemExit as err:
        why = (usage.getvalue().strip().splitlines() or [f"exit {err.code}"])[-1]
        return {"error": f"argument error: {why}", "warnings": catcher.messages}
    except BaseException as err:  # SGLang rejects with ValueError, AssertionError, TypeError
        return {**_error(err), "warnings": catcher.messages}
    finally:
        logging.getLogger("sglang").removeHandler(catcher)


def _model_class(architecture: str):
    import importlib

    module, name = MODEL_CLASSES[architecture]
    return getattr(importlib.import_module(module), name)


def _stand_in_self(architecture: str, num_layers: int) -> SimpleNamespace:
    me = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True),
                         config=SimpleNamespace(num_hidden_layers=num_layers), model=SimpleNamespace())
    if architecture in _DELEGATES:
        inner = _stand_in_self(_DELEGATES[architecture], num_layers)
        method = _model_class(_DELEGATES[architecture]).set_eagle3_layers_to_capture
        inner.set_eagle3_layers_to_capture = lambda ids: method(inner, ids)
        me.language_model, me.model = inner, inner.model
    return me


def layers(case: dict) -> dict:
    architecture = case["architecture"]
    if architecture not in MODEL_CLASSES:
        return {"error": f"no SGLang model class known to the probe for {architecture}"}
    try:
        me = _stand_in_self(architecture, int(case["num_layers"]))
        _model_class(architecture).set_eagle3_layers_to_capture(me, case.get("ids"))
        return {"layers_to_capture": [int(c) for c in me.model.layers_to_capture], "capture": "input-of-layer"}
    except BaseException as err:
        return _error(err)


def main() -> None:
    request = json.loads(sys.stdin.read() or "{}")
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # SGLang prints; only our JSON goes to stdout
        import sglang

        answer = {"version": sglang.__version__,
                  "resolve": [resolve(argv) for argv in request.get("resolve", [])],
                  "layers": [layers(case) for case in request.get("layers", [])]}
    out.write(json.dumps(answer) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
