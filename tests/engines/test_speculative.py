"""EAGLE-3 speculative decoding: lossless greedy, the accept path, cache rollback, sampling."""
from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from drafter.model import DraftKVCache, init_random_drafter, load_drafter
from drafter.target import HFTarget
from drafter.engines.reference.speculative import ForcedAccepts, SamplingParams, SpeculativeEngine, accept_drafts
from tests.fixtures.speculative import EOS, build_random_target, successor_pair  # noqa: F401 (fixture)



pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="session")
def random_pair(tiny_target, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("random")
    target = build_random_target(tiny_target, root / "target")
    return target, init_random_drafter(target, root / "draft", draft_vocab_size=256, seed=7)


def _engine(pair, steps: int) -> SpeculativeEngine:
    target_dir, draft_dir = pair
    return SpeculativeEngine(HFTarget(target_dir, device="cpu"), load_drafter(draft_dir), steps)


def _reference(engine: SpeculativeEngine, prompt: list[int], max_new: int) -> list[int]:
    """The target's own greedy decoding (transformers generate)."""
    ids = torch.tensor([prompt])
    out = engine.target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                       do_sample=False)
    return out[0, len(prompt):].tolist()


# ----------------------------------------------------------------------------- lossless
PROMPTS = [[0, 17, 150], [0, 391], [0, 33, 7, 190], [0, 402, 403], [0, 99] * 6]


@pytest.mark.parametrize("steps", [1, 3])
def test_lossless_with_crafted_drafter_and_accept_path(successor_pair, steps):
    engine = _engine(successor_pair, steps)
    results = []
    for prompt in PROMPTS:
        res = engine.generate(prompt, SamplingParams(max_new_tokens=25))
        assert res.output_ids == _reference(engine, prompt, 25), prompt
        assert res.completion_tokens / res.spec_verify_ct == res.accept_length
        results.append(res)
    run, eos_run, _, fixed, _ = results
    # x+1 run: the first draft is always right, later ones never (1 accepted + bonus per verify)
    assert run.accepted_drafts == run.spec_verify_ct and run.accept_length > 1.8
    # fixed point: every draft accepted (the a == S path)
    assert fixed.accepted_drafts == fixed.proposed_drafts and fixed.accept_length > steps
    # 392 .. 400 then EOS: stops on EOS, EOS included like generate()
    assert eos_run.output_ids[-1] == EOS and eos_run.finish_reason == "stop" and eos_run.matched_stop == EOS
    total = sum(r.completion_tokens for r in results) / sum(r.spec_verify_ct for r in results)
    assert total > 1.5


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_lossless_with_random_drafter(random_pair, steps):
    engine = _engine(random_pair, steps)
    gen = torch.Generator().manual_seed(steps)
    for n in (1, 5, 23):
        prompt = torch.randint(0, 512, (n,), generator=gen).tolist()
        res = engine.generate(prompt, SamplingParams(max_new_tokens=30))
        assert res.output_ids == _reference(engine, prompt, 30), prompt
        assert res.speculative and res.spec_verify_ct >= 1


def test_lossless_on_the_trained_tiny_target(tiny_target, tmp_path):
    engine = _engine((tiny_target, init_random_drafter(tiny_target, tmp_path / "d", seed=2)), 3)
    tok = engine.target.tokenizer
    for question in ("Hi", "Write a poem about the sea"):
        text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)
        prompt = tok(text, add_special_tokens=False).input_ids
        assert engine.generate(prompt, SamplingParams(max_new_tokens=20)).output_ids == _reference(engine, prompt, 20)


def test_caches_hold_exactly_the_committed_tokens(random_pair):
    """Each iteration starts with both caches = committed - 1 positions, computed from target features."""
    engine = _engine(random_pair, 3)
    drafter, target = engine.drafter, engine.target
    checked = []

    def hook(committed, tcache, dcache):
        assert tcache.get_seq_length() == len(dcache) == len(committed) - 1
        checked.append(list(committed))
        if len(checked) % 4:
            return
        # Recompute from scratch: target features at 0..n-2, drafter input tokens at 1..n-1.
        with torch.no_grad():
            full = target.forward(torch.tensor([committed[:-1]]), target.new_cache(), want_aux=True)
            fresh = DraftKVCache()
            drafter(target.embed(torch.tensor([committed[1:]])), full.aux, cache=fresh)
        assert torch.allclose(dcache.k, fresh.k, atol=1e-4) and torch.allclose(dcache.v, fresh.v, atol=1e-4)

    engine.generate([0, 5, 9, 200, 17], SamplingParams(max_new_tokens=40), debug_hook=hook)
    assert len(checked) >= 8


def test_stops_on_stop_ids_stop_fn_and_length(successor_pair):
    engine = _engine(successor_pair, 3)
    res = engine.generate([0, 150], SamplingParams(max_new_tokens=50, stop_token_ids=[157]))
    assert res.output_ids == list(range(151, 158)) and res.finish_reason == "stop" and res.matched_stop == 157
    res = engine.generate([0, 150], SamplingParams(max_new_tokens=50), stop_fn=lambda ids: 3 if 155 in ids else None)
    assert res.output_ids == [151, 152, 153] and res.finish_reason == "stop"
    res = engine.generate([0, 150], SamplingParams(max_new_tokens=6))
    assert res.output_ids == list(range(151, 157)) and res.finish_reason == "length"
    res = engine.generate([0, 398], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert res.output_ids[:3] == [399, 400, EOS] and len(res.output_ids) == 10
    one = engine.generate([0, 150], SamplingParams(max_new_tokens=1))
    assert one.output_ids == [151] and one.spec_verify_ct == 0 and one.accept_length is None


def test_plain_decoding_without_drafter(random_pair):
    spec = _engine(random_pair, 2)
    plain = SpeculativeEngine(spec.target)
    prompt = [0, 1, 2, 3]
    res = plain.generate(prompt, SamplingParams(max_new_tokens=20))
    assert not res.speculative and res.spec_verify_ct == 0
    assert res.output_ids == _reference(spec, prompt, 20)


def test_engine_is_reentrant(random_pair):
    """Caches are per request, so even unserialised threads give the sequential answers."""
    engine = _engine(random_pair, 3)
    prompts = [[0, 11 * i + 3, 7] for i in range(4)]
    expected = [engine.generate(p, SamplingParams(max_new_tokens=20)).output_ids for p in prompts]
    got = [None] * 4

    def run(i):
        got[i] = engine.generate(prompts[i], SamplingParams(max_new_tokens=20)).output_ids
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected


def test_speculative_sampling_keeps_the_target_distribution():
    """First emitted token ~ p whatever q is (rejection sampling over the draft distribution)."""
    p_logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0]])
    q = torch.tensor([0.05, 0.6, 0.3, 0.05, 0.0])  # a poor draft: token 4 not even in the draft vocab
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    n = 4000
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=gen))
        accepted, bonus = accept_drafts(p_logits, [d], [q], params, gen)
        counts[d if accepted else bonus] += 1
    assert torch.allclose(counts / n, torch.softmax(p_logits[0], -1), atol=0.03)


def test_sampling_generation_is_speculative_and_seeded(successor_pair):
    engine = _engine(successor_pair, 3)
    params = dict(max_new_tokens=15, temperature=0.7, seed=123)
    a = engine.generate([0, 150], SamplingParams(**params))
    b = engine.generate([0, 150], SamplingParams(**params))
    assert a.output_ids == b.output_ids and a.speculative and a.spec_verify_ct >= 1
    assert len(a.output_ids) == 15


# ----------------------------------------------------------------------------- forced acceptance

@pytest.mark.parametrize("accept_length", [1.0, 1.5, 2.5, 2.75, 4.0])
def test_forced_acceptance_gives_the_requested_mean_accept_length(random_pair, accept_length):
    """A random drafter is (almost) never accepted for real: forced, it still gets exactly the mean
    asked for (1 + accepted drafts / verifies, within one token over the request), whatever the
    prompt; the same engine unforced is lossless again."""
    target_dir, draft_dir = random_pair
    target = HFTarget(target_dir, device="cpu")
    forced = SpeculativeEngine(target, load_drafter(draft_dir), 3, forced_accept_length=accept_length)
    for prompt in ([0, 17, 150], [0, 99] * 6):
        res = forced.generate(prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))
        assert len(res.output_ids) == 60 and res.speculative
        got = 1 + res.accepted_drafts / res.spec_verify_ct
        assert abs(got - accept_length) <= 1 / res.spec_verify_ct, (got, res.verifies)
        assert {acc for _, acc in res.verifies} <= {math.floor(accept_length - 1), math.ceil(accept_length - 1)}
    real = SpeculativeEngine(target, load_drafter(draft_dir), 3)
    assert real.generate([0, 17, 150], SamplingParams(max_new_tokens=20)).output_ids == \
        _reference(real, [0, 17, 150], 20)


def test_forced_accepts_schedule_and_its_limits(random_pair):
    seq = ForcedAccepts(2.4, 3)
    got = [seq.next() for _ in range(10)]
    assert sum(got) == 14 and set(got) == {1, 2}  # 1.4 drafts per verify, never off by a whole token
    assert [ForcedAccepts(4.0, 3).next() for _ in range(3)] == [3, 3, 3]
    target_dir, draft_dir = random_pair
    target = HFTarget(target_dir, device="cpu")
    with pytest.raises(ValueError, match=r"must be in \[1, num_steps \+ 1 = 4\]"):
        SpeculativeEngine(target, load_drafter(draft_dir), 3, forced_accept_length=4.5)
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeEngine(target, None, 3, forced_accept_length=2.0)


def test_engine_checks_drafter_against_target(random_pair, tiny_target, tmp_path):
    target = HFTarget(random_pair[0], device="cpu")
    with pytest.raises(ValueError, match="out of range.*output-of-layer-0-based.*hidden_states\\[i \\+ 1\\]"):
        target.set_aux_layer_ids([1, 2, 4])
    other = init_random_drafter(tiny_target, tmp_path / "d", aux_layer_ids=[2, 0, 1])
    engine = SpeculativeEngine(target, load_drafter(other), 2)
    assert target.aux_layer_ids == [2, 0, 1]
    assert engine.generate([0, 1], SamplingParams(max_new_tokens=3)).completion_tokens == 3
