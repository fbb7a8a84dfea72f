"""EAGLE-3 chain speculative decoding (topk 1) over an HFTarget, and plain decoding.

One request at a time (the server serialises requests with a lock). Per iteration:

  1. draft: the drafter's output at the last committed position gives d_1; each further step
     feeds the drafter its own pre-norm hidden state and the embedding of the token it just drafted.
  2. verify: ONE target forward over [last token, d_1 .. d_S].
  3. accept: the longest prefix of drafts the target agrees with, plus the target's own token at
     the first disagreement (the bonus): 1 .. S+1 tokens per verify.
  4. roll back: crop both KV caches to the committed length, then let the drafter catch up on the
     accepted positions with the target's aux features from the verify pass (like SGLang's
     draft-extend), so drafter cache entries always come from target features, never drafts.

Greedy (temperature 0) is lossless by construction: every emitted token is the target's argmax
given the committed prefix. Temperature > 0 uses speculative sampling (accept d with probability
min(1, p(d)/q(d)), else resample from max(p - q, 0)), which keeps the target's distribution.

Invariant between iterations: `committed` tokens are known, both caches hold len(committed) - 1
positions (the last token is not yet processed), and the drafter's output at the last cached
position is ready to produce d_1.

Forced acceptance (`forced_accept_length`, the bench's accept-length curve; SGLang's
SGLANG_SIMULATE_ACC_LEN and vLLM's synthetic rejection sampling are the same idea): step 3 accepts
a set number of drafts instead of the ones the target agrees with, so a cycle costs what a real
cycle with that acceptance costs (same draft steps, verify, rollback and catch-up). The output is
then not the target's: for timing only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from drafter.model import DraftKVCache, Eagle3Drafter
from drafter.target import HFTarget, crop_cache

# Returns how many output tokens to keep when a stop condition (e.g. a stop string) is met.
StopFn = Callable[[list[int]], "int | None"]


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1


@dataclass
class GenerationResult:
    output_ids: list[int]
    prompt_tokens: int
    finish_reason: str                  # "stop" or "length"
    matched_stop: int | str | None = None
    speculative: bool = False
    spec_verify_ct: int = 0             # target verify forwards
    accepted_drafts: int = 0            # drafts accepted, bonus tokens not included
    proposed_drafts: int = 0
    # One (output tokens before this verify, drafts accepted) pair per verify: per-position and
    # per-output-length acceptance (the export's offline judgement) are computed from these.
    verifies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def accept_length(self) -> float | None:
        """SGLang's definition: completion_tokens / spec_verify_ct (bonus token included)."""
        return self.completion_tokens / self.spec_verify_ct if self.spec_verify_ct else None


class _Output:
    """Collects emitted tokens and decides when the request is finished."""

    def __init__(self, params: SamplingParams, eos_ids: set[int], stop_fn: StopFn | None):
        self.params, self.stop_fn = params, stop_fn
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        self.ids: list[int] = []
        self.finish_reason: str | None = None
        self.matched: int | str | None = None

    def push(self, tokens: list[int]) -> bool:
        """Append tokens until a stop condition; True when the request is finished."""
        for tok in tokens:
            self.ids.append(tok)
            if tok in self.stop_ids:
                self.finish_reason, self.matched = "stop", tok
                return True
            if len(self.ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                return True
        if self.stop_fn is not None:
            keep = self.stop_fn(self.ids)
            if keep is not None:
                del self.ids[keep:]
                self.finish_reason, self.matched = "stop", "stop_string"
                return True
        return False


def _warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p on [..., V] float logits -> probabilities."""
    logits = logits / max(params.temperature, 1e-5)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > params.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class SpeculativeEngine:
    """Generates for one request at a time; with `drafter=None` it is plain decoding."""

    def __init__(self, target: HFTarget, drafter: Eagle3Drafter | None = None, num_steps: int = 3,
                 forced_accept_length: float | None = None):
        if forced_accept_length is not None:
            if drafter is None:
                raise ValueError("forced_accept_length needs a drafter")
            if not 1.0 <= forced_accept_length <= num_steps + 1:
                raise ValueError(f"forced_accept_length {forced_accept_length}: must be in [1, num_steps + 1 = "
                                 f"{num_steps + 1}] (tokens per verify, bonus included)")
        if drafter is not None:
            if num_steps < 1:
                raise ValueError("num_steps must be >= 1 with a drafter")
            cfg = drafter.config
            if cfg.target_hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
                raise ValueError(
                    f"drafter built for target_hidden_size={cfg.target_hidden_size}, vocab_size="
                    f"{cfg.vocab_size}; target has hidden_size={target.hidden_size}, vocab_size={target.vocab_size}")
            if cfg.hidden_size != target.hidden_size and drafter.embed_tokens is None:
                raise ValueError("drafter hidden size differs from the target's and it has no embed_tokens")
            target.set_aux_layer_ids(cfg.resolved_aux_layer_ids(target.num_layers))
        self.target, self.drafter, self.num_steps = target, drafter, num_steps
        self.forced_accept_length = forced_accept_length

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    # ------------------------------------------------------------------ helpers
    def _embed(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids, device=self.target.device).reshape(1, -1)
        d = self.drafter
        # SGLang feeds the drafter the target's embedding when the hidden sizes agree.
        if d.config.hidden_size == self.target.hidden_size:
            return self.target.embed(ids).to(d.lm_head.weight.dtype)
        return d.embed_tokens(ids)

    def _positions(self, start: int, count: int) -> torch.Tensor:
        return torch.arange(start, start + count, device=self.target.device)[None]

    @staticmethod
    def _pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
        if params.greedy:
            return int(logits.argmax(-1))
        return int(torch.multinomial(_warp(logits, params), 1, generator=gen))

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        gen = torch.Generator(device=self.target.device)
        if params.seed is not None:
            gen.manual_seed(params.seed)
        else:
            gen.seed()
        return gen

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("empty prompt")
        limit = self.target.max_position_embeddings
        if len(prompt) >= limit:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context length {limit}")
        bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"token ids out of the vocabulary (size {self.target.vocab_size}): {bad[:5]}")

    # ------------------------------------------------------------------ entry point
    @torch.inference_mode()
    def generate(self, prompt: list[int], params: SamplingParams, stop_fn: StopFn | None = None,
                 use_speculation: bool = True, debug_hook: Callable | None = None) -> GenerationResult:
        """Generate for one prompt. `debug_hook(committed, target_cache, draft_cache)` is called at
        the start of every speculative iteration (tests check the cache invariant with it)."""
        self._check_prompt(prompt)
        params = replace(params, max_new_tokens=max(1, min(params.max_new_tokens,
                                                           self.target.max_position_embeddings - len(prompt))))
        out = _Output(params, self.target.eos_token_ids, stop_fn)
        gen = self._generator(params)
        result = GenerationResult(output_ids=out.ids, prompt_tokens=len(prompt), finish_reason="")
        if self.speculative and use_speculation:
            result.speculative = True
            self._speculative(prompt, params, out, gen, result, debug_hook)
        else:
            self._plain(prompt, params, out, gen)
        result.finish_reason, result.matched_stop = out.finish_reason or "length", out.matched
        return result

    def _plain(self, prompt: list[int], params: SamplingParams, out: _Output, gen) -> None:
        cache = self.target.new_cache()
        ids = torch.tensor([prompt])
        while True:
            logits = self.target.forward(ids, cache, last_only=True).logits[0, -1]
            token = self._pick(logits, params, gen)
            if out.push([token]):
                return
            ids = torch.tensor([[token]])

    def _speculative(self, prompt: list[int], params: SamplingParams, out: _Output, gen,
                     result: GenerationResult, debug_hook: Callable | None) -> None:
        target, drafter, steps = self.target, self.drafter, self.num_steps
        tcache, dcache = target.new_cache(), DraftKVCache()
        prefill = target.forward(torch.tensor([prompt]), tcache, want_aux=True)
        token = self._pick(prefill.logits[0, -1], params, gen)
        if out.push([token]):
            return
        # Drafter prefill: at position p it sees token p+1 and the target's features at p.
        d_logits, d_hidden = drafter(self._embed(prompt[1:] + [token]), prefill.aux.to(drafter.lm_head.weight.dtype),
                                     self._positions(0, len(prompt)), dcache)
        last_token, cached = token, len(prompt)
        logits, hidden = d_logits[:, -1:], d_hidden[:, -1:]
        forced = ForcedAccepts(self.forced_accept_length, steps) if self.forced_accept_length is not None else None
        while True:
            if debug_hook is not None:
                debug_hook(prompt + out.ids, tcache, dcache)
            # 1. draft `steps` tokens (keep their draft distributions for sampling)
            drafts, draft_probs = [], []
            for k in range(steps):
                draft_id, q = self._draft_pick(logits[0, 0], params, gen)
                drafts.append(int(drafter.draft_to_target(draft_id)))
                draft_probs.append(q)
                if k + 1 < steps:
                    logits, hidden = drafter(self._embed([drafts[-1]]), hidden,
                                             self._positions(cached + k, 1), dcache)
            dcache.crop(cached)
            # 2. verify all drafts in one target forward
            verify = target.forward(torch.tensor([[last_token] + drafts]), tcache, want_aux=True)
            result.spec_verify_ct += 1
            result.proposed_drafts += steps
            # 3. accept the agreeing prefix + the bonus token
            accepted, bonus = accept_drafts(verify.logits[0], drafts, draft_probs, params, gen)
            if forced is not None:  # the real comparison above kept its cost; its outcome is replaced
                accepted = forced.next()
                bonus = self._pick(verify.logits[0, accepted], params, gen)
            result.accepted_drafts += accepted
            result.verifies.append((len(out.ids), accepted))
            new_tokens = drafts[:accepted] + [bonus]
            # 4. roll back the target cache past the first rejected draft
            crop_cache(tcache, cached + accepted + 1)
            if out.push(new_tokens):
                return
            d_logits, d_hidden = drafter(self._embed(new_tokens),
                                         verify.aux[:, :accepted + 1].to(drafter.lm_head.weight.dtype),
                                         self._positions(cached, accepted + 1), dcache)
            logits, hidden = d_logits[:, -1:], d_hidden[:, -1:]
            last_token, cached = bonus, cached + accepted + 1

    def _draft_pick(self, draft_logits: torch.Tensor, params: SamplingParams, gen):
        """A draft id and, when sampling, the draft distribution q over the TARGET vocab."""
        if params.greedy:
            return draft_logits.argmax(-1), None
        q_draft = torch.softmax(draft_logits.float() / params.temperature, dim=-1)
        draft_id = torch.multinomial(q_draft, 1, generator=gen)[0]
        q = torch.zeros(self.target.vocab_size, device=q_draft.device)
        q[self.drafter.draft_to_target(torch.arange(len(q_draft), device=q_draft.device))] = q_draft
        return draft_id, q


class ForcedAccepts:
    """Drafts accepted per verify for a forced mean accept length `a` (tokens per verify, bonus
    included, so a - 1 drafts): floor or ceil of a - 1, the one that keeps the running total
    nearest (a - 1) x verifies. Deterministic, and exact to one token over any request, where a
    random draw (SGLang's match-expected) would leave a short request's mean off by chance."""

    def __init__(self, accept_length: float, num_steps: int):
        self.drafts, self.num_steps = accept_length - 1.0, num_steps
        self.verifies = self.accepted = 0

    def next(self) -> int:
        self.verifies += 1
        k = min(self.num_steps, max(0, math.floor(self.drafts * self.verifies - self.accepted + 0.5)))
        self.accepted += k
        return k


def accept_drafts(target_logits: torch.Tensor, drafts: list[int], draft_probs: list,
                  params: SamplingParams, gen: torch.Generator | None = None) -> tuple[int, int]:
    """(number of accepted drafts, bonus token) given target logits [S+1, V] over [last, d_1..d_S].

    Greedy: accept while d_i equals the target's argmax, then the argmax at the first mismatch.
    Sampling (Leviathan et al. / Chen et al.): accept d_i with probability min(1, p_i(d)/q_i(d));
    on rejection sample from normalise(max(p_i - q_i, 0)); if all pass, sample from p_{S}.
    """
    if params.greedy:
        choice = target_logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == choice[accepted]:
            accepted += 1
        return accepted, choice[accepted]
    p = _warp(target_logits.float(), params)
    for i, (d, q) in enumerate(zip(drafts, draft_probs)):
        u = torch.rand((), device=p.device, generator=gen)
        if u * q[d] <= p[i, d]:
            continue
        residual = (p[i] - q).clamp_min(0)
        residual = residual if residual.sum() > 0 else p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))
