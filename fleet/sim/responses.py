"""ASGI responses for chat completions: the SSE stream and the one-shot JSON answer.

Both are plain ASGI callables (not Starlette's StreamingResponse) because they need three things
Starlette does not give together: (1) notice a client disconnect while waiting for the engine, and
abort the sequence at once (a watcher task reads ``receive()`` for ``http.disconnect``); (2) close
the connection mid-body for the ``drop`` scenario (returning without finishing the body makes
uvicorn close the socket, so the client sees an incomplete chunked body, like a crash);
(3) write many small SSE frames in one ``send`` per engine tick.

Stream shape (docs/vllm-api.md): a first chunk ``delta: {"role": "assistant", "content": ""}``; then
``reasoning`` deltas, ``content`` deltas or hermes ``tool_calls`` deltas, at most a few tokens per
chunk (1 token per chunk at low speed, up to 8 when a tick carries many tokens); a last chunk with
``delta: {}`` and the ``finish_reason``; a usage chunk with ``choices: []`` when
``stream_options.include_usage``; ``data: [DONE]``. With ``stream_options.continuous_usage_stats``
every chunk also carries ``usage`` (prompt, completion and total tokens so far). An error after the stream started is
``data: {"error": {...}}`` then ``[DONE]``, HTTP status 200.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from fleet.sim.engine import Engine, SeqState, Sequence
from fleet.sim.plan import CONTENT, REASONING, TOOL_ARGS, TOOL_START, OutputCursor, OutputPlan
from fleet.sim.validate import error_body

log = logging.getLogger(__name__)
Scope = dict[str, Any]
MAX_TOKENS_PER_CHUNK = 8


@dataclass
class Completion:
    """Everything a writer needs about one accepted request."""

    engine: Engine
    seq: Sequence
    plan: OutputPlan
    completion_id: str
    created: int
    model: str
    include_usage: bool
    breaking: str | None = None  # "drop", "error_event" or "crash" (fleet/sim/scenarios.py)
    # stream_options.continuous_usage_stats: every chunk carries the usage so far (prompt,
    # completion and total tokens, as vLLM's running counts; the details only in the last chunk)
    continuous_usage: bool = False
    details: bool = True  # completion_tokens_details (the chat route's; not on /v1/completions)
    crash_s: float = math.inf  # how long a "crash" leaves the engine dead

    def end_half_way(self) -> None:
        """The stream's break: this sequence aborted, or for a crash the whole engine down."""
        if self.breaking == "crash":
            self.engine.kill(self.crash_s)
        else:
            self.engine.abort(self.seq)

    def usage(self) -> dict[str, Any]:
        generated = self.seq.generated
        usage: dict[str, Any] = {
            "prompt_tokens": self.seq.prompt_len,
            "completion_tokens": generated,
            "total_tokens": self.seq.prompt_len + generated,
            "prompt_tokens_details": {"cached_tokens": self.seq.cached_tokens},
        }
        if self.details:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": min(self.plan.reasoning_tokens, generated)}
        return usage


async def _watch_disconnect(receive: Any, engine: Engine, seq: Sequence) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if seq.active:
                log.info("sim: client disconnected, aborting %s", seq.request_id)
            engine.abort(seq)
            return


class _Writer:
    def __init__(self, c: Completion) -> None:
        self.c = c
        self.cursor = OutputCursor(c.plan)
        self.consumed = 0
        self.streamed = 0  # tokens written in chunks so far (continuous usage)
        self.calls_started = 0  # tool calls whose first delta was written (their index)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        watcher = asyncio.create_task(_watch_disconnect(receive, self.c.engine, self.c.seq))
        try:
            await self.respond(send)
        finally:
            watcher.cancel()
            self.c.engine.abort(self.c.seq)

    async def respond(self, send: Any) -> None:
        raise NotImplementedError

    async def next_tokens(self) -> int | None:
        """Wait for new tokens; their count, 0 at the end, None when the break point is reached."""
        seq = self.c.seq
        while seq.visible <= self.consumed and not seq.closed:
            seq.event.clear()
            await seq.event.wait()
        new = seq.visible - self.consumed
        stop = self.c.plan.break_at
        if self.c.breaking and stop is not None and self.consumed + new >= stop:
            return None
        return new


class StreamWriter(_Writer):
    OBJECT = "chat.completion.chunk"

    async def respond(self, send: Any) -> None:
        c = self.c
        head = (f'{{"id":"{c.completion_id}","object":"{self.OBJECT}",'
                f'"created":{c.created},"model":{json.dumps(c.model)},"choices":[{{"index":0,')
        self.head, self.tail = head, ',"logprobs":null,"finish_reason":null}]}\n\n'
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache")]})
        out = self._opening()
        while True:
            new = await self.next_tokens()
            if new is None:
                await self._break(send, out)
                return
            out.extend(self._frames(new))
            if self.c.seq.closed:
                break
            await send({"type": "http.response.body", "body": "".join(out).encode(),
                        "more_body": True})
            out = []
        if self.c.seq.state is SeqState.ABORTED:
            return
        if self.c.seq.state is SeqState.FAILED:
            out.append(_error_frame(500, "EngineCore encountered an issue (simulated death)."))
        else:
            out.append(self._finish_frame())
            if c.include_usage:
                out.append(self._usage_frame())
        out.append("data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": "".join(out).encode(),
                    "more_body": False})

    async def _break(self, send: Any, out: list[str]) -> None:
        stop = self.c.plan.break_at or 0
        out.extend(self._frames(stop - self.consumed))
        if self.c.breaking == "error_event":
            out.append(_error_frame(500, "Simulated engine error during generation."))
            out.append("data: [DONE]\n\n")
        log.info("sim: %s scenario for %s after %d tokens", self.c.breaking,
                 self.c.seq.request_id, stop)
        self.c.end_half_way()
        done = self.c.breaking == "error_event"
        await send({"type": "http.response.body", "body": "".join(out).encode(),
                    "more_body": not done})
        # drop: return without ending the body; uvicorn closes the connection.

    def _opening(self) -> list[str]:
        return [self._frame({"role": "assistant", "content": ""})]

    def _field(self, delta: dict[str, Any]) -> str:
        """The choice's payload: a chat chunk's ``delta``."""
        return '"delta":' + json.dumps(delta, ensure_ascii=False)

    def _frame(self, delta: dict[str, Any], tokens: int = 0) -> str:
        """One chunk; with continuous usage, the usage so far (``tokens`` more generated)."""
        self.streamed += tokens
        if not self.c.continuous_usage:
            return "data: " + self.head + self._field(delta) + self.tail
        prompt = self.c.seq.prompt_len
        usage = {"prompt_tokens": prompt, "completion_tokens": self.streamed, "total_tokens": prompt + self.streamed}
        return ("data: " + self.head + self._field(delta) + self.tail[:-3]
                + ',"usage":' + json.dumps(usage) + "}\n\n")

    def _frames(self, new: int) -> list[str]:
        if new <= 0:
            return []
        self.consumed += new
        per = min(MAX_TOKENS_PER_CHUNK, max(1, math.ceil(new / 4)))
        frames: list[str] = []
        for kind, pieces in self.cursor.take_pieces(new):
            for i in range(0, len(pieces), per):
                part = pieces[i : i + per]
                delta = self._delta(kind, "".join(part))
                if delta is not None:
                    frames.append(self._frame(delta, len(part)))
                else:
                    self.streamed += len(part)
        return frames

    def _delta(self, kind: str, text: str) -> dict[str, Any] | None:
        if kind == REASONING:
            return {"reasoning": text}
        if kind == CONTENT:
            return {"content": text}
        calls = self.c.plan.tool_calls
        if kind == TOOL_START and self.calls_started < len(calls):
            call, index = calls[self.calls_started], self.calls_started
            self.calls_started += 1
            return {"tool_calls": [{"index": index, "type": "function", "id": call.call_id,
                                    "function": {"name": call.name}}]}
        if kind == TOOL_ARGS:
            return {"tool_calls": [{"index": self.calls_started - 1, "function": {"arguments": text}}]}
        return None

    def _finish_frame(self) -> str:
        return ("data: " + self.head + self._field({}) + ',"logprobs":null,"finish_reason":'
                + json.dumps(self.c.plan.finish_reason) + ',"stop_reason":null}]}\n\n')

    def _usage_frame(self) -> str:
        c = self.c
        body = {"id": c.completion_id, "object": self.OBJECT, "created": c.created,
                "model": c.model, "choices": [], "usage": c.usage()}
        return "data: " + json.dumps(body) + "\n\n"


class CompletionStreamWriter(StreamWriter):
    """The /v1/completions stream: ``choices[0].text`` chunks, everything the model writes as
    text (no reasoning or tool parser on this route), no opening role chunk."""

    OBJECT = "text_completion"

    def _opening(self) -> list[str]:
        return []

    def _field(self, delta: dict[str, Any]) -> str:
        return '"text":' + json.dumps(delta.get("text", ""), ensure_ascii=False)

    def _delta(self, kind: str, text: str) -> dict[str, Any] | None:
        return {"text": text}


def _error_frame(status: int, message: str) -> str:
    return "data: " + json.dumps(error_body(status, message)) + "\n\n"


class FullWriter(_Writer):
    async def respond(self, send: Any) -> None:
        while True:
            new = await self.next_tokens()
            if new is None:
                await self._break(send)
                return
            if self.c.seq.closed:
                break
            self.consumed += new
        state = self.c.seq.state
        if state is SeqState.ABORTED:
            return
        if state is SeqState.FAILED:
            await _send_json(send, 500, error_body(500, "EngineCore encountered an issue."))
            return
        await _send_json(send, 200, self._body())

    async def _break(self, send: Any) -> None:
        self.c.end_half_way()
        if self.c.breaking == "error_event":
            await _send_json(send, 500, error_body(500, "Simulated engine error."))
            return
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", b"4096")]})
        await send({"type": "http.response.body", "body": b'{"id":"', "more_body": True})

    def _body(self) -> dict[str, Any]:
        c = self.c
        texts: dict[str, list[str]] = {REASONING: [], CONTENT: []}
        arguments: list[list[str]] = []  # per call, in order
        for kind, pieces in self.cursor.take_pieces(c.seq.generated):
            if kind == TOOL_START:
                arguments.append([])
            elif kind == TOOL_ARGS:
                arguments[-1].extend(pieces)
            elif kind in texts:
                texts[kind].extend(pieces)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(texts[CONTENT]) or None,
            "reasoning": "".join(texts[REASONING]) or None,
            "tool_calls": [],
            "refusal": None,
        }
        if c.plan.finish_reason == "tool_calls":
            message["tool_calls"] = [{"id": call.call_id, "type": "function", "function": {
                "name": call.name, "arguments": "".join(args)}}
                for call, args in zip(c.plan.tool_calls, arguments, strict=True)]
        return {
            "id": c.completion_id, "object": "chat.completion", "created": c.created,
            "model": c.model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": c.plan.finish_reason, "stop_reason": None}],
            "usage": c.usage(),
        }


async def _send_json(send: Any, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body, ensure_ascii=False).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class CompletionFullWriter(FullWriter):
    """The one-shot /v1/completions answer: every generated piece as one ``text``."""

    def _body(self) -> dict[str, Any]:
        c = self.c
        text = "".join("".join(pieces) for _, pieces in self.cursor.take_pieces(c.seq.generated))
        return {
            "id": c.completion_id, "object": "text_completion", "created": c.created,
            "model": c.model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": c.plan.finish_reason, "stop_reason": None}],
            "usage": c.usage(),
        }
