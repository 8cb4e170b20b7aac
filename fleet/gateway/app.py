"""The gateway's ASGI app and what one gateway process holds (``Gateway``).

Routes: ``POST /v1/chat/completions`` (fleet/gateway/chat.py), ``GET /v1/models``, the task routes
of fleet/gateway/tasks.py, the file routes of fleet/gateway/fileroutes.py, the batch routes (and
a file's content) of fleet/gateway/batches.py, the caller's own usage
(``GET /v1/organization/usage/completions``, fleet/gateway/usage.py), ``GET /health`` and ``GET /livez`` (no key needed
for those two) and ``GET /metrics`` (a metrics key of ``gateway.metrics_keys``, never a project's
API key: its figures are every project's). ``/health`` is readiness: 200 when the fleet's Redis answers a
PING within a second, else 503 with a JSON body naming what is down; the backend is left out
(every gateway shares it, and a request meeting a dead backend gets its own 503
``E_UPSTREAM_UNAVAILABLE``). ``/livez`` is liveness: 200 while the process serves.
Every other route and method answers vLLM's error body with a code, never Starlette's HTML page
(a wrong method 405 with ``Allow``, a trailing slash 404, never a redirect).
A Redis error of a route is 503 ``E_BROKER_UNAVAILABLE`` with Retry-After when Redis cannot
serve right now, 500 ``E_INTERNAL`` otherwise (``wire.redis_failure``, the one mapping).

``Gateway.build_body`` turns a chat request into the body the fleet would send for the same job
on the queue path (fleet/infer/requestbody.py builds both): the project's system prompt first
(fleet/prep/prepare.py lays it out and counts the prompt exactly, as prep does; a conversation is
never trimmed, a prompt that does not fit is 400 ``E_PROMPT_TOO_LONG``), untrusted messages
fenced and their requests stripped of tools (fleet/core/request.py), tools the project does not
allow removed, ``chat_template_kwargs`` only as allowed switches and never on an untrusted
request (fleet/core/request.py ``template_kwargs``: 400 ``E_INPUT_INVALID`` before anything is
counted), the project's thinking budget and content reserve as ``thinking_token_budget`` and
``max_completion_tokens``, planned by the queue path's planner (fleet/infer/budget.py: a
client's own ``max_tokens`` lowers the thinking budget so the content reserve still fits, and
below the reserve is 400 ``E_INPUT_INVALID`` naming the smallest that works), the
project's response schema unless the request brings its own ``response_format``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

import redis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Mount, Route

from fleet.client import Client
from fleet.core import routing
from fleet.core.codes import Code
from fleet.core.config import BackendSettings
from fleet.core.errors import AuthError, BrokerUnavailable, Busy, FleetError, PromptTooLong
from fleet.core.keys import job_ref
from fleet.core.models import Job
from fleet.core.redisconn import async_redis_client
from fleet.core.request import build_request_messages, template_kwargs, tools_allowed
from fleet.core.seal import cache_salt, key_tag
from fleet.core.usage import key_label
from fleet.gateway.admission import Admission
from fleet.gateway.auth import Caller, LiveSettings
from fleet.gateway.batches import BatchRoutes
from fleet.gateway.chat import ChatCompletions
from fleet.gateway.events import EventHub
from fleet.gateway.fileroutes import FileRoutes
from fleet.gateway.metrics import GatewayMetrics
from fleet.gateway.tasks import TaskRoutes
from fleet.gateway.usage import UsageRoutes
from fleet.gateway.wire import ChatRequest, broker_down, error_body, error_headers, redis_failure, status_of
from fleet.infer.budget import Plan
from fleet.infer.budget import plan as plan_budget
from fleet.infer.requestbody import base_temperature, request_body
from fleet.infer.retrying import RetryBudget
from fleet.infer.validate import response_format
from fleet.prep.cachehint import CacheEstimate, estimate_routed
from fleet.prep.prepare import prepare
from fleet.prep.tokens import TokenCounter
from fleet.worker.app import create_app as create_celery_app
from fleet.worker.dispatch import make_send
from fleet.worker.runtime import Runtime
from schedulers.store.keyquota import KeyQuotas

log = logging.getLogger(__name__)
T = TypeVar("T")
IO_THREADS = 32
BUSY_RETRY_AFTER_S = 1
HEALTH_TIMEOUT_S = 1.0  # a Redis slower than this to answer PING is not ready
# A task submit rides out a Redis that does not answer this long (a blip), then answers 503
# E_BROKER_UNAVAILABLE with Retry-After rather than hold its client (idempotency_key makes the
# client's retry safe).
SUBMIT_RETRY_S = 2.0


class Gateway:
    def __init__(self, live: LiveSettings) -> None:
        self.live = live
        settings = live.settings
        self.metrics = GatewayMetrics()
        self.runtime = Runtime(settings, on_turn=self.metrics.usage.observe)
        self.model = settings.backend.model
        self.vllm = self.runtime.vllm
        self.aredis = async_redis_client(settings)
        self.executor = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="gateway-io")
        # Batches on threads of their own: a large batch never holds up chat.
        self.batch_executor = ThreadPoolExecutor(max_workers=settings.gateway.batch_threads,
                                                 thread_name_prefix="gateway-batch")
        self.streams = ThreadPoolExecutor(max_workers=2 * settings.backend.max_num_seqs,
                                          thread_name_prefix="gateway-stream")  # fleet/gateway/upstream.py
        self._batch_calls: dict[str, int] = {}  # project -> its batch calls running or queued
        self._batch_lock = threading.Lock()
        send = make_send(settings, self.runtime.redis, create_celery_app(settings))
        self.admission = Admission(self.runtime.store, self.runtime.results, self.aredis,
                                   self.runtime.keys, self.run, send)
        self.key_quotas = KeyQuotas(self.runtime.redis, self.runtime.keys)  # schedulers/store/keyquota.py
        self.client = Client(settings, redis_client=self.runtime.redis, retry_s=SUBMIT_RETRY_S)
        self._budgets: dict[str, RetryBudget] = {}
        # Only the process's own count cache, not the shared Redis one: a chat prompt is new
        # nearly every time (each turn adds to the conversation), so the Redis tier would cost a
        # GET that misses and a SET, two round trips per request, for little reuse. An empty
        # base URL makes an estimate-only counter (fleet/prep/tokens.py). One counter per backend
        # that counts a model's prompts (routing.counting_backend: each model's own tokenizer).
        self._counters: dict[str, TokenCounter] = {}
        self._counters_lock = threading.Lock()
        self.counter = self.counter_for(self.runtime.settings.backend)
        self.events = EventHub(settings, self.runtime.keys, self.admission.gateway_id)

    def key_tag(self, caller: Caller, job: Job) -> dict[str, str]:
        """The job hash fields naming the caller's API key, for a job submitted for it
        (``/v1/tasks``, a batch line), sealed (fleet/core/seal.py ``key_tag``) and written with the
        job's record (``Client.submit``'s ``record``): the inference worker reserves the key's
        quota from it at each turn (fleet/worker/keyquotas.py) and its turns count under that key
        in the usage ledger."""
        ref = job_ref(caller.project, job.id)
        return key_tag(self.live.settings, ref, key_label(caller.key_id))

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A blocking call (Redis, /tokenize) off the event loop."""
        return await _off_loop(self.executor, fn, *args, **kwargs)

    async def run_batch(self, project: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A blocking call of a project's batch routes, on their own threads
        (``gateway.batch_threads``), so however much batch work waits, chat's threads stay free;
        one of the project's batch calls (``hold_batch_call``) until its thread is done with it
        (or it is dropped unstarted), not until its client goes: a client that disconnects
        frees nothing early."""
        release = self.hold_batch_call(project)
        try:
            future = self.batch_executor.submit(fn, *args, **kwargs)
        except BaseException:
            release()
            raise
        future.add_done_callback(lambda _: release())
        return await asyncio.wrap_future(future)

    def hold_batch_call(self, project: str) -> Callable[[], None]:
        """Take one of the project's batch calls: at most ``gateway.batch_calls_per_project`` at
        a time in this gateway process (Busy, 429 ``E_BUSY``, past it), so no project can hold
        every batch thread or queue work without bound. The count is the process's own: each
        gateway process admits that many. Returns the call that gives it back (once)."""
        limit = self.live.settings.gateway.batch_calls_per_project
        with self._batch_lock:
            held = self._batch_calls.get(project, 0)
            if held >= limit:
                raise Busy(f"batches: {held} batch calls of this project are in flight, "
                           f"gateway.batch_calls_per_project is {limit}; try again shortly",
                           retry_after_s=BUSY_RETRY_AFTER_S)
            self._batch_calls[project] = held + 1

        def release() -> None:
            with self._batch_lock:
                left = self._batch_calls[project] - 1
                if left:
                    self._batch_calls[project] = left
                else:
                    del self._batch_calls[project]

        return release

    async def run_held(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A blocking step of a batch call already held (``hold_batch_call``), on the batch
        threads: a result file's download is one batch call over all its chunks."""
        return await _off_loop(self.batch_executor, fn, *args, **kwargs)

    def retry_budget(self, project: str) -> RetryBudget:
        if project not in self._budgets:
            self._budgets[project] = RetryBudget(self.runtime.redis, self.runtime.keys, project,
                                                 self.live.settings.retry.budget_ratio)
        return self._budgets[project]

    def caller(self, authorization: str | None) -> Caller:
        return self.live.current().caller(authorization)

    async def close(self) -> None:
        await self.events.close()
        await self.aredis.aclose()
        for executor in (self.executor, self.batch_executor, self.streams):
            executor.shutdown(wait=False, cancel_futures=True)
        for client in self.runtime.backend_clients():
            client.close()
        for counter in self._counters.values():
            counter.close()

    def counter_for(self, entry: BackendSettings) -> TokenCounter:
        """The token counter of backend ``entry`` (made on first use): its ``/tokenize`` with
        ``gateway.exact_prompt_count``, else the estimate."""
        with self._counters_lock:
            counter = self._counters.get(entry.name)
            if counter is None:
                url = entry.url if self.live.settings.gateway.exact_prompt_count else ""
                counter = self._counters[entry.name] = TokenCounter(url, entry.model, None, self.runtime.keys)
            return counter

    def build_body(self, req: ChatRequest, caller: Caller, job_id: str) -> Built:
        """The vLLM request body of one chat request, its prompt and max tokens, and its
        warnings (tools removed)."""
        project, rt = caller.settings, self.runtime
        fleet_settings = self.live.settings.model_copy(
            update={"backends": rt.settings.backends, "backend": rt.settings.backend})
        # Built against the largest backend of its model (fleet/core/routing.py ``route``), with
        # the backends this process started with: its store and its backend clients know those
        # (a reload that changes [[backends]] needs a restart, docs/backends.md).
        settings = fleet_settings.on_backend(routing.route(fleet_settings, project, req.model).name)
        job = req.to_job(job_id, caller.project, caller.band).model_copy(update={"allow_trim": False})
        sampling = req.passthrough()
        switches = template_kwargs(req.chat_template_kwargs, settings.gateway.chat_template_kwargs,
                                   job.untrusted)
        if switches:  # true/false switches only: they render no text worth counting
            sampling["chat_template_kwargs"] = switches
        first = plan_budget(job, project, settings, 0)
        try:
            counter = self.counter_for(routing.counting_backend(fleet_settings, project, req.model))
            prepared = prepare(job, settings, project, rt.redis, rt.keys, first.room_tokens, counter)
        except PromptTooLong as exc:
            raise chat_too_long(exc, settings.backend.max_model_len, first.max_tokens) from exc
        plan = plan_budget(job, project, settings, prepared.prompt_tokens)
        ready = job.model_copy(update={"messages": prepared.messages})
        messages, _ = build_request_messages(ready, prepared.fence_tag)
        tools, tool_choice, warnings = tools_allowed(ready, project)
        max_tokens = plan.max_tokens
        body = request_body(job_id, 1, messages, max_tokens=max_tokens,
                            thinking_budget=plan.thinking_budget, seed=req.seed,
                            temperature=base_temperature(req.temperature),
                            cache_salt=cache_salt(settings, caller.project), sampling=sampling,
                            response_format=response_format(job, project) or req.response_format,
                            tools=tools, tool_choice=tool_choice)
        mask = routing.eligible(fleet_settings, req.model, prepared.prompt_tokens + max_tokens)
        # what this project sent recently, per backend of the mask (fleet/prep/cachehint.py): the
        # uncached tokens the prefill limits count, and the backend that holds the prefix
        cache = estimate_routed(rt.redis, rt.keys, fleet_settings, caller.project, wire=body["messages"],
                                tools=body.get("tools"), salt=body["cache_salt"],
                                prompt_tokens=prepared.prompt_tokens, eligible=mask)
        return Built(body, prepared.prompt_tokens, max_tokens, warnings, mask, cache, prepared.fence_tag, plan)


def chat_too_long(exc: PromptTooLong, max_model_len: int, max_tokens: int) -> PromptTooLong:
    """Prep's refusal (written for jobs, which can allow trimming) as a chat client reads it: a
    conversation is never trimmed, so what is too long and what to send instead."""
    if exc.prompt_tokens is None or exc.room_tokens is None:
        return exc
    return PromptTooLong(
        f"the conversation is {exc.prompt_tokens} tokens (messages, tools and the project's system "
        f"prompt) but at most {exc.room_tokens} fit: the model's context is {max_model_len} tokens, "
        f"{max_tokens} of them kept for the reasoning and the answer. Shorten the conversation or "
        f"send fewer tools", param="messages")


class Built(NamedTuple):
    """What ``Gateway.build_body`` makes of a chat request."""

    body: dict[str, Any]
    prompt_tokens: int
    max_tokens: int
    warnings: list[str]
    eligible: int = 1  # the backends it may run on (fleet/core/routing.py ``eligible``)
    cache: CacheEstimate | None = None  # its expected prefix-cache misses and hint backend
    fence_tag: str | None = None  # the random tag marking its untrusted content (repeat cache key)
    plan: Plan | None = None  # its budget plan: what a continuation after a failover keeps to


async def _off_loop(executor: ThreadPoolExecutor, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.wrap_future(executor.submit(fn, *args, **kwargs))


def _error(exc: FleetError) -> JSONResponse:
    headers = {k.decode(): v.decode() for k, v in error_headers(exc)}
    return JSONResponse(error_body(exc.code, exc.message, exc.param), status_code=status_of(exc.code),
                        headers=headers)


def _authed(gw: Gateway, handler: Callable[[Request, Caller], Awaitable[Response]]
            ) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request, gw.caller(request.headers.get("authorization")))
        except redis.RedisError as exc:
            log.warning("%s %s: redis error %r", request.method, request.url.path, exc)
            return _error(redis_failure(exc))
        except BrokerUnavailable as exc:  # fleet.Client's: its message names the broker's URL
            log.warning("%s %s: %s", request.method, request.url.path, exc.message)
            return _error(broker_down(exc.__cause__))
        except FleetError as exc:
            log.info("%s %s code=%s", request.method, request.url.path, exc.code.value)
            return _error(exc)
    return endpoint


def _routes(gw: Gateway) -> list[Route | Mount]:
    tasks = TaskRoutes(gw)
    files = FileRoutes(gw)
    batches = BatchRoutes(gw)
    usage = UsageRoutes(gw)

    async def models(request: Request, caller: Caller) -> Response:
        """Every name every backend serves, once; ``root``: the name requests to it carry."""
        cards: dict[str, dict[str, object]] = {}
        for backend in gw.live.settings.backends:
            for name in backend.served_models:
                cards.setdefault(name, {
                    "id": name, "object": "model", "created": 0, "owned_by": "fleet",
                    "root": backend.model, "parent": None,
                    "max_model_len": backend.max_model_len, "permission": []})
        return JSONResponse({"object": "list", "data": list(cards.values())})

    async def health(request: Request) -> Response:
        """Ready: this process serves and its Redis answers a PING within HEALTH_TIMEOUT_S."""
        try:
            await asyncio.wait_for(gw.aredis.ping(), HEALTH_TIMEOUT_S)
        except (redis.RedisError, TimeoutError) as exc:
            return JSONResponse({"status": "unavailable", "redis": f"no answer ({type(exc).__name__})"},
                                status_code=503)
        return JSONResponse({"status": "ok", "redis": "ok"})

    async def livez(request: Request) -> Response:
        """Alive: the process answers HTTP, whatever Redis does (for a supervisor's restart check)."""
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        """Every project's figures: only for a metrics key (``gateway.metrics_keys``)."""
        try:
            gw.live.current().metrics_reader(request.headers.get("authorization"))
        except AuthError as exc:
            log.info("%s %s code=%s", request.method, request.url.path, exc.code.value)
            return _error(exc)
        return Response(gw.metrics.exposition(), media_type="text/plain; version=0.0.4")

    return [
        Route("/v1/chat/completions", ChatCompletions(gw), methods=["POST"]),
        Route("/v1/models", _authed(gw, models), methods=["GET"]),
        Route("/v1/tasks", _authed(gw, tasks.submit), methods=["POST"]),
        Route("/v1/tasks/{task_id}", _authed(gw, tasks.get), methods=["GET"]),
        Route("/v1/tasks/{task_id}", _authed(gw, tasks.cancel), methods=["DELETE"]),
        Route("/v1/tasks/{task_id}/events", _authed(gw, tasks.events), methods=["GET"]),
        Route("/v1/files", _authed(gw, files.upload), methods=["POST"]),
        Route("/v1/files", _authed(gw, files.list_files), methods=["GET"]),
        Route("/v1/files/{file_id}", _authed(gw, files.file), methods=["GET"]),
        Route("/v1/files/{file_id}", _authed(gw, files.delete_file), methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", _authed(gw, batches.content), methods=["GET"]),
        Route("/v1/batches", _authed(gw, batches.create), methods=["POST"]),
        Route("/v1/batches", _authed(gw, batches.list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", _authed(gw, batches.get), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", _authed(gw, batches.cancel), methods=["POST"]),
        Route("/v1/organization/usage/completions", _authed(gw, usage.completions), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/livez", livez, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors: an unknown route is 404 ``E_NOT_FOUND``, a known route with another
    method 405 ``E_INPUT_INVALID`` with ``Allow`` (the methods it takes)."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    code = {404: Code.E_NOT_FOUND, 405: Code.E_INPUT_INVALID}.get(status, Code.E_INTERNAL)
    body = error_body(code, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'error')}",
                      status=status)
    headers = {"Allow": _allowed(request)} if status == 405 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _allowed(request: Request) -> str:
    """Every method of the path (Starlette's own ``Allow`` names only the first route's, and
    ``/v1/files`` is two routes)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is Match.PARTIAL and isinstance(route, Route):
            methods |= route.methods or set()
    return ", ".join(sorted(methods))


async def _unexpected(request: Request, exc: Exception) -> Response:
    """A bug or a Redis failure still answers the error body with a code, never a bare 500."""
    log.error("%s %s failed: %r", request.method, request.url.path, exc)
    if isinstance(exc, redis.RedisError):
        return _error(redis_failure(exc))
    return JSONResponse(error_body(Code.E_INTERNAL, f"internal error: {type(exc).__name__}"),
                        status_code=500)


def create_app(gw: Gateway) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(gw.admission.listen(), name="grant-listener"),
                 asyncio.create_task(gw.events.run(), name="event-hub")]
        yield
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await gw.close()

    app = Starlette(routes=_routes(gw), lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _unexpected})
    # ``/v1/files/`` is 404 with a code like any unknown path, not a bare 307 to ``/v1/files``.
    app.router.redirect_slashes = False
    return app
