"""Continuing a cut reasoning where it stopped, instead of thinking it all again
(``routing.continue_cut_turns = "continue"``, docs/backends.md section 7).

When a backend cuts a queue job's turn (its stream dropped, the server went away or answered an
upstream error) after the model had reasoned for a while, the reasoning so far is kept in the turn
(``keep``: a ``Kept`` record, sealed in the job record with the rest of the turn) and the next
turn, wherever admission grants it, goes on from there (``resume_turn``):

1. the prompt the cut attempt sent, rendered by the backend's own template up to and with its
   generation prompt (``POST /tokenize`` with the same messages and tools), which for the
   deployment's thinking model ends in the open ``<think>``;
2. ``POST /v1/completions`` with that prompt plus the kept reasoning (as token ids), ``stop:
   ["</think>"]`` and at most what the thinking budget has left: the model thinks only the rest.
   The loop watcher reads the kept reasoning first, so a loop that spans the cut is caught;
3. ``POST /v1/completions`` with the prompt, the whole reasoning and ``</think>``: the answer,
   under the job's ``response_format`` when it has one (the grammar starts where the answer does).

A turn cut after its reasoning ended (its answer had begun) keeps the reasoning and runs step 3
only: the answer is short, and continuing a half-written answer would restart a schema's grammar
mid-document. The completions route runs neither vLLM's reasoning parser nor its tool parser, so
the fleet splits the reasoning from the answer itself (the stop string), and a turn that sends
tools is never continued (its tool calls would come back as text): it restarts with carry-over.

Why not the chat route's ``continue_final_message``: it renders the conversation with the final
assistant message left open right after its *content*. Qwen3's template renders an assistant
message's reasoning as a closed ``<think>...</think>`` block before the content, so a cut
reasoning continued that way starts after ``</think>`` (the model answers without finishing its
thought), and reasoning put into the content as an open ``<think>`` gets the template's own empty
think block in front of it. The completions route has no template in the way.

When a continuation is not safe, the turn restarts with carry-over (``why_not`` says why; the
envelope's warnings say it too):

- the backend's template does not open ``<think>`` in its generation prompt (``opens_think``: checked
  once per backend and process through the server's own ``/tokenize`` and ``/detokenize``);
- the backend serves another model than the one that wrote the reasoning (never the small model
  finishing the big one's thought);
- the prompt the next turn would send is not the one the reasoning was written for (a digest of
  messages and tools);
- the turn sends tools.

Token counts: ``Kept.tokens`` are the reasoning tokens kept (the server's running count when it
sent one): what the continuation did not generate again, the attempt's ``continued_tokens``. The
continued attempt's usage is what its two requests cost (both prompts, the second one cached).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypedDict

from fleet.core.errors import FleetError
from fleet.infer.budget import Plan
from fleet.infer.vllm import Delta, StreamResult, VllmClient

THINK_END = "</think>"
MIN_KEPT_TOKENS = 64  # less than this is not worth a continuation
MAX_KEPT_CHARS = 400_000  # the turn record stays bounded
PROBE = [{"role": "user", "content": "Reply with OK."}]


class Kept(TypedDict):
    reasoning: str  # as the server streamed it
    closed: bool  # the reasoning had ended: the answer had begun
    tokens: int  # reasoning tokens kept
    model: str  # the model that wrote it (the backend's)
    backend: str  # the backend that cut it
    digest: str  # of the messages and tools it was written for


def digest(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    return hashlib.sha256(json.dumps([messages, tools], sort_keys=True).encode()).hexdigest()


def keep(result: StreamResult | None, body: dict[str, Any], model: str, backend: str) -> Kept | None:
    """What a cut attempt leaves for a continuation; None when there is nothing worth keeping (too
    little reasoning, too much, tool calls begun, tools sent)."""
    if result is None or body.get("tools") or result.tool_calls:
        return None
    tokens = result.reasoning_tokens + result.kept_tokens
    if tokens < MIN_KEPT_TOKENS or len(result.reasoning) > MAX_KEPT_CHARS:
        return None
    return Kept(reasoning=result.reasoning, closed=bool(result.content), tokens=tokens, model=model,
                backend=backend, digest=digest(body["messages"], body.get("tools")))


_opens: dict[str, bool] = {}
_opens_lock = threading.Lock()


def opens_think(client: VllmClient, key: str) -> bool:
    """Whether the backend's chat template ends its generation prompt in an open ``<think>``
    (checked once per ``key``, the backend, in this process; a failed check is not kept)."""
    with _opens_lock:
        known = _opens.get(key)
    if known is not None:
        return known
    text = client.decode(client.render(PROBE))
    found = text.rstrip(" \n").endswith("<think>")
    with _opens_lock:
        _opens[key] = found
    return found


def why_not(kept: Kept, body: dict[str, Any], model: str, client: VllmClient, key: str) -> str | None:
    """Why this turn cannot continue ``kept`` on this backend; None when it can."""
    if kept["model"] != model:
        return f"the backend serves {model!r}, the reasoning is {kept['model']!r}'s"
    if body.get("tools"):
        return "the turn sends tools (the completions route has no tool parser)"
    if digest(body["messages"], body.get("tools")) != kept["digest"]:
        return "the prompt changed since the reasoning was written"
    try:
        if not opens_think(client, key):
            return "the backend's chat template does not open <think> in its generation prompt"
    except FleetError as exc:
        if exc.code.retryable:  # the backend is away: the attempt fails as it would, kept intact
            raise
        return f"the backend's template could not be checked: {exc.message}"
    return None


def _usage(parts: list[StreamResult], reasoning_tokens: int) -> dict[str, Any]:
    prompt = sum(p.prompt_tokens or 0 for p in parts)
    completion = sum(p.completion_tokens for p in parts)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "prompt_tokens_details": {"cached_tokens": sum(p.cached_tokens for p in parts)}}


def joined(kept: Kept, thought: StreamResult | None, answer: StreamResult | None,
           forced: bool) -> StreamResult:
    """One attempt's result from its requests: the whole reasoning (kept and new), the answer, the
    usage of what was generated (the usage is left out while a part is still cut, so a cut
    continuation is counted by its running counts, as a cut chat stream is)."""
    parts = [p for p in (thought, answer) if p is not None]
    new_reasoning = thought.completion_tokens if thought is not None else 0
    complete = all(p.usage is not None for p in parts)
    streamed = [p.streamed_tokens for p in parts]
    first = next((p.first_token_s for p in parts if p.first_token_s is not None), None)
    return StreamResult(
        content=answer.content if answer is not None else "",
        reasoning=kept["reasoning"] + (thought.reasoning if thought is not None else ""),
        finish_reason=answer.finish_reason if answer is not None else None,
        usage=_usage(parts, new_reasoning) if complete and parts else None,
        first_token_s=first, duration_s=sum(p.duration_s for p in parts),
        thinking_forced=forced,
        reasoning_deltas=thought.reasoning_deltas if thought is not None else 0,
        content_deltas=answer.content_deltas if answer is not None else 0,
        response_id=parts[-1].response_id if parts else None,
        streamed_tokens=None if None in streamed else sum(s or 0 for s in streamed),
        streamed_reasoning=new_reasoning,
        kept_tokens=kept["tokens"],
    )


def resume_turn(client: VllmClient, body: dict[str, Any], kept: Kept, plan: Plan,
                on_delta: Callable[[Delta], None], cancel: threading.Event,
                deadline: float | None) -> StreamResult:
    """Continue ``kept`` with the chat request ``body`` (as built for this attempt) on
    ``client``'s backend. Any exception (a FleetError, the loop watcher's verdict) carries
    ``.partial``: the attempt so far, the kept reasoning included, so a continuation cut again is
    kept again."""
    run = _Continuation(client, body, kept, plan, cancel, deadline)
    try:
        return run.go(on_delta)
    except Exception as exc:
        exc.partial = joined(kept, run.thought or run.cut(exc, "thought"),  # type: ignore[attr-defined]
                             run.cut(exc, "answer"), run.forced)
        raise


class _Continuation:
    def __init__(self, client: VllmClient, body: dict[str, Any], kept: Kept, plan: Plan,
                 cancel: threading.Event, deadline: float | None) -> None:
        self.client, self.body, self.kept, self.plan = client, body, kept, plan
        self.cancel, self.deadline = cancel, deadline
        self.common: dict[str, Any] = {key: body[key] for key in ("seed", "temperature", "cache_salt",
                                                                  "stream_options") if key in body}
        self.rid = str(body.get("request_id", "resume"))
        self.thought: StreamResult | None = None
        self.forced = False
        self.phase = "render"

    def cut(self, exc: Exception, phase: str) -> StreamResult | None:
        """The partial result of ``phase`` when the exception came from it."""
        return getattr(exc, "partial", None) if self.phase == phase else None

    def go(self, on_delta: Callable[[Delta], None]) -> StreamResult:
        prompt = self.client.render(self.body["messages"], self.body.get("tools"))
        reasoning = self.kept["reasoning"]
        if not self.kept["closed"]:
            plan = self.plan
            budget = plan.thinking_budget if plan.thinking_budget >= 0 else plan.max_tokens - plan.content_reserve
            left = budget - self.kept["tokens"]
            if left > 0:
                ask = {**self.common, "prompt": prompt + self.client.encode(reasoning),
                       "max_tokens": left, "stop": [THINK_END], "request_id": f"{self.rid}-think"}
                self.phase = "thought"
                self.thought = self.client.stream_completion(ask, on_delta, self.cancel, self.deadline,
                                                             "reasoning")
                reasoning += self.thought.reasoning
            self.forced = self.thought is None or self.thought.finish_reason == "length"
        done = self.thought.completion_tokens if self.thought is not None else 0
        self.phase = "render"
        ask = {**self.common, "prompt": prompt + self.client.encode(reasoning.rstrip("\n") + f"\n{THINK_END}\n\n"),
               "max_tokens": max(1, self.plan.max_tokens - self.kept["tokens"] - done - 1),
               "request_id": f"{self.rid}-answer"}
        if self.body.get("response_format") is not None:
            ask["response_format"] = self.body["response_format"]

        def on_answer(delta: Delta) -> None:  # running counts over the attempt, not this request
            if delta.streamed is not None and done:
                delta = replace(delta, streamed=(delta.streamed[0] + done, delta.streamed[1] + done))
            on_delta(delta)

        self.phase = "answer"
        answer = self.client.stream_completion(ask, on_answer, self.cancel, self.deadline, "content")
        return joined(self.kept, self.thought, answer, self.forced)
