"""Chat completions against a pool of OpenAI-compatible servers, with retries and a dead-server check.

`ServerPool` hands out request slots: at most `concurrency` requests in flight per server, servers
taken round-robin among those with a free slot. `ChatClient.chat` sends one request and retries
what a retry can fix (429, 408, 5xx, refused/broken connections, timeouts) with exponential backoff
and full jitter; other 4xx answers (a prompt longer than the context, ...) are final at once.

Two failure scopes:
- the REQUEST is bad (`RequestFailed`: the caller records it and moves on): a final 4xx, or every
  retry failed while the server still answers a 1-token probe (a prompt that crashes generation);
- the SERVER is down (`DatagenServerDown`: the caller stops, carrying on would turn every remaining
  sample into an error record): `max_consecutive_failures` failed attempts in a row on one server,
  or a request that used up its retries on a server that fails the probe as well. The probe keeps a
  server outage at low concurrency from being recorded as bad samples.

Every request asks for the generated token ids (drafter.engines.TOKEN_IDS_REQUEST);
`ChatAnswer.token_ids` holds them as the engine returned them, or None from a server that
returns none.
"""
from __future__ import annotations

import asyncio
import collections
import email.utils
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from drafter.backoff import backoff_delay
from drafter.errors import DrafterError
from drafter.engines.answers import TOKEN_IDS_REQUEST, answer_token_ids

RETRY_STATUS = frozenset({408, 429})  # plus every 5xx
PROBE_MESSAGES = [{"role": "user", "content": "Hello"}]


class DatagenServerDown(DrafterError):
    """A server stopped answering: too many failed attempts in a row, or a failed 1-token probe.
    Retryable: the stage has saved its finished shards, a re-run resumes after them."""

    retryable = True

    def __init__(self, url: str, last_error: str, failures: int):
        self.url, self.last_error, self.failures = url, last_error, failures
        super().__init__(f"datagen server {url} is down ({failures} failed attempts in a row); "
                         f"last error: {last_error}")

    def __reduce__(self):  # keep the fields (and notes) across process boundaries (Prefect results)
        return (DatagenServerDown, (self.url, self.last_error, self.failures), self.__dict__)


class RequestFailed(Exception):
    """One request gave up: a final 4xx, or every retry failed. `reason` is a short label
    (http_400, http_500, timeout, connection, bad_response) used to count errors."""

    def __init__(self, reason: str, detail: str, attempts: int, server: str):
        self.reason, self.detail, self.attempts, self.server = reason, detail, attempts, server
        super().__init__(f"{reason} after {attempts} attempt(s) on {server}: {detail}")


@dataclass(frozen=True)
class ChatAnswer:
    content: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    server: str
    attempts: int
    token_ids: list[int] | None = None  # the generated ids as the engine returned them; None: not returned


@dataclass(frozen=True)
class _Outcome:
    answer: dict | None = None         # the parsed 200 response
    reason: str | None = None          # set when the attempt failed
    detail: str = ""
    retryable: bool = False
    retry_after_s: float | None = None


def normalise_url(url: str) -> str:
    """Base URL without a trailing '/' or '/v1' (both spellings are common in OpenAI clients)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


# ---------------------------------------------------------------------------------------- pool


@dataclass
class ServerState:
    url: str
    idle: list[httpx.AsyncClient] = field(default_factory=list)  # one connection per free slot
    in_flight: int = 0
    consecutive_failures: int = 0
    last_error: str = ""
    requests: int = 0
    failures: int = 0


@dataclass(frozen=True)
class Slot:
    """The right to send one request to `server`, over a connection of its own."""

    server: ServerState
    http: httpx.AsyncClient


class ServerPool:
    """Request slots over several servers, handed out first come, first served: a coroutine that
    just released a slot cannot take it again ahead of one already waiting (without that, one
    conversation's next turns would overtake the others and shards would finish out of order).
    Single event loop: no locks needed. Use as `async with ServerPool(...) as pool:`."""

    def __init__(self, urls: list[str], concurrency: int, max_consecutive_failures: int,
                 timeout_s: float = 300.0):
        if not urls:
            raise ValueError("ServerPool needs at least one server URL")
        self.servers = [ServerState(normalise_url(u)) for u in urls]
        self.concurrency = concurrency
        self.max_consecutive_failures = max_consecutive_failures
        self.failure: DatagenServerDown | None = None
        self._next = 0
        self._waiters: collections.deque[tuple[str | None, asyncio.Future]] = collections.deque()
        # One single-connection client per slot, not one shared pool: httpcore scans every pooled
        # connection on every request event, which is quadratic in the pool size (a 128-connection
        # pool capped us at ~100 req/s). A pool of one costs nothing to scan. One TLS context for
        # all: building one per client costs ~30 ms.
        tls = httpx.create_ssl_context()
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
        self._clients: list[httpx.AsyncClient] = []
        for server in self.servers:
            # trust_env=False: an HTTP(S)_PROXY meant for the internet must not capture inference traffic.
            server.idle = [httpx.AsyncClient(limits=limits, timeout=timeout, verify=tls, trust_env=False)
                           for _ in range(concurrency)]
            self._clients += server.idle

    async def __aenter__(self) -> "ServerPool":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.gather(*(client.aclose() for client in self._clients), return_exceptions=True)

    @property
    def slots(self) -> int:
        return self.concurrency * len(self.servers)

    def _pick(self, prefer: str | None) -> ServerState | None:
        if prefer is not None:
            # Stay on the server that answered the previous turn: its prefix cache holds the history.
            server = next((s for s in self.servers if s.url == prefer), None)
            if server is not None:
                return server if server.in_flight < self.concurrency else None
        n = len(self.servers)
        for k in range(n):
            server = self.servers[(self._next + k) % n]
            if server.in_flight < self.concurrency:
                self._next = (self._next + k + 1) % n
                return server
        return None

    @staticmethod
    def _take(server: ServerState) -> Slot:
        server.in_flight += 1
        return Slot(server, server.idle.pop())

    async def acquire(self, prefer: str | None = None) -> Slot:
        """A slot on `prefer` (waiting for it) or, without a preference, on the next server in
        round-robin order that has one. Raises DatagenServerDown once any server is down."""
        if self.failure is not None:
            raise self.failure
        if not self._waiters and (server := self._pick(prefer)) is not None:
            return self._take(server)
        waiter = (prefer, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            return await waiter[1]
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter[1].done() and not waiter[1].cancelled() and waiter[1].exception() is None:
                self.release(waiter[1].result())  # handed a slot, but cancelled before taking it
            raise

    def release(self, slot: Slot) -> None:
        slot.server.in_flight -= 1
        slot.server.idle.append(slot.http)
        self._hand_over()

    def _hand_over(self) -> None:
        """Give free slots to waiters in arrival order; one waiting for a busy preferred server
        does not hold up those behind it that can go elsewhere."""
        for waiter in list(self._waiters):
            if all(s.in_flight >= self.concurrency for s in self.servers):
                return
            prefer, future = waiter
            if future.done():  # its task was cancelled; it removes nothing itself then
                self._waiters.remove(waiter)
                continue
            server = self._pick(prefer)
            if server is None:
                continue
            self._waiters.remove(waiter)
            future.set_result(self._take(server))

    def record(self, server: ServerState, outcome: _Outcome) -> None:
        """Count an attempt. Any answer that is not a server-side failure (a 200, a final 4xx)
        proves the server alive. Raises DatagenServerDown at the threshold."""
        server.requests += 1
        if outcome.reason is None or not outcome.retryable:
            server.consecutive_failures = 0
            return
        server.failures += 1
        server.consecutive_failures += 1
        server.last_error = f"{outcome.reason}: {outcome.detail}"
        if server.consecutive_failures >= self.max_consecutive_failures:
            raise self.declare_down(server, server.last_error)
        if self.failure is not None:
            raise self.failure

    def declare_down(self, server: ServerState, last_error: str) -> DatagenServerDown:
        if self.failure is None:
            self.failure = DatagenServerDown(server.url, last_error, server.consecutive_failures)
            while self._waiters:  # every waiter stops too
                future = self._waiters.popleft()[1]
                if not future.done():
                    future.set_exception(self.failure)
        return self.failure

    def stats(self) -> list[dict[str, Any]]:
        return [{"url": s.url, "requests": s.requests, "failures": s.failures} for s in self.servers]


# -------------------------------------------------------------------------------------- client


def _snippet(resp: httpx.Response) -> str:
    body = resp.text.strip().replace("\n", " ")
    return f"HTTP {resp.status_code}" + (f": {body[:200]}" if body else "")


def _retry_after(resp: httpx.Response) -> float | None:
    """Retry-After in seconds (a number or an HTTP date), if the server sent one."""
    value = resp.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _parse(resp: httpx.Response) -> _Outcome:
    try:
        body = resp.json()
        choice = body["choices"][0]
        message = choice["message"]
        usage = body.get("usage") or {}
        return _Outcome(answer={"content": message.get("content") or "",
                                "finish_reason": choice.get("finish_reason"),
                                "prompt_tokens": int(usage.get("prompt_tokens") or 0),
                                "completion_tokens": int(usage.get("completion_tokens") or 0),
                                "token_ids": answer_token_ids(body)})
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
        # A 200 we cannot read is a server fault (proxy error page, truncated body): retry it.
        return _Outcome(reason="bad_response", detail=f"{type(err).__name__}: {err}; {_snippet(resp)}",
                        retryable=True)


class ChatClient:
    """Sends chat completions through a ServerPool, retrying transient failures."""

    def __init__(self, pool: ServerPool, *, model: str, temperature: float, max_tokens: int,
                 timeout_s: float, max_retries: int, backoff_base_s: float, backoff_max_s: float):
        self.pool = pool
        self.params = {"model": model, "temperature": temperature, "max_tokens": max_tokens, **TOKEN_IDS_REQUEST}
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.backoff_base_s, self.backoff_max_s = backoff_base_s, backoff_max_s

    async def _attempt(self, slot: Slot, messages: list[dict], **overrides: Any) -> _Outcome:
        try:
            # One deadline for the whole request: httpx's read timeout is per socket read only.
            async with asyncio.timeout(self.timeout_s):
                resp = await slot.http.post(f"{slot.server.url}/v1/chat/completions",
                                            json={**self.params, **overrides, "messages": messages})
        except (TimeoutError, httpx.TimeoutException):
            return _Outcome(reason="timeout", detail=f"no answer within {self.timeout_s:g}s", retryable=True)
        except httpx.TransportError as err:
            return _Outcome(reason="connection", detail=f"{type(err).__name__}: {err}", retryable=True)
        if resp.status_code == 200:
            return _parse(resp)
        retryable = resp.status_code in RETRY_STATUS or resp.status_code >= 500
        return _Outcome(reason=f"http_{resp.status_code}", detail=_snippet(resp), retryable=retryable,
                        retry_after_s=_retry_after(resp) if retryable else None)

    async def chat(self, messages: list[dict], prefer: str | None = None) -> ChatAnswer:
        """The answer to `messages`, or RequestFailed / DatagenServerDown. `prefer`: the server to
        try first (the one that answered the conversation's previous turn)."""
        outcome = _Outcome()
        server: ServerState | None = None
        for attempt in range(1, self.max_retries + 2):
            # A retry goes round-robin: another server may well answer what this one could not.
            slot = await self.pool.acquire(prefer if attempt == 1 else None)
            server = slot.server
            try:
                outcome = await self._attempt(slot, messages)
            finally:
                self.pool.release(slot)
            self.pool.record(server, outcome)
            if outcome.reason is None:
                a = outcome.answer
                return ChatAnswer(a["content"], a["finish_reason"], a["prompt_tokens"],
                                  a["completion_tokens"], server.url, attempt, a["token_ids"])
            if not outcome.retryable:
                break
            if attempt > self.max_retries:
                await self._confirm_alive(server, outcome)
                break
            delay = backoff_delay(attempt, self.backoff_base_s, self.backoff_max_s)
            if outcome.retry_after_s is not None:
                delay = max(delay, min(outcome.retry_after_s, self.backoff_max_s))
            await asyncio.sleep(delay)
        raise RequestFailed(outcome.reason or "unknown", outcome.detail, attempt, server.url if server else "")

    async def _confirm_alive(self, server: ServerState, outcome: _Outcome) -> None:
        """A request used up its retries: is it the request or the server? Ask for one token;
        if that fails too, the server is down (its samples must be redone, not recorded as bad).
        The probe takes a slot like any request, and does not reset the failure count: a server
        that answers probes but fails every real request is still caught by the threshold."""
        slot = await self.pool.acquire(prefer=server.url)
        try:
            probe = await self._attempt(slot, PROBE_MESSAGES, max_tokens=1, temperature=0.0)
        finally:
            self.pool.release(slot)
        if probe.reason is not None:
            raise self.pool.declare_down(server, f"{outcome.reason}: {outcome.detail}; a 1-token probe "
                                                 f"failed too: {probe.reason}: {probe.detail}")
