"""Generation: the conversations of a datagen shard sent to OpenAI-compatible servers, turn by
turn (each turn asked with the target's own earlier answers), the results written per shard
(`errors-i` before `gen-i`, the shard's done mark), with the re-tokenization check of each answer's
recorded token ids.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from urllib.parse import urlsplit
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Coroutine, TypeVar

from drafter.config import LifecycleConfig
from drafter.formats import DATAGEN as STAGE
from drafter.formats import error_shard_name, gen_shard_name
from drafter.chat_client import ChatClient, DatagenServerDown, RequestFailed, ServerPool
from drafter.serving.session import ServerSession
from drafter.stage_output import Progress, StageOutput, guarded_progress, to_jsonl
from drafter.tokenize import TOKEN_IDS, end_of_turn_ids, has_token_ids, retokenize_agreement

log = logging.getLogger(__name__)

T = TypeVar("T")

@dataclass
class Shard:
    """The conversations of one output shard and their results, kept in input order."""

    index: int
    conversations: list[dict]
    split: str = "train"
    records: list[dict | None] = field(default_factory=list)
    errors: list[dict | None] = field(default_factory=list)
    remaining: int = 0
    saved: bool = False
    digest: str = ""               # drafter.contracts.reuse.digest of the conversations' keys (resume check)
    servers: Counter = field(default_factory=Counter)  # which server answered each record's last turn
    error_servers: Counter = field(default_factory=Counter)  # which server gave up on each error record

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


def server_counts(shard: "Shard") -> dict[str, int]:
    return dict(sorted(shard.servers.items()))


def without_server(detail: str, server: str) -> str:
    """An error's detail with the server's address (URL, then host:port) replaced by `<server>`:
    an error body or a connection error may name it, and fan-out child k serves on `serve.port + k`."""
    if server:
        detail = detail.replace(server, "<server>")
        netloc = urlsplit(server).netloc
        if netloc:
            detail = detail.replace(netloc, "<server>")
    return detail


def write_shard_files(out: StageOutput, shard: Shard, records: list[dict], errors: list[dict],
                       check: RetokenizeCheck) -> None:
    if errors:
        out.write_shard(shard.error_name, to_jsonl(errors),
                        meta={"rows": len(errors), "servers": dict(sorted(shard.error_servers.items()))})
    out.write_shard(shard.name, to_jsonl(records),
                    meta={**shard_meta(records, errors, check), "servers": server_counts(shard),
                          "input_digest": shard.digest})


# ------------------------------------------------------------------------------- the async run


class _Generation:
    """Regenerates a list of shards: a producer feeds conversations in order to a fixed set of
    workers; a writer saves shards in order as they complete. The producer stays at most
    `window` shards ahead of the writer, so memory stays bounded and shards land in order."""

    def __init__(self, out: StageOutput, client: ChatClient, shards: list[Shard], workers: int,
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
            record, error, server = await self._regenerate(conversation)
            shard.finish(position, record, error)
            (shard.servers if record is not None else shard.error_servers)[server] += 1
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

    async def _save(self, shard: Shard) -> None:
        records = [r for r in shard.records if r is not None]
        errors = [e for e in shard.errors if e is not None]
        # The store is blocking (boto3, fsync): keep the event loop generating meanwhile.
        await asyncio.to_thread(self._write_files, shard, records, errors)
        shard.saved = True
        shard.records = shard.errors = []  # free the memory; the store holds them now

    def _write_files(self, shard: Shard, records: list[dict], errors: list[dict]) -> None:
        write_shard_files(self.out, shard, records, errors, self.check)

    # ---- one conversation

    async def _regenerate(self, conversation: dict) -> tuple[dict | None, dict | None, str]:
        """(record, None, the server of its last turn) or (None, error record, the server that gave
        up). Neither record names its server (nor does an error's detail: `without_server`): the
        answers, or the failure, alone decide the bytes, whichever server, port or fan-out child gave
        them; the shard's marker counts the servers and the log names the one that failed."""
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
                log.warning("datagen: conversation %s left out: turn %d failed on %s (%s after %d attempt(s)): %s",
                            conversation["id"], len(finish_reasons), err.server, err.reason, err.attempts,
                            err.detail[:500])
                return None, {"id": conversation["id"], "reason": err.reason, "attempts": err.attempts,
                              "turn": len(finish_reasons), "detail": without_server(err.detail, err.server)[:500]}, \
                    err.server
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
                "gen": dict(self.gen_info)}, None, server

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


async def generate(out: StageOutput, cfg: LifecycleConfig, shards: list[Shard], server_urls: list[str],
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


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, also from a thread that already runs an event loop (notebooks, async hosts)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# ------------------------------------------------------------------------------------- the stage


def with_servers(cfg: LifecycleConfig, generate, on_line) -> dict[str, Any]:
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

