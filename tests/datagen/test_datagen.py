"""The datagen stage against real HTTP servers on loopback: a programmable OpenAI-compatible fake
(stdlib, threaded) and, once, the reference engine on `tiny_target`. Resume tests run on both
store backends."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from drafter.config import ConfigError, LifecycleConfig, ServeConfig, StorageConfig, TargetConfig, parse_config
from drafter.formats import iter_generations
from drafter.chat_client import DatagenServerDown
from drafter.stages import TABLE, datagen, prepare
from drafter.store import open_store
from tests.fixtures.datagen_fakes import (FakeOpenAI, datagen_output, fakes, last_user, make_cfg,  # noqa: F401
                                          prepared, run_datagen, sharegpt)

REPO = Path(__file__).resolve().parents[2]



def datagen_fingerprint(cfg: LifecycleConfig, fp: str) -> str:
    return TABLE.fingerprint("datagen", cfg, {"prepare": fp})


def gen_shards(cfg, store, fp) -> dict:
    return {n: i.sha256 for n, i in datagen_output(cfg, store, fp).completed_shards().items()
            if n.startswith("gen-")}


# ----------------------------------------------------------------------------------------- tests


def test_multi_turn_resends_new_answers_and_rerun_contacts_no_server(tmp_path, any_store, any_storage_config,
                                                                     fakes):
    fake = fakes()
    rows = [sharegpt(0, turns=3, system=True), sharegpt(1), sharegpt(2, turns=2)]
    cfg = make_cfg(tmp_path, any_storage_config, rows, temperature=0.5)
    fp = prepared(cfg, any_store)
    seen = []
    result = run_datagen(cfg, any_store, fp, [fake.url], progress=lambda *a: seen.append(a))
    assert not result.skipped

    # What the server received for conversation 0: the history holds the NEW answers.
    asked = [b["messages"] for b in fake.received if "question 0." in last_user(b)]
    assert [len(m) for m in asked] == [2, 4, 6]
    assert asked[2] == [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "question 0.0"},
                        {"role": "assistant", "content": "[1] re: question 0.0"},
                        {"role": "user", "content": "question 0.1"},
                        {"role": "assistant", "content": "[2] re: question 0.1"},
                        {"role": "user", "content": "question 0.2"}]
    assert not any("OLD" in m["content"] for b in fake.received for m in b["messages"])
    assert {(b["model"], b["temperature"], b["max_tokens"]) for b in fake.received} == {("fake-model", 0.5, 16)}

    records = list(iter_generations(any_store, result.manifest))
    assert [r["id"] for r in records] == ["c000", "c001", "c002"]
    r0 = records[0]
    assert r0["source_id"] == "c000" and r0["finish_reasons"] == ["stop"] * 3
    assert r0["messages"][-1] == {"role": "assistant", "content": "[3] re: question 0.2"}
    assert r0["usage"] == {"prompt_tokens": 2 + 4 + 6, "completion_tokens": 12}
    # the record never names its server (the same answers are the same bytes); the marker counts them
    assert r0["gen"] == {"model": "fake-model", "temperature": 0.5, "max_tokens": 16}
    assert [result.manifest.shard(n).meta["servers"] for n in ("gen-00000.jsonl", "gen-00001.jsonl")] == [
        {fake.url: 2}, {fake.url: 1}]
    assert [s.name for s in result.manifest.shards] == ["conversation-keys.jsonl", "gen-00000.jsonl", "gen-00001.jsonl"]
    meta = result.manifest.meta
    assert (meta["conversations"], meta["generated"], meta["errors"], meta["turns"]) == (3, 3, 0, 6)
    assert meta["completion_tokens"] == sum(r["usage"]["completion_tokens"] for r in records)
    assert meta["throughput"]["requests"] == 6 and meta["throughput"]["requests_per_s"] > 0
    assert meta["generation"]["temperature"] == 0.5
    assert seen[-1][:2] == (3, 3) and "req/s" in seen[-1][2] and "tok/s" in seen[-1][3]

    # Complete: skipped without contacting anything (the URL is a closed port).
    n = len(fake.received)
    again = run_datagen(cfg, any_store, fp, ["http://127.0.0.1:9"])
    assert again.skipped and again.manifest == result.manifest and len(fake.received) == n


def test_round_robin_with_bounded_in_flight(tmp_path, fakes):
    a, b = fakes(delay_s=0.02), fakes(delay_s=0.02)
    cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"), [sharegpt(i) for i in range(24)],
                   concurrency_per_server=3, shard_size=5)
    store = open_store(cfg.storage)
    result = run_datagen(cfg, store, prepared(cfg, store), [a.url, b.url + "/v1/"])
    assert len(a.received) + len(b.received) == 24
    assert abs(len(a.received) - len(b.received)) <= 4
    assert 1 < a.max_in_flight <= 3 and 1 < b.max_in_flight <= 3
    servers = sum((Counter(s.meta["servers"]) for s in result.manifest.shards if s.name.startswith("gen-")), Counter())
    assert servers == {a.url: len(a.received), b.url: len(b.received)}
    assert [r["id"] for r in iter_generations(store, result.manifest)] == [f"c{i:03d}" for i in range(24)]


def test_429_and_500_are_retried_then_succeed(tmp_path, fakes):
    fake = fakes()
    fake.fail = lambda body, attempt: {1: 429, 2: 503}.get(attempt)
    cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"), [sharegpt(i, turns=2) for i in range(4)],
                   max_retries=3, max_consecutive_failures=50)
    store = open_store(cfg.storage)
    result = run_datagen(cfg, store, prepared(cfg, store), [fake.url])
    assert result.manifest.meta["generated"] == 4 and result.manifest.meta["errors"] == 0
    assert Counter(fake.prompts) == {f"question {i}.{t}": 3 for i in range(4) for t in range(2)}
    assert result.manifest.meta["throughput"]["servers"][0]["failures"] == 16


def test_bad_requests_go_to_the_error_shard(tmp_path, fakes):
    """A 400 is final at once; a prompt failing forever (while the server still answers) is retried,
    then recorded. Neither conversation is in the output; the server is not declared down."""
    fake = fakes()
    fake.fail = lambda body, attempt: (400 if last_user(body) == "question 1.0" else
                                       500 if last_user(body) == "question 2.1" else None)
    cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"),
                   [sharegpt(i, turns=2) for i in range(5)], concurrency_per_server=1)
    store = open_store(cfg.storage)
    result = run_datagen(cfg, store, prepared(cfg, store), [fake.url])
    assert [r["id"] for r in iter_generations(store, result.manifest)] == ["c000", "c003", "c004"]
    errors = list(iter_generations(store, result.manifest, errors=True))
    assert [(e["id"], e["reason"], e["attempts"], e["turn"]) for e in errors] == [
        ("c001", "http_400", 1, 0), ("c002", "http_500", 3, 1)]
    assert "programmed 500" in errors[1]["detail"]
    assert not any("server" in e for e in errors)  # its marker counts them (see the port test below)
    assert [result.manifest.shard(n).meta["servers"] for n in ("errors-00000.jsonl", "errors-00001.jsonl")] == [
        {fake.url: 1}, {fake.url: 1}]
    meta = result.manifest.meta
    assert meta["errors"] == 2 and meta["errors_by_reason"] == {"http_400": 1, "http_500": 1}
    assert meta["generated"] == 3 and meta["conversations"] == 5
    assert "errors-00000.jsonl" in [s.name for s in result.manifest.shards]
    assert "errors-00001.jsonl" in [s.name for s in result.manifest.shards]


class EchoingFake(FakeOpenAI):
    """A server whose refusals name its own address (as many error pages do)."""

    def handle(self, body):
        status, payload, headers = super().handle(body)
        if status is not None and status != 200:
            payload = {"error": {"message": f"programmed {status} from {self.url} ({self.url.split('//')[1]})"}}
        return status, payload, headers


def test_a_failed_request_gives_the_same_bytes_whatever_port_answered_it(tmp_path, caplog):
    """Fan-out child k serves on `serve.port + k` (and a re-run may start its server on another
    port): the committed output, error shards of both splits included, is the same bytes whichever
    port refused the request. The address stays in the log and in the shard's marker."""
    rows = [sharegpt(i, turns=1 + i % 2) for i in range(12)]
    refused = lambda body, attempt: (400 if last_user(body).startswith(("question 3.", "question 7.")) else
                                     500 if last_user(body) in ("question 5.1", "question 9.0") else None)
    outputs, urls = [], []
    for run in ("a", "b"):
        fake = EchoingFake()
        try:
            fake.fail = refused
            cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/{run}/store"), rows,
                           concurrency_per_server=2, shard_size=3, max_consecutive_failures=50)
            cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"eval_fraction": 0.35})})
            store = open_store(cfg.storage)
            with caplog.at_level("WARNING", logger="drafter.datagen.generate"):
                result = run_datagen(cfg, store, prepared(cfg, store), [fake.url])
        finally:
            fake.close()
        urls.append(fake.url)
        out = datagen_output(cfg, store, prepared(cfg, store))
        outputs.append({s.name: out.read_shard(s.name) for s in result.manifest.shards})
        marked = Counter()
        for s in result.manifest.shards:
            if "errors-" in s.name:
                marked.update(s.meta["servers"])
        assert marked == {fake.url: result.manifest.meta["errors"] + result.manifest.meta["eval"]["errors"]}
    assert urls[0] != urls[1]
    a, b = outputs
    assert any(n.startswith("errors-") for n in a) and any(n.startswith("eval-errors-") for n in a), sorted(a)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], (name, a[name][:300], b[name][:300])
    assert not any(u.split("//")[1] in data.decode() for data in a.values() for u in urls)
    logged = [r.getMessage() for r in caplog.records]
    assert all(any(u in m and "c003" in m for m in logged) for u in urls), logged  # the address: in the log


@pytest.mark.parametrize("failure", ["http_500", "vanish"])
def test_server_down_keeps_finished_shards_and_rerun_completes(tmp_path, any_store, any_storage_config,
                                                               fakes, failure):
    fake = fakes()
    if failure == "http_500":
        fake.fail = lambda body, attempt: 500 if len(fake.received) > 7 else None
    else:
        fake.die_after = 7
    rows = [sharegpt(i) for i in range(12)]
    cfg = make_cfg(tmp_path, any_storage_config, rows, concurrency_per_server=1)
    fp = prepared(cfg, any_store)
    with pytest.raises(DatagenServerDown) as info:
        run_datagen(cfg, any_store, fp, [fake.url])
    err = info.value
    assert err.url == fake.url and fake.url in str(err)
    assert ("500" in err.last_error) if failure == "http_500" else ("connection" in err.last_error)
    out = datagen_output(cfg, any_store, fp)
    assert not out.is_complete()
    done = gen_shards(cfg, any_store, fp)
    assert sorted(done) == ["gen-00000.jsonl", "gen-00001.jsonl", "gen-00002.jsonl"]  # 7 answered

    healthy = fakes()
    result = run_datagen(cfg, any_store, fp, [healthy.url])
    ids = [r["id"] for r in iter_generations(any_store, result.manifest)]
    assert ids == [f"c{i:03d}" for i in range(12)]  # none lost, none twice
    assert sorted(healthy.prompts) == sorted(f"question {i}.0" for i in range(6, 12))  # finished: not redone
    assert {s.name: s.sha256 for s in result.manifest.shards if s.name in done} == done
    assert result.manifest.meta["resumed_shards"] == 3 and result.manifest.meta["errors"] == 0


def test_shards_finished_behind_an_unfinished_one_are_kept(tmp_path, fakes):
    """Shards are written in order; when the stage stops, shards that finished behind an unfinished
    one are saved too. Here c000 (shard 0) keeps failing until its server goes down for good."""
    fake = fakes()
    answered: list[str] = []

    def fail(body, attempt):
        if last_user(body) == "question 0.0" or len(answered) >= 5:
            return 500
        answered.append(last_user(body))
        return None
    fake.fail = fail
    cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"), [sharegpt(i) for i in range(6)],
                   max_retries=20, max_consecutive_failures=22)  # c000 cannot use up its retries first
    store = open_store(cfg.storage)
    fp = prepared(cfg, store)
    with pytest.raises(DatagenServerDown, match="500"):
        run_datagen(cfg, store, fp, [fake.url])
    assert sorted(gen_shards(cfg, store, fp)) == ["gen-00001.jsonl", "gen-00002.jsonl"]

    healthy = fakes()
    result = run_datagen(cfg, store, fp, [healthy.url])
    assert sorted(healthy.prompts) == ["question 0.0", "question 1.0"]
    assert [r["id"] for r in iter_generations(store, result.manifest)] == [f"c{i:03d}" for i in range(6)]


def test_server_down_survives_pickling():
    import pickle

    err = DatagenServerDown("http://h:1", "connection: refused", 10)
    err.add_note("server log: x.log")
    back = pickle.loads(pickle.dumps(err))
    assert (back.url, back.last_error, back.failures, back.__notes__) == (
        "http://h:1", "connection: refused", 10, ["server log: x.log"])


CHILD = """
import sys
from drafter.config import LifecycleConfig
from drafter.stages import TABLE
from drafter.store import open_store
cfg = LifecycleConfig.model_validate_json(sys.argv[1])
cfg = cfg.model_copy(update={"datagen": cfg.datagen.model_copy(update={"server_urls": [sys.argv[3]]})})
TABLE.run("datagen", cfg, open_store(cfg.storage), upstream={"prepare": sys.argv[2]})
"""


def test_sigkill_mid_run_then_rerun_resumes(tmp_path, any_store, any_storage_config, fakes):
    fake = fakes()
    fake.hold_after = 8  # 4 conversations x 2 turns answered, then the server stalls
    rows = [sharegpt(i, turns=2) for i in range(10)]
    cfg = make_cfg(tmp_path, any_storage_config, rows, concurrency_per_server=1)
    fp = prepared(cfg, any_store)
    child = subprocess.Popen([sys.executable, "-c", CHILD, cfg.model_dump_json(), fp, fake.url], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while len(gen_shards(cfg, any_store, fp)) < 2:
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the child never finished two shards"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    before = gen_shards(cfg, any_store, fp)
    assert sorted(before) == ["gen-00000.jsonl", "gen-00001.jsonl"]
    assert not datagen_output(cfg, any_store, fp).is_complete()

    fresh = fakes()
    result = run_datagen(cfg, any_store, fp, [fresh.url])
    ids = [r["id"] for r in iter_generations(any_store, result.manifest)]
    assert ids == [f"c{i:03d}" for i in range(10)]
    assert len(fresh.received) == 6 * 2  # only conversations 4..9, two turns each
    assert {s.name: s.sha256 for s in result.manifest.shards if s.name in before} == before
    assert result.manifest.meta["generated"] == 10 and result.manifest.meta["turns"] == 20


def test_stale_error_shard_of_an_unfinished_shard_is_not_committed(tmp_path, fakes):
    fake = fakes()
    cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"), [sharegpt(i) for i in range(3)])
    store = open_store(cfg.storage)
    fp = prepared(cfg, store)
    # A killed run wrote errors-00000 but died before gen-00000; this time the server is healthy.
    datagen_output(cfg, store, fp).write_shard("errors-00000.jsonl", b'{"id": "c000", "reason": "timeout"}\n')
    result = run_datagen(cfg, store, fp, [fake.url])
    assert [s.name for s in result.manifest.shards] == ["conversation-keys.jsonl", "gen-00000.jsonl", "gen-00001.jsonl"]
    assert result.manifest.meta["errors"] == 0


def test_fingerprint_ignores_only_operational_settings(tmp_path):
    cfg = make_cfg(tmp_path, StorageConfig(), [sharegpt(0)])
    fp = datagen_fingerprint(cfg, "p1")
    same = cfg.model_copy(update={"datagen": cfg.datagen.model_copy(update={
        "server_urls": ["http://x:1"], "concurrency_per_server": 64, "backoff_base_s": 3.0})})
    assert datagen_fingerprint(same, "p1") == fp
    hotter = cfg.model_copy(update={"datagen": cfg.datagen.model_copy(update={"temperature": 0.7})})
    other_target = cfg.model_copy(update={"target": TargetConfig(path="/elsewhere", name="fake-model")})
    assert len({fp, datagen_fingerprint(hotter, "p1"), datagen_fingerprint(other_target, "p1"),
                datagen_fingerprint(cfg, "p2")}) == 4


def test_eval_split_is_regenerated_into_its_own_shards(tmp_path, fakes):
    """Held-out metrics need held-out answers written by the target too: the eval split lands in
    `eval-gen-*` shards of the same output, and the train split reads as before."""
    fake = fakes()
    cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"), [sharegpt(i) for i in range(10)])
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"eval_fraction": 0.3})})
    store = open_store(cfg.storage)
    fp = prepared(cfg, store)
    result = run_datagen(cfg, store, fp, [fake.url])
    meta = result.manifest.meta
    train = [r["id"] for r in iter_generations(store, result.manifest)]
    held_out = [r["id"] for r in iter_generations(store, result.manifest, split="eval")]
    assert held_out and not set(train) & set(held_out) and len(train) + len(held_out) == 10
    assert meta["conversations"] == len(train) and meta["eval"]["generated"] == len(held_out)
    assert all(s.name.startswith(("gen-", "eval-gen-", "conversation-keys")) for s in result.manifest.shards)
    assert meta["eval_shards"] == sum(s.name.startswith("eval-gen-") for s in result.manifest.shards) >= 1
    assert all(r["messages"][-1]["content"].startswith("[") for r in iter_generations(store, fp_of(result), split="eval"))


def fp_of(result) -> str:
    return result.manifest.fingerprint


def test_config_errors():
    with pytest.raises(ConfigError, match="server URLs must be http"):
        parse_config({"target": {"path": "/x"}, "datagen": {"server_urls": ["localhost:30000"]}})
    with pytest.raises(ConfigError, match="max_consecutive_failures"):
        parse_config({"target": {"path": "/x"}, "datagen": {"max_retries": 5, "max_consecutive_failures": 6}})


def test_task_retries_only_transient_failures():
    from drafter.errors import is_retryable as is_transient
    from drafter.server_errors import HealthCheckTimeout, ServerConfigError, ServerCrashed
    from drafter.store import CorruptObject, StoreError

    assert is_transient(DatagenServerDown("http://h:1", "connection: refused", 10))
    assert is_transient(ServerCrashed("exited", engine="reference"))
    assert is_transient(HealthCheckTimeout("not ready", engine="reference"))
    assert is_transient(StoreError("S3 unreachable"))
    assert not is_transient(ServerConfigError("port taken", engine="reference"))
    assert not is_transient(ConfigError([("datagen.server_urls", "none")]))
    assert not is_transient(CorruptObject("k", "sha256 mismatch"))
    assert not is_transient(ValueError("a bug"))


def test_the_servers_token_ids_reach_the_dump_and_a_retokenization_mismatch_warns(tmp_path, fakes, tiny_target,
                                                                                   caplog):
    """A server that answers ids which re-tokenising its text does not give (each character its
    own token): the records keep the server's ids, the manifest and the summary report the low
    agreement with a warning, and the dump stores exactly the server's ids as the answer tokens."""
    from transformers import AutoTokenizer

    from drafter.config import DumpConfig
    from drafter.formats import iter_dump_samples
    from drafter.stages import TABLE

    tok = AutoTokenizer.from_pretrained(tiny_target)
    eot_id = tok.convert_tokens_to_ids("<|eot_id|>")
    as_chars = lambda text: [t for ch in text for t in tok(ch, add_special_tokens=False)["input_ids"]] + [eot_id]
    fake = fakes()
    fake.token_ids = as_chars
    cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"), [sharegpt(0, turns=2), sharegpt(1)],
                   shard_size=8)
    cfg = cfg.model_copy(update={"target": TargetConfig(path=str(tiny_target), name="fake-model")})
    store = open_store(cfg.storage)
    fp = prepared(cfg, store)
    with caplog.at_level("WARNING", logger="drafter.stages.datagen"):
        result = run_datagen(cfg, store, fp, [fake.url])
    assert all(b["return_token_ids"] is True for b in fake.received)
    assert not any("token_ids" in m for b in fake.received for m in b["messages"])  # history: text only
    records = list(iter_generations(store, result.manifest))
    answers = {r["id"]: [m for m in r["messages"] if m["role"] == "assistant"] for r in records}
    assert all(m["token_ids"] == as_chars(m["content"]) for ms in answers.values() for m in ms)
    meta = result.manifest.meta
    ids = meta["token_ids"]
    assert (ids["turns_with_ids"], ids["turns_without_ids"]) == (3, 0)
    assert ids["measured_tokens"] == sum(len(m["token_ids"]) for ms in answers.values() for m in ms)
    assert meta["retokenize_agreement"] == round(ids["same_tokens"] / ids["measured_tokens"], 4) < 0.95
    assert any(line.startswith("WARNING: re-tokenizing the answers' text reproduces only") for line in result.summary)
    assert any("reproduces only" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")

    dump_cfg = cfg.model_copy(update={
        "dump": DumpConfig(upstream="datagen", aux_layer_ids=[0, 1, 2], devices=["cpu"], max_length=512),
        "train": cfg.train.model_copy(update={"draft_vocab_size": 256})})
    dumped = TABLE.run("dump", dump_cfg, store, upstream={"datagen": result.manifest.fingerprint})
    assert dumped.manifest.meta["samples_from_token_ids"] == 2
    for sample in iter_dump_samples(store, dumped.manifest, expect_aux_layer_ids=[0, 1, 2]):
        learned = [t for t, m in zip(sample["input_ids"].tolist(), sample["loss_mask"].tolist()) if m]
        assert learned == [t for m in answers[sample["id"]] for t in m["token_ids"]]


def test_sglang_shaped_token_ids_are_kept_and_agreeing_ids_do_not_warn(tmp_path, fakes, tiny_target):
    """SGLang answers the ids in `response_token_ids`; ids equal to the text's own tokens agree fully."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    fake = fakes()
    fake.ids_field = "response_token_ids"
    fake.token_ids = lambda content: tok(content, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"), [sharegpt(0, turns=2)], shard_size=8)
    cfg = cfg.model_copy(update={"target": TargetConfig(path=str(tiny_target), name="fake-model")})
    store = open_store(cfg.storage)
    result = run_datagen(cfg, store, prepared(cfg, store), [fake.url])
    answers = [m for r in iter_generations(store, result.manifest) for m in r["messages"] if m["role"] == "assistant"]
    assert [m["token_ids"] for m in answers] == [fake.token_ids(m["content"]) for m in answers]
    meta = result.manifest.meta
    assert meta["retokenize_agreement"] == 1.0 and meta["token_ids"]["turns_without_ids"] == 0
    assert not any(line.startswith("WARNING") for line in result.summary)
    assert "token ids recorded for 2 of 2 answers; re-tokenization agreement 100.0%" in result.summary


def test_a_server_without_token_ids_still_works_and_the_fallback_is_warned(tmp_path, fakes, caplog):
    """A generic OpenAI server ignores `return_token_ids`: records have text only, the dump will
    re-tokenise them, and the stage says so (without needing the target's tokenizer)."""
    fake = fakes()
    cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"), [sharegpt(0, turns=2), sharegpt(1)],
                   shard_size=8)
    store = open_store(cfg.storage)
    with caplog.at_level("WARNING", logger="drafter.stages.datagen"):
        result = run_datagen(cfg, store, prepared(cfg, store), [fake.url])
    assert not any("token_ids" in m for r in iter_generations(store, result.manifest) for m in r["messages"])
    meta = result.manifest.meta
    assert meta["token_ids"] == {"turns_with_ids": 0, "turns_without_ids": 3, "measured_tokens": 0, "same_tokens": 0}
    assert meta["retokenize_agreement"] is None
    assert any(line.startswith("WARNING: 3 of 3 answers came without token ids") for line in result.summary)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("falls back to re-tokenizing" in w for w in warnings)
    assert not any("tokenizer" in w for w in warnings)  # nothing to measure: never loaded


@pytest.mark.slow
def test_reference_engine_on_tiny_target(tmp_path, tiny_target):
    """The real thing: with no server URL the stage starts our reference server on the tiny target
    itself (through the server session: gated, torn down), regenerating a multi-turn conversation."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"),
                   [sharegpt(0, turns=2), sharegpt(1)], max_tokens=6, shard_size=8)
    cfg = cfg.model_copy(update={
        "target": TargetConfig(path=str(tiny_target), name="tiny"),
        # One torch thread: on a busy 2-core machine two threads made a lone request ~30x slower.
        "serve": ServeConfig(engine="reference", port=port, device="cpu", log_dir=str(tmp_path / "logs"),
                             extra_args=["--cpu-threads", "1"], startup_timeout_s=120, stall_timeout_s=60)})
    store = open_store(cfg.storage)
    fp = prepared(cfg, store)
    lines = []
    result = TABLE.run("datagen", cfg, store, upstream={"prepare": fp}, on_line=lines.append)
    assert any("ready to roll" in line for line in lines)  # start-up lines reach the caller
    assert len(list((tmp_path / "logs").glob("reference-*.launch.json"))) == 1
    assert not list((tmp_path / "logs").glob("*.pid.json"))  # torn down
    records = list(iter_generations(store, result.manifest))
    assert [r["id"] for r in records] == ["c000", "c001"]
    assert [len(r["finish_reasons"]) for r in records] == [2, 1]
    assert set(f for r in records for f in r["finish_reasons"]) <= {"stop", "length"}
    assert all(0 < r["usage"]["completion_tokens"] <= 6 * len(r["finish_reasons"]) for r in records)
    assert [m["role"] for m in records[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert not any("OLD" in m["content"] for r in records for m in r["messages"])
    assert records[0]["gen"]["model"] == "tiny" and "server" not in records[0]["gen"]
    assert result.manifest.shard("gen-00000.jsonl").meta["servers"] == {f"http://127.0.0.1:{port}": 2}
    # the engine's own ids are kept with each answer, and they are what its text was decoded from
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    answers = [m for r in records for m in r["messages"] if m["role"] == "assistant"]
    assert all(tok.decode(m["token_ids"], skip_special_tokens=True) == m["content"] for m in answers)
    assert sum(len(m["token_ids"]) for m in answers) == sum(r["usage"]["completion_tokens"] for r in records)
    ids = result.manifest.meta["token_ids"]
    assert (ids["turns_with_ids"], ids["turns_without_ids"]) == (3, 0) and ids["measured_tokens"] > 0
    with socket.socket() as s:  # torn down: the port is free again
        s.bind(("127.0.0.1", port))


def test_task_retries_a_server_down_and_resumes(tmp_path, fakes, prefect_server):
    from prefect import flow

    from drafter.stages import TABLE
    from tasks.stage import stage_task

    fake = fakes()
    fake.fail = lambda body, attempt: 500 if 4 <= len(fake.received) - 1 < 8 else None  # a short outage
    rows = [sharegpt(i) for i in range(8)]
    cfg = make_cfg(tmp_path, StorageConfig(root=f"file://{tmp_path}/store"), rows, concurrency_per_server=1)
    cfg = cfg.model_copy(update={"datagen": cfg.datagen.model_copy(update={"server_urls": [fake.url]})})
    fp = prepared(cfg, open_store(cfg.storage))

    @flow
    def once():
        task = stage_task(TABLE["datagen"], TABLE).with_options(retry_delay_seconds=0, retry_jitter_factor=None)
        return task(cfg, {"prepare": fp})

    report = once()
    assert not report["skipped"] and [s["url"] for s in report["meta"]["throughput"]["servers"]] == [fake.url]
    assert report["meta"]["generated"] == 8 and report["meta"]["resumed_shards"] == 2
    answered = [last_user(b) for n, b in enumerate(fake.received) if not 4 <= n < 8]
    assert sorted(answered) == sorted(f"question {i}.0" for i in range(8))  # each exactly once
    again = once()  # a skipped stage ends its task run Completed with a "skipped" message
    assert again.message.startswith("skipped: output already complete") and again.result()["skipped"]
