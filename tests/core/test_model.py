"""The EAGLE-3 drafter network and its SGLang checkpoint format (drafter/model.py)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafter.config import LAYER_ID_CONVENTION
from drafter.model import (
    EXPECTED_KEYS, DraftKVCache, DrafterCheckpointError, Eagle3DraftConfig, Eagle3Drafter, apply_rope,
    init_random_drafter, load_drafter, rope_inv_freq, save_drafter, ttt_attention_mask)

# Field names SGLang's LlamaForCausalLMEagle3 / transformers' LlamaConfig read (contract section 1).
SGLANG_FIELDS = {
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
    "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "vocab_size", "draft_vocab_size",
    "target_hidden_size", "tie_word_embeddings", "rope_theta", "max_position_embeddings", "eagle_config"}
SGLANG_KEYS = {
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def small_config(**kw) -> Eagle3DraftConfig:
    base = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=100, draft_vocab_size=40, target_hidden_size=24, aux_layer_ids=[1, 2, 3],
                rope_theta=500000.0, max_position_embeddings=256)
    base.update(kw)
    return Eagle3DraftConfig(**base)


@pytest.fixture
def drafter_dir(tiny_target, tmp_path):
    return init_random_drafter(tiny_target, tmp_path / "draft", draft_vocab_size=128, seed=3)


def test_random_drafter_is_in_sglang_format(tiny_target, drafter_dir):
    cfg = json.loads((drafter_dir / "config.json").read_text())
    target = json.loads((tiny_target / "config.json").read_text())
    assert SGLANG_FIELDS <= set(cfg)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == target["vocab_size"] and cfg["draft_vocab_size"] == 128
    assert cfg["target_hidden_size"] == target["hidden_size"]
    n = target["num_hidden_layers"]
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True,
                                   "eagle_aux_hidden_state_layer_ids": [1, n // 2 - 1, max(n - 4, 0)]}
    assert cfg["layer_id_convention"] == LAYER_ID_CONVENTION == "output-of-layer-0-based"
    tensors = load_file(str(drafter_dir / "model.safetensors"))
    assert set(tensors) == SGLANG_KEYS
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].shape == (target["hidden_size"], 3 * target["hidden_size"])
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * target["hidden_size"]
    # d2t offsets and t2d agree: hot ids = d2t + arange (how SGLang reads them)
    hot = tensors["d2t"] + torch.arange(128)
    assert tensors["t2d"].sum() == 128 and tensors["t2d"][hot].all()


def test_config_round_trips(tmp_path):
    cfg = small_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                       extra={"bos_token_id": 1, "pretraining_tp": 1})
    cfg.save(tmp_path / "config.json")
    again = Eagle3DraftConfig.load(tmp_path / "config.json")
    assert again == cfg
    assert again.to_json_dict() == json.loads((tmp_path / "config.json").read_text())
    # A SpecForge-style config without our convention field or draft vocab still loads (SGLang rules)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["layer_id_convention"], raw["draft_vocab_size"], raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    legacy = Eagle3DraftConfig.from_json_dict(raw)
    assert legacy.draft_vocab_size == legacy.vocab_size and legacy.aux_layer_ids is None
    assert legacy.resolved_aux_layer_ids(32) == [1, 15, 28]


@pytest.mark.parametrize("change, words", [
    ({"layer_id_convention": "input-of-layer"}, "layer_id_convention"),
    ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLMEagle3"),
    ({"num_hidden_layers": 2}, "num_hidden_layers"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
])
def test_config_refuses_what_we_cannot_serve(change, words):
    raw = small_config().to_json_dict()
    raw.update(change)
    with pytest.raises(DrafterCheckpointError, match=words):
        Eagle3DraftConfig.from_json_dict(raw)


def _corrupt(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_load_refuses_missing_unknown_and_misshaped_keys(drafter_dir):
    assert isinstance(load_drafter(drafter_dir), Eagle3Drafter)

    def damage(t):
        del t["midlayer.hidden_norm.weight"]
        t["midlayer.hiden_norm.weight"] = torch.ones(64)          # a typo SGLang would drop silently
        t["model.fc.weight"] = t.pop("fc.weight")
        t["lm_head.weight"] = t["lm_head.weight"][:100]
    _corrupt(drafter_dir, damage)
    with pytest.raises(DrafterCheckpointError) as err:
        load_drafter(drafter_dir)
    msg = str(err.value)
    assert "missing keys: ['fc.weight', 'midlayer.hidden_norm.weight']" in msg
    assert "unknown keys" in msg and "midlayer.hiden_norm.weight" in msg and "model.fc.weight" in msg
    assert "strip the 'model.' prefix" in msg
    assert "lm_head.weight: shape [100, 64], expected [128, 64]" in msg


def test_load_refuses_broken_vocab_maps(drafter_dir):
    _corrupt(drafter_dir, lambda t: t.update(d2t=torch.arange(128) + 10_000))
    with pytest.raises(DrafterCheckpointError, match="d2t maps draft ids outside"):
        load_drafter(drafter_dir)
    _corrupt(drafter_dir, lambda t: t.update(d2t=torch.zeros(128, dtype=torch.int64), t2d=torch.ones(512, dtype=torch.bool)))
    with pytest.raises(DrafterCheckpointError, match="t2d disagrees"):
        load_drafter(drafter_dir)
    _corrupt(drafter_dir, lambda t: t.update(t2d=torch.zeros(512)))
    with pytest.raises(DrafterCheckpointError, match="t2d: dtype torch.float32, expected torch.bool"):
        load_drafter(drafter_dir)


def test_save_load_round_trip_keeps_weights(tmp_path):
    torch.manual_seed(0)
    model = Eagle3Drafter(small_config(), with_embedding=True)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    model.d2t.copy_(torch.arange(40) * 2 - torch.arange(40))  # draft id i -> target id 2i
    model.t2d[torch.arange(40) * 2] = True
    save_drafter(model, tmp_path / "d")
    again = load_drafter(tmp_path / "d")
    assert again.embed_tokens is not None
    for key, value in model.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    assert again.draft_to_target(torch.tensor([0, 1, 39])).tolist() == [0, 2, 78]
    assert set(EXPECTED_KEYS(small_config())) == SGLANG_KEYS


def _random_drafter(seed=0, **kw) -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(small_config(**kw))
    for name, p in model.named_parameters():
        torch.nn.init.normal_(p, std=0.3) if not name.endswith("norm.weight") else torch.nn.init.uniform_(p, 0.5, 1.5)
    return model.eval()


def test_kv_cache_matches_one_full_pass():
    """Prefill + cached single steps + crop/redo give exactly what one causal pass gives."""
    model = _random_drafter()
    b, t = 2, 7
    embeds, aux = torch.randn(b, t, 32), torch.randn(b, t, 72)
    with torch.no_grad():
        full_logits, full_h = model(embeds, aux)
        cache = DraftKVCache()
        model(embeds[:, :3], aux[:, :3], cache=cache)
        model(embeds[:, 3:5], aux[:, 3:5], cache=cache)        # speculative entries...
        cache.crop(3)                                           # ...rolled back
        pieces = [model(embeds[:, i:i + 1], aux[:, i:i + 1], cache=cache) for i in range(3, t)]
    assert len(cache) == t
    assert torch.allclose(torch.cat([p[0] for p in pieces], 1), full_logits[:, 3:], atol=1e-5)
    assert torch.allclose(torch.cat([p[1] for p in pieces], 1), full_h[:, 3:], atol=1e-5)


def test_midlayer_math_follows_sglang():
    """fc only for 3*H_target wide input; residual is the incoming hidden; lm_head(norm(h))."""
    model = _random_drafter(seed=1)
    embeds, aux = torch.randn(1, 4, 32), torch.randn(1, 4, 72)
    with torch.no_grad():
        logits, h = model(embeds, aux)
        layer = model.midlayer
        hidden = model.fc(aux)
        x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), -1)
        attn = layer.self_attn(x, torch.arange(4)[None], None, None)
        expected = hidden + attn
        expected = expected + layer.mlp(layer.post_attention_layernorm(expected))
        assert torch.allclose(h, expected, atol=1e-6)
        assert torch.allclose(logits, model.lm_head(model.norm(expected)), atol=1e-6)
        # the drafter's own hidden (width H) skips fc
        assert torch.equal(model.project(h), h)
        with pytest.raises(ValueError, match="hidden width 50"):
            model.project(torch.randn(1, 1, 50))


def test_eagle31_norms_each_captured_state_and_feeds_the_post_norm_hidden_on():
    """EAGLE 3.1 as vLLM 0.32.0 / SGLang 0.5.23 compute it (drafter.model's docstring cites the lines): one
    RMSNorm per aux state (not one over the concatenation) before fc, and norm(h) as the next step's hidden."""
    model = _random_drafter(seed=1, fc_norm=True, norm_output=True)
    embeds, aux = torch.randn(1, 4, 32), torch.randn(1, 4, 72) * torch.tensor([1.0, 5.0, 0.2]).repeat_interleave(24)
    with torch.no_grad():
        logits, h = model(embeds, aux)
        chunks = aux.split(24, dim=-1)
        hidden = model.fc(torch.cat([model.fc_norm[i](chunks[i]) for i in range(3)], -1))
        layer = model.midlayer
        x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), -1)
        pre = hidden + layer.self_attn(x, torch.arange(4)[None], None, None)
        pre = pre + layer.mlp(layer.post_attention_layernorm(pre))
        assert torch.allclose(h, model.norm(pre), atol=1e-6)  # post-norm, also what lm_head reads
        assert torch.allclose(logits, model.lm_head(model.norm(pre)), atol=1e-6)
        one_norm = torch.nn.functional.rms_norm(aux, (72,), eps=model.config.rms_norm_eps)
        assert not torch.allclose(model.project(aux), model.fc(one_norm), atol=1e-3)  # per state, not one norm
        assert torch.equal(model.project(h), h)  # the drafter's own hidden skips fc and its norms


def test_eagle3_config_is_unchanged_and_eagle31_round_trips(tmp_path):
    """eagle3's config.json carries no 3.1 flag (existing exports stay byte for byte); eagle3.1's
    flags and fc_norm weights survive save / load, and a missing fc_norm weight is refused."""
    from drafter.model import DRAFTERS

    assert "fc_norm" not in small_config().to_json_dict() and "norm_output" not in small_config().to_json_dict()
    assert small_config().drafter == "eagle3"
    from drafter.model import set_draft_vocab

    model = _random_drafter(seed=4, **DRAFTERS["eagle3.1"])
    set_draft_vocab(model, torch.arange(0, 80, 2))
    assert model.config.drafter == "eagle3.1"
    save_drafter(model, tmp_path / "d")
    data = json.loads((tmp_path / "d" / "config.json").read_text())
    assert (data["fc_norm"], data["norm_output"]) == (True, True)
    loaded = load_drafter(tmp_path / "d")
    assert loaded.config.drafter == "eagle3.1"
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(tensors)
    del tensors["fc_norm.1.weight"]
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(DrafterCheckpointError, match=r"missing keys: \['fc_norm.1.weight'\]"):
        load_drafter(tmp_path / "d")


def test_attention_fast_path_equals_the_plain_formula():
    """The serving attention (one cos/sin for q and k, SDPA's own GQA) gives exactly the numbers of
    the plain formula: RoPE on q and k separately, k/v repeated per query head, causal SDPA."""
    model = _random_drafter(seed=2)
    attn = model.midlayer.self_attn
    x, pos = torch.randn(1, 6, 64), torch.arange(10, 16)[None]
    with torch.no_grad():
        q = attn.q_proj(x).view(1, 6, 4, 8).transpose(1, 2)
        k = attn.k_proj(x).view(1, 6, 2, 8).transpose(1, 2)
        v = attn.v_proj(x).view(1, 6, 2, 8).transpose(1, 2)
        q, k = apply_rope(q, pos, attn.inv_freq), apply_rope(k, pos, attn.inv_freq)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        expected = attn.o_proj(out.transpose(1, 2).reshape(1, 6, 32))
        cache = DraftKVCache()
        prefix = attn(x[:, :4], pos[:, :4], cache, None)
        steps = [attn(x[:, i:i + 1], pos[:, i:i + 1], cache, None) for i in (4, 5)]
    assert torch.equal(attn(x, pos, None, None), expected)
    assert torch.allclose(torch.cat([prefix] + steps, 1), expected, atol=1e-6)


def test_training_unroll_matches_serving_draft_steps():
    """The same module trains with a TTT unroll: row t at step k == serving draft step k from t."""
    model = _random_drafter(seed=2)
    t_len, steps = 6, 3
    embeds = torch.randn(1, t_len + steps, 32)    # embedding of the token at p + 1 (+ later tokens)
    aux = torch.randn(1, t_len, 72)
    with torch.no_grad():
        cache, hidden, unrolled = DraftKVCache(), aux, []
        for k in range(steps):
            logits, hidden = model(embeds[:, k:k + t_len], hidden, torch.arange(t_len)[None] + k, cache,
                                   ttt_attention_mask(t_len, k))
            unrolled.append(logits)
        for t in range(t_len):                      # serving: prefix 0..t, then own draft steps
            cache = DraftKVCache()
            logits, h = model(embeds[:, :t + 1], aux[:, :t + 1], cache=cache)
            logits, h = logits[:, -1:], h[:, -1:]
            for k in range(steps):
                assert torch.allclose(logits[0, 0], unrolled[k][0, t], atol=1e-5), (t, k)
                logits, h = model(embeds[:, t + k + 1:t + k + 2], h, cache=cache)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = small_config(rope_scaling=scaling)
    hf_cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, max_position_embeddings=256,
                         rope_theta=500000.0, rope_scaling=scaling)
    rotary = LlamaRotaryEmbedding(hf_cfg)
    q = torch.randn(1, 4, 9, 8)
    pos = torch.arange(100, 109)[None]
    cos, sin = rotary(q, pos)
    expected, _ = apply_rotary_pos_emb(q, q, cos, sin)
    assert torch.allclose(apply_rope(q, pos, rope_inv_freq(cfg)), expected, atol=1e-5)


def test_init_random_drafter_checks_layer_ids(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="out of range.*output-of-layer-0-based"):
        init_random_drafter(tiny_target, tmp_path / "bad", aux_layer_ids=[1, 2, 4])
    # The last layer (3 of 4) has no output SGLang or HFTarget can capture: refused here too.
    with pytest.raises(ValueError, match=r"\[3\] out of range.*valid ids are 0\.\.2"):
        init_random_drafter(tiny_target, tmp_path / "last", aux_layer_ids=[0, 1, 3])
    path = init_random_drafter(tiny_target, tmp_path / "ok", aux_layer_ids=[0, 1, 2], seed=1)
    assert load_drafter(path).config.aux_layer_ids == [0, 1, 2]


def test_transformers5_rope_parameters_read_alike_for_targets_and_drafts():
    from drafter.model import draft_config_for_target

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    target = {"num_hidden_layers": 8, "vocab_size": 100, "hidden_size": 32, "intermediate_size": 48,
              "num_attention_heads": 4, "rope_parameters": rope}
    from_target = draft_config_for_target(target)
    data = from_target.to_json_dict()
    del data["rope_theta"], data["rope_scaling"]
    from_json = Eagle3DraftConfig.from_json_dict({**data, "rope_parameters": rope})
    for cfg in (from_target, from_json):
        assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == rope
    assert "rope_parameters" not in from_json.extra
    plain = draft_config_for_target({**target, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4
