"""`drafter smoke`: the lifecycle's contracts checked end to end in minutes, on the user's own profile.

Layer ids off by one between the capture, the export and the engine, a stale vocab map, a format an
engine reads differently, settings a server rewrites: each is a silent failure of the full lifecycle,
found hours later as a poor accept length. The smoke run finds them first, cheaply:

1. a small configuration derived from the profile (`smoke_config`): a few prompts (3 to train on, 1
   held out), short greedy answers, a drafter overfit on them in a few hundred steps, the export's
   judge reduced to a file check (the overfit drafter knows nothing of held-out prompts), the
   profile's target, engine, layer ids, vocabulary, formats, capture backend and launch settings
   unchanged; its own store prefix (`<storage.root>/smoke`). The stages are content-addressed, so its
   outputs never share a fingerprint with the real ones either (server logs go where the profile's do:
   their names are unique per launch, and a cancelled run's hooks find its servers there);
2. prepare, datagen, dump, train and export through the stage table, exactly as the lifecycle runs them;
3. the capture re-checked (the `hf` backend): the dumped aux states of one training sample are
   matched against every layer of the target run again here; they must be the outputs of the layers
   the manifest names (a capture one layer off is invisible to every record);
4. one server of the profile's engine with the export (the serve stage's drafter, through the
   server session: preflight with its layer-id check, gate, settings read back strictly, teardown),
   asked greedy continuations of training prompts, each `num_steps + 2` tokens long (the prefill
   token and one verify): a full draft block is accepted when one verify takes all `num_steps`
   drafts, read from the engine's own accept figures (meta_info counts, or vLLM's `/metrics` deltas:
   the bench's `measure`).

A failure is `SmokeFailed`: one line naming the step and the contract it broke (layer ids, vocab
map, format, settings), exit code 4 (3 when a retry may fix it, 2 for a configuration error).
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from drafter.config import LifecycleConfig
from drafter.errors import DrafterError, describe, exit_code, is_retryable

SMOKE_STAGES = ("prepare", "datagen", "dump", "train", "export")
PROMPTS = 4            # conversations kept: 3 to train on, 1 held out (the export's judge needs one)
ROWS_READ = 64         # rows read per source (filters drop some)
MAX_CHARS = 2000       # short prompts: the dump and the training stay small
ANSWER_TOKENS = 32     # greedy answer tokens per prompt
MAX_LENGTH = 512       # tokens per sample
TRAIN_STEPS = 300      # optimizer steps of the overfit drafter
LEARNING_RATE = 3e-3
PROBES_PER_PROMPT = 4  # offsets into a training answer where a full draft block is looked for
NUM_STEPS = 3          # draft steps when the profile's serve.speculative does not set them

# The contracts a failure is named by, and the words in an error's line that say which one it broke.
CONTRACTS = (("layer ids", ("layer id", "layer_id", "aux layer", "aux_layer")),
             ("vocab map", ("vocab", "d2t", "t2d")),
             ("settings", ("speculative setting", "settings", "num_steps", "draft tokens")),
             ("format", ("keys", "format", "shape", "config.json", "safetensors", "layout")))


class SmokeFailed(DrafterError):
    """The smoke run broke a contract (or a stage failed): `stage`, `contract` and the line that says
    why. Retryable and its exit code as the error underneath (a server start that crashed: 3)."""

    def __init__(self, stage: str, contract: str | None, detail: str, cause: BaseException | None = None):
        self.stage, self.contract, self.detail = stage, contract, detail
        broke = f"{contract} contract broken: " if contract else ""
        super().__init__(f"smoke failed at {stage}: {broke}{detail}")
        if cause is not None:
            self.retryable = is_retryable(cause)
            self.exit_code = exit_code(cause)


def contract_of(line: str) -> str | None:
    """Which contract an error's line names (the first of CONTRACTS whose words it uses), or None."""
    low = line.lower()
    return next((name for name, words in CONTRACTS if any(w in low for w in words)), None)


def smoke_root(root: str) -> str:
    return root.rstrip("/") + "/smoke"


def smoke_config(cfg: LifecycleConfig) -> LifecycleConfig:
    """The profile made small: what it runs on (target, engine, layer ids, vocabulary size, formats,
    capture backend, launch settings) as it is; how much it runs (prompts, answers, steps) tiny."""
    data = cfg.model_dump()
    spec = cfg.serve.speculative
    steps = spec.num_steps if spec is not None and spec.is_set else NUM_STEPS
    data["data"].update(sources=[{**s, "limit": min(s["limit"] or ROWS_READ, ROWS_READ)} for s in data["data"]["sources"]],
                        limit=PROMPTS, eval_fraction=0.25, max_eval=1, max_turns=1,
                        max_chars=min(cfg.data.max_chars, MAX_CHARS), min_chars=1, allow_empty=False)
    data["datagen"].update(temperature=0.0, max_tokens=ANSWER_TOKENS, shard_size=PROMPTS, workers=1)
    max_length = min(cfg.dump.max_length, MAX_LENGTH)
    data["dump"].update(aux_layer_ids=cfg.aux_layer_ids(), max_length=max_length, samples_per_shard=PROMPTS,
                        workers=1)
    data["train"].update(epochs=TRAIN_STEPS, max_steps=TRAIN_STEPS, ttt_length=steps, learning_rate=LEARNING_RATE,
                         lr_scaling="none", warmup_ratio=0.0, min_lr_ratio=1.0, max_length=max_length,
                         tokens_per_micro_batch=max_length, micro_batches_per_step=1, eval_every_steps=TRAIN_STEPS,
                         save_every_steps=TRAIN_STEPS, nproc_per_node=1,
                         init_from=None if cfg.train.init_from == "champion" else cfg.train.init_from)
    data["export"].update(eval_prompts=1, judge_num_steps=steps, judge_max_new_tokens=16, min_accept_length=1.0,
                          min_accept_ratio=1e-6, vllm_judge=None, judge_bucket_edges=[16])
    data["serve"].update(speculative={"num_steps": steps, "eagle_topk": 1, "num_draft_tokens": steps + 1},
                         draft_path=None)
    data["storage"]["root"] = smoke_root(cfg.storage.root)
    return LifecycleConfig.model_validate(data)


@dataclass
class SmokeReport:
    """What the smoke run did: each step's line and seconds, and the acceptance it saw."""

    engine: str
    num_steps: int
    store: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    probes: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        full = [p for p in self.probes if p["full_block"]]
        return (f"smoke passed in {self.seconds:.0f}s: engine {self.engine} accepted a full block of "
                f"{self.num_steps} drafts on {len(full)} of {len(self.probes)} training-prompt probes "
                f"(outputs under {self.store})")

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "num_steps": self.num_steps, "store": self.store, "steps": self.steps,
                "probes": self.probes, "seconds": self.seconds, "line": self.line()}


def run_smoke(cfg: LifecycleConfig, *, on_step: Callable[[str], None] | None = None,
              on_line: Callable[[str], None] | None = None) -> SmokeReport:
    """The smoke run of `cfg` (the profile; the small configuration is derived here): `on_step` gets
    one line per step, `on_line` the stages' and the servers' own lines. Raises SmokeFailed naming the
    step and the contract; returns the report when a full block was accepted."""
    from drafter.stages import TABLE
    from drafter.store import open_store

    say = on_step or (lambda line: None)
    t0 = time.monotonic()
    small = smoke_config(cfg)
    store = open_store(small.storage)
    fps = TABLE.fingerprints(small, store=store)
    report = SmokeReport(engine=small.serve.engine, num_steps=small.serve.speculative.num_steps,
                         store=small.storage.root)

    def step(name: str, work: Callable[[], str]) -> None:
        began = time.monotonic()
        try:
            outcome = work()
        except SmokeFailed:
            raise
        except DrafterError as err:
            # one line, whatever the error's own layout; its type after the reason
            line = " ".join(describe(err).split()).removeprefix(f"error ({type(err).__name__}): ")
            line = f"{line} ({type(err).__name__})"
            raise SmokeFailed(name, contract_of(line), line, err) from err
        seconds = time.monotonic() - began
        report.steps.append({"step": name, "outcome": outcome, "seconds": round(seconds, 1)})
        say(f"smoke: {name}: {outcome} ({seconds:.1f}s)")

    for name in SMOKE_STAGES:
        step(name, lambda name=name: TABLE.run(name, small, store, fingerprints=fps, on_line=on_line).outcome())
        if name == "dump":  # before anything trains on them
            step("capture", lambda: check_capture(small, store, fps["dump"]))
    step("serve", lambda: _serve_and_probe(small, store, fps, report, on_line))
    report.seconds = round(time.monotonic() - t0, 1)
    return report


# ---- the capture: are the dumped aux states the outputs of the layers the manifest names?

def training_samples(cfg: LifecycleConfig, store, dump_fp: str, count: int) -> list[dict]:
    """The first `count` training samples of the dump (input ids, loss mask, states), as read for training."""
    from drafter.formats import iter_dump_samples

    samples = []
    with tempfile.TemporaryDirectory(prefix="drafter-smoke-") as tmp:
        for sample in iter_dump_samples(store, dump_fp, expect_aux_layer_ids=cfg.aux_layer_ids(), workdir=tmp):
            samples.append({k: (v.clone() if hasattr(v, "clone") else v) for k, v in sample.items()})
            if len(samples) == count:
                break
    return samples


def check_capture(cfg: LifecycleConfig, store, dump_fp: str) -> str:
    """Run the target (Hugging Face, as the `hf` backend does) over one dumped training sample and
    find, for each stored aux state, the layer whose output it is closest to: it must be the layer the
    manifest (and the profile) names."""
    import torch

    from drafter.target import HFTarget

    if cfg.dump.backend != "hf":
        return f"not re-checked (dump.backend {cfg.dump.backend}: the target is not loaded here)"
    (sample,) = training_samples(cfg, store, dump_fp, 1)
    device = next((d for d in cfg.dump.devices if d != "auto"), "auto")
    target = HFTarget(cfg.target.path, device=device, dtype=cfg.dump.dtype,
                      trust_remote_code=cfg.target.trust_remote_code)
    ids = torch.as_tensor(sample["input_ids"], dtype=torch.long)[None].to(target.device)
    with torch.inference_mode():
        hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    stored = sample["aux_hidden_states"].float()            # [T, 3, H]
    outputs = torch.stack([h[0].float().cpu() for h in hidden[1:]])  # [N, T, H]: the output of layer i at i
    claimed = cfg.aux_layer_ids()
    found = []
    for j in range(stored.shape[1]):
        err = (outputs - stored[:, j]).norm(dim=(1, 2)) / stored[:, j].norm().clamp_min(1e-12)
        found.append(int(err.argmin()))
    if found != claimed:
        raise SmokeFailed("capture", "layer ids", f"the aux states dumped as the outputs of layers {claimed} "
                                               f"(dump.aux_layer_ids) are those of layers {found}: the capture "
                                               f"is off by {found[0] - claimed[0]:+d}")
    return f"aux states are the outputs of layers {found}, as the manifest says"


# ---- serving: one server of the profile's engine with the export; a full draft block on a training prompt

def probe_prompts(samples: list[dict], num_steps: int) -> list[dict]:
    """Training prompts cut at a few offsets into their answers: each continues with at least
    num_steps + 2 answer tokens the drafter was trained on."""
    probes = []
    for k, sample in enumerate(samples):
        ids, mask = [int(t) for t in sample["input_ids"]], [int(m) for m in sample["loss_mask"]]
        if 1 not in mask:
            continue
        first = mask.index(1)
        room = len(ids) - first - (num_steps + 2)
        for offset in sorted({room * i // PROBES_PER_PROMPT for i in range(PROBES_PER_PROMPT)} if room >= 0 else ()):
            probes.append({"sample": sample["id"], "offset": offset, "prompt": ids[:first + offset]})
    return probes


def _serve_and_probe(cfg: LifecycleConfig, store, fps, report: SmokeReport, on_line) -> str:
    from drafter.bench.measure import ClientApi, measure
    from drafter.engine_registry import make_engine
    from drafter.serving.session import ServerSession
    from drafter.stages import TABLE

    serve = TABLE["serve"].code  # the serve stage's rule for which drafter (this configuration's export)
    draft = serve.draft_path(serve.inputs(TABLE.context("serve", cfg, store, fingerprints=fps)))
    steps = cfg.serve.speculative.num_steps
    probes = probe_prompts(training_samples(cfg, store, fps["dump"], PROMPTS), steps)
    if not probes:
        raise SmokeFailed("serve", None, f"no training answer is {steps + 2} tokens long: nothing to probe")
    with ServerSession(cfg, draft_path=draft, on_line=on_line, strict_settings=True) as served:
        engine = make_engine(served.engine)
        api = ClientApi(style=engine.client_style(served.settings), stream=False, flush_cache=False,
                        served_model_name=cfg.target.served_name, counters=engine.reports_counters)
        for probe in probes:
            m = measure(served.base_url, api, [probe["prompt"]], batch_size=1, max_tokens=steps + 2,
                        ignore_eos=True, flush=False, engine=engine)
            per_verify = m["draft_accept_length"] or m["accept_length"]
            report.probes.append({"sample": probe["sample"], "offset": probe["offset"],
                                  "draft_accept_length": per_verify, "verifies": m["verify_ct"],
                                  "full_block": per_verify is not None and per_verify >= steps + 1 - 1e-6})
    full = [p for p in report.probes if p["full_block"]]
    if not full:
        best = max((p["draft_accept_length"] or 0.0) for p in report.probes)
        raise SmokeFailed("serve", "layer ids / vocab map", f"engine {cfg.serve.engine} accepted no full block of {steps} "
                                                 f"drafts on {len(probes)} training-prompt probes (best "
                                                 f"{max(best - 1, 0):.2f} drafts per verify): the served drafter "
                                                 f"reads other layers or another vocab map than it was trained with")
    return f"{len(full)} of {len(probes)} probes accepted a full block of {steps} drafts"

