"""The OpenAI/vLLM wire format of the gateway: the chat request it accepts, the chunks and bodies it
answers with, and its error body.

Shapes follow vLLM's OpenAI-compatible server (docs/vllm-api.md): reasoning goes in the delta's
``reasoning`` field (and also in ``reasoning_content`` when ``gateway.reasoning_content`` is on);
the first chunk is ``{"role": "assistant", "content": ""}``; the last carries the
``finish_reason``; a usage chunk with ``choices: []`` follows when ``stream_options.include_usage``;
then ``data: [DONE]``. Errors are vLLM's body ``{"error": {"message", "type", "param", "code"}}``
with one difference: ``code`` is the fleet's message code (``E_AUTH``, ``E_QUEUE_TIMEOUT``...), a
string as in OpenAI's own API, where vLLM repeats the HTTP status. Mid-stream the same body is a
``data:`` event followed by ``[DONE]``, HTTP status still 200.

OpenAI fields clients send by default are accepted (``parse_chat``): identifiers and hints with no
effect on the answer are dropped (``IGNORED``), sampling fields vLLM honours go through
(``PASSTHROUGH``), and a field the gateway cannot honour is accepted only at its neutral value
(``NEUTRAL``: ``logprobs: false``, ``store: false``, ``modalities: ["text"]``...); any other value is
400 ``E_INPUT_INVALID`` with ``param`` naming the field and the message saying why. A field the
gateway does not know at all (a typo such as ``temprature``), ``n`` other than 1, or messages the
fleet's ``Message`` refuses are 400 ``E_INPUT_INVALID`` too; the ``untrusted`` flag on a message is
the fleet's, as on the queue path. ``loop_retry`` is the gateway's own option (docs/gateway.md).
Every refusal names its field in ``param`` as OpenAI does (``messages.1.content``); types are
strict (a boolean is no number); ``tool_choice`` ``"required"`` or a named function without
``tools`` is refused, as vLLM refuses it.

A list (files, batches) is read a page at a time with OpenAI's cursor: ``paging`` reads a list
request's ``after``, ``limit`` and ``order``, ``list_body`` answers one page.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Literal

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from fleet.core.codes import Code
from fleet.core.errors import BrokerUnavailable, FleetError, InputInvalid, TooLarge
from fleet.core.limits import NestedTooDeep, loads
from fleet.core.models import Band, Job, Message, describe_invalid
from fleet.core.redisconn import UNAVAILABLE
from schedulers.policy.quota import Remaining

LIST_LIMIT = 20  # a list's page when the request sets no limit
# Sampling fields sent on to vLLM unchanged when the client sets them. ``chat_template_kwargs``
# is not one: it can carry text into the template, so the gateway sends only its allowed switches
# (fleet/core/request.py ``template_kwargs``).
PASSTHROUGH = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "stop", "parallel_tool_calls",
               "logit_bias", "reasoning_effort", "min_tokens", "stop_token_ids")
# Identifiers and hints that do not change the answer: accepted and dropped.
IGNORED = frozenset({"user", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                     "verbosity", "store_options"})
# Fields the gateway cannot honour: accepted at their neutral value (or null), refused otherwise.
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "logprobs": ((False,), "the gateway does not return log probabilities"),
    "top_logprobs": ((0,), "the gateway does not return log probabilities"),
    "store": ((False,), "the gateway keeps no completions (chats are not stored)"),
    "modalities": ((["text"],), "the fleet's model answers text only"),
    "audio": ((), "the fleet's model answers text only"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "the fleet has no web search"),
    "functions": ((), "the deprecated functions field is not supported; send tools"),
    "function_call": ((), "the deprecated function_call field is not supported; send tool_choice"),
}

HTTP_STATUS: dict[Code, int] = {
    Code.E_INPUT_INVALID: 400,
    Code.E_PROMPT_TOO_LONG: 400,
    Code.E_UPSTREAM_REJECTED: 400,
    Code.E_TOOL_REJECTED: 400,
    Code.E_AUTH: 401,
    Code.E_NOT_FOUND: 404,
    Code.E_TOO_LARGE: 413,
    Code.E_QUEUE_TIMEOUT: 429,
    Code.E_BUSY: 429,
    Code.E_QUOTA_EXCEEDED: 429,
    Code.E_CANCELLED: 499,
    Code.E_UPSTREAM_UNAVAILABLE: 503,
    Code.E_BROKER_UNAVAILABLE: 503,
    Code.E_CONNECT_TIMEOUT: 504,
    Code.E_FIRST_TOKEN_TIMEOUT: 504,
    Code.E_UPSTREAM_TIMEOUT: 504,
    Code.E_STREAM_STALLED: 504,
    Code.E_DEADLINE: 504,
}
# A Redis restart with its append-only file takes seconds: the hint for a request that met one.
BROKER_RETRY_AFTER_S = 5
ERROR_TYPE = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
              405: "MethodNotAllowedError", 413: "RequestTooLargeError",
              429: "RateLimitError", 499: "CancelledError", 503: "ServiceUnavailableError",
              504: "TimeoutError"}


class ChatRequest(BaseModel):
    # strict: a boolean is not a number (``max_tokens: true`` is refused, not read as 1)
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    thinking_token_budget: int | None = Field(None, ge=-1)
    temperature: float | None = Field(None, ge=0, le=2)
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    n: Literal[1] = 1
    loop_retry: bool = False  # the gateway's own: retry a loop cut before any content was sent
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    reasoning_effort: str | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    @property
    def max_total_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def passthrough(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in PASSTHROUGH if getattr(self, name) is not None}

    def to_job(self, job_id: str, project: str, band: Band) -> Job:
        """The fleet Job this request is, for request building and budget planning."""
        schema = None
        fmt = self.response_format or {}
        if fmt.get("type") == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
        try:
            return Job(id=job_id, project=project, messages=self.messages, band=band,
                       thinking_budget=self.thinking_token_budget, max_tokens=self.max_total_tokens,
                       response_schema=schema,
                       tools=self.tools, tool_choice=self.tool_choice,
                       temperature=self.temperature, seed=self.seed)
        except ValidationError as exc:
            raise invalid(exc) from exc


def invalid(exc: ValidationError) -> InputInvalid:
    """400 ``E_INPUT_INVALID`` naming each field at fault, ``param`` the first as OpenAI names it
    (``messages.1.content``)."""
    first = exc.errors()[0]["loc"] if exc.errors() else ()
    # pydantic adds the member of a union it tried ("str", "list[dict[str,any]]"): not a field
    names = [str(p) for p in first if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
    return InputInvalid(describe_invalid(exc), param=".".join(names) or None)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def json_object(raw: bytes, what: str = "a JSON object") -> dict[str, Any]:
    """A request body that must be one JSON object; InputInvalid (400) otherwise, also for one
    nested deeper than ``MAX_JSON_DEPTH`` (fleet/core/limits.py; ``param`` the field at fault)."""
    try:
        data = loads(raw)
    except NestedTooDeep as exc:
        raise InputInvalid(f"the request body is {exc}", param=exc.param) from None
    except ValueError as exc:
        raise InputInvalid(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InputInvalid(f"the request body must be {what}")
    return data


def parse_chat(raw: bytes) -> ChatRequest:
    data = json_object(raw)
    if data.get("stream_options") is not None and not data.get("stream"):
        raise InputInvalid("stream_options: only allowed when stream is true", param="stream_options")
    for name, (neutral, why) in NEUTRAL.items():
        value = data.pop(name, None)
        if value is not None and value not in neutral:
            allowed = " or ".join(json.dumps(v) for v in neutral) or "null"
            raise InputInvalid(f"{name}: {why}; send {allowed} or leave it out", param=name)
    for name in IGNORED:
        data.pop(name, None)
    try:
        req = ChatRequest.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc) from exc
    forcing = req.tool_choice == "required" or isinstance(req.tool_choice, dict)
    if forcing and not req.tools:  # vLLM refuses it too; "auto" and "none" mean nothing without tools
        raise InputInvalid("tool_choice: a required or named tool choice needs tools; send tools "
                           "or leave tool_choice out", param="tool_choice")
    return req


def status_of(code: Code) -> int:
    return HTTP_STATUS.get(code, 500)


def error_body(code: Code, message: str, param: str | None = None, status: int | None = None
               ) -> dict[str, Any]:
    """The error body of ``code`` (``status``: an HTTP status other than the code's own)."""
    status = status or status_of(code)
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "InternalServerError"),
                      "param": param, "code": code.value}}


def error_headers(exc: FleetError) -> list[tuple[bytes, bytes]]:
    """Headers an error answer carries beyond its body: ``Retry-After`` when asking again makes
    sense, the error's own hint (a queue wait, a busy project) or, when Redis is away, a few
    seconds."""
    seconds = exc.retry_after_s
    if seconds is None and exc.code is Code.E_BROKER_UNAVAILABLE:
        seconds = BROKER_RETRY_AFTER_S
    return [] if seconds is None else [(b"retry-after", str(seconds).encode())]


def ratelimit_headers(left: Remaining) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-*`` headers from what remains of the project's quota this minute
    (schedulers/policy/quota.py ``remaining``): the requests trio when it has requests_per_minute,
    the tokens trio when it has tokens_per_minute (its cost units); resets as OpenAI writes
    them ("12s")."""
    reset = f"{math.ceil(left.reset_s)}s".encode()
    out = []
    if left.limit_requests:
        out += [(b"x-ratelimit-limit-requests", str(left.limit_requests).encode()),
                (b"x-ratelimit-remaining-requests", str(left.remaining_requests).encode()),
                (b"x-ratelimit-reset-requests", reset)]
    if left.limit_tokens:
        out += [(b"x-ratelimit-limit-tokens", str(left.limit_tokens).encode()),
                (b"x-ratelimit-remaining-tokens", str(left.remaining_tokens).encode()),
                (b"x-ratelimit-reset-tokens", reset)]
    return out


WARNINGS_HEADER = b"x-fleet-warnings"
CODE_HEADER = b"x-fleet-code"


def code_header(code: Code) -> tuple[bytes, bytes]:
    """``X-Fleet-Code``: the fleet's code of a chat answer (``OK``, ``OK_TRUNCATED``, an error's)."""
    return CODE_HEADER, code.value.encode()


def warning_headers(warnings: list[str]) -> list[tuple[bytes, bytes]]:
    """``X-Fleet-Warnings``: what the gateway changed in a request (tools removed), one header
    joined by "; " (ASCII: a name outside it shows as "?"); none when it changed nothing."""
    if not warnings:
        return []
    return [(WARNINGS_HEADER, "; ".join(warnings).encode("ascii", "replace"))]


def redis_failure(exc: redis.RedisError) -> FleetError:
    """What a request that met a Redis error answers: 503 ``E_BROKER_UNAVAILABLE`` (Retry-After)
    when Redis cannot serve right now (fleet/core/redisconn.py ``UNAVAILABLE``: down, restarting,
    loading, a demoted master), 500 ``E_INTERNAL`` for anything else (a bug: a wrong command)."""
    if isinstance(exc, UNAVAILABLE):
        return broker_down(exc)
    return FleetError(f"the fleet's Redis failed: {type(exc).__name__}")


def broker_down(cause: BaseException | None) -> BrokerUnavailable:
    """503 ``E_BROKER_UNAVAILABLE`` as a client sees it: what failed, not where the broker is
    (``fleet.Client``'s own message names the broker URL, for operators)."""
    named = f" ({type(cause).__name__})" if cause is not None else ""
    return BrokerUnavailable(f"the fleet's Redis does not answer{named}; try again in a few seconds")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 ``E_TOO_LARGE`` past ``limit`` bytes
    (``gateway.max_body_bytes``): at once when Content-Length says so, else the moment the bytes
    received pass it, so an oversized body is never held whole, let alone parsed."""
    over = TooLarge(f"the request body is larger than gateway.max_body_bytes ({limit} bytes)")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise over
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise over
        chunks.append(chunk)
    return b"".join(chunks)


def paging(request: Request) -> tuple[str | None, int, bool]:
    """A list request's ``after``, ``limit`` (1 to 100) and order (newest first unless asc)."""
    query = request.query_params
    try:
        limit = int(query.get("limit", LIST_LIMIT))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InputInvalid("limit: an integer from 1 to 100", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InputInvalid('order: "asc" or "desc"', param="order")
    return query.get("after") or None, limit, order == "desc"


def list_body(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """One page of an OpenAI list (files, batches), with its cursor ids."""
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


class ChunkMaker:
    """``chat.completion.chunk`` frames of one completion."""

    def __init__(self, completion_id: str, model: str, reasoning_content: bool) -> None:
        self.completion_id = completion_id
        self.model = model
        self.created = int(time.time())
        self.reasoning_content = reasoning_content
        self.backend = ""  # the backend that finished the answer (after a failover: not the first)

    def _fleet(self, code: Code) -> dict[str, str]:
        """The answer's ``fleet`` field: its code, and the backend that finished it."""
        return {"code": code.value, "backend": self.backend} if self.backend else {"code": code.value}

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return sse({"id": self.completion_id, "object": "chat.completion.chunk",
                    "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish_reason}]})

    def role(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def delta(self, reasoning: str, content: str, tool_calls: list[dict[str, Any]]) -> bytes:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning"] = reasoning
            if self.reasoning_content:
                delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return self._chunk(delta)

    def finish(self, finish_reason: str | None, code: Code) -> bytes:
        """The chunk with the ``finish_reason``, and the fleet's code as ``fleet.code`` (an extra
        field SDKs keep: the ``openai`` SDK's ``chunk.model_extra``) with ``fleet.backend``, the
        backend that finished the answer (a stream's ``x-fleet-backend`` header went before a
        failover could move it)."""
        return sse({"id": self.completion_id, "object": "chat.completion.chunk",
                    "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                 "finish_reason": finish_reason or "stop"}],
                    "fleet": self._fleet(code)})

    def usage(self, usage: dict[str, Any], code: Code) -> bytes:
        """The usage chunk (``choices: []``), the last: the fleet's code on it too."""
        return sse({"id": self.completion_id, "object": "chat.completion.chunk",
                    "created": self.created, "model": self.model, "choices": [], "usage": usage,
                    "fleet": self._fleet(code)})

    def full(self, content: str, reasoning: str, tool_calls: list[dict[str, Any]],
             finish_reason: str | None, usage: dict[str, Any], code: Code) -> dict[str, Any]:
        """The non-streaming ``chat.completion`` body, the fleet's code as ``fleet.code``."""
        message: dict[str, Any] = {"role": "assistant", "content": content or None,
                                   "reasoning": reasoning or None, "tool_calls": tool_calls,
                                   "refusal": None}
        if self.reasoning_content:
            message["reasoning_content"] = reasoning or None
        return {"id": self.completion_id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": finish_reason or "stop"}],
                "usage": usage, "fleet": self._fleet(code)}
