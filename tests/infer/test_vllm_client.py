"""The vLLM client: SSE parsing, stream assembly, error translation and the timeouts.

Parsing and error mapping run on ``httpx.MockTransport``; the timeouts and cancel run against a
raw HTTP server on a real socket (a thread in this process that writes scripted SSE bytes), so the
sliced reads, the expiry codes and the closing of the connection are exercised for real.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fleet.core.codes import Code
from fleet.core.config import TimeoutSettings
from fleet.core.errors import FleetError
from fleet.infer import vllm
from fleet.infer.sse import SseEvent, SseParser
from fleet.infer.vllm import Cancel, Delta, VllmClient

# -- helpers ------------------------------------------------------------------------------------


def sse(*chunks: Any, done: bool = True) -> bytes:
    out = b""
    for chunk in chunks:
        if isinstance(chunk, bytes):
            out += chunk
        else:
            out += b"data: " + json.dumps(chunk).encode() + b"\n\n"
    return out + (b"data: [DONE]\n\n" if done else b"")


def delta(finish: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "choices": [{"index": 0, "delta": fields, "finish_reason": finish}]}


def usage(prompt: int, completion: int, reasoning: int) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "completion_tokens_details": {"reasoning_tokens": reasoning}}}


def mock_client(handler: Any, **timeouts: float) -> VllmClient:
    return VllmClient("http://vllm.test", "local", transport=httpx.MockTransport(handler),
                      timeouts=TimeoutSettings(**timeouts))


def fixed(body: bytes, status: int = 200) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body,
                              headers={"content-type": "text/event-stream"})
    return handler


def run(client: VllmClient, body: dict[str, Any] | None = None,
        cancel: threading.Event | None = None, deadline: float | None = None,
        on_delta: Any = None) -> tuple[Any, list[Delta]]:
    seen: list[Delta] = []
    result = client.stream_chat(
        body or {"messages": [{"role": "user", "content": "hi"}]},
        on_delta or seen.append, cancel or threading.Event(), deadline)
    return result, seen


def code_of(fn: Any) -> tuple[Code, FleetError]:
    with pytest.raises(FleetError) as info:
        fn()
    return info.value.code, info.value


# -- SSE parser ---------------------------------------------------------------------------------


def test_parser_same_events_whatever_the_split() -> None:
    raw = (": keep-alive\r\n\r\ndata: {\"a\": \"é\"}\r\n\r\n"
           "data: line1\ndata: line2\n\ndata: [DONE]\n\n")
    data = raw.encode()
    expected = list(SseParser().feed(data))
    assert expected == [SseEvent(comment="keep-alive"), SseEvent(data='{"a": "é"}'),
                        SseEvent(data="line1\nline2"), SseEvent(data="[DONE]")]
    for cut in range(1, len(data)):
        parser = SseParser()
        events = list(parser.feed(data[:cut])) + list(parser.feed(data[cut:]))
        assert events + list(parser.close()) == expected, cut


def test_parser_keeps_an_unterminated_last_event() -> None:
    parser = SseParser()
    assert list(parser.feed(b"data: {}\n\ndata: tail")) == [SseEvent(data="{}")]
    assert list(parser.close()) == [SseEvent(data="tail")]


# Characters str.splitlines breaks on that are not SSE line ends; JSON encoders leave them raw.
NOT_LINE_ENDS = "\u2028\u2029\u0085\x0b\x0c\x1c\x1d\x1e"


def test_parser_ends_lines_only_at_cr_lf_crlf_whatever_the_split() -> None:
    text = json.dumps({"content": f"a{NOT_LINE_ENDS}b 日本語"}, ensure_ascii=False)
    raw = (f"data: {text}\r\r: keep-alive\rdata: x\rdata: y\r\n\r\n"
           f"data: {text}\n\ndata: [DONE]\r\n\r\n").encode()
    expected = [SseEvent(data=text), SseEvent(comment="keep-alive"), SseEvent(data="x\ny"),
                SseEvent(data=text), SseEvent(data="[DONE]")]
    assert list(SseParser().feed(raw)) == expected
    for cut in range(1, len(raw)):
        parser = SseParser()
        events = list(parser.feed(raw[:cut])) + list(parser.feed(raw[cut:]))
        assert events + list(parser.close()) == expected, cut


def test_cr_at_the_end_of_one_read_and_lf_at_the_start_of_the_next_is_one_line_end() -> None:
    parser = SseParser()
    events = [*parser.feed(b"data: one\r"), *parser.feed(b"\ndata: two\r"), *parser.feed(b"\n\r\n")]
    assert events == [SseEvent(data="one\ntwo")]


def test_stream_with_unicode_line_separators_in_the_json_arrives_intact() -> None:
    reasoning = f"think{NOT_LINE_ENDS}思考"
    answer = "answer\u2028line\u2029para\u0085end 日本語の答え"
    body = b"".join(
        b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
        for chunk in (delta(reasoning=reasoning), delta(content=answer), delta(finish="stop"))
    ) + b"data: [DONE]\n\n"
    result, _ = run(mock_client(fixed(body)))
    assert (result.reasoning, result.content, result.finish_reason) == (reasoning, answer, "stop")


# -- assembly -----------------------------------------------------------------------------------


def test_stream_assembles_reasoning_content_tools_and_usage() -> None:
    body = sse(
        delta(role="assistant", content=""),
        b": keep-alive\n\n",
        delta(reasoning="Let me "),
        delta(reasoning_content="think."),
        delta(reasoning="", content="Hello"),
        delta(tool_calls=[{"index": 1, "id": "call-b", "type": "function",
                           "function": {"name": "open_ticket"}}]),
        delta(tool_calls=[{"index": 0, "id": "call-a", "type": "function",
                           "function": {"name": "search_docs"}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": "{\"q\": "}}]),
        delta(tool_calls=[{"index": 1, "function": {"arguments": "{}"}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": "\"x\"}"}}]),
        delta(finish="tool_calls"),
        usage(10, 7, 2),
    )
    result, seen = run(mock_client(fixed(body)), {"messages": [], "thinking_token_budget": 5})
    assert result.reasoning == "Let me think."
    assert result.content == "Hello"
    assert result.finish_reason == "tool_calls"
    assert [c["id"] for c in result.tool_calls] == ["call-a", "call-b"]
    assert result.tool_calls[0]["function"] == {"name": "search_docs", "arguments": '{"q": "x"}'}
    assert result.tool_calls[1]["function"] == {"name": "open_ticket", "arguments": "{}"}
    assert result.usage["completion_tokens_details"]["reasoning_tokens"] == 2
    assert result.reasoning_tokens == 2 and result.prompt_tokens == 10
    assert result.thinking_forced is False
    assert result.first_token_s is not None
    assert any(d.keepalive for d in seen)
    assert "".join(d.reasoning for d in seen) == "Let me think."


def test_thinking_forced_when_reasoning_tokens_reach_the_budget() -> None:
    body = sse(delta(reasoning="a"), delta(reasoning="b"), delta(content="ok", finish="stop"),
               usage(3, 3, 2))
    result, _ = run(mock_client(fixed(body)), {"messages": [], "thinking_token_budget": 2})
    assert result.thinking_forced is True
    result, _ = run(mock_client(fixed(body)), {"messages": [], "thinking_token_budget": -1})
    assert result.thinking_forced is False


def test_request_carries_model_stream_options_and_request_id() -> None:
    captured: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        captured.append(request)
        return httpx.Response(200, content=sse(delta(content="x", finish="stop")))

    run(mock_client(handler), {"messages": [], "request_id": "job-1"})
    sent = json.loads(captured[0].content)
    assert sent["model"] == "local" and sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert captured[0].headers["x-request-id"] == "job-1"


# -- errors -------------------------------------------------------------------------------------


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": "X", "param": param,
                                 "code": status}}).encode()


@pytest.mark.parametrize(
    ("status", "param", "code"),
    [
        (400, "input_tokens", Code.E_PROMPT_TOO_LONG),
        (400, None, Code.E_UPSTREAM_REJECTED),
        (404, None, Code.E_UPSTREAM_REJECTED),
        (422, None, Code.E_UPSTREAM_REJECTED),
        (500, None, Code.E_UPSTREAM_ERROR),
        (502, None, Code.E_UPSTREAM_UNAVAILABLE),
        (503, None, Code.E_UPSTREAM_UNAVAILABLE),
        (504, None, Code.E_UPSTREAM_UNAVAILABLE),
    ],
)
def test_http_status_codes(status: int, param: str | None, code: Code) -> None:
    client = mock_client(fixed(error_body(status, "nope", param), status))
    got, error = code_of(lambda: run(client))
    assert got is code
    assert "nope" in error.message


def test_error_event_mid_stream_keeps_the_partial_result() -> None:
    body = sse(delta(reasoning="thinking"), {"error": {"message": "engine died", "code": 500}})
    got, error = code_of(lambda: run(mock_client(fixed(body))))
    assert got is Code.E_UPSTREAM_ERROR
    assert "engine died" in error.message
    assert error.partial.reasoning == "thinking"  # type: ignore[attr-defined]


def test_body_ending_without_done_is_a_dropped_stream() -> None:
    body = sse(delta(reasoning="half"), done=False)
    got, _ = code_of(lambda: run(mock_client(fixed(body))))
    assert got is Code.E_STREAM_DROPPED


def test_unparseable_chunk_is_an_upstream_error() -> None:
    got, _ = code_of(lambda: run(mock_client(fixed(b"data: {not json\n\n"))))
    assert got is Code.E_UPSTREAM_ERROR


def test_transport_errors_are_translated() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectTimeout("slow", request=request)

    def drop(request: httpx.Request) -> httpx.Response:
        def body() -> Iterator[bytes]:
            yield sse(delta(reasoning="a"), done=False)
            raise httpx.RemoteProtocolError("peer closed connection", request=request)
        return httpx.Response(200, content=body())

    assert code_of(lambda: run(mock_client(refuse)))[0] is Code.E_UPSTREAM_UNAVAILABLE
    assert code_of(lambda: run(mock_client(slow)))[0] is Code.E_CONNECT_TIMEOUT
    got, error = code_of(lambda: run(mock_client(drop)))
    assert got is Code.E_STREAM_DROPPED
    assert error.partial.reasoning == "a"  # type: ignore[attr-defined]


def test_cancel_and_callback_errors_stop_the_stream() -> None:
    body = sse(*[delta(reasoning=f"r{i} ") for i in range(20)], delta(content="x", finish="stop"))
    cancel = threading.Event()
    seen: list[Delta] = []

    def cancel_after_three(d: Delta) -> None:
        seen.append(d)
        if len(seen) == 3:
            cancel.set()

    got, _ = code_of(lambda: run(mock_client(fixed(body)), cancel=cancel,
                                 on_delta=cancel_after_three))
    assert got is Code.E_CANCELLED and len(seen) == 3

    class Stop(Exception):
        pass

    def stop(d: Delta) -> None:
        raise Stop

    with pytest.raises(Stop) as info:
        run(mock_client(fixed(body)), on_delta=stop)
    assert info.value.partial.reasoning == "r0 "  # type: ignore[attr-defined]


def test_plain_endpoints() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            sent = json.loads(request.content)
            assert sent["add_generation_prompt"] is True and sent["tools"]
            return httpx.Response(200, json={"count": 42, "max_model_len": 100, "tokens": []})
        if request.url.path == "/metrics":
            return httpx.Response(200, text="vllm:num_requests_running 3\n")
        return httpx.Response(503)

    client = mock_client(handler)
    assert client.tokenize([{"role": "user", "content": "x"}], tools=[{"type": "function"}]) == 42
    assert "num_requests_running" in client.metrics_text()
    assert client.health() is False


# -- timeouts on a real socket ------------------------------------------------------------------

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class ScriptedServer:
    """Answers one request with scripted steps: ("send", bytes) or ("wait", seconds)."""

    def __init__(self, steps: list[tuple[str, Any]]) -> None:
        self.steps = steps
        self.closed_by_client = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            while len(body) < length:
                body += conn.recv(65536)
            try:
                for kind, value in self.steps:
                    if kind == "send":
                        conn.sendall(value)
                    elif self._client_closed(conn, value):
                        break
                else:
                    self._client_closed(conn, 10)
            except OSError:
                self.closed_by_client.set()
        self.sock.close()

    def _client_closed(self, conn: socket.socket, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for the client to hang up (recv gives b"")."""
        conn.settimeout(wait_s)
        try:
            if conn.recv(65536) == b"":
                self.closed_by_client.set()
                return True
        except TimeoutError:
            pass
        return False

    def client(self, **timeouts: float) -> VllmClient:
        return VllmClient(f"http://127.0.0.1:{self.port}", "local",
                          timeouts=TimeoutSettings(**timeouts))


def event_bytes(obj: Any) -> bytes:
    return chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")


def test_first_token_timeout_even_when_the_server_sends_nothing() -> None:
    server = ScriptedServer([("send", HEAD), ("send", event_bytes(delta(role="assistant"))),
                             ("wait", 5)])
    got, _ = code_of(lambda: run(server.client(first_token_s=0.4, idle_s=30)))
    assert got is Code.E_FIRST_TOKEN_TIMEOUT
    assert server.closed_by_client.wait(5)


def test_idle_gap_after_the_first_token_is_a_stall() -> None:
    server = ScriptedServer([("send", HEAD), ("send", event_bytes(delta(reasoning="a"))),
                             ("send", chunk(b": keep-alive\n\n")), ("wait", 5)])
    got, error = code_of(lambda: run(server.client(first_token_s=30, idle_s=0.4)))
    assert got is Code.E_STREAM_STALLED
    assert error.partial.reasoning == "a"  # type: ignore[attr-defined]
    assert server.closed_by_client.wait(5)


def test_attempt_total_and_job_deadline() -> None:
    trickle: list[tuple[str, Any]] = [("send", HEAD)]
    for _ in range(40):
        trickle += [("send", event_bytes(delta(reasoning="x"))), ("wait", 0.05)]
    server = ScriptedServer(trickle)
    got, _ = code_of(lambda: run(server.client(first_token_s=30, idle_s=30, attempt_s=0.5)))
    assert got is Code.E_UPSTREAM_TIMEOUT
    assert server.closed_by_client.wait(5)

    server = ScriptedServer([("send", HEAD), ("wait", 5)])
    got, _ = code_of(lambda: run(server.client(), deadline=time.time() + 0.4))
    assert got is Code.E_DEADLINE
    assert server.closed_by_client.wait(5)


def test_cancel_wakes_a_blocked_read_and_closes_the_connection() -> None:
    server = ScriptedServer([("send", HEAD), ("send", event_bytes(delta(reasoning="a"))),
                             ("wait", 10)])
    cancel = threading.Event()

    def on_delta(d: Delta) -> None:
        if d.reasoning:
            threading.Timer(0.2, cancel.set).start()

    got, _ = code_of(lambda: run(server.client(first_token_s=60, idle_s=60), cancel=cancel,
                                 on_delta=on_delta))
    assert got is Code.E_CANCELLED
    assert server.closed_by_client.wait(5)


def test_a_cancel_event_ends_a_blocked_read_at_once_not_at_the_slice_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With slices of a minute, only the ``Cancel`` hook can end the read within the bound."""
    monkeypatch.setattr(vllm, "READ_SLICE_S", 60.0)
    server = ScriptedServer([("send", HEAD), ("send", event_bytes(delta(reasoning="a"))),
                             ("wait", 60)])
    cancel = Cancel()
    result: list[Code | None] = []

    def on_delta(d: Delta) -> None:
        if d.reasoning:
            threading.Timer(0.2, cancel.set).start()

    thread = threading.Thread(target=lambda: result.append(code_of(lambda: run(
        server.client(first_token_s=600, idle_s=600), cancel=cancel, on_delta=on_delta))[0]))
    thread.start()
    assert server.closed_by_client.wait(10)
    thread.join(10)
    assert result == [Code.E_CANCELLED]


def test_connection_refused_is_unavailable() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    client = VllmClient(f"http://127.0.0.1:{port}", "local")
    assert code_of(lambda: run(client))[0] is Code.E_UPSTREAM_UNAVAILABLE
    assert client.health() is False
