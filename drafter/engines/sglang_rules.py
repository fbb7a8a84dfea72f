"""What SGLang does with our speculative settings and layer ids: our prediction (rules transcribed from
SGLang 0.5.23's source, contract sections 3 and 8), and the same question put to the user's installed
SGLang, which decides whenever it is importable (sglang_probe.py runs in its interpreter).

- `predict_resolution`: the S/K/D and max running requests SGLang resolves our launch flags to. Our
  SpeculativeConfig refuses every setting SGLang would rewrite, so a correct prediction is "unchanged".
- `resolution_problems` / `layer_problems`: our prediction against SGLang's answer, each problem
  naming SGLang's own value.
- `check_with_sglang`: both questions for one configuration, for `config validate` and the serve
  preflight. Refuses a mismatch before any launch; says which source decided.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence

from drafter.config import ConfigError, SpeculativeConfig
from drafter.layers import READ_VERSIONS, UnknownLayerIdRule, engine_layer_ids
from drafter.server_errors import ServerConfigError
from drafter.engines.layer_check import installed_version, target_architecture

PROBE = Path(__file__).with_name("sglang_probe.py")

# _auto_choose_speculative_params (arg_groups/speculative_hook.py, 0.5.23): (steps, topk, draft tokens)
# when none of the three is given; every other EAGLE target architecture gets (3, 1, 4).
AUTO_PARAMS = {"LlamaForCausalLM": (5, 4, 8), "Grok1ForCausalLM": (5, 4, 8), "Grok1VForCausalLM": (5, 4, 8)}
AUTO_PARAMS_OTHERS = (3, 1, 4)
# _handle_eagle_family: speculative decoding caps running requests at 48 unless it is set.
SPECULATIVE_MAX_RUNNING_REQUESTS = 48
# Our names -> SGLang's resolved ServerArgs fields.
RESOLVED_FIELDS = {"algorithm": "speculative_algorithm", "num_steps": "speculative_num_steps",
                   "eagle_topk": "speculative_eagle_topk", "num_draft_tokens": "speculative_num_draft_tokens",
                   "max_running_requests": "max_running_requests"}


class SGLangProbeError(RuntimeError):
    """SGLang is importable but the probe did not answer (crashed, timed out, printed no JSON)."""


def predict_resolution(spec: SpeculativeConfig | None, architecture: str, *, speculating: bool,
                       max_running_requests: int | None = None) -> dict[str, Any]:
    """The values SGLang 0.5.23 resolves our flags to, in our names."""
    if not speculating:
        return {"algorithm": None, "max_running_requests": max_running_requests}
    if spec is not None and spec.is_set:
        steps, topk, draft = spec.num_steps, spec.eagle_topk, spec.num_draft_tokens
    else:
        steps, topk, draft = AUTO_PARAMS.get(architecture, AUTO_PARAMS_OTHERS)
    return {"algorithm": spec.algorithm if spec is not None else "EAGLE3", "num_steps": steps, "eagle_topk": topk,
            "num_draft_tokens": draft,
            "max_running_requests": max_running_requests or SPECULATIVE_MAX_RUNNING_REQUESTS}


def resolution_problems(predicted: Mapping[str, Any], answer: Mapping[str, Any], version: str = "") -> list[str]:
    """Each field where SGLang resolved something else than we predict, naming SGLang's value."""
    if "error" in answer:
        return [f"SGLang {version} rejects the launch arguments: {answer['error']}"]
    resolved = answer["resolved"]
    problems = []
    for ours, theirs in RESOLVED_FIELDS.items():
        if ours not in predicted:
            continue
        got = resolved.get(theirs)
        if got != predicted[ours]:
            why = [name for name, changes in answer.get("overrides", []) if theirs in changes]
            problems.append(f"{theirs}: SGLang {version} resolves {got!r}"
                            + (f" (set by its {why[-1]})" if why else "") + f", we predict {predicted[ours]!r}")
    return problems


def layer_problems(our_ids: Sequence[int], written: Sequence[int], answer: Mapping[str, Any],
                   architecture: str, version: str = "") -> list[str]:
    """Draft-config ids `written` must make SGLang capture the outputs of our layers `our_ids`.
    SGLang's layers_to_capture entry c is the input of layer c = the output of our layer c - 1."""
    if "error" in answer:
        return [f"SGLang {version} set_eagle3_layers_to_capture({list(written)}) for {architecture} failed: "
                f"{answer['error']}"]
    captured = [c - 1 for c in answer["layers_to_capture"]]
    if captured == list(our_ids):
        return []
    return [f"SGLang {version} {architecture}: draft-config ids {list(written)} capture layers_to_capture "
            f"{answer['layers_to_capture']} = the outputs of layers {captured}, not our {list(our_ids)}"]


def ask_sglang(python: str, request: Mapping[str, Any], *, env: Mapping[str, str] | None = None,
               timeout_s: float = 600.0) -> dict[str, Any]:
    """Run the probe in SGLang's interpreter `python`. Raises SGLangProbeError when it gives no answer."""
    try:
        out = subprocess.run([python, str(PROBE)], input=json.dumps(request), capture_output=True, text=True,
                             timeout=timeout_s, env=dict(env) if env is not None else None, check=False)
    except subprocess.TimeoutExpired:
        raise SGLangProbeError(f"asking SGLang ({python}) took more than {timeout_s:.0f}s") from None
    except OSError as err:
        raise SGLangProbeError(f"cannot run {python}: {err}") from None
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise SGLangProbeError(f"asking SGLang ({python}) failed (exit {out.returncode}): {tail}")
    return json.loads(lines[-1])


def _launch_arguments(argv: Sequence[str]) -> list[str]:
    """launch_server's own arguments: drop `python -m sglang.launch_server`."""
    argv = list(argv)
    if "-m" in argv[:3]:
        return argv[argv.index("-m") + 2:]
    return argv[1:]


def _predicted_for(cfg, spec: SpeculativeConfig | None, speculating: bool, architecture: str) -> dict[str, Any]:
    predicted = predict_resolution(spec, architecture, speculating=speculating,
                                   max_running_requests=cfg.serve.max_running_requests)
    if "--max-running-requests" in cfg.serve.extra_args:  # the user's own flag: SGLang takes it as given
        predicted.pop("max_running_requests")
    return predicted


def check_with_sglang(cfg, launches: Sequence[tuple[SpeculativeConfig | None, bool, Sequence[str]]], *,
                      python: str, env: Mapping[str, str] | None = None, architecture: str = "",
                      layers: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Ask the SGLang importable by `python` how it resolves each launch (speculative setting, whether
    we give it a drafter, argv) and, when `layers` = {aux_layer_ids, num_layers} is given, which layers
    the draft-config ids capture (`ids` in `layers`, default: our rule's ids for its version).

    Returns the report {source, asked_sglang, engine_version, launches, layers}; raises
    ServerConfigError on any disagreement with our prediction, naming SGLang's answer. When SGLang is
    not importable there, our transcribed rules decide and the report says so."""
    version = installed_version("sglang", python)
    if version is None:
        return _not_asked(f"sglang is not importable with {python}")
    request: dict[str, Any] = {"resolve": [_launch_arguments(argv) for _, _, argv in launches]}
    our_ids = written = None
    if layers is not None:
        our_ids = list(layers["aux_layer_ids"])
        written = layers.get("ids")
        if written is None:
            try:
                written = engine_layer_ids(our_ids, "sglang", version, architecture).ids
            except UnknownLayerIdRule as err:
                raise ServerConfigError(f"sglang: {err}", engine="sglang") from None
        request["layers"] = [{"architecture": architecture, "num_layers": int(layers["num_layers"]),
                              "ids": list(written)}]
    try:
        answer = ask_sglang(python, request, env=env)
    except SGLangProbeError as err:
        raise ServerConfigError(f"sglang {version} is importable with {python} but could not be asked: {err}",
                                engine="sglang") from None
    report: dict[str, Any] = {"source": f"sglang {answer['version']} installed ({python})", "asked_sglang": True,
                              "engine_version": answer["version"], "launches": []}
    problems: list[str] = []
    for (spec, speculating, argv), resolved in zip(launches, answer["resolve"]):
        predicted = _predicted_for(cfg, spec, speculating, architecture)
        found = resolution_problems(predicted, resolved, answer["version"])
        label = _label(spec) if speculating else "no speculation"
        problems += [f"{label}: {p}" for p in found]
        report["launches"].append({"setting": label, "predicted": predicted,
                                   "resolved": {ours: resolved.get("resolved", {}).get(theirs)
                                                for ours, theirs in RESOLVED_FIELDS.items()}})
    if layers is not None:
        captured = answer["layers"][0]
        problems += layer_problems(our_ids, written, captured, architecture, answer["version"])
        report["layers"] = {"aux_layer_ids": our_ids, "ids": list(written),
                            "layers_to_capture": captured.get("layers_to_capture")}
    if problems:
        raise ServerConfigError("our SGLang rules disagree with the installed SGLang, which decides: "
                                + "; ".join(problems), engine="sglang")
    return report


def _label(spec: SpeculativeConfig | None) -> str:
    if spec is not None and spec.is_set:
        return f"{spec.num_steps}/{spec.eagle_topk}/{spec.num_draft_tokens}"
    return "EAGLE-3 with SGLang's own numbers"


def _local_target(cfg) -> tuple[str, int] | None:
    """(architecture, layers) of a local target; None for a hub id (SGLang would fetch its config)."""
    path = Path(cfg.target.path).expanduser()
    if not (path / "config.json").is_file():
        return None
    return target_architecture(str(path)) or "", cfg.target.resolved_shape()["num_hidden_layers"] or 0


def _not_asked(why: str) -> dict[str, Any]:
    return {"source": f"transcribed rules (read in sglang {READ_VERSIONS['sglang']}; {why})", "asked_sglang": False}


def preflight_with_sglang(cfg, argv: Sequence[str], env: Mapping[str, str], python: str,
                          layer_ids: Mapping[str, Any], *, speculating: bool) -> dict[str, Any]:
    """The serve preflight: SGLang resolves the exact launch argv, and captures the layers the draft's
    ids name (`layer_ids`: what drafter.engines.layer_check found in the export)."""
    target = _local_target(cfg)
    if target is None:
        return _not_asked(f"target {cfg.target.path} is not a local directory")
    arch, num_layers = target
    layers = None
    if layer_ids.get("checked") and num_layers:
        layers = {"aux_layer_ids": layer_ids["aux_layer_ids"], "ids": layer_ids["ids"], "num_layers": num_layers}
    return check_with_sglang(cfg, [(cfg.serve.speculative, speculating, argv)], python=python, env=env,
                             architecture=arch, layers=layers)


def validate_with_sglang(cfg) -> dict[str, Any]:
    """`config validate`: every launch the profile can make (serve, each bench setting, the bench
    baseline) resolved by the installed SGLang, and the layers the export's ids will capture."""
    from drafter.engines import _launch_env, engine_python, make_engine

    python = engine_python(cfg)
    target = _local_target(cfg)
    if target is None:
        return _not_asked(f"target {cfg.target.path} is not a local directory")
    arch, num_layers = target
    engine = make_engine("sglang")
    draft = cfg.serve.draft_path
    if not draft or not (Path(draft).expanduser() / "config.json").is_file():
        draft = cfg.target.path  # no drafter yet: resolution reads only the draft's config.json
    settings = [cfg.serve.speculative] + [s for s in cfg.bench.speculative if s != cfg.serve.speculative]
    launches = []
    for spec in settings:
        one = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"speculative": spec})})
        launches.append((spec, True, engine.build_launch(one, draft).argv))
    launches.append((None, False, engine.build_launch(cfg.model_copy(update={"serve": cfg.serve.model_copy(
        update={"speculative": None})}), None).argv))
    layers = None
    try:
        ours = cfg.aux_layer_ids() if num_layers else None
    except ConfigError:
        # a serve-only profile of a shallow target has no default ids: the draft's own are
        # checked at launch (drafter.engines.layer_check), so nothing is resolved here
        ours = None
    if ours is not None:
        try:
            written = engine_layer_ids(ours, "sglang", cfg.export.sglang_version, arch).ids
        except UnknownLayerIdRule as err:
            raise ServerConfigError(f"sglang: {err}", engine="sglang") from None
        layers = {"aux_layer_ids": ours, "ids": written, "num_layers": num_layers}
    env, _ = _launch_env(cfg)
    return check_with_sglang(cfg, launches, python=python, env=env, architecture=arch, layers=layers)
