"""Synchronous streaming client for vLLM's OpenAI-compatible server: the one boundary where httpx,
HTTP and vLLM errors become fleet errors (fleet/core/errors.py, one message code each).

Threads: the inference worker runs one thread per in-flight request (up to 32+ per process), so
the client is synchronous and thread-safe; one ``VllmClient`` (one httpx pool) serves them all.

Timeouts of one streamed attempt, each with its own code:
  connect         E_CONNECT_TIMEOUT       httpx connect timeout (``timeouts.connect_s``)
  first token     E_FIRST_TOKEN_TIMEOUT   request sent -> first reasoning/content/tool delta
  idle gap        E_STREAM_STALLED        after the first token, between two ``data:`` events
                                          (keep-alive comments do not count as progress)
  attempt total   E_UPSTREAM_TIMEOUT      the whole attempt (``timeouts.attempt_s``)
  job deadline    E_DEADLINE              ``deadline`` (unix seconds) passed to ``stream_chat``
  cancel          E_CANCELLED             the ``cancel`` event: at once when it is a ``Cancel``,
                                          else within READ_SLICE_S

httpx fixes a response's read timeout once per request, which cannot express "min(idle, remaining
first-token/total/deadline), recomputed per read" nor a cancel that wakes a blocked read. So the
default transport (``sliced_transport``) gives httpcore a network backend whose ``read`` waits in
slices of at most READ_SLICE_S, and between slices asks the stream's ``_StreamClock`` (found in a
thread-local: one thread streams one request at a time) which limit is nearest and whether cancel
is set. A slice that times out leaves the socket intact; a limit that expires raises the fleet
error from inside the read, httpcore closes the connection (it is mid-response, so it cannot be
reused) and vLLM aborts the sequence when it sees the disconnect. The same clock is also checked
between events, so an injected transport (``httpx.MockTransport`` in tests) gets every limit
except the wake-up of a blocked read.

A cancel should not wait for the slice to end (a client that left must free its slot at once).
When ``cancel`` is a ``Cancel`` (a ``threading.Event`` that runs hooks when set), the stream hooks
itself to it: setting it shuts the socket being read down, the blocked ``recv`` returns at once,
and the read raises ``Cancelled``. The hook is removed, under the clock's lock, before the
connection can go back to the pool, so a late cancel never touches a connection another request
then uses.

Errors raised by ``stream_chat`` carry ``exc.partial``: the ``StreamResult`` assembled so far (the
reasoning of an aborted attempt is what carry-over works from). Exceptions raised by ``on_delta``
(the loop watcher's verdict) close the stream the same way and propagate unchanged.

HTTP status mapping: 400/404/422 (and other 4xx) -> E_UPSTREAM_REJECTED, except a 400 with
``param: "input_tokens"`` -> E_PROMPT_TOO_LONG; 500 -> E_UPSTREAM_ERROR; 502/503/504/429 and
connection refused -> E_UPSTREAM_UNAVAILABLE. A ``{"error": ...}`` event mid-stream ->
E_UPSTREAM_ERROR. A body that ends without ``[DONE]``/finish_reason -> E_STREAM_DROPPED.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpcore
import httpx

from fleet.core.codes import Code
from fleet.core.config import TimeoutSettings
from fleet.core.errors import (
    Cancelled,
    DeadlineExceeded,
    FleetError,
    PromptTooLong,
    StreamDropped,
    UpstreamError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from fleet.infer.sse import SseEvent, iter_events

log = logging.getLogger(__name__)

READ_SLICE_S = 0.25
PLAIN_READ_TIMEOUT_S = 30.0

_local = threading.local()


@dataclass(frozen=True)
class Delta:
    """One parsed chunk. A ``keepalive`` delta carries nothing; it lets a watcher see the clock."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    keepalive: bool = False
    # the server's running counts so far, (reasoning, completion) tokens, when it sends them
    streamed: tuple[int, int] | None = None
    # answer text came that is held back (a continuation's tool call being written, fleet/infer/
    # hermes.py): progress for the stall watch, nothing to show yet
    held: bool = False


@dataclass
class StreamResult:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    first_token_s: float | None = None
    duration_s: float = 0.0
    thinking_forced: bool = False
    reasoning_deltas: int = 0
    content_deltas: int = 0
    response_id: str | None = None
    # the server's running counts (stream_options.continuous_usage_stats): completion tokens so
    # far, and of them those that came in reasoning chunks; None when it sends none
    streamed_tokens: int | None = None
    streamed_reasoning: int = 0
    # a continued reasoning (fleet/infer/resume.py): tokens of ``reasoning`` an earlier attempt
    # generated (not this one's, not in its usage); the prompt tokens its requests sent (the
    # prompt's figure while the usage is missing: a cut continuation); the chat prompt's tokens as
    # the server rendered it (what the prefix-cache record holds); whether the reasoning ended
    kept_tokens: int = 0
    sent_prompt_tokens: int | None = None
    rendered_prompt_tokens: int | None = None
    thought_ended: bool = False
    # the server answered 200 and the stream began: the request reached a working engine (an
    # engine already dead answers 500 first), so a failure after it may be this request's doing
    opened: bool = False

    @property
    def reasoning_tokens(self) -> int:
        """From the usage chunk; an aborted stream has none, so estimate (a delta carries at
        least one token, a token is about 4 characters)."""
        details = (self.usage or {}).get("completion_tokens_details") or {}
        value = details.get("reasoning_tokens")
        if value is not None:
            return int(value)
        if self.usage is None and self.streamed_tokens is not None:  # cut: the running count
            return self.streamed_reasoning
        return max(self.reasoning_deltas, round(len(self.reasoning) / 4))

    @property
    def completion_tokens(self) -> int:
        value = (self.usage or {}).get("completion_tokens")
        if value is not None:
            return int(value)
        if self.streamed_tokens is not None:
            return self.streamed_tokens
        return self.reasoning_tokens + max(self.content_deltas, round(len(self.content) / 4))

    @property
    def prompt_tokens(self) -> int | None:
        value = (self.usage or {}).get("prompt_tokens")
        return int(value) if value is not None else self.sent_prompt_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held (``prompt_tokens_details.cached_tokens``; 0 when
        the server does not report it)."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)


# -- timing -------------------------------------------------------------------------------------


class Cancel(threading.Event):
    """A ``threading.Event`` whose ``set`` also runs the hooks added to it (see module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self._hooks: list[Callable[[], None]] = []
        self._hooks_lock = threading.Lock()

    def hook(self, fn: Callable[[], None]) -> None:
        with self._hooks_lock:
            self._hooks.append(fn)

    def unhook(self, fn: Callable[[], None]) -> None:
        with self._hooks_lock:
            if fn in self._hooks:
                self._hooks.remove(fn)

    def set(self) -> None:
        super().set()
        with self._hooks_lock:
            hooks = list(self._hooks)
        for fn in hooks:
            fn()


class _StreamClock:
    """Which limit of one attempt is nearest, on a monotonic clock."""

    def __init__(
        self, timeouts: TimeoutSettings, cancel: threading.Event, deadline: float | None
    ) -> None:
        self.start = time.monotonic()
        self.timeouts = timeouts
        self.cancel = cancel
        self.deadline = None if deadline is None else self.start + (deadline - time.time())
        self.first_token_at: float | None = None
        self.last_event_at = self.start
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._attached = True  # False once the stream let go of its connection

    def reading(self, sock: socket.socket | None) -> None:
        """The socket the stream reads from now (a cancel shuts it down)."""
        with self._lock:
            if self._attached:
                self._socket = sock

    def wake(self) -> None:
        """The cancel hook: end a blocked read on the stream's socket at once."""
        with self._lock:
            if self._socket is not None:
                with contextlib.suppress(OSError):
                    self._socket.shutdown(socket.SHUT_RDWR)

    def detach(self) -> None:
        with self._lock:
            self._attached = False
            self._socket = None

    def remaining(self) -> tuple[float, Code]:
        """Seconds until the nearest limit and the code it would end with."""
        now = time.monotonic()
        t = self.timeouts
        if self.first_token_at is None:
            limits = [(self.start + t.first_token_s - now, Code.E_FIRST_TOKEN_TIMEOUT)]
        else:
            limits = [(self.last_event_at + t.idle_s - now, Code.E_STREAM_STALLED)]
        limits.append((self.start + t.attempt_s - now, Code.E_UPSTREAM_TIMEOUT))
        if self.deadline is not None:
            limits.append((self.deadline - now, Code.E_DEADLINE))
        return min(limits, key=lambda item: item[0])

    def check(self) -> float:
        """Raise the fleet error of an expired limit or a cancel; else seconds left."""
        if self.cancel.is_set():
            raise Cancelled("cancelled while streaming")
        left, code = self.remaining()
        if left <= 0:
            raise _expired(code, self)
        return left


class _CallClock(_StreamClock):
    """The one limit of a plain call (a tokenizer call of a continuation): its read timeout. The
    sliced reads ask it as they ask a stream's clock, so a cancel ends the call at once."""

    def __init__(self, timeouts: TimeoutSettings, cancel: threading.Event, limit_s: float) -> None:
        super().__init__(timeouts, cancel, None)
        self.limit_s = limit_s

    def remaining(self) -> tuple[float, Code]:
        return self.start + self.limit_s - time.monotonic(), Code.E_UPSTREAM_TIMEOUT

    def check(self) -> float:
        if self.cancel.is_set():
            raise Cancelled("cancelled while waiting for the server's reply")
        left = self.remaining()[0]
        if left <= 0:
            raise UpstreamTimeout(f"no reply within {self.limit_s:g} s", code=Code.E_UPSTREAM_TIMEOUT)
        return left


def _expired(code: Code, clock: _StreamClock) -> FleetError:
    elapsed = time.monotonic() - clock.start
    if code is Code.E_DEADLINE:
        return DeadlineExceeded(f"job deadline passed after {elapsed:.1f} s of streaming")
    what = {
        Code.E_FIRST_TOKEN_TIMEOUT: f"no first token within {clock.timeouts.first_token_s} s",
        Code.E_STREAM_STALLED: f"stream silent for {clock.timeouts.idle_s} s",
        Code.E_UPSTREAM_TIMEOUT: f"attempt ran past {clock.timeouts.attempt_s} s",
    }[code]
    return UpstreamTimeout(what, code=code)


# -- transport whose reads are sliced -----------------------------------------------------------


class _SlicedStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        clock: _StreamClock | None = getattr(_local, "clock", None)
        if clock is None:
            return self._inner.read(max_bytes, timeout)
        clock.reading(self._inner.get_extra_info("socket"))
        while True:
            left = clock.check()
            try:
                data = self._inner.read(max_bytes, min(left, READ_SLICE_S))
            except httpcore.ReadTimeout:
                continue  # only a slice ended; nothing was read, the socket is intact
            except httpcore.ReadError:
                clock.check()  # a socket shut down by a cancel is the cancel
                raise
            if not data:
                clock.check()
            return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, timeout)

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _SlicedStream(self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _SlicedBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None, socket_options: Any = None,
                    ) -> httpcore.NetworkStream:
        stream = self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _SlicedStream(stream)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> httpcore.NetworkStream:
        return _SlicedStream(self._inner.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def sliced_transport(max_connections: int = 256) -> httpx.HTTPTransport:
    """An ``httpx.HTTPTransport`` whose pool reads through ``_SlicedBackend`` (see module doc)."""
    transport = httpx.HTTPTransport()
    # httpx offers no public hook for the network backend; replacing its pool with one built
    # through httpcore's public constructor is the smallest way in.
    transport._pool = httpcore.ConnectionPool(
        max_connections=max_connections,
        max_keepalive_connections=max_connections // 2,
        keepalive_expiry=5.0,
        network_backend=_SlicedBackend(),
    )
    return transport


# -- error translation --------------------------------------------------------------------------


def _error_body(response: httpx.Response) -> tuple[str, str | None]:
    try:
        error = response.json().get("error") or {}
        return str(error.get("message") or response.text[:300]), error.get("param")
    except (ValueError, AttributeError):
        return response.text[:300], None


def http_error(response: httpx.Response) -> FleetError:
    """The fleet error for a non-200 answer (the body must have been read)."""
    status = response.status_code
    message, param = _error_body(response)
    text = f"HTTP {status}: {message}"
    if status == 400 and param == "input_tokens":
        return PromptTooLong(text)
    if status in (429, 502, 503, 504):
        return UpstreamUnavailable(text)
    if 400 <= status < 500:
        return UpstreamRejected(text)
    return UpstreamError(text)




def _ids(response: httpx.Response) -> list[int]:
    """The token ids of a ``/tokenize`` reply; UpstreamError for anything else."""
    try:
        return [int(t) for t in response.json()["tokens"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise UpstreamError(f"unexpected /tokenize reply: {response.text[:200]!r}") from exc


def translate(exc: httpx.HTTPError, streaming: bool) -> FleetError:
    """httpx's exception tree onto fleet codes. ``streaming``: the response headers were in."""
    if isinstance(exc, httpx.ConnectTimeout):
        return UpstreamTimeout(f"connect timeout: {exc}", code=Code.E_CONNECT_TIMEOUT)
    if isinstance(exc, httpx.ConnectError | httpx.PoolTimeout):
        return UpstreamUnavailable(f"cannot connect: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        code = Code.E_STREAM_STALLED if streaming else Code.E_FIRST_TOKEN_TIMEOUT
        return UpstreamTimeout(f"read timeout: {exc}", code=code)
    if isinstance(exc, httpx.TransportError):
        if streaming:
            return StreamDropped(f"connection dropped mid-stream: {exc!r}")
        return UpstreamUnavailable(f"connection closed before a response: {exc!r}")
    return UpstreamError(f"HTTP client error: {exc!r}")


# -- assembling a stream ------------------------------------------------------------------------


class _Assembler:
    """Turns parsed chunks into Deltas and the final StreamResult."""

    def __init__(self, thinking_budget: int | None, text_is: str | None = None) -> None:
        self.result = StreamResult()
        self._budget = thinking_budget
        self._text_is = text_is  # a text completion's chunks: their text is this kind
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._tools: dict[int, dict[str, Any]] = {}
        self.done = False

    def chunk(self, data: dict[str, Any]) -> Delta | None:
        if "error" in data:
            error = data["error"] if isinstance(data["error"], dict) else {"message": data["error"]}
            raise UpstreamError(f"error event mid-stream: {error.get('message', error)}")
        if data.get("id") and self.result.response_id is None:
            self.result.response_id = data["id"]
        choices = data.get("choices") or []
        usage = data.get("usage")
        if usage and not choices:  # the usage chunk, after the last choice
            self.result.usage = usage
        if not choices:
            return None
        choice = choices[0]
        delta = choice.get("delta") or {}
        if self._text_is is not None:
            delta = {self._text_is: choice.get("text") or ""}
        reasoning = delta.get("reasoning") or delta.get("reasoning_content") or ""
        content = delta.get("content") or ""
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):  # a running count
            before = self.result.streamed_tokens or 0
            self.result.streamed_tokens = max(before, usage["completion_tokens"])
            if reasoning:
                self.result.streamed_reasoning += self.result.streamed_tokens - before
        tools = delta.get("tool_calls") or []
        finish = choice.get("finish_reason")
        if reasoning:
            self._reasoning.append(reasoning)
            self.result.reasoning_deltas += 1
        if content:
            self._content.append(content)
            self.result.content_deltas += 1
        for call in tools:
            self._tool_delta(call)
        if finish:
            self.result.finish_reason = finish
        streamed = None if self.result.streamed_tokens is None else (self.result.streamed_reasoning,
                                                                      self.result.streamed_tokens)
        return Delta(reasoning=reasoning, content=content, tool_calls=tools, finish_reason=finish,
                     streamed=streamed)

    def _tool_delta(self, call: dict[str, Any]) -> None:
        index = int(call.get("index", len(self._tools)))
        slot = self._tools.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if call.get("id"):
            slot["id"] = call["id"]
        if call.get("type"):
            slot["type"] = call["type"]
        function = call.get("function") or {}
        if function.get("name"):
            slot["function"]["name"] += function["name"]
        if function.get("arguments"):
            slot["function"]["arguments"] += function["arguments"]

    def finish(self, start: float) -> StreamResult:
        result = self.result
        result.reasoning = "".join(self._reasoning)
        result.content = "".join(self._content)
        result.tool_calls = [self._tools[i] for i in sorted(self._tools)]
        result.duration_s = time.monotonic() - start
        if self._budget is not None and self._budget >= 0:
            result.thinking_forced = result.reasoning_tokens >= self._budget
        return result


# -- the client ---------------------------------------------------------------------------------


class VllmClient:
    """One backend. Thread-safe; share one instance per process."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str = "",
        transport: httpx.BaseTransport | None = None,
        timeouts: TimeoutSettings | None = None,
    ) -> None:
        self.model = model
        self.timeouts = timeouts or TimeoutSettings.model_validate({})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers=headers,
            transport=transport if transport is not None else sliced_transport(),
            timeout=httpx.Timeout(
                PLAIN_READ_TIMEOUT_S, connect=self.timeouts.connect_s, pool=self.timeouts.connect_s
            ),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VllmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- streaming ------------------------------------------------------------------------------
    def stream_chat(
        self,
        body: dict[str, Any],
        on_delta: Callable[[Delta], None],
        cancel: threading.Event,
        deadline: float | None = None,
    ) -> StreamResult:
        """Stream one chat completion. Raises a FleetError (with ``.partial``) on any failure."""
        budget = body.get("thinking_token_budget")
        return self._stream("/v1/chat/completions", body, _Assembler(budget if isinstance(budget, int) else None),
                            on_delta, cancel, deadline)

    def stream_completion(
        self,
        body: dict[str, Any],
        on_delta: Callable[[Delta], None],
        cancel: threading.Event,
        deadline: float | None = None,
        text_is: str = "content",
    ) -> StreamResult:
        """Stream one text completion (``POST /v1/completions``, a ``prompt`` of token ids): its
        text comes as ``reasoning`` or ``content`` deltas (``text_is``), since no reasoning
        parser runs on that route; limits, errors and ``.partial`` as ``stream_chat``."""
        return self._stream("/v1/completions", body, _Assembler(None, text_is), on_delta, cancel,
                            deadline)

    def _stream(self, path: str, body: dict[str, Any], assembler: _Assembler,
                on_delta: Callable[[Delta], None], cancel: threading.Event,
                deadline: float | None) -> StreamResult:
        body = {"model": self.model, **body, "stream": True}
        body.setdefault("stream_options", {"include_usage": True})
        headers = {"X-Request-Id": str(body["request_id"])} if body.get("request_id") else {}
        clock = _StreamClock(self.timeouts, cancel, deadline)
        _local.clock = clock
        if isinstance(cancel, Cancel):
            cancel.hook(clock.wake)
        streaming = False
        try:
            # The read timeout only matters for a transport without sliced reads (a backstop);
            # the sliced backend asks the clock instead.
            left = clock.check()
            timeout = httpx.Timeout(PLAIN_READ_TIMEOUT_S, connect=self.timeouts.connect_s,
                                    read=left, pool=self.timeouts.connect_s)
            with self._http.stream("POST", path, json=body, headers=headers, timeout=timeout) as response:
                try:
                    if response.status_code != 200:
                        response.read()
                        raise http_error(response)
                    streaming = assembler.result.opened = True
                    self._consume(response, assembler, clock, on_delta)
                finally:
                    clock.detach()  # before the connection can go back to the pool
            return assembler.finish(clock.start)
        except httpx.HTTPError as exc:
            error = translate(exc, streaming)
            error.partial = assembler.finish(clock.start)  # type: ignore[attr-defined]
            raise error from exc
        except Exception as exc:
            exc.partial = assembler.finish(clock.start)  # type: ignore[attr-defined]
            raise
        finally:
            clock.detach()
            if isinstance(cancel, Cancel):
                cancel.unhook(clock.wake)
            _local.clock = None

    def _consume(
        self,
        response: httpx.Response,
        assembler: _Assembler,
        clock: _StreamClock,
        on_delta: Callable[[Delta], None],
    ) -> None:
        for event in iter_events(response.iter_bytes()):
            clock.check()
            if event.comment is not None:
                on_delta(Delta(keepalive=True))
                continue
            clock.last_event_at = time.monotonic()
            if event.is_done:
                assembler.done = True
                return
            delta = self._parse(event, assembler)
            if delta is None:
                continue
            token = delta.reasoning or delta.content or delta.tool_calls
            if clock.first_token_at is None and token:
                clock.first_token_at = clock.last_event_at
                assembler.result.first_token_s = clock.first_token_at - clock.start
            on_delta(delta)
        if assembler.result.finish_reason is None:
            raise StreamDropped("the stream ended without a finish_reason or [DONE]")

    @staticmethod
    def _parse(event: SseEvent, assembler: _Assembler) -> Delta | None:
        try:
            data = json.loads(event.data or "")
        except ValueError as exc:
            raise UpstreamError(f"unparseable stream chunk: {str(event.data)[:200]!r}") from exc
        if not isinstance(data, dict):
            raise UpstreamError(f"unexpected stream chunk: {str(event.data)[:200]!r}")
        return assembler.chunk(data)

    # -- plain calls ----------------------------------------------------------------------------
    def _read_timeout(self, timeout_s: float | None) -> dict[str, Any]:
        """``_call``'s ``timeout`` for a call with a read timeout of its own (None: the client's):
        connecting keeps ``connect_s``."""
        if timeout_s is None:
            return {}
        connect = self.timeouts.connect_s
        return {"timeout": httpx.Timeout(max(timeout_s, 0.001), connect=connect, pool=connect)}

    def _call(self, method: str, path: str, cancel: threading.Event | None = None, limit_s: float | None = None,
              **kwargs: Any) -> httpx.Response:
        """One plain request. With ``cancel``, its reads go through a ``_CallClock`` of
        ``limit_s`` (else the plain read timeout): setting a ``Cancel`` ends a blocked read at
        once (any other event within a read slice), as it ends a stream's."""
        try:
            if cancel is None:
                response = self._http.request(method, path, **kwargs)
            else:
                response = self._cancellable(method, path, cancel, limit_s or PLAIN_READ_TIMEOUT_S, **kwargs)
        except httpx.HTTPError as exc:
            raise translate(exc, streaming=False) from exc
        if response.status_code != 200:
            raise http_error(response)
        return response

    def _cancellable(self, method: str, path: str, cancel: threading.Event, limit_s: float,
                     **kwargs: Any) -> httpx.Response:
        clock = _CallClock(self.timeouts, cancel, limit_s)
        previous, _local.clock = getattr(_local, "clock", None), clock
        if isinstance(cancel, Cancel):
            cancel.hook(clock.wake)
        try:
            clock.check()
            with self._http.stream(method, path, **kwargs) as response:
                try:
                    response.read()
                finally:
                    clock.detach()  # before the connection can go back to the pool
            return response
        finally:
            clock.detach()
            if isinstance(cancel, Cancel):
                cancel.unhook(clock.wake)
            _local.clock = previous

    def tokenize(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                 ) -> int:
        """Exact prompt tokens of a chat request, as vLLM's template counts them."""
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "add_generation_prompt": True}
        if tools:
            body["tools"] = tools
        return int(self._call("POST", "/tokenize", json=body).json()["count"])

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               timeout_s: float | None = None, cancel: threading.Event | None = None) -> list[int]:
        """The token ids of a chat request's prompt as the server's template renders it, up to
        and with the generation prompt (``POST /tokenize``). ``timeout_s``: the read timeout of
        this call (else the plain one); ``cancel`` ends it (``_call``)."""
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "add_generation_prompt": True}
        if tools:
            body["tools"] = tools
        return _ids(self._call("POST", "/tokenize", cancel, timeout_s, json=body, **self._read_timeout(timeout_s)))

    def encode(self, text: str, timeout_s: float | None = None, cancel: threading.Event | None = None) -> list[int]:
        """The token ids of plain ``text`` (no special tokens added)."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return _ids(self._call("POST", "/tokenize", cancel, timeout_s, json=body, **self._read_timeout(timeout_s)))

    def decode(self, tokens: list[int], timeout_s: float | None = None, cancel: threading.Event | None = None) -> str:
        response = self._call("POST", "/detokenize", cancel, timeout_s,
                              json={"model": self.model, "tokens": tokens}, **self._read_timeout(timeout_s))
        try:
            return str(response.json()["prompt"])
        except (ValueError, KeyError, TypeError) as exc:
            raise UpstreamError(f"unexpected /detokenize reply: {response.text[:200]!r}") from exc

    def metrics_text(self) -> str:
        return self._call("GET", "/metrics").text

    def health(self) -> bool:
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False
