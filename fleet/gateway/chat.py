"""``POST /v1/chat/completions``: one request from key to released lease.

    authenticate -> parse -> build the fleet request (project defaults, untrusted fencing, token
    count, budget plan) -> enqueue and wait for the grant (keep-alives, 429 past the limit) ->
    claim the lease, keep it renewed -> stream from vLLM with the loop watcher -> release the
    lease the moment the upstream stream has closed -> one access log line, one Envelope (code,
    usage, timings; never the text) and the metrics.

A plain ASGI callable rather than Starlette's ``StreamingResponse``, for the reason the simulator
gives (fleet/sim/responses.py): it must notice a client disconnect while it waits for admission
or for vLLM, and its response status is only known once admission has answered. Nothing is sent
before admission (unless ``gateway.wait_keepalive`` is on: then a streaming client that waits past
``gateway.keepalive_s`` gets the 200 headers and ``: keep-alive`` comments, and after that a failure
can only be an error event). Before the first byte, every failure is an HTTP status with the error
body (fleet/gateway/wire.py): 401 ``E_AUTH``, 400 ``E_INPUT_INVALID`` /
``E_PROMPT_TOO_LONG``, 404 ``E_NOT_FOUND`` (another model), 413 ``E_TOO_LARGE`` (a body over
``gateway.max_body_bytes``, refused while it is read), 429 ``E_QUEUE_TIMEOUT`` with
``Retry-After``, 503 ``E_BROKER_UNAVAILABLE`` with ``Retry-After`` (the fleet's Redis away), 503/504
upstream.

A client that disconnects: while waiting, its pending item is withdrawn at once (a grant that came
anyway is given back); while streaming, the lease keeper's ``Cancel`` is set, which shuts the
upstream socket down at once (fleet/infer/vllm.py), vLLM aborts the sequence, and the lease is
released as soon as the stream thread has let go of the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import LockError
from redis.lock import Lock
from starlette.requests import Request

from fleet.core.codes import Code
from fleet.core.errors import (
    Cancelled,
    FleetError,
    InputInvalid,
    NotFound,
    QueueTimeout,
    QuotaExceeded,
    ThinkLoop,
    UpstreamUnavailable,
)
from fleet.core.keys import job_ref
from fleet.core.models import Envelope, Timings, Usage
from fleet.core.promptcache import backend_tag, record_sent
from fleet.core.repeatcache import FIRST_POLL_S, LAST_POLL_S, LOCK_S, Entry, RepeatCache, repeatable, request_digest
from fleet.core.routing import backends_serving
from fleet.core.usage import TurnUsage, key_label
from fleet.gateway.admission import Ticket
from fleet.gateway.auth import Caller
from fleet.gateway.upstream import Failed, Finished, Resume, UpstreamStream
from fleet.gateway.wire import (
    DONE,
    KEEPALIVE,
    ChatRequest,
    ChunkMaker,
    code_header,
    error_body,
    error_headers,
    parse_chat,
    ratelimit_headers,
    read_body,
    redis_failure,
    sse,
    status_of,
    warning_headers,
)
from fleet.infer.attempts import CHARS_PER_TOKEN_ESTIMATE
from fleet.infer.requestbody import retry_body
from fleet.infer.resume import ContinuationRefused, Kept, keep, resume_turn, why_not
from fleet.infer.turnusage import turn_usage
from fleet.infer.vllm import Delta, StreamResult
from fleet.prep.cachehint import CacheEstimate
from fleet.worker.lease import LeaseKeeper
from fleet.worker.runtime import OnBackend
from schedulers.policy.quota import NEVER_FITS, Quota, Windows, remaining
from schedulers.policy.quota import Usage as QuotaUsage
from schedulers.store.base import quota_entry, quota_of

if TYPE_CHECKING:
    from fleet.gateway.app import Built, Gateway

log = logging.getLogger(__name__)
Send = Any
# What a backend that went away cuts a request with; a failover sends it to another backend.
FAILOVER_CODES = frozenset({Code.E_STREAM_DROPPED, Code.E_UPSTREAM_UNAVAILABLE, Code.E_CONNECT_TIMEOUT})


async def send_json(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
                    ) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ChatCompletions:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        request = Request(scope, receive)
        job_id = uuid.uuid4().hex
        caller: Caller | None = None
        try:
            caller = self.gw.caller(request.headers.get("authorization"))
            req = parse_chat(await read_body(request, self.gw.live.settings.gateway.max_body_bytes))
            if not backends_serving(self.gw.live.settings, req.model):
                raise NotFound(f"The model `{req.model}` does not exist.", param="model")
            built = await self.gw.run(self.gw.build_body, req, caller, job_id)
        except (FleetError, redis.RedisError) as caught:
            exc = redis_failure(caught) if isinstance(caught, redis.RedisError) else caught
            project = caller.project if caller is not None else "-"
            self.gw.metrics.finished(project, exc.code)
            log.info("chat job=%s project=%s code=%s status=%d", job_id, project, exc.code.value,
                     status_of(exc.code))
            await send_json(send, status_of(exc.code), _json(error_body(exc.code, exc.message, exc.param)),
                            [*error_headers(exc), code_header(exc.code)])
            return
        if built.warnings:
            log.info("chat job=%s project=%s warnings: %s", job_id, caller.project, "; ".join(built.warnings))
        await _Session(self.gw, caller, req, job_id, built, receive, send).run()


def _json(data: dict[str, Any]) -> bytes:
    return json.dumps(data, ensure_ascii=False).encode()


class _Session:
    def __init__(self, gw: Gateway, caller: Caller, req: ChatRequest, job_id: str, built: Built,
                 receive: Any, send: Send) -> None:
        self.gw, self.caller, self.req, self.job_id = gw, caller, req, job_id
        self.ref = job_ref(caller.project, job_id)  # the job's identity in the store and in Redis keys
        self.body, self.prompt_tokens, self.max_tokens = built.body, built.prompt_tokens, built.max_tokens
        self.eligible = built.eligible
        self.cache = built.cache or CacheEstimate(built.prompt_tokens)
        self.warnings = built.warnings
        self.fence_tag = built.fence_tag
        self.cache_hit: Entry | None = None  # answered from the project's exact-repeat cache
        self.cache_lock: Lock | None = None  # this request computes the answer identical ones wait for
        self.cache_digest = ""
        self.key_quota: Quota | None = None  # the API key's own quota, once reserved against
        # Every answer's headers say what the gateway changed (tools removed), visible to any client.
        self.headers = warning_headers(built.warnings)
        self._receive, self._send = receive, send
        self.chunks = ChunkMaker(f"chatcmpl-{job_id}", gw.model, gw.live.settings.gateway.reasoning_content)
        self.started = time.monotonic()
        self.headers_sent = False
        self.last_write = self.started
        self.disconnected = asyncio.Event()
        self.keeper: LeaseKeeper | None = None
        self.on: OnBackend | None = None  # the backend the grant names, once admitted
        self.keeper_running = False
        self.waited_s: float | None = None
        self.result: StreamResult | None = None
        self.first_token_s: float | None = None
        self.sent_deltas = False  # a reasoning/content delta reached the client
        self.held: list[str] = []  # reasoning held back while loop_retry may still retry
        self.fence = 0  # of the grant, once admitted
        self.turns: list[TurnUsage] = []  # each attempt sent to vLLM, for the usage ledger
        self.ticket: Ticket | None = None  # the grant the request holds now
        self.ticket_turns = 0  # of self.turns, the first that ran on self.ticket (its quota's)
        self.key_turns = 0  # of self.turns, the first the key quota's reservation now covers
        self.tried = 0  # the backends (a mask) that cut this request
        self.grant_attempts = 0  # attempts made on the grant held now (loop_retry's count)
        self.plan = built.plan
        self.failovers = 0  # times a backend cut it and it went back through admission
        self.kept: Kept | None = None  # the cut reasoning the next attempt continues
        self.sent_answer = False  # answer text or a tool call reached the client
        self.sent_calls = False  # a tool call reached the client: never continued

    # -- the client side --------------------------------------------------------------------
    async def _watch_disconnect(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._gone()
                return

    def _gone(self) -> None:
        self.disconnected.set()
        if self.keeper is not None:
            self.keeper.cancel.set()

    async def _write(self, data: bytes, more: bool = True) -> None:
        if self.disconnected.is_set():
            return
        try:
            if not self.headers_sent:
                self.headers_sent = True
                await self._send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"), *self.headers]})
            await self._send({"type": "http.response.body", "body": data, "more_body": more})
            self.last_write = time.monotonic()
        except OSError:  # uvicorn's ClientDisconnected: the watcher may not have seen it yet
            self._gone()

    async def _fail(self, exc: FleetError) -> None:
        if self.disconnected.is_set():
            return
        body = error_body(exc.code, exc.message, exc.param)
        if self.headers_sent:
            await self._write(sse(body) + DONE, more=False)
            return
        self.headers_sent = True
        try:
            await send_json(self._send, status_of(exc.code), _json(body),
                            [*error_headers(exc), code_header(exc.code), *self.headers])
        except OSError:
            self._gone()

    # -- one request ------------------------------------------------------------------------
    async def run(self) -> None:
        watcher = asyncio.create_task(self._watch_disconnect())
        code = Code.E_INTERNAL
        message = ""
        renewer: asyncio.Task[None] | None = None
        try:
            self.cache_hit = await self._repeat()
            if self.cache_hit is not None:
                code = await self._serve_cached(self.cache_hit)
            else:
                if self.cache_lock is not None:
                    renewer = asyncio.create_task(self._renew_cache_lock(self.cache_lock))
                self.ticket = await self._admit()
                if self.ticket is None:
                    code, message = Code.E_CANCELLED, "the client went away while waiting"
                else:
                    code = await self._stream(self.ticket)
                    if code is Code.OK and self.cache_lock is not None:
                        await self._keep()
        except FleetError as exc:
            code, message = exc.code, exc.message
            await self._fail(exc)
        except redis.RedisError as exc:
            log.warning("chat job=%s: redis error %r", self.job_id, exc)
            failure = redis_failure(exc)
            code, message = failure.code, failure.message
            await self._fail(failure)
        finally:
            watcher.cancel()
            if renewer is not None:
                renewer.cancel()
            if self.cache_lock is not None:
                await self._release_cache_lock(self.cache_lock)
            self.gw.admission.forget(self.ref)
            if self.keeper is not None:
                # Ends the stream thread's read if this task was cancelled mid-stream (uvicorn's
                # shutdown), so the pool thread is free and the exit does not wait for vLLM.
                self.keeper.cancel.set()
            await self._hand_back()
            await self._settle_key_quota(admitted=bool(self.turns))
            await self._account(code, message)

    # -- the exact-repeat cache (fleet/core/repeatcache.py) -------------------------------------
    def _repeat_cache(self) -> RepeatCache | None:
        project = self.caller.project
        settings = self.gw.live.settings.projects[project].repeat_cache
        if not repeatable(settings, self.req.temperature, self.req.seed):
            return None
        return RepeatCache(self.gw.runtime.redis, self.gw.runtime.keys, project, settings)

    async def _repeat(self) -> Entry | None:
        """The kept answer of an identical request, waiting for one running now (no stampede);
        None: this request runs, holding the computing lock when it got it. A Redis error here
        only skips the cache."""
        cache = self._repeat_cache()
        if cache is None:
            return None
        self.cache_digest = request_digest(self.req.model, self.body, self.fence_tag)
        try:
            entry = await self.gw.run(cache.get, self.cache_digest)
            if entry is not None:
                return entry
            lock = cache.lock(self.cache_digest)
            if await self.gw.run(lock.acquire):
                return await self._computing(cache, lock)
            await self.gw.run(cache.count, "waits")
            until, pause = time.monotonic() + cache.settings.wait_s, FIRST_POLL_S
            while time.monotonic() < until and not self.disconnected.is_set():
                await asyncio.sleep(pause)
                pause = min(LAST_POLL_S, pause * 2)
                entry = await self.gw.run(cache.get, self.cache_digest, count=False)
                if entry is not None:
                    await self.gw.run(cache.count, "hits")
                    return entry
                if await self.gw.run(lock.acquire):  # the first one ended (maybe without an answer)
                    return await self._computing(cache, lock)
        except redis.RedisError as exc:
            log.warning("chat job=%s: repeat cache skipped (%r)", self.job_id, exc)
        return None

    async def _computing(self, cache: RepeatCache, lock: Lock) -> Entry | None:
        """The lock is this request's: it computes, unless the answer was kept between its last
        look and the lock (the request that held it kept its answer, then let the lock go)."""
        entry = await self.gw.run(cache.get, self.cache_digest, count=False)
        if entry is None:
            self.cache_lock = lock
            return None
        await self._release_cache_lock(lock)
        await self.gw.run(cache.count, "hits")
        return entry

    async def _renew_cache_lock(self, lock: Lock) -> None:
        with contextlib.suppress(redis.RedisError, LockError):
            while True:
                await asyncio.sleep(LOCK_S / 3)
                await self.gw.run(lock.reacquire)

    async def _release_cache_lock(self, lock: Lock) -> None:
        with contextlib.suppress(redis.RedisError, LockError):
            await self.gw.run(lock.release)

    async def _keep(self) -> None:
        """This request's OK answer, for the identical requests to come."""
        cache, r = self._repeat_cache(), self.result
        if cache is None or r is None:
            return
        now = time.time()
        entry = Entry(content=r.content, reasoning=r.reasoning, tool_calls=r.tool_calls,
                      finish_reason=r.finish_reason or "stop", usage=self._answer_usage(r.usage or {}),
                      backend=self.on.settings.backend.name if self.on else "", created_at=now,
                      expires_at=now + cache.settings.ttl_s)
        try:
            await self.gw.run(cache.put, self.cache_digest, entry)
        except redis.RedisError as exc:
            log.warning("chat job=%s: answer not kept in the repeat cache (%r)", self.job_id, exc)

    async def _serve_cached(self, entry: Entry) -> Code:
        """The kept answer, as the first request got it (stream or not), marked ``cached``."""
        code = Code.OK
        self.headers += [(b"x-fleet-cache", b"hit"), (b"x-fleet-backend", entry.backend.encode())]
        self.chunks.backend = entry.backend
        if self.req.stream:
            calls = [{**call, "index": i} for i, call in enumerate(entry.tool_calls)]
            data = self.chunks.role() + self.chunks.delta(entry.reasoning, entry.content, calls)
            data += self.chunks.finish(entry.finish_reason, code)
            if self.req.include_usage:
                data += self.chunks.usage(entry.usage, code)
            await self._write(data + DONE, more=False)
        elif not self.disconnected.is_set():
            body = self.chunks.full(entry.content, entry.reasoning, entry.tool_calls, entry.finish_reason,
                                    entry.usage, code)
            body["cached"] = True
            self.headers_sent = True
            await send_json(self._send, 200, _json(body), [code_header(code), *self.headers])
        return code

    async def _quota(self, waited: bool = False) -> None:
        """The project's quota before admission (schedulers/store/base.py ``quota_entry``): the
        ``x-ratelimit-*`` headers of what remains this minute on every answer, 429
        E_QUOTA_EXCEEDED (Retry-After when waiting helps) for a request it refuses, 400
        E_INPUT_INVALID for one no window could ever hold. ``waited``: the request waited its
        whole ``max_queue_wait_s`` in line (``over = "wait"``); if its quota still has no room,
        that is why, whatever ``over`` says."""
        project = self.caller.project
        store = self.gw.runtime.store
        if store.config.quota(project) is None:
            return
        over = "refuse" if waited else self.gw.live.settings.projects[project].quota.over
        entry = await self.gw.run(quota_entry, store, project, over, self.prompt_tokens, self.max_tokens,
                                  time.time(), headers=not waited)
        if entry.remaining is not None:
            self.headers += ratelimit_headers(entry.remaining)
        if entry.refused is not None:
            message, retry_s = entry.refused
            if retry_s is None and message.startswith(NEVER_FITS):
                raise InputInvalid(message, param="max_tokens")
            raise QuotaExceeded(message, retry_after_s=None if retry_s is None else max(1, math.ceil(retry_s)))

    async def _key_quota(self) -> None:
        """The API key's own quota (schedulers/store/keyquota.py), before admission: reserve the
        request's worst case, or wait for the window that holds it (``over = "wait"``, at most
        ``gateway.max_queue_wait_s``) or answer 429 E_QUOTA_EXCEEDED; 400 when no window could
        ever hold it. Its ``x-ratelimit-*`` headers then describe the key's quota."""
        project, label = self.caller.project, key_label(self.caller.key_id)
        limits = self.gw.live.settings.projects[project].key_quotas.get(label)
        if limits is None:
            return
        quota = quota_of(limits)
        cost = quota.reserve(self.prompt_tokens, self.max_tokens)
        if quota.never_fits(cost):
            raise InputInvalid(f"{NEVER_FITS}: this request may cost {cost:,} (prompt and output limit), "
                               f"more than its API key's smallest token quota ({quota.smallest_tokens:,})",
                               param="max_tokens")
        give_up = self.started + self.gw.live.settings.gateway.max_queue_wait_s
        while True:
            now = time.time()
            used = await self.gw.run(self.gw.key_quotas.used, project, label, now)
            held = await self.gw.run(self.gw.key_quotas.reserve, project, label, quota, self.ref,
                                     self.prompt_tokens, self.max_tokens, now)
            self.headers = [h for h in self.headers if not h[0].startswith(b"x-ratelimit-")]
            self.headers += ratelimit_headers(remaining(quota, QuotaUsage(used[0], used[1]), Windows.at(now)))
            if held is None:
                self.key_quota = quota
                return
            name, limit, retry_s = held
            wait_s = min(retry_s + 0.05, give_up - time.monotonic())
            if limits.over == "refuse" or wait_s <= 0 or self.disconnected.is_set():
                raise QuotaExceeded(f"quota: this API key's {name} = {limit:,} has no room for this request "
                                    f"(cost {cost:,}); room again in {math.ceil(retry_s)} s",
                                    retry_after_s=max(1, math.ceil(retry_s)))
            await asyncio.sleep(wait_s)

    async def _settle_key_quota(self, admitted: bool) -> None:
        """The key's reservation meets what the request spent (0 when it was never admitted)."""
        quota = self.key_quota
        if quota is None:
            return
        spent = sum(quota.spent(max(t.prompt_tokens, self.prompt_tokens), t.cached_tokens,
                                t.reasoning_tokens + t.answer_tokens) for t in self.turns[self.key_turns:]) \
            if admitted else 0
        try:
            await self.gw.run(self.gw.key_quotas.settle, self.caller.project, self.ref, spent)
        except redis.RedisError as exc:
            log.warning("chat job=%s: key quota reservation not settled (%r); it stands", self.job_id, exc)

    async def _settle_quota(self, ticket: Ticket) -> None:
        """The grant's quota reservation meets what its attempts spent (nothing without a quota);
        a Redis error leaves the reservation standing (the window keeps the worst case)."""
        store = self.gw.runtime.store
        quota = store.config.quota(self.caller.project)
        if quota is None:
            return
        # a prompt sent counts whole even when the attempt was cut before its first token (vLLM
        # computed some of it; a client hanging up mid-prefill gets nothing back)
        spent = sum(quota.spent(max(t.prompt_tokens, self.prompt_tokens), t.cached_tokens,
                                t.reasoning_tokens + t.answer_tokens) for t in self.turns[self.ticket_turns:])
        try:
            await self.gw.run(store.settle, self.ref, ticket.fence, spent)
        except redis.RedisError as exc:
            log.warning("chat job=%s: quota reservation not settled (%r); it stands", self.job_id, exc)

    async def _admit(self) -> Ticket | None:
        gw, settings = self.gw, self.gw.live.settings.gateway
        adm = gw.admission
        await self._quota()
        await self._key_quota()
        enqueued_at = await adm.enqueue(self.ref, self.caller.project, self.caller.band,
                                        self.prompt_tokens, self.max_tokens, settings.max_queue_wait_s,
                                        self.eligible, self.cache)
        give_up_at = self.started + settings.max_queue_wait_s
        while True:
            now = time.monotonic()
            if self.disconnected.is_set() or now >= give_up_at:
                grant = await adm.withdraw(self.ref)
                if self.disconnected.is_set():
                    if grant is not None:
                        await adm.give_back(self.ref, grant)
                    return None
                if grant is None:
                    await self._quota(waited=True)  # held by its quota: say so, not "busy"
                    raise adm.timeout_error(settings.max_queue_wait_s)
                break
            wait_s = give_up_at - now
            if self.req.stream and settings.wait_keepalive:  # the next keep-alive is due sooner
                wait_s = min(wait_s, self.last_write + settings.keepalive_s - now)
            grant = await adm.next_grant(self.ref, wait_s, self.disconnected)
            if grant is not None:
                break
            # Off by default: the status is decided before the first byte (a 429 SDKs retry).
            if (self.req.stream and settings.wait_keepalive
                    and time.monotonic() - self.last_write >= settings.keepalive_s):
                await self._write(KEEPALIVE)
        ticket = await adm.claim(self.ref, self.caller.project, grant, enqueued_at)
        self.waited_s = ticket.waited_s
        return ticket

    def _on_ticket(self, ticket: Ticket) -> None:
        """The backend the grant names, and a lease keeper for it (entered by the caller)."""
        rt = self.gw.runtime
        try:
            self.on = rt.on_backend(ticket.backend)
        except KeyError as exc:  # a dispatcher with other settings granted it
            raise UpstreamUnavailable(f"the grant names {exc}") from exc
        # every answer says which backend served it; the chunks carry its model's name
        self.headers = [h for h in self.headers if h[0] != b"x-fleet-backend"]
        self.headers.append((b"x-fleet-backend", self.on.settings.backend.name.encode()))
        self.chunks.model = self.on.settings.backend.model
        self.chunks.backend = self.on.settings.backend.name
        # A chat request is cancelled by its client leaving (self.disconnected), never by a request.
        self.keeper = LeaseKeeper(rt.lease_store, lambda: False, ticket.job_id, ticket.fence,
                                  rt.settings.admission.lease_ttl_s)
        self.fence = ticket.fence
        if self.disconnected.is_set():
            self.keeper.cancel.set()

    async def _stream(self, ticket: Ticket) -> Code:
        self._on_ticket(ticket)
        attempt = 1
        while True:
            outcome = await self._attempt(attempt)
            if isinstance(outcome, Finished):
                break
            if self.disconnected.is_set():
                raise Cancelled("the client disconnected")
            if await self._retry_loop(outcome.error, self.grant_attempts):
                log.info("chat job=%s: loop cut before any content was sent; attempt %d", self.job_id, attempt + 1)
            elif not await self._fail_over(outcome):
                raise outcome.error
            attempt += 1
        self.result = outcome.result
        return await self._finish(outcome.result)

    async def _attempt(self, attempt: int) -> Finished | Failed:
        body = self.body
        self.grant_attempts += 1
        if attempt > 1:  # its own request id; a new seed, as a worker's retry has
            body = retry_body(body, self.job_id, attempt)
        assert self.on is not None and self.keeper is not None
        kept, resume = self.kept, None
        if kept is not None:
            resume = self._resume(body, kept, self.on, self.keeper.cancel)
        upstream = UpstreamStream(self.on.vllm, body, self.gw.live.settings.watcher, self.keeper.cancel,
                                  asyncio.get_running_loop(), self.gw.streams, kept, resume).start()
        if attempt == 1:  # the request is on its way to vLLM before anything else is done
            await self._started()
        outcome = await self._relay(upstream)
        await upstream.done.wait()
        self._turn_ended(attempt, outcome)
        return outcome

    def _resume(self, body: dict[str, Any], kept: Kept, on: OnBackend, cancel: threading.Event) -> Resume:
        """The continuation of ``kept`` on backend ``on`` (fleet/infer/resume.py), as a stream."""
        assert self.plan is not None
        backend = on.settings.backend
        plan = replace(self.plan, max_model_len=backend.max_model_len)
        return lambda on_delta: resume_turn(on.vllm, body, kept, plan, backend.name or backend.url, on_delta,
                                            cancel, None)

    async def _fail_over(self, outcome: Failed) -> bool:
        """Whether a turn its backend cut goes on, on a new grant (``gateway.fail_over``): only
        for a backend that went away (``FAILOVER_CODES``: a server's own 500, a timeout or a
        refusal would meet the next one alike), never once a tool call reached the client. The
        first failover takes no retry-budget token, as a queue job's first cut takes none: a crash
        cuts every stream on its server, and a token would charge the projects of the streams it
        cut for the one that caused it. A later one does (a request cut again is more likely the
        one that brings servers down): its project's budget bounds its requests' crashes, and
        ``fail_over`` each one's.
        A reasoning, or answer text, already streamed is continued where it stopped
        (``routing.continue_cut_turns = "continue"``, a backend whose template allows it, not an
        answer under a ``response_format``); else the turn runs again while nothing reached the
        client (a reasoning only held back is dropped with it) and ends with the error after. The grant is given
        up (its quota settled with what it spent), the request goes back in line, to a backend
        of its model that has not cut it when there is one, for at most ``max_queue_wait_s``."""
        error, settings = outcome.error, self.gw.live.settings
        if isinstance(error, ContinuationRefused):  # this backend will not continue it: run it again
            if self.sent_deltas:
                return False
            self.kept = None
            self.held.clear()
            log.info("chat job=%s: the continuation was refused (%s); the turn runs again", self.job_id,
                     error.message)
            return True
        if (error.code not in FAILOVER_CODES or self.sent_calls or self.on is None
                or self.failovers >= settings.gateway.fail_over or self.disconnected.is_set()):
            return False
        kept = None
        if settings.routing.continue_cut_turns == "continue" and self.plan is not None:
            backend = self.on.settings.backend
            kept = keep(outcome.partial, self.body, backend.model, backend.name, answer=self.sent_answer)
        if kept is None and self.sent_deltas:  # a restart would stream what the client has a second time
            return False
        if self.failovers >= 1 and not await self.gw.run(self.gw.retry_budget(self.caller.project).try_spend):
            log.warning("chat job=%s: cut by %s again, not failed over: the project's retry budget is spent",
                        self.job_id, self.on.settings.backend.name)
            return False
        failed = self.on.settings.backend.name
        self.tried |= self.gw.runtime.settings.backend_bit(failed)
        await self._hand_back()
        ticket = await self._readmit(kept)
        if ticket is None:
            return False
        self.failovers += 1
        self._on_ticket(ticket)
        assert self.keeper is not None and self.on is not None
        self.keeper.__enter__()
        self.keeper_running = True
        self.grant_attempts = 0
        self.kept = await self._continuable(kept)
        if self.kept is None and self.sent_deltas:
            return False
        if self.kept is None:
            self.held.clear()
        how = "continue" if self.kept is not None else "restart"
        self.gw.metrics.failed_over(self.caller.project, failed, how)
        log.info("chat job=%s: %s cut it (%s); %s on %s", self.job_id, failed, error.code.value, how,
                 self.on.settings.backend.name)
        return not self.disconnected.is_set()

    async def _continuable(self, kept: Kept | None) -> Kept | None:
        """``kept``, when the new grant's backend can continue it (fleet/infer/resume.py ``why_not``)."""
        if kept is None or self.on is None or self.keeper is None:
            return None
        backend = self.on.settings.backend
        why = await self.gw.run(why_not, kept, self.body, backend.model, self.on.vllm, backend.name or backend.url,
                                self.keeper.cancel, None)
        if why is not None:
            log.info("chat job=%s: a cut reasoning of %d tokens is not continued on %s: %s", self.job_id,
                     kept["tokens"], backend.name, why)
            return None
        return kept

    async def _readmit(self, kept: Kept | None) -> Ticket | None:
        """Back in line after a failover, sized as what the next attempt sends (a continuation's
        prompt holds the kept reasoning, all of it uncached on another backend), with a new
        reservation of the API key's quota; the new grant, or None when the client left or the
        key's quota has no room. QueueTimeout when the wait passed ``max_queue_wait_s``."""
        adm, settings = self.gw.admission, self.gw.live.settings.gateway
        mask = self.eligible & ~self.tried or self.eligible
        prompt, max_tokens = self.prompt_tokens, self.max_tokens
        if kept is not None:  # the kept answer text too, at the estimate's 3 characters a token (more, not less)
            held = kept["tokens"] + len(kept.get("answer", "")) // CHARS_PER_TOKEN_ESTIMATE
            prompt, max_tokens = prompt + held, max(1, max_tokens - held)
        if self.disconnected.is_set() or not await self._key_quota_again(prompt, max_tokens):
            return None
        enqueued_at = await adm.enqueue(self.ref, self.caller.project, self.caller.band, prompt, max_tokens,
                                        settings.max_queue_wait_s, mask, CacheEstimate(prompt))
        give_up_at = time.monotonic() + settings.max_queue_wait_s
        grant = None
        while grant is None and not self.disconnected.is_set() and time.monotonic() < give_up_at:
            wait_s = give_up_at - time.monotonic()
            if self.headers_sent:  # a stream already open: the client hears us wait
                wait_s = min(wait_s, self.last_write + settings.keepalive_s - time.monotonic())
            grant = await adm.next_grant(self.ref, wait_s, self.disconnected)
            if grant is None and self.headers_sent and time.monotonic() - self.last_write >= settings.keepalive_s:
                await self._write(KEEPALIVE)
        if grant is None:
            grant = await adm.withdraw(self.ref)
        if grant is not None and self.disconnected.is_set():
            await adm.give_back(self.ref, grant)
            return None
        if grant is None and self.disconnected.is_set():
            return None
        if grant is None:
            log.info("chat job=%s: not admitted again within %g s after its backend cut it", self.job_id,
                     settings.max_queue_wait_s)
            raise self._not_readmitted(settings.max_queue_wait_s)
        self.ticket = await adm.claim(self.ref, self.caller.project, grant, enqueued_at)
        return self.ticket

    def _not_readmitted(self, max_wait_s: float) -> QueueTimeout:
        """E_QUEUE_TIMEOUT (a 429 with Retry-After when nothing was sent yet) for a request cut by
        its backend that found no seat again: the fleet was full, not the request wrong."""
        busy = self.gw.admission.timeout_error(max_wait_s)
        exc = QueueTimeout(f"cut by its backend, then {busy.message}")
        exc.retry_after_s = busy.retry_after_s
        return exc

    async def _key_quota_again(self, prompt: int, max_tokens: int) -> bool:
        """The API key's reservation settled with what the attempts so far spent and made again
        for the next one's worst case (no key quota: nothing to do); False when it has no room."""
        quota = self.key_quota
        if quota is None:
            return True
        await self._settle_key_quota(admitted=True)
        self.key_turns, project, label = len(self.turns), self.caller.project, key_label(self.caller.key_id)
        held = await self.gw.run(self.gw.key_quotas.reserve, project, label, quota, self.ref, prompt, max_tokens,
                                 time.time())
        if held is not None:
            self.key_quota = None  # nothing reserved: nothing to settle at the end
            log.info("chat job=%s: not failed over: its API key's %s has no room", self.job_id, held[0])
            return False
        return True

    async def _hand_back(self) -> None:
        """Give the grant up: its lease no longer renewed, its quota reservation settled with what
        the turns run on it spent, its slot released (the ticket forgotten only then: a failure on
        the way leaves it for ``run``'s last call)."""
        keeper, ticket = self.keeper, self.ticket
        if keeper is not None and self.keeper_running:
            self.keeper_running = False
            await self.gw.run(keeper.__exit__, None, None, None)
        if ticket is not None:
            await self._settle_quota(ticket)
            self.ticket_turns = len(self.turns)
            await self.gw.admission.release(ticket)
            self.ticket = None

    def _turn_ended(self, attempt: int, outcome: Finished | Failed) -> None:
        """What the usage ledger counts for this attempt (counted in ``_account``)."""
        if isinstance(outcome, Finished):
            result: StreamResult | None = outcome.result
            code = Code.OK_TRUNCATED if outcome.result.finish_reason == "length" else Code.OK
        else:
            result, code = outcome.partial, outcome.error.code
        self.turns.append(turn_usage(
            self.caller.project, self.job_id, self.fence, attempt, code.value, result,
            self.prompt_tokens, key=key_label(self.caller.key_id),
            model=self.on.settings.backend.model if self.on else self.gw.model,
            tool_round=bool(result is not None and result.tool_calls)))

    async def _started(self) -> None:
        """What the first attempt needs, off its critical path: lease renewals (the claim just
        renewed it, so the first one is a third of the TTL away), the role chunk, and the credit
        of a first attempt to the project's retry budget (loop retries and later failovers spend it)."""
        assert self.keeper is not None
        self.keeper.__enter__()
        self.keeper_running = True
        if self.req.stream:
            await self._write(self.chunks.role())
        await self.gw.run(self.gw.retry_budget(self.caller.project).first_attempt)

    async def _retry_loop(self, error: FleetError, attempt: int) -> bool:
        """Whether a failed attempt is retried: only a loop cut, only when the client asked for it
        (``loop_retry``), only before any delta was sent, within ``retry.max_attempts`` and the
        project's retry budget (fleet/infer/retrying.py), under the same lease."""
        if not (isinstance(error, ThinkLoop) and self.req.loop_retry and not self.sent_deltas):
            return False
        if attempt >= self.gw.live.settings.retry.max_attempts:
            return False
        budget = self.gw.retry_budget(self.caller.project)
        if not await self.gw.run(budget.try_spend):
            return False
        self.held.clear()
        self.kept = None  # a restart, on a new seed: the held reasoning, kept part included, goes
        return True

    async def _relay(self, upstream: UpstreamStream) -> Finished | Failed:
        keepalive_s = self.gw.live.settings.gateway.keepalive_s
        while True:
            if not (self.req.stream and self.req.loop_retry and not self.sent_deltas):
                item = await upstream.queue.get()
            else:  # reasoning held back: keep-alives meanwhile, so the client still hears us
                try:
                    item = await asyncio.wait_for(upstream.queue.get(), keepalive_s)
                except TimeoutError:
                    await self._write(KEEPALIVE)
                    continue
            if not isinstance(item, Delta):
                if isinstance(item, Failed) and item.partial is not None:
                    self.result = item.partial
                return item
            if self.first_token_s is None:
                self.first_token_s = time.monotonic() - self.started
            if self.req.stream and (item.reasoning or item.content or item.tool_calls):
                await self._send_delta(item)
            elif self.req.stream and item.held and time.monotonic() - self.last_write >= keepalive_s:
                await self._write(KEEPALIVE)  # a tool call being written, held back: the client hears us

    async def _send_delta(self, item: Delta) -> None:
        """With ``loop_retry``, reasoning is held back until the answer starts (or the stream
        ends), so a loop cut in the reasoning can be retried without the client seeing it."""
        if self.req.loop_retry and not self.sent_deltas and not (item.content or item.tool_calls):
            self.held.append(item.reasoning)
            return
        await self._flush_held()
        self.sent_deltas = True
        self.sent_answer = self.sent_answer or bool(item.content or item.tool_calls)
        self.sent_calls = self.sent_calls or bool(item.tool_calls)
        await self._write(self.chunks.delta(item.reasoning, item.content, item.tool_calls))

    async def _flush_held(self) -> None:
        if self.held:
            reasoning, self.held = "".join(self.held), []
            self.sent_deltas = True
            await self._write(self.chunks.delta(reasoning, "", []))

    async def _finish(self, result: StreamResult) -> Code:
        """The answer's end, with the fleet's code: ``X-Fleet-Code`` on a non-streaming answer
        and ``fleet.code`` in its body; a stream's headers went before the code was known, so
        its finishing chunk (and the usage chunk after it) carry ``fleet.code``."""
        usage = self._answer_usage(result.usage or {})
        code = Code.OK_TRUNCATED if result.finish_reason == "length" else Code.OK
        if self.req.stream:
            await self._flush_held()
            tail = self.chunks.finish(result.finish_reason, code)
            if self.req.include_usage:
                tail += self.chunks.usage(usage, code)
            await self._write(tail + DONE, more=False)
        elif not self.disconnected.is_set():
            body = self.chunks.full(result.content, result.reasoning, result.tool_calls,
                                    result.finish_reason, usage, code)
            self.headers_sent = True
            await send_json(self._send, 200, _json(body), [code_header(code), *self.headers])
        return code

    def _answer_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The answer's usage: the last attempt's, and after a failover the tokens generated before
        it too (the part of the reasoning a continuation kept, or a cut attempt's whole output),
        with the prompt counted once: what the request cost the model."""
        if not self.failovers or not usage or len(self.turns) < 2:
            return usage
        earlier = self.turns[:-1]
        reasoning = sum(t.reasoning_tokens for t in earlier)
        completion = int(usage.get("completion_tokens") or 0) + reasoning + sum(t.answer_tokens for t in earlier)
        prompt = self.turns[0].prompt_tokens or int(usage.get("prompt_tokens") or 0)
        details = dict(usage.get("completion_tokens_details") or {})
        details["reasoning_tokens"] = int(details.get("reasoning_tokens") or 0) + reasoning
        cached = dict(usage.get("prompt_tokens_details") or {})
        cached["cached_tokens"] = min(int(cached.get("cached_tokens") or 0), prompt)
        return {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion, "completion_tokens_details": details,
                "prompt_tokens_details": cached}

    async def _account(self, code: Code, message: str) -> None:
        """The access log line, the metrics and the Envelope (code, usage, timings; no text)."""
        total_s = time.monotonic() - self.started
        r = self.result
        usage = Usage(prompt_tokens=(r.prompt_tokens if r else None) or self.prompt_tokens,
                      completion_tokens=r.completion_tokens if r else 0,
                      reasoning_tokens=r.reasoning_tokens if r else 0,
                      cached_tokens=r.cached_tokens if r else 0)
        if self.failovers and self.turns:  # every attempt's output, the prompt once (as the answer's)
            prompt = self.turns[0].prompt_tokens or self.prompt_tokens
            usage = Usage(prompt_tokens=prompt,
                          completion_tokens=sum(t.reasoning_tokens + t.answer_tokens for t in self.turns),
                          reasoning_tokens=sum(t.reasoning_tokens for t in self.turns),
                          cached_tokens=min(usage.cached_tokens, prompt))
        project = self.caller.project
        hit = self.cache_hit
        if hit is not None:  # what the first request was told; no model turn ran for this one
            usage = Usage(prompt_tokens=int(hit.usage.get("prompt_tokens", 0)),
                          completion_tokens=int(hit.usage.get("completion_tokens", 0)))
            self.turns = [TurnUsage(project, self.job_id, 0, 0, code.value, key=key_label(self.caller.key_id),
                                    model=self.req.model, cache_hit=True, ended_at=time.time())]
        self.gw.metrics.request(project, code, self.waited_s, self.first_token_s, usage)
        if self.turns:
            await self.gw.run(self.gw.runtime.ledger.count, self.turns)
        if r is not None and self.first_token_s is not None and self.on is not None:
            try:
                await self.gw.run(self._record_sent, r)
            except redis.RedisError:  # an estimate only: the next request counts its prompt whole
                log.warning("chat job=%s: recording what was sent failed", self.job_id)
        log.info("chat job=%s project=%s code=%s stream=%s waited=%s ttft=%s total=%.3fs "
                 "prompt=%d completion=%d backend=%s failovers=%d", self.job_id, project, code.value,
                 self.req.stream, _secs(self.waited_s), _secs(self.first_token_s), total_s, usage.prompt_tokens,
                 usage.completion_tokens, self._served_by() or "-", self.failovers)
        envelope = Envelope.failure(self.job_id, project, code, message, usage=usage,
                                    timings=Timings(queued_s=self.waited_s, first_token_s=self.first_token_s,
                                                    total_s=round(total_s, 4)),
                                    metadata={"origin": "gateway", "failovers": self.failovers},
                                    warnings=self.warnings, cached=hit is not None,
                                    backend=hit.backend if hit is not None else self._served_by())
        try:
            await self.gw.run(self.gw.runtime.results.publish, envelope, stream="gateway")
        except redis.RedisError:  # accounting only: the client has its answer
            log.exception("publishing the envelope of gateway job %s failed", self.job_id)

    def _served_by(self) -> str:
        """The backend of the request's last attempt ('' when none ran)."""
        return self.on.settings.backend.name if self.on is not None and self.turns else ""

    def _record_sent(self, result: StreamResult) -> None:
        """What this request sent to its backend (fleet/core/promptcache.py), once the server
        computed its prompt: a later request of the project that starts with it (the next turn of
        the conversation, with the same tools) counts that part as cached there and is routed
        there. The whole prompt only: a chat request has no stable prefix of its own."""
        assert self.on is not None
        settings, rt = self.on.settings, self.gw.runtime
        pipe = rt.redis.pipeline(transaction=False)
        record_sent(pipe, rt.keys, self.caller.project, wire=self.body["messages"], tools=self.body.get("tools"),
                    salt=self.body["cache_salt"], prompt_tokens=result.rendered_prompt_tokens or result.prompt_tokens,
                    prefix=[], prefix_tokens=0,
                    remember_s=settings.backend.prefix_cache_s, backend=backend_tag(settings))
        pipe.execute()


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"
