"""The `datagen` stage: the target rewrites the assistant turns of the prepared conversations.

Output (`datagen/<fingerprint>/`):
- `gen-00000.jsonl`, ...: one record per conversation, in prepared order:
  `{"id", "messages", "source_id", "finish_reasons", "usage": {"prompt_tokens", "completion_tokens"},
  "gen": {"model", "temperature", "max_tokens", "server"}}` (`id` == `source_id`: one generation per
  prompt; `server` answered the last turn). Each assistant message is `{"role", "content"}` plus
  `"token_ids"`: the ids the engine generated for it, as returned (the stop token included when the
  engine returns it), present only when the server returned ids (drafter.serving.engines
  `answer_token_ids`). The dump trains on these ids and re-tokenises only records without them
  (drafter.tokenize); records written before ids were recorded simply have none;
- `errors-00000.jsonl`, ...: `{"id", "reason", "attempts", "server", "turn", "detail"}` for the
  conversations of that shard that could not be generated (only written when there are some).

Without earlier outputs to reuse, shard i holds conversations [i*shard_size, (i+1)*shard_size) of
the prepared split; each shard's marker records the digest of the conversations it was planned for,
so a killed run resumes at the shards without a verified `gen-i` of the same plan and never
duplicates or drops a sample.
`errors-i` is written before `gen-i`: `gen-i` is the shard's "done" mark.

Incremental (drafter.retrain.reuse): earlier outputs for the same target and settings are looked up; their
shards whose conversations are all still in the corpus are referenced whole, answers in their other
shards are copied, and only the remaining conversations are sent to the target (in new shards after
the referenced ones). `conversation-keys.jsonl` lists each shard's conversation keys for later runs.

Multi-turn conversations are regenerated turn by turn: turn k is asked with the history holding the
target's OWN earlier answers (the original answers are dropped), as the drafter will see at serving.

Re-tokenisation check (manifest `token_ids` and `retokenize_agreement`, per split): `token_ids`
counts the answers (assistant turns) with and without ids; `retokenize_agreement` is, over the
answers whose conversation carries ids, the fraction of the answer tokens the dump trains on (the
returned ids, plus the template's end of turn where the engine did not return its stop token) that
re-tokenising the text with the target's chat template reproduces, matched turn by turn as in-order
blocks (drafter.tokenize.retokenize_agreement); null when nothing could be measured (no ids, or the
target's tokenizer is not loadable where datagen runs). It is the diagnostic of what the text
alone would have given. The stage warns (log + summary line) when it is below
RETOKENIZE_WARN_BELOW (the dump uses the ids, so the warning says the text would have been wrong),
and when answers came without ids (the dump re-tokenises those: the drafter then trains on
sequences the target may not emit).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Coroutine, TypeVar

from drafter.retrain import reuse
from drafter.config import LifecycleConfig, fingerprint_fields
from drafter.formats import DATAGEN as STAGE
from drafter.formats import PREPARE, SPLITS, error_shard_name, gen_shard_name, load_prepared, split_prefix
from drafter.serving.client import ChatClient, DatagenServerDown, RequestFailed, ServerPool
from drafter.serving.session import ServerSession
from drafter.stage_output import EmptyOutput, Progress, ShardInfo, StageOutput, StageResult, guarded_progress, to_jsonl
from drafter.stage_output import fingerprint as stage_fingerprint
from drafter.store import ObjectStore
from drafter.target_identity import target_identity
from drafter.tokenize import TOKEN_IDS, end_of_turn_ids, has_token_ids, retokenize_agreement

log = logging.getLogger(__name__)

T = TypeVar("T")

RETOKENIZE_WARN_BELOW = 0.95  # retokenize_agreement under this: the text would have trained wrong sequences


# Bump when what a datagen output holds changes for the same settings: 2 = answers carry the
# engine's token ids, so outputs written before (text only, re-tokenized by the dump) are neither
# skipped nor reused.
DATAGEN_RECORD_VERSION = 2


def _settings(cfg: LifecycleConfig) -> dict:
    # The answers depend on the target's weights and on the name requests use.
    target = {"served_name": cfg.target.served_name, **target_identity(cfg.target)}
    return {"datagen": fingerprint_fields(cfg.datagen), "target": target, "splits": list(SPLITS),
            "records": DATAGEN_RECORD_VERSION}


def fingerprint(cfg: LifecycleConfig, upstream: Mapping[str, str]) -> str:
    """The datagen section's output fields, the target's identity and the prepared corpus."""
    return stage_fingerprint(STAGE, _settings(cfg), [upstream[PREPARE]])


def output(cfg: LifecycleConfig, store: ObjectStore, upstream: Mapping[str, str]) -> StageOutput:
    return StageOutput(store, STAGE, fingerprint(cfg, upstream))


# ------------------------------------------------------------------------------------ one shard


@dataclass
class _Shard:
    """The conversations of one output shard and their results, kept in input order."""

    index: int
    conversations: list[dict]
    split: str = "train"
    records: list[dict | None] = field(default_factory=list)
    errors: list[dict | None] = field(default_factory=list)
    remaining: int = 0
    saved: bool = False
    digest: str = ""               # drafter.retrain.reuse.digest of the conversations' keys (resume check)

    def __post_init__(self) -> None:
        self.records = [None] * len(self.conversations)
        self.errors = [None] * len(self.conversations)
        self.remaining = len(self.conversations)

    @property
    def name(self) -> str:
        return gen_shard_name(self.index, self.split)

    @property
    def error_name(self) -> str:
        return error_shard_name(self.index, self.split)

    def finish(self, position: int, record: dict | None, error: dict | None) -> None:
        self.records[position], self.errors[position] = record, error
        self.remaining -= 1


class RetokenizeCheck:
    """Counts, per shard, the answers with ids and how many of their tokens re-tokenising the text
    reproduces, with the target's tokenizer. It is loaded on first use (a run whose servers return
    no ids never needs it); one that cannot be loaded leaves the share unmeasured, with one warning.
    Used by one thread at a time (shards are written one after the other)."""

    def __init__(self, cfg: LifecycleConfig):
        self.path, self.trust_remote_code = cfg.target.path, cfg.target.trust_remote_code
        self._tokenizer: Any = None
        self._eot_ids: set[int] = set()
        self._failed = False

    def _load(self) -> Any:
        if self._tokenizer is None and not self._failed:
            try:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
                self._eot_ids = end_of_turn_ids(self._tokenizer)
            except Exception as err:  # a diagnostic must not stop the stage
                self._failed = True
                log.warning("datagen: re-tokenization agreement not measured: the target's tokenizer at %s "
                            "could not be loaded (%s)", self.path, err)
        return self._tokenizer

    def counts(self, records: list[dict]) -> dict[str, int]:
        with_ids = [r for r in records if has_token_ids(r["messages"])]
        out = {"turns_with_ids": sum(m["role"] == "assistant" for r in with_ids for m in r["messages"]),
               "measured_tokens": 0, "same_tokens": 0}
        tokenizer = self._load() if with_ids else None
        for record in with_ids if tokenizer is not None else []:
            got = retokenize_agreement(tokenizer, record["messages"], self._eot_ids)
            if got is not None:
                out["measured_tokens"] += got[0]
                out["same_tokens"] += got[1]
        return out


def shard_meta(records: list[dict], errors: list[dict], check: RetokenizeCheck) -> dict[str, Any]:
    """Per-shard counts, stored in the shard's marker; the manifest sums them over all shards
    (including shards a killed earlier run wrote)."""
    return {
        "conversations": len(records) + len(errors), "generated": len(records), "errors": len(errors),
        "errors_by_reason": dict(sorted(Counter(e["reason"] for e in errors).items())),
        "turns": sum(len(r["finish_reasons"]) for r in records),
        "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in records),
        "completion_tokens": sum(r["usage"]["completion_tokens"] for r in records),
        "finish_reasons": dict(sorted(Counter(f for r in records for f in r["finish_reasons"]).items())),
        "token_ids": check.counts(records),
    }


def _write_shard_files(out: StageOutput, shard: _Shard, records: list[dict], errors: list[dict],
                       check: RetokenizeCheck) -> None:
    if errors:
        out.write_shard(shard.error_name, to_jsonl(errors), meta={"rows": len(errors)})
    out.write_shard(shard.name, to_jsonl(records),
                    meta={**shard_meta(records, errors, check), "input_digest": shard.digest})


# ------------------------------------------------------------------------------- the async run


class _Generation:
    """Regenerates a list of shards: a producer feeds conversations in order to a fixed set of
    workers; a writer saves shards in order as they complete. The producer stays at most
    `window` shards ahead of the writer, so memory stays bounded and shards land in order."""

    def __init__(self, out: StageOutput, client: ChatClient, shards: list[_Shard], workers: int,
                 window: int, gen_info: dict, progress: Progress | None, done_before: int, total: int,
                 check: RetokenizeCheck):
        self.out, self.client, self.shards, self.check = out, client, shards, check
        self.n_workers, self.gen_info = workers, gen_info
        self.progress, self.done, self.total = guarded_progress(progress, STAGE), done_before, total
        self.jobs: asyncio.Queue = asyncio.Queue(maxsize=workers)
        self.window = asyncio.Semaphore(window)
        self.changed = asyncio.Event()       # a shard completed, or the writer must stop
        self.stopping = False
        self.started = time.monotonic()
        self.requests = self.completion_tokens = self.errors = 0

    # ---- orchestration

    async def run(self) -> None:
        workers = [asyncio.create_task(self._work()) for _ in range(self.n_workers)]
        producer = asyncio.create_task(self._produce())
        writer = asyncio.create_task(self._write())
        self._report()  # a resumed run starts its bar at the shards already done
        try:
            pending = {producer, writer, *workers}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()
        except BaseException as failure:
            for task in (producer, *workers):
                task.cancel()
            await asyncio.gather(producer, *workers, return_exceptions=True)
            if writer.done() or isinstance(failure, asyncio.CancelledError):
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
            else:  # keep every finished shard: the re-run starts after them
                self.stopping = True
                self.changed.set()
                try:
                    await writer
                except Exception as err:
                    failure.add_note(f"finished shards could not all be saved: {err}")
            raise

    async def _produce(self) -> None:
        for shard in self.shards:
            await self.window.acquire()
            for position, conversation in enumerate(shard.conversations):
                if shard.records[position] is None:  # not copied from an earlier output
                    await self.jobs.put((shard, position, conversation))
        for _ in range(self.n_workers):
            await self.jobs.put(None)

    async def _work(self) -> None:
        while (job := await self.jobs.get()) is not None:
            shard, position, conversation = job
            record, error = await self._regenerate(conversation)
            shard.finish(position, record, error)
            self.errors += error is not None
            self.done += 1
            if shard.remaining == 0:
                self.changed.set()
            self._report()

    async def _write(self) -> None:
        for shard in self.shards:
            while shard.remaining and not self.stopping:
                self.changed.clear()
                await self.changed.wait()
            if shard.remaining:
                break
            await self._save(shard)
            self.window.release()
        # Stopping after a failure: shards that completed behind an unfinished one are kept too.
        for shard in self.shards:
            if not shard.remaining and not shard.saved:
                await self._save(shard)

    async def _save(self, shard: _Shard) -> None:
        records = [r for r in shard.records if r is not None]
        errors = [e for e in shard.errors if e is not None]
        # The store is blocking (boto3, fsync): keep the event loop generating meanwhile.
        await asyncio.to_thread(self._write_files, shard, records, errors)
        shard.saved = True
        shard.records = shard.errors = []  # free the memory; the store holds them now

    def _write_files(self, shard: _Shard, records: list[dict], errors: list[dict]) -> None:
        _write_shard_files(self.out, shard, records, errors, self.check)

    # ---- one conversation

    async def _regenerate(self, conversation: dict) -> tuple[dict | None, dict | None]:
        """(record, None) or (None, error record)."""
        history: list[dict] = []  # what the next turn is asked with: text only
        kept: list[dict] = []     # what the record keeps: the answers with their ids
        finish_reasons: list[str | None] = []
        prompt_tokens = completion_tokens = 0
        server = None
        for message in conversation["messages"]:
            if message["role"] == "assistant":
                continue  # dropped: the target writes its own answer below
            history.append({"role": message["role"], "content": message["content"]})
            kept.append(history[-1])
            if message["role"] != "user":
                continue
            try:
                answer = await self.client.chat(history, prefer=server)
            except RequestFailed as err:
                return None, {"id": conversation["id"], "reason": err.reason, "attempts": err.attempts,
                              "server": err.server, "turn": len(finish_reasons), "detail": err.detail[:500]}
            history.append({"role": "assistant", "content": answer.content})
            kept.append(history[-1] if answer.token_ids is None else {**history[-1], TOKEN_IDS: answer.token_ids})
            finish_reasons.append(answer.finish_reason)
            prompt_tokens += answer.prompt_tokens
            completion_tokens += answer.completion_tokens
            server = answer.server
            self.requests += 1
            self.completion_tokens += answer.completion_tokens
        return {"id": conversation["id"], "messages": kept, "source_id": conversation["id"],
                "finish_reasons": finish_reasons,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
                "gen": {**self.gen_info, "server": server}}, None

    # ---- figures

    def figures(self) -> dict[str, Any]:
        seconds = max(time.monotonic() - self.started, 1e-9)
        return {"seconds": round(seconds, 3), "requests": self.requests,
                "requests_per_s": round(self.requests / seconds, 3),
                "completion_tokens": self.completion_tokens,
                "tokens_per_s": round(self.completion_tokens / seconds, 2)}

    def _report(self) -> None:
        if self.progress is None:
            return
        f = self.figures()
        info = [f"{f['requests_per_s']:.2f} req/s", f"{f['tokens_per_s']:.0f} tok/s"]
        if self.errors:
            info.append(f"{self.errors} errors")
        self.progress(self.done, self.total, *info)


async def _generate(out: StageOutput, cfg: LifecycleConfig, shards: list[_Shard], server_urls: list[str],
                    progress: Progress | None, done_before: int, total: int,
                    check: RetokenizeCheck) -> dict[str, Any]:
    d = cfg.datagen
    async with ServerPool(server_urls, d.concurrency_per_server, d.max_consecutive_failures,
                          d.request_timeout_s) as pool:
        # Twice the slots: conversations waiting out a backoff or between turns leave no slot idle.
        workers = 2 * pool.slots
        # Shards are written in order, so the oldest one waits for its slowest conversation; two
        # shards beyond what the workers hold keep them busy meanwhile (records are small in RAM).
        window = math.ceil(workers / d.shard_size) + 2
        client = ChatClient(pool, model=cfg.target.served_name, temperature=d.temperature,
                            max_tokens=d.max_tokens, timeout_s=d.request_timeout_s, max_retries=d.max_retries,
                            backoff_base_s=d.backoff_base_s, backoff_max_s=d.backoff_max_s)
        gen_info = {"model": cfg.target.served_name, "temperature": d.temperature, "max_tokens": d.max_tokens}
        run = _Generation(out, client, shards, workers, window, gen_info, progress, done_before, total, check)
        await run.run()
    return {**run.figures(), "servers": pool.stats()}


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, also from a thread that already runs an event loop (notebooks, async hosts)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# ------------------------------------------------------------------------------------- the stage


def _counts(metas: list[dict]) -> dict[str, Any]:
    """Conversation, error, turn and token counts summed over shard markers."""
    total: Counter = Counter()
    errors_by_reason: Counter = Counter()
    finish_reasons: Counter = Counter()
    ids: Counter = Counter()
    for m in metas:
        total.update({k: m[k] for k in ("conversations", "generated", "errors", "turns",
                                        "prompt_tokens", "completion_tokens")})
        errors_by_reason.update(m["errors_by_reason"])
        finish_reasons.update(m["finish_reasons"])
        ids.update(m.get("token_ids") or {})  # shards written before ids were recorded have none
    measured = ids["measured_tokens"]
    return {**{k: total[k] for k in ("conversations", "generated", "errors", "turns", "prompt_tokens",
                                     "completion_tokens")},
            "errors_by_reason": dict(sorted(errors_by_reason.items())),
            "finish_reasons": dict(sorted(finish_reasons.items())),
            "token_ids": {"turns_with_ids": ids["turns_with_ids"],
                          "turns_without_ids": total["turns"] - ids["turns_with_ids"],
                          "measured_tokens": measured, "same_tokens": ids["same_tokens"]},
            "retokenize_agreement": round(ids["same_tokens"] / measured, 4) if measured else None}


def _manifest_meta(cfg: LifecycleConfig, shards: dict[str, ShardInfo], plan: dict[str, list[str]],
                   prepare_fp: str, resumed: int, this_run: dict[str, Any], reused: dict) -> dict[str, Any]:
    """Top-level counts describe the train split (what the drafter learns from); `eval` the
    held-out split (regenerated the same way, for held-out metrics)."""
    d = cfg.datagen
    return {
        "prepare_fingerprint": prepare_fp,
        **_counts([shards[name].meta for name in plan["train"]]),
        "eval": _counts([shards[name].meta for name in plan["eval"]]),
        "shards": len(plan["train"]), "eval_shards": len(plan["eval"]), "shard_size": d.shard_size,
        "resumed_shards": resumed,
        "reuse": reused,
        "generation": {"model": cfg.target.served_name, "target_path": cfg.target.path,
                       "temperature": d.temperature, "max_tokens": d.max_tokens,
                       "request_timeout_s": d.request_timeout_s, "max_retries": d.max_retries},
        "throughput": this_run,  # this run only: shards resumed from an earlier run are not timed
    }


def _drop_unplanned(out: StageOutput, done: dict[str, ShardInfo], plan: dict[str, list[str]],
                    todo: list[_Shard]) -> None:
    """Shards of a killed attempt that planned differently (the reusable history changed since)
    would be committed with ours: remove what this plan does not name. Errors of a shard that is
    redone go too (`_drop_stale_errors`)."""
    keep = {name for names in plan.values() for name in names} | {reuse.KEYS_SHARD}
    keep |= {name.replace("gen-", "errors-", 1) for name in keep}
    for name in done:
        if name not in keep:
            out.drop_shard(name)
    _drop_stale_errors(out, done, todo)


def _drop_stale_errors(out: StageOutput, done: dict[str, ShardInfo], todo: list[_Shard]) -> None:
    """An `errors-i` whose `gen-i` never landed (killed in between) would be committed with the
    redone shard and name conversations that are now fine: remove it before redoing shard i.
    Removing the object is enough, a marker only counts while its shard exists."""
    for shard in todo:
        name = shard.error_name
        if name in done:
            out.store.delete(out.key(name))


def run(cfg: LifecycleConfig, store: ObjectStore, *, upstream: Mapping[str, str],
        progress: Progress | None = None, on_line=None) -> StageResult:
    """Regenerate the answers of both prepared splits (train, then the held-out eval split, whose
    shards carry the prefix `eval-`) through `datagen.server_urls`
    (OpenAI-compatible), or, with none given, through `serve.engine` serving the target alone,
    started here through the server session and always torn down. Skips (starting and contacting
    no server) when the output is complete; resumes at the missing shards. Raises
    DatagenServerDown, after saving every finished shard, when a server stops answering.
    `on_line` receives the start-up log lines of a server the stage starts itself."""
    out = output(cfg, store, upstream)
    if out.is_complete():
        return _result(out, skipped=True)
    prepare_fingerprint = upstream[PREPARE]
    key = reuse.reuse_key(STAGE, _settings(cfg))
    earlier = reuse.earlier_outputs(store, STAGE, key, out.fingerprint)
    shards, links = _plan(store, cfg, prepare_fingerprint, earlier)
    plan = {split: [name for name, _ in links if name.startswith(f"{split_prefix(split)}gen-")]
            + [s.name for s in shards if s.split == split] for split in SPLITS}
    done = out.completed_shards()
    digest_of = lambda name: (done[name].meta.get("input_digest") if name in done else None)
    for name, link in links:
        if digest_of(name) != reuse.digest(link.keys):
            out.store.delete(out.key(name.replace("gen-", "errors-", 1)))  # a killed attempt's
            out.link_shard(name, link.source, link.source_name,
                           meta={**reuse.linked_meta(link.source.manifest.shard(link.source_name).meta),
                                 "input_digest": reuse.digest(link.keys)})
    todo = [s for s in shards if digest_of(s.name) != s.digest]
    resumed = len(shards) - len(todo)
    reused = {"earlier_outputs": [o.fingerprint for o in earlier], "linked_shards": len(links),
              "linked_conversations": sum(len(link.keys) for _, link in links),
              "copied_conversations": sum(len(s.conversations) - s.remaining for s in shards),
              "asked_conversations": sum(s.remaining for s in todo)}
    this_run: dict[str, Any] = {}
    check = RetokenizeCheck(cfg)
    _drop_unplanned(out, done, plan, todo)
    for shard in [s for s in todo if not s.remaining]:  # every answer copied: nothing to ask
        _write_shard_files(out, shard, list(shard.records), [], check)
    todo = [s for s in todo if s.remaining]
    if todo:
        if resumed:
            log.info("datagen: resuming %s, %d of %d shards already done", out.uri, resumed, len(shards))
        total = sum(len(s.conversations) for s in shards)
        done_before = total - sum(len(s.conversations) for s in todo)
        generate = lambda urls: _run_sync(_generate(out, cfg, todo, urls, progress, done_before, total, check))
        this_run = _with_servers(cfg, generate, on_line)
    # The keys of what each shard really holds (a conversation that failed is not in it).
    linked_keys = {name: link.keys for name, link in links}
    out.write_shard(reuse.KEYS_SHARD, to_jsonl(
        {"shard": name, "keys": linked_keys.get(name) or [reuse.conversation_key(r) for r in out.read_jsonl(name)]}
        for split in SPLITS for name in plan[split]))
    out.commit(lambda committed: _not_empty(cfg, _manifest_meta(cfg, committed, plan, prepare_fingerprint,
                                                                resumed, this_run, reused)),
               expect=[*plan["train"], *plan["eval"], reuse.KEYS_SHARD])
    reuse.register(out, key)
    return _result(out, skipped=False)


def _plan(store: ObjectStore, cfg: LifecycleConfig, prepare_fp: str, earlier: list[StageOutput]
          ) -> tuple[list[_Shard], list[tuple[str, reuse.Link]]]:
    """Per split: earlier shards referenced whole (named first), then new shards of the remaining
    conversations in corpus order, with answers found in earlier shards filled in."""
    size = cfg.datagen.shard_size
    shards: list[_Shard] = []
    links: list[tuple[str, reuse.Link]] = []
    for split in SPLITS:
        conversations = load_prepared(store, prepare_fp, split)
        found = reuse.plan_datagen(earlier, conversations, f"{split_prefix(split)}gen-")
        links += [(gen_shard_name(i, split), link) for i, link in enumerate(found.links)]
        rest, first = found.remaining, len(found.links)
        for i in range(math.ceil(len(rest) / size)):
            shard = _Shard(first + i, rest[i * size:(i + 1) * size], split)
            keys = [reuse.conversation_key(c) for c in shard.conversations]
            shard.digest = reuse.digest(keys)
            for position, k in enumerate(keys):
                if k in found.copies:
                    shard.finish(position, found.copies[k], None)
            shards.append(shard)
    return shards, links


def _not_empty(cfg: LifecycleConfig, meta: dict[str, Any]) -> dict[str, Any]:
    """The manifest meta, unless no train conversation was generated (then nothing is committed:
    the error shards stay, so the reasons can be read and a re-run needs no server)."""
    if meta["generated"] == 0 and not cfg.datagen.allow_empty:
        raise EmptyOutput(f"datagen generated 0 of {meta['conversations']} train conversations "
                          f"(errors {meta['errors_by_reason']}); see the errors-*.jsonl shards, or set "
                          f"datagen.allow_empty: true")
    return meta


def _with_servers(cfg: LifecycleConfig, generate, on_line) -> dict[str, Any]:
    """`generate(urls)` through the configured servers, or through a target server started here."""
    if cfg.datagen.server_urls:
        return generate(list(cfg.datagen.server_urls))
    started = False

    def startup_lines(line: str) -> None:
        # Start-up lines reach the caller (a hang must be visible); once serving, per-request
        # lines would flood it: they stay in the server's own log file.
        if on_line is not None and not started:
            on_line(line)

    with ServerSession(cfg, target_only=True, on_line=startup_lines) as served:
        started = True
        log.info("datagen: %s ready in %.1fs (log %s)", served.base_url, served.seconds_to_ready, served.log_path)
        try:
            return generate([served.base_url])
        except DatagenServerDown as err:
            err.add_note(f"server log: {served.log_path}")
            raise


def token_id_warnings(meta: dict[str, Any]) -> list[str]:
    """What the train split's ids say about training on re-tokenised text (empty: nothing to warn)."""
    ids = meta.get("token_ids") or {"turns_with_ids": 0, "turns_without_ids": meta["turns"]}
    agreement = meta.get("retokenize_agreement")
    warnings = []
    if agreement is not None and agreement < RETOKENIZE_WARN_BELOW:
        warnings.append(f"re-tokenizing the answers' text reproduces only {agreement:.1%} of the "
                        f"{ids['measured_tokens']} answer tokens the target generated (below "
                        f"{RETOKENIZE_WARN_BELOW:.0%}): text alone would have been wrong; the dump trains on the "
                        f"returned token ids")
    if ids["turns_without_ids"]:
        warnings.append(f"{ids['turns_without_ids']} of {ids['turns_with_ids'] + ids['turns_without_ids']} answers "
                        f"came without token ids (the server returned none): the dump falls back to re-tokenizing "
                        f"their text, and the drafter will train on token sequences the target may not emit")
    return warnings


def _token_id_line(meta: dict[str, Any]) -> str | None:
    ids, agreement = meta.get("token_ids") or {}, meta.get("retokenize_agreement")
    if not ids.get("turns_with_ids"):
        return None
    share = f"{agreement:.1%}" if agreement is not None else "not measured"
    return (f"token ids recorded for {ids['turns_with_ids']} of {ids['turns_with_ids'] + ids['turns_without_ids']} "
            f"answers; re-tokenization agreement {share}")


def _result(out: StageOutput, skipped: bool) -> StageResult:
    meta = out.manifest.meta
    t = meta.get("throughput") or {}
    summary = [f"{meta['generated']} of {meta['conversations']} conversations generated, {meta['errors']} "
               f"errors {meta['errors_by_reason']}"]
    if (line := _token_id_line(meta)) is not None:
        summary.append(line)
    for warning in token_id_warnings(meta):
        log.warning("datagen %s: %s", out.uri, warning)
        summary.append(f"WARNING: {warning}")
    if t.get("requests"):
        summary.append(f"{t['requests_per_s']:.2f} req/s, {t['tokens_per_s']:.1f} tok/s this run "
                       f"({', '.join(s['url'] for s in t.get('servers') or [])})")
    r = meta.get("reuse") or {}
    if r.get("linked_shards") or r.get("copied_conversations"):
        summary.append(f"reused from earlier outputs: {r['linked_shards']} shards referenced "
                       f"({r['linked_conversations']} conversations), {r['copied_conversations']} answers copied; "
                       f"{r['asked_conversations']} conversations asked")
    rows = [{"metric": k, "value": str(meta[k])} for k in (
        "conversations", "generated", "errors", "errors_by_reason", "turns", "completion_tokens",
        "finish_reasons", "token_ids", "retokenize_agreement", "shards", "resumed_shards") if k in meta]
    rows.append({"metric": "eval", "value": f"{meta['eval']['generated']} of {meta['eval']['conversations']} "
                                            f"held-out conversations generated"})
    rows += [{"metric": f"throughput.{k}", "value": str(v)} for k, v in t.items() if k != "servers"]
    return StageResult.committed(out.manifest, out.uri, skipped, summary, rows)
