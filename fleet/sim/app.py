"""The simulator's ASGI app: vLLM's OpenAI-compatible routes plus a few ``/sim/*`` helpers.

vLLM routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (fleet/sim/completions.py),
``GET /v1/models``, ``GET /health``,
``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``, ``GET /load``.

Simulator-only routes (for the fleet's tests and benchmarks; a real vLLM has none of them):

- ``GET /sim/stats``: running, waiting, the peak running / waiting / long-prompt running counts
  since the last reset, totals (requests, finished, aborted, preemptions, tokens), time integrals
  (``running_seconds`` = integral of the running count over simulated time, ...), ``sim_time``
  (now, simulated) and ``engine_time`` (how far the engine has computed; token counters match it).
- ``POST /sim/reset``: zero those counters and peaks, the ``/K`` scenario counts and the request
  log; revive a dead engine. In-flight requests are not touched.
- ``POST /sim/kill``: the engine dies now (as the ``dead`` marker does: in-flight requests fail,
  ``/health`` answers 503, new requests get 500) until ``POST /sim/revive`` (or reset), which
  brings it back and keeps every count (so ``/K`` markers stay spent: jobs that come back after an
  outage are not hit by them again).
- ``GET /sim/ttft``: ``{"total", "seconds", "requests"}``: how many requests that produced a token
  have ended, and the simulated seconds from arrival to first token of the last 20,000 of them
  with their request ids (the server's
  own time to first token, as vLLM's histogram counts it, unrounded; cleared by a reset, the total
  not).
- ``GET /sim/requests?limit=N``: the last N chat and completion request bodies received (oldest
  first), each ``{"id", "received_at" (unix s), "sim_time", "body", "path"}`` and, once its prompt
  was counted, ``"prompt_tokens"`` and ``"blocks"`` (its whole blocks' chained hashes, equal for
  equal prompts in every simulator process); the log keeps 2,000.

A chat request goes: parse and validate (400/404) -> render the chat template and count tokens
(400 ``input_tokens`` if too long) -> scenario markers (500/503 answers, engine death) -> output
plan (seeded per request) -> engine sequence -> stream or one-shot writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleet.sim.completions import CompletionHandler
from fleet.sim.engine import Engine, Sequence
from fleet.sim.kvcache import block_hashes, note_prompt
from fleet.sim.metrics import SimMetrics
from fleet.sim.plan import LengthDistribution, RequestShape, build_plan, seeded
from fleet.sim.profiles import SimProfile
from fleet.sim.responses import Completion, FullWriter, StreamWriter
from fleet.sim.scenarios import MarkerError, ScenarioBook, breaking_of, chosen_tool, enact_refusals
from fleet.sim.template import message_text, render_chat
from fleet.sim.tokenizer import Tokenizer
from fleet.sim.validate import APIError, ChatRequest, error_body, parse_chat

log = logging.getLogger(__name__)
TTFT_SAMPLES = 20_000


REQUEST_LOG_SIZE = 2_000  # requests GET /sim/requests can give back


@dataclass
class SimConfig:
    profile: SimProfile
    speed: float = 1.0
    seed: int = 0
    fault_rate: float = 0.0
    long_threshold: int = 32_768
    lengths: LengthDistribution = field(default_factory=LengthDistribution)
    request_log_size: int = REQUEST_LOG_SIZE
    tick_real_s: float | None = None
    chat_template: str = "qwen3"


class SimState:
    """Everything one simulator instance owns; built by ``create_app``."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.profile = config.profile
        self.tokenizer = Tokenizer()
        self.engine = Engine(config.profile, config.speed, config.tick_real_s,
                             on_finish=self._on_finish)
        self.metrics = SimMetrics(self.engine, config.profile.served_model_names[0])
        self.scenarios = ScenarioBook(config.seed, config.fault_rate)
        self.requests: deque[dict[str, Any]] = deque(maxlen=config.request_log_size)
        self.started = int(time.time())
        # simulated seconds from arrival to first token of the requests that ended (GET /sim/ttft)
        self.ttfts: deque[tuple[str, float]] = deque(maxlen=TTFT_SAMPLES)
        self.ttft_total = 0

    def _on_finish(self, seq: Sequence) -> None:
        self.metrics.observe_finished(seq)
        if seq.first_token_t is not None:
            self.ttfts.append((seq.request_id, seq.first_token_t - seq.arrival_t))
            self.ttft_total += 1

    def reset(self) -> None:
        self.engine.reset_stats()
        self.engine.revive()
        self.metrics = SimMetrics(self.engine, self.profile.served_model_names[0])
        self.scenarios.reset()
        self.requests.clear()
        self.ttfts.clear()


def _json_error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None


def _request_id(request: Request, body: Any) -> str:
    header = request.headers.get("x-request-id")
    if header:
        return header
    if isinstance(body, dict) and isinstance(body.get("request_id"), str):
        return str(body["request_id"])
    return uuid.uuid4().hex


def _user_texts(messages: list[dict[str, Any]]) -> tuple[str, str]:
    users = [message_text(m.get("content")) for m in messages if m.get("role") == "user"]
    return (users[0], users[-1]) if users else ("", "")


def _rng(seed: int, req: ChatRequest) -> random.Random:
    return seeded(seed, [req.body.get("seed"), req.messages, req.tools, req.response_format,
                         req.thinking])


class ChatHandler:
    def __init__(self, state: SimState) -> None:
        self.s = state

    async def __call__(self, request: Request) -> Any:
        try:
            body = await _read_json(request)
            rid = _request_id(request, body)
            self.s.requests.append({"id": rid, "received_at": time.time(),
                                    "sim_time": self.s.engine.sim_now(), "body": body,
                                    "path": "/v1/chat/completions"})
            return self.accept(parse_chat(body, self.s.profile.served_model_names), rid)
        except APIError as exc:
            log.info("sim: refused request: %d %s", exc.status, exc.message)
            return _json_error(exc)

    def _prompt(self, req: ChatRequest, pad: int) -> tuple[list[int], int]:
        text = render_chat(req.messages, req.tools, True, req.thinking, self.s.config.chat_template)
        ids = self.s.tokenizer.encode(text)
        prompt_len = len(ids) + pad
        limit = self.s.profile.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                           f"your request has {prompt_len} input tokens. Please reduce the length "
                           "of the input messages.", "input_tokens")
        return ids, prompt_len

    def accept(self, req: ChatRequest, rid: str) -> Any:
        first, last = _user_texts(req.messages)
        try:
            scenario = self.s.scenarios.resolve(last, first)
        except MarkerError as exc:
            raise APIError(400, str(exc), "messages") from exc
        ids, prompt_len = self._prompt(req, scenario.integer("prompt_pad") or 0)
        enact_refusals(scenario, self.s.engine)
        room = self.s.profile.max_model_len - prompt_len
        max_tokens = room if req.max_tokens is None else min(room, req.max_tokens)
        shape = RequestShape(max_tokens, req.thinking, req.budget, req.response_format,
                             chosen_tool(req.tools, req.tool_choice, scenario))
        plan = build_plan(shape, scenario, _rng(self.s.config.seed, req), self.s.config.lengths)
        hashes = block_hashes(ids, self.s.profile.block_tokens, req.cache_salt)
        note_prompt(self.s.requests, rid, prompt_len, hashes)
        seq = Sequence(
            request_id=rid, prompt_len=prompt_len, hashes=hashes, total=plan.total,
            finish_reason=plan.finish_reason, long=prompt_len > self.s.config.long_threshold,
            slow_first_s=scenario.number("slow_first_token"), stall_at=plan.stall_at,
            stall_s=scenario.number("stall"))
        self.s.engine.submit(seq)
        completion = Completion(self.s.engine, seq, plan, f"chatcmpl-{rid}", int(time.time()),
                                req.model, req.include_usage, breaking_of(scenario), req.continuous_usage,
                                crash_s=scenario.number("crash", math.inf))
        return StreamWriter(completion) if req.stream else FullWriter(completion)



def _routes(state: SimState) -> list[Route]:
    s = state
    served = s.profile.served_model_names

    async def completions(request: Request) -> Any:
        try:
            body = await _read_json(request)
            rid = _request_id(request, body)
            s.requests.append({"id": rid, "received_at": time.time(), "sim_time": s.engine.sim_now(),
                               "body": body, "path": "/v1/completions"})
            return CompletionHandler(s).accept(body, rid)
        except APIError as exc:
            log.info("sim: refused completion request: %d %s", exc.status, exc.message)
            return _json_error(exc)

    async def models(request: Request) -> Response:
        # vLLM lists one card per --served-model-name, all of the one model
        cards = [{"id": name, "object": "model", "created": s.started, "owned_by": "vllm",
                  "root": f"sim/{s.profile.name}", "parent": None,
                  "max_model_len": s.profile.max_model_len} for name in served]
        return JSONResponse({"object": "list", "data": cards})

    async def health(request: Request) -> Response:
        return Response(status_code=503 if s.engine.dead else 200)

    async def tokenize(request: Request) -> Response:
        try:
            body = await _read_json(request)
            text = _tokenize_text(body, s.config.chat_template)
        except APIError as exc:
            return _json_error(exc)
        ids = s.tokenizer.encode(text)
        return JSONResponse({"count": len(ids), "max_model_len": s.profile.max_model_len,
                             "tokens": ids, "token_strs": None})

    async def detokenize(request: Request) -> Response:
        try:
            body = await _read_json(request)
        except APIError as exc:
            return _json_error(exc)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return JSONResponse(error_body(400, "tokens must be a list of integers", "tokens"),
                                status_code=400)
        return JSONResponse({"prompt": s.tokenizer.decode(tokens)})

    async def metrics(request: Request) -> Response:
        return Response(s.metrics.render(), media_type="text/plain; version=0.0.4")

    async def load(request: Request) -> Response:
        return JSONResponse({"server_load": len(s.engine.running) + len(s.engine.waiting)})

    return [
        Route("/v1/chat/completions", ChatHandler(s).__call__, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", metrics),
        Route("/load", load),
        *_sim_routes(s),
    ]


def _sim_routes(s: SimState) -> list[Route]:
    async def stats(request: Request) -> Response:
        return JSONResponse(sim_stats(s))

    async def reset(request: Request) -> Response:
        s.reset()
        return JSONResponse({"ok": True})

    async def kill(request: Request) -> Response:
        s.engine.kill(float("inf"))
        return JSONResponse({"ok": True})

    async def revive(request: Request) -> Response:
        s.engine.revive()
        return JSONResponse({"ok": True})

    async def ttft(request: Request) -> Response:
        return JSONResponse({"total": s.ttft_total, "seconds": [t for _, t in s.ttfts],
                             "requests": [rid for rid, _ in s.ttfts]})

    async def requests_log(request: Request) -> Response:
        limit = int(request.query_params.get("limit", "100"))
        items = list(s.requests)[-limit:] if limit > 0 else []
        return JSONResponse({"requests": items})

    return [
        Route("/sim/stats", stats),
        Route("/sim/reset", reset, methods=["POST"]),
        Route("/sim/kill", kill, methods=["POST"]),
        Route("/sim/revive", revive, methods=["POST"]),
        Route("/sim/requests", requests_log),
        Route("/sim/ttft", ttft),
    ]


def _tokenize_text(body: Any, template: str) -> str:
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    if isinstance(body.get("prompt"), str):
        return str(body["prompt"])
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise APIError(400, "either prompt or messages is required", "prompt")
    kwargs = body.get("chat_template_kwargs") or {}
    return render_chat(messages, body.get("tools") or None,
                       bool(body.get("add_generation_prompt", True)),
                       kwargs.get("enable_thinking", True) is not False, template)


def sim_stats(s: SimState) -> dict[str, Any]:
    e, st = s.engine, s.engine.stats
    return {
        "running": len(e.running), "waiting": len(e.waiting),
        "long_running": sum(1 for q in e.running if q.long),
        "max_running_seen": st.max_running_seen, "max_waiting_seen": st.max_waiting_seen,
        "max_long_running_seen": st.max_long_running_seen,
        "total_requests": st.total_requests, "finished": st.finished, "aborted": st.aborted,
        "failed": st.failed, "preemptions": st.preemptions,
        "prompt_tokens": st.prompt_tokens, "generation_tokens": st.generation_tokens,
        "prefill_tokens": st.prefill_tokens,
        "prefix_cache_queries": e.cache.queries, "prefix_cache_hits": e.cache.hits,
        "kv_blocks_used": e.pool.used, "kv_blocks_total": e.pool.total,
        "kv_cache_usage": e.kv_usage,
        "running_seconds": st.running_seconds, "waiting_seconds": st.waiting_seconds,
        "busy_seconds": st.busy_seconds, "finished_by_reason": dict(st.finished_by_reason),
        "sim_time": e.sim_now(), "engine_time": e.t, "speed": e.speed, "dead": e.dead,
        "long_threshold": s.config.long_threshold,
    }


def create_app(config: SimConfig) -> Starlette:
    state = SimState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(state.engine.run(), name="sim-engine")
        log.info("sim: profile %s, speed %.1f, seed %d", config.profile.name, config.speed,
                 config.seed)
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = Starlette(routes=_routes(state), lifespan=lifespan)
    app.state.sim = state
    return app
