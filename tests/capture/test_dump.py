"""The dump stage on the tiny target: exact hidden states, shard format, quarantine, kill + resume,
several workers, the training-side reader, both store backends."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from drafter.capture import backends, base
from drafter.capture import hf as hf_capture
from drafter.capture import tokenized
from drafter.capture.plan import plan_dump
from drafter.config import LAYER_ID_CONVENTION, ConfigError
from drafter.contracts.shards import (FINAL_HIDDEN, HiddenStateShard, bytes_per_token, project_corpus,
                                      storage_projection, write_shard_file)
from drafter.formats import DumpMismatch, iter_dump_samples, read_conversations
from drafter.formats import hidden_state_shard_name as shard_name
from drafter.stage_output import StageOutput, to_jsonl
from drafter.store import CorruptObject, FileStore
from drafter.tokenize import tokenize_conversation
from tests.fixtures.dump_stage import (AUX, BUDGET, MAXLEN, convs, make_cfg, put_prepared, run_dump,  # noqa: F401
                                       shard_bytes)  # (convs: a fixture)

REPO = Path(__file__).resolve().parents[2]


def plan(cfg, upstream_stage: str, fp: str):
    return plan_dump(cfg.model_copy(update={"dump": cfg.dump.model_copy(update={"upstream": upstream_stage})}),
                          {upstream_stage: fp})


@pytest.fixture(scope="module")
def hf(tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_target)


# ---- exactness


def test_captured_states_equal_the_targets_hidden_states(any_store, tiny_target, convs, hf):
    """Stored aux/final states == HF output_hidden_states at the configured layers, bit for bit,
    for batches with padding (recomputed with the same batch plan); ids/mask == tokenisation."""
    model, tok = hf
    cfg = make_cfg(tiny_target)
    fp = put_prepared(any_store, convs[:10])
    result = run_dump(cfg, any_store, "prepare", fp)
    assert not result.skipped and result.manifest.meta["num_samples"] == 10
    stored = {s["id"]: s for s in iter_dump_samples(any_store, result.manifest, expect_aux_layer_ids=AUX)}
    padded_batches = 0
    for index in range(3):
        records = convs[index * 4:(index + 1) * 4][:10 - index * 4]
        tokens = [tokenize_conversation(tok, r["messages"], MAXLEN) for r in records]
        for batch in base.plan_batches([len(t[0]) for t in tokens], BUDGET):
            seqs = [tokens[j][0] for j in batch]
            longest = max(map(len, seqs))
            padded_batches += len(set(map(len, seqs))) > 1
            ids = torch.full((len(seqs), longest), tok.pad_token_id)
            for row, s in enumerate(seqs):
                ids[row, :len(s)] = torch.tensor(s)
            with torch.inference_mode():
                hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            for row, j in enumerate(batch):
                got, n = stored[records[j]["id"]], len(seqs[row])
                assert got["input_ids"].tolist() == tokens[j][0]
                assert got["loss_mask"].tolist() == tokens[j][1]
                for k, layer in enumerate(AUX):  # our convention: id i = hidden_states[i + 1]
                    assert torch.equal(got["aux_hidden_states"][:, k], hs[layer + 1][row, :n])
                assert torch.equal(got["hidden_states"], hs[-1][row, :n])
    assert padded_batches >= 2, "the test must exercise batches with padding"


def test_unbatched_capture_equals_a_single_unpadded_forward(tmp_path, tiny_target, convs, hf):
    """tokens_per_batch below any length: one sample per forward, no padding: equal to a plain forward pass; the
    final state is what lm_head turns into the target's logits."""
    model, tok = hf
    store = FileStore(tmp_path / "store")
    fp = put_prepared(store, convs[:5])
    result = run_dump(make_cfg(tiny_target, tokens_per_batch=8), store, "prepare", fp)
    for sample in iter_dump_samples(store, result.manifest, expect_aux_layer_ids=AUX):
        with torch.inference_mode():
            out = model(input_ids=sample["input_ids"][None], output_hidden_states=True)
        for k, layer in enumerate(AUX):
            assert torch.equal(sample["aux_hidden_states"][:, k], out.hidden_states[layer + 1][0])
        assert torch.equal(sample["hidden_states"], out.hidden_states[-1][0])
        with torch.inference_mode():
            assert torch.equal(model.lm_head(sample["hidden_states"][None]), out.logits)


# ---- manifest, skip, upstreams


def test_manifest_meta_and_skip_without_model_load(tmp_path, tiny_target, convs, monkeypatch):
    store = FileStore(tmp_path / "store")
    fp = put_prepared(store, convs[:6])
    cfg = make_cfg(tiny_target)
    first = run_dump(cfg, store, "prepare", fp)
    meta = first.manifest.meta
    assert meta["aux_layer_ids"] == AUX and meta["layer_id_convention"] == LAYER_ID_CONVENTION
    assert meta["dtype"] == "float32" and meta["hidden_size"] == 64 and meta["num_hidden_layers"] == 4
    assert meta["final_hidden_state"] == FINAL_HIDDEN
    assert meta["upstream"] == {"stage": "prepare", "fingerprint": fp}
    assert meta["num_shards"] == 2 and [s.name for s in first.manifest.shards] == [shard_name(0), shard_name(1)]
    assert meta["num_tokens"] > meta["num_loss_tokens"] > 0
    assert meta["bytes"] == first.manifest.total_bytes
    # Measured bytes/token = payload (4 x 64 float32 + id + mask) plus headers and offsets.
    assert meta["payload_bytes_per_token"] == bytes_per_token(64, "float32") == 4 * 64 * 4 + 9
    assert meta["payload_bytes_per_token"] < meta["bytes_per_token"] < meta["payload_bytes_per_token"] * 1.2
    assert "hidden 64 (float32, 3 aux + final" in meta["storage_projection"]
    for key in ("target_fingerprint", "tokenizer_hash", "chat_template_hash"):
        assert len(meta[key]) == 16
    assert meta["quarantined"]["total"] == 0

    def no_model(*a, **k):
        raise AssertionError("a complete dump must not load the model")

    monkeypatch.setattr(hf_capture, "load_capture_model", no_model)
    again = run_dump(cfg, store, "prepare", fp, devices=["cpu", "cpu"])  # workers: not in the fingerprint
    assert again.skipped and again.manifest == first.manifest
    # What changes the bytes' meaning changes the fingerprint (a new output, never a stale one).
    assert plan(make_cfg(tiny_target, max_length=64), "prepare", fp).fingerprint != first.manifest.fingerprint
    assert plan(make_cfg(tiny_target, aux_layer_ids=[0, 2, 1]), "prepare", fp).fingerprint \
        != first.manifest.fingerprint
    assert plan(cfg, "prepare", "another0").fingerprint != first.manifest.fingerprint


def test_datagen_upstream_is_read_in_shard_order(tmp_path, tiny_target, convs):
    store = FileStore(tmp_path / "store")
    gen = StageOutput(store, "datagen", "gen00000")
    gen.write_shard("gen-00001.jsonl", to_jsonl([{**c, "finish_reasons": ["stop"]} for c in convs[3:5]]))
    gen.write_shard("gen-00000.jsonl", to_jsonl(convs[0:3]))
    gen.write_shard("errors-00000.jsonl", to_jsonl([{"id": "x", "reason": "timeout"}]))
    gen.commit({})
    assert [r["id"] for r in read_conversations(store, "datagen", "gen00000")] == [c["id"] for c in convs[:5]]
    result = run_dump(make_cfg(tiny_target, samples_per_shard=2), store, "datagen", "gen00000")
    ids = [s["id"] for s in iter_dump_samples(store, result.manifest, expect_aux_layer_ids=AUX)]
    assert sorted(ids[0:2]) == sorted(c["id"] for c in convs[0:2])  # shard i = samples [2i, 2i+2)
    assert sorted(ids[2:4]) == sorted(c["id"] for c in convs[2:4]) and ids[4] == convs[4]["id"]


def test_bad_records_and_answerless_samples_are_quarantined(tmp_path, tiny_target, convs):
    store = FileStore(tmp_path / "store")
    records = [convs[0], {"id": "no-messages"}, {"id": "user-only", "messages": [{"role": "user", "content": "hi"}]},
               {"id": "bad-role", "messages": [{"role": "robot", "content": "beep"}]}, convs[1]]
    fp = put_prepared(store, records)
    meta = run_dump(make_cfg(tiny_target), store, "prepare", fp).manifest.meta
    assert meta["num_samples"] == 2
    assert meta["quarantined"]["by_reason"] == {"bad_record": 1, "no_loss_tokens": 1, "template_error": 1}


def test_last_layer_as_aux_is_a_config_error(tiny_target):
    with pytest.raises(ConfigError, match="dump.aux_layer_ids"):
        plan(make_cfg(tiny_target, aux_layer_ids=[0, 1, 3]), "prepare", "x")
    with pytest.raises(ValueError, match="dump reads the output of"):
        plan(make_cfg(tiny_target), "train", "x")


# ---- quarantine of non-finite states


def test_nan_sample_is_quarantined_and_its_batch_mates_are_untouched(tmp_path, tiny_target, convs, hf,
                                                                     monkeypatch):
    _model, tok = hf
    store = FileStore(tmp_path / "store")
    fp = put_prepared(store, convs[:8])
    cfg = make_cfg(tiny_target)
    clean = {s["id"]: s for s in iter_dump_samples(
        store, run_dump(cfg, store, "prepare", fp).manifest, expect_aux_layer_ids=AUX)}
    victim = convs[5]
    victim_ids = torch.tensor(tokenize_conversation(tok, victim["messages"], MAXLEN)[0])
    real_load = hf_capture.load_capture_model

    def load_with_nan(*args, **kwargs):
        cm = real_load(*args, **kwargs)

        def poison(module, inputs, output):
            (ids,) = inputs
            for row in range(ids.shape[0]):
                if torch.equal(ids[row, :len(victim_ids)], victim_ids):
                    output[row, 3] = float("nan")  # one token of one sample
            return output

        cm.model.get_input_embeddings().register_forward_hook(poison)
        return cm

    monkeypatch.setattr(hf_capture, "load_capture_model", load_with_nan)
    store2 = FileStore(tmp_path / "store2")
    put_prepared(store2, convs[:8])
    result = run_dump(cfg, store2, "prepare", fp)
    meta = result.manifest.meta
    assert meta["quarantined"]["samples"] == [{"id": victim["id"], "reason": "nonfinite"}]
    assert meta["num_samples"] == 7
    got = {s["id"]: s for s in iter_dump_samples(store2, result.manifest, expect_aux_layer_ids=AUX)}
    assert set(got) == set(clean) - {victim["id"]}
    for sid, sample in got.items():  # rows are independent: the other samples are bit-identical
        for key in ("aux_hidden_states", "hidden_states", "input_ids", "loss_mask"):
            assert torch.equal(sample[key], clean[sid][key])


# ---- kill and resume


CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from drafter.config import load_config
    from drafter.stage_output import StageOutput
    from drafter.capture import tokenized
    from drafter.stages import TABLE
    from drafter.store import FileStore

    cfg_path, store_root, log_path, slow_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    real_write, real_build = StageOutput.write_shard, tokenized.tokenize_shard

    def write_shard(self, name, data, meta=None):
        info = real_write(self, name, data, meta)
        with open(log_path, "a") as f:  # count verified writes, across processes
            f.write(name + "\\n")
        return info

    def build_shard(*args, **kwargs):
        built = real_build(*args, **kwargs)
        time.sleep(slow_s)  # slow enough to be killed mid-run
        return built

    StageOutput.write_shard, tokenized.tokenize_shard = write_shard, build_shard
    result = TABLE.run("dump", load_config(cfg_path), FileStore(store_root), upstream={"prepare": "prep0000"})
    print(result.uri, result.manifest.meta["num_samples"])
""")


def run_child(tmp_path, cfg, root: Path, log: Path, slow_s: float) -> subprocess.Popen:
    script, cfg_path = tmp_path / "child.py", tmp_path / "cfg.yaml"
    script.write_text(CHILD)
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    return subprocess.Popen([sys.executable, str(script), str(cfg_path), str(root), str(log), str(slow_s)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_redoes_only_unfinished_shards(tmp_path, tiny_target, convs):
    cfg = make_cfg(tiny_target, samples_per_shard=2)  # 12 samples -> 6 shards
    names = [shard_name(i) for i in range(6)]
    reference = FileStore(tmp_path / "reference")
    put_prepared(reference, convs[:12])
    expected = run_dump(cfg, reference, "prepare", "prep0000").manifest

    root = tmp_path / "killed"
    store = FileStore(root)
    put_prepared(store, convs[:12])
    out = StageOutput(store, "dump", expected.fingerprint)
    log = tmp_path / "writes.log"
    child = run_child(tmp_path, cfg, root, log, slow_s=0.6)
    deadline = time.monotonic() + 60
    while len(out.completed_shards()) < 2:
        assert child.poll() is None, child.stdout.read()
        assert time.monotonic() < deadline, "the child made no progress"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    done_at_kill = set(out.completed_shards())
    assert 2 <= len(done_at_kill) < 6 and not out.is_complete()

    log.write_text("")
    resumed = run_child(tmp_path, cfg, root, log, slow_s=0)
    output, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, output
    rewritten = log.read_text().split()
    assert sorted(rewritten) == sorted(set(names) - done_at_kill), "only unverified shards are redone"
    manifest = out.load_manifest()
    assert shard_bytes(store, manifest) == shard_bytes(reference, expected)  # byte-identical
    assert manifest.meta == expected.meta


def test_resume_with_two_cpu_workers(any_store, tmp_path, tiny_target, convs, monkeypatch):
    cfg = make_cfg(tiny_target, samples_per_shard=2)
    reference = FileStore(tmp_path / "reference")
    put_prepared(reference, convs[:10])
    expected = run_dump(cfg, reference, "prepare", "prep0000").manifest

    fp = put_prepared(any_store, convs[:10])
    real_build = tokenized.tokenize_shard

    def crash_at_shard_3(tokenizer, max_length, index, records, split):
        if index == 3:
            raise RuntimeError("simulated crash")
        return real_build(tokenizer, max_length, index, records, split)

    monkeypatch.setattr(tokenized, "tokenize_shard", crash_at_shard_3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_dump(cfg, any_store, "prepare", fp)
    out = StageOutput(any_store, "dump", expected.fingerprint)
    before = set(out.completed_shards())
    assert before == {shard_name(i) for i in range(3)}  # finished shards were uploaded before failing

    monkeypatch.setattr(tokenized, "tokenize_shard", real_build)
    written, real_write = [], StageOutput.write_shard
    monkeypatch.setattr(StageOutput, "write_shard",
                        lambda self, name, data, meta=None: written.append(name) or real_write(self, name, data, meta))
    result = run_dump(cfg, any_store, "prepare", fp, devices=["cpu", "cpu"])
    assert sorted(written) == [shard_name(3), shard_name(4)]
    assert shard_bytes(any_store, result.manifest) == shard_bytes(reference, expected)
    assert {s.meta["device"] for s in result.manifest.shards} == {"cpu"}


# ---- the reader


def test_reader_refuses_other_layer_ids_and_corrupt_shards(any_store, tiny_target, convs):
    fp = put_prepared(any_store, convs[:4])
    manifest = run_dump(make_cfg(tiny_target), any_store, "prepare", fp).manifest
    with pytest.raises(DumpMismatch, match=r"dump has \[0, 1, 2\], expected \[1, 2, 3\]"):
        next(iter_dump_samples(any_store, manifest, expect_aux_layer_ids=[1, 2, 3]))
    with pytest.raises(DumpMismatch, match="expected 'input-of-layer'"):
        next(iter_dump_samples(any_store, manifest, expect_aux_layer_ids=AUX,
                               expect_layer_id_convention="input-of-layer"))
    assert len(list(iter_dump_samples(any_store, manifest.fingerprint, expect_aux_layer_ids=AUX))) == 4
    key = f"dump/{manifest.fingerprint}/{shard_name(0)}"
    blob = bytearray(any_store.get_bytes(key))
    blob[-1] ^= 0xFF
    any_store.put_bytes(key, bytes(blob))
    with pytest.raises(CorruptObject, match="sha256 mismatch"):
        list(iter_dump_samples(any_store, manifest, expect_aux_layer_ids=AUX))


# ---- shard format and storage arithmetic


def test_shard_file_roundtrip_views_and_determinism(tmp_path):
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(0)
    samples = [{"id": f"s{i}", "input_ids": list(range(n)), "loss_mask": [i % 2] * n,
                "aux_hidden_states": torch.randn(n, 3, 8, generator=gen).to(torch.bfloat16),
                "hidden_states": torch.randn(n, 8, generator=gen).to(torch.bfloat16)} for i, n in enumerate([5, 1, 7])]
    a = write_shard_file(tmp_path / "a.safetensors", samples, metadata={"aux_layer_ids": AUX})
    b = write_shard_file(tmp_path / "b.safetensors", samples, metadata={"aux_layer_ids": AUX})
    assert a.read_bytes() == b.read_bytes()  # no timestamps, sorted metadata
    shard = HiddenStateShard(a)
    assert len(shard) == 3 and shard.sample_ids == ["s0", "s1", "s2"] and shard.aux_layer_ids == AUX
    for i, want in enumerate(samples):
        got = shard.sample(i)
        assert got["id"] == want["id"] and got["input_ids"].tolist() == want["input_ids"]
        assert got["aux_hidden_states"].dtype == torch.bfloat16
        assert torch.equal(got["aux_hidden_states"], want["aux_hidden_states"])
        assert torch.equal(got["hidden_states"], want["hidden_states"])
        # zero-copy: a view into the shard's one mapped tensor
        assert got["aux_hidden_states"].untyped_storage().data_ptr() == \
            shard.tensors["aux_hidden_states"].untyped_storage().data_ptr()
    plain = load_file(a)  # any safetensors reader can open it
    assert plain["offsets"].tolist() == [0, 5, 6, 13] and plain["loss_mask"].dtype == torch.uint8


def test_empty_shard_keeps_shapes(tmp_path):
    from drafter.contracts.shards import ShardWriter

    path = ShardWriter().finish(tmp_path / "e.safetensors", empty_like={
        "input_ids": (torch.int64, ()), "loss_mask": (torch.uint8, ()),
        "aux_hidden_states": (torch.float32, (3, 16)), "hidden_states": (torch.float32, (16,))})
    shard = HiddenStateShard(path)
    assert len(shard) == 0 and shard.tensors["aux_hidden_states"].shape == (0, 3, 16)


def test_a_failed_finish_removes_the_spool(tmp_path):
    from drafter.contracts.shards import ShardWriter, write_shard_file

    with pytest.raises(ValueError, match="empty_like"):
        ShardWriter(spool_dir=tmp_path).finish(tmp_path / "e.safetensors")
    with pytest.raises(ValueError, match="empty_like"):
        write_shard_file(tmp_path / "f.safetensors", [], spool_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_storage_projection_reproduces_the_seed_run():
    # 87.8M tokens of Kimi-K2.5 (hidden 7168) in bf16, 3 aux + final: the seed's "4.6 TB" was TiB.
    text = project_corpus(87_800_000, 7168, "bfloat16")
    assert text == "87.8M tokens at hidden 7168 (bfloat16, 3 aux + final, 57,353 B/token) -> 5.0 TB (4.6 TiB)"
    assert storage_projection(1000.0, 2_000_000) == "2.0M tokens (1,000 B/token) -> 2.0 GB (1.9 GiB)"
    with pytest.raises(ValueError):
        bytes_per_token(7168, "int8")


def test_eval_split_is_dumped_into_its_own_shards(tmp_path, tiny_target, convs):
    """The trainer needs held-out features: the eval split lands in `eval-hs-*` shards of the same
    output, read with split="eval"; the train split's shards and counts are unchanged by it."""
    store = FileStore(tmp_path / "store")
    fp = put_prepared(store, convs[:5], held_out=convs[5:8])
    result = run_dump(make_cfg(tiny_target, samples_per_shard=2), store, "prepare", fp)
    names = sorted(s.name for s in result.manifest.shards)
    assert names == ["eval-hs-00000.safetensors", "eval-hs-00001.safetensors", shard_name(0), shard_name(1),
                     shard_name(2)]
    assert shard_name(1, "eval") == "eval-hs-00001.safetensors"
    meta = result.manifest.meta
    assert meta["num_samples"] == 5 and meta["num_shards"] == 3
    assert meta["eval"]["num_samples"] == 3 and meta["eval"]["num_shards"] == 2
    held_out = [s["id"] for s in iter_dump_samples(store, result.manifest, expect_aux_layer_ids=AUX, split="eval")]
    train = [s["id"] for s in iter_dump_samples(store, result.manifest, expect_aux_layer_ids=AUX)]
    assert sorted(held_out) == sorted(c["id"] for c in convs[5:8])
    assert sorted(train) == sorted(c["id"] for c in convs[:5])
    # each shard's marker records its samples' token counts in shard order (the export's length distribution)
    by_shard = {s.name: s.meta["sample_tokens"] for s in result.manifest.shards}
    stored = [len(s["input_ids"]) for s in iter_dump_samples(store, result.manifest, expect_aux_layer_ids=AUX)]
    assert [n for name in (shard_name(0), shard_name(1), shard_name(2)) for n in by_shard[name]] == stored
    assert sum(stored) == meta["num_tokens"] and len(by_shard["eval-hs-00000.safetensors"]) == 2


def test_recorded_token_ids_are_fed_as_they_are_and_records_without_them_are_retokenised(tmp_path, tiny_target,
                                                                                         convs, hf):
    """A datagen record whose answers carry `token_ids` is dumped with exactly those ids; one
    without (older generations) re-tokenises its text as before; ids that are not ids are a bad record."""
    _, tok = hf
    eot_id = tok.convert_tokens_to_ids("<|eot_id|>")
    # each answer emitted one character at a time: not what BPE re-tokenises the text to
    as_chars = lambda text: [t for ch in text.strip() for t in tok(ch, add_special_tokens=False)["input_ids"]]
    answers = {k: as_chars(m["content"]) + [eot_id] for k, m in enumerate(convs[0]["messages"]) if m["role"] == "assistant"}
    with_ids = {**convs[0], "messages": [{**m, "token_ids": answers[k]} if k in answers else m
                                         for k, m in enumerate(convs[0]["messages"])]}
    bad = {**convs[2], "messages": [{**m, "token_ids": "12 13"} if m["role"] == "assistant" else m
                                    for m in convs[2]["messages"]]}
    store = FileStore(tmp_path / "store")
    gen = StageOutput(store, "datagen", "gen00000")
    gen.write_shard("gen-00000.jsonl", to_jsonl([with_ids, convs[1], bad]))
    gen.commit({})
    result = run_dump(make_cfg(tiny_target, max_length=10_000), store, "datagen", "gen00000")
    samples = {s["id"]: s for s in iter_dump_samples(store, result.manifest, expect_aux_layer_ids=AUX)}
    learned = lambda ids, mask: [t for t, m in zip(ids, mask) if m]
    exact = samples[with_ids["id"]]
    # the recorded ids, nothing re-tokenised (which would have given other tokens)
    assert learned(exact["input_ids"].tolist(), exact["loss_mask"].tolist()) == sum(answers.values(), [])
    assert learned(*tokenize_conversation(tok, convs[0]["messages"], 10_000)) != sum(answers.values(), [])
    ids, mask = tokenize_conversation(tok, convs[1]["messages"], 10_000)
    assert samples[convs[1]["id"]]["input_ids"].tolist() == ids and samples[convs[1]["id"]]["loss_mask"].tolist() == mask
    meta = result.manifest.meta
    assert meta["samples_from_token_ids"] == 1 and meta["quarantined"]["by_reason"] == {"bad_record": 1}
    assert any("1 samples from the target's own token ids" in line for line in result.summary)
