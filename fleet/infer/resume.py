"""Continuing a cut reasoning where it stopped, instead of thinking it all again
(``routing.continue_cut_turns = "continue"``, docs/backends.md section 7).

When a backend cuts a queue job's turn (its stream dropped, the server went away or answered an
upstream error) after the model had reasoned for a while, the reasoning so far is kept in the turn
(``keep``: a ``Kept`` record, sealed in the job record with the rest of the turn) and the next
turn, wherever admission grants it, goes on from there (``resume_turn``):

1. the prompt the cut attempt sent, rendered by the backend's own template up to and with its
   generation prompt (``POST /tokenize`` with the same messages and tools), which for the
   deployment's thinking model ends in the open ``<think>``;
2. ``POST /v1/completions`` with that prompt plus the kept reasoning (as token ids, its control
   tags broken by ``neutralise`` as carry-over quotes model text), ``stop: ["</think>"]`` and at
   most what the thinking budget has left, keeping the answer's reserve inside ``max_model_len``:
   the model thinks only the rest. The loop watcher reads the kept reasoning first
   (``LoopWatcher.read_before``), so a loop that spans the cut is caught;
3. ``POST /v1/completions`` with the same ids, the rest of the thought and ``</think>``: the answer,
   under the job's ``response_format`` when it has one (the grammar starts where the answer does),
   at most what is left of the turn's output allowance and of ``max_model_len``.

A turn cut after its reasoning ended (its answer had begun) keeps the reasoning and runs step 3
only: the answer is short, and continuing a half-written answer would restart a schema's grammar
mid-document. Except when a client already has part of the answer (a gateway stream cut after its
answer text began, ``keep(..., answer=True)``): then the text it has goes into step 3's prompt
after ``</think>`` and the model writes the rest, so the stream goes on where it stopped (not
under a ``response_format``: that one is not continued).

The completions route runs neither vLLM's reasoning parser nor its tool parser, so the fleet
splits the reasoning from the answer itself (the stop string) and, for a turn that sends tools
with ``tool_choice`` auto (or unset), reads the answer's hermes ``<tool_call>`` blocks as the chat
route's parser would (fleet/infer/hermes.py): the content streams on as it comes, a block is held
back and goes out as one ``tool_calls`` delta at the end, ``finish_reason`` "tool_calls". A turn
that forces a call (``tool_choice`` "required" or a named function: the chat route would constrain
the output, the completions route cannot) is not continued. A turn cut once its tool call had
begun is not either (the call would be written twice).

Why not the chat route's ``continue_final_message``: it renders the conversation with the final
assistant message left open right after its *content*. Qwen3's template renders an assistant
message's reasoning as a closed ``<think>...</think>`` block before the content, so a cut
reasoning continued that way starts after ``</think>`` (the model answers without finishing its
thought), and reasoning put into the content as an open ``<think>`` gets the template's own empty
think block in front of it. The completions route has no template in the way.

When a continuation is not safe, the turn restarts with carry-over (``why_not`` says why; the
envelope's warnings say it too):

- the backend's template does not open ``<think>`` in its generation prompt (``opens_think``: checked
  once per backend and ``PROBE_TTL_S`` in a process through the server's own ``/tokenize`` and
  ``/detokenize``, so a server restarted with another template is seen within ten minutes);
- the backend serves another model than the one that wrote the reasoning (never the small model
  finishing the big one's thought);
- the prompt the next turn would send is not the one the reasoning was written for (a digest of
  messages and tools);
- the turn forces a tool call (``tool_choice``), or its cut attempt had begun one;
- the request sets a sampling field the continuation cannot keep (``NOT_CARRIED``: a stop string,
  a token bias, a minimum length; the others, ``CARRIED``, go with both requests);
- the server refuses the continuation (a 400 on the completions route, no room left for the
  answer): ``ContinuationRefused``, an upstream error, so the turn is retried as a restart.

Cancel and the job's deadline are checked before each tokenizer call and bound each stream; a
tokenizer call reads for at most ``timeouts.idle_s`` (never past the job's deadline), so a server
that hangs on ``/tokenize`` costs a continuation what a silent stream would, and a cancel ends a
call under way at once (its reads go through the same sliced, cancellable reads as a stream's).

Token counts: ``Kept.tokens`` are the reasoning tokens kept (the server's running count when it
sent one): what the continuation did not generate again, the attempt's ``continued_tokens``. The
continued attempt's usage is what its two requests cost (both prompts, the second one cached);
cut again, it counts what its requests generated, never the kept part again (``joined``), and
keeps the kept reasoning, its end and its forced end for the next continuation.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NotRequired, TypedDict

from fleet.core.codes import Code
from fleet.core.errors import (
    Cancelled,
    DeadlineExceeded,
    FleetError,
    PromptTooLong,
    UpstreamError,
    UpstreamRejected,
    UpstreamUnavailable,
)
from fleet.core.request import neutralise
from fleet.infer import hermes
from fleet.infer.budget import Plan
from fleet.infer.vllm import PLAIN_READ_TIMEOUT_S, Delta, StreamResult, VllmClient

THINK_END = "</think>"
END_TOKENS = 8  # what "\n</think>\n\n" costs, with room to spare
MIN_KEPT_TOKENS = 64  # less than this is not worth a continuation
MAX_KEPT_CHARS = 400_000  # the turn record stays bounded
PROBE = [{"role": "user", "content": "Reply with OK."}]
# A request's sampling fields: those the completions route takes as the chat route does go with
# both requests of a continuation; a turn that sets one of the others is not continued (a stop
# string or a token bias would have to apply to the answer only, a minimum length to the whole).
CARRIED = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
NOT_CARRIED = ("stop", "stop_token_ids", "logit_bias", "min_tokens", "reasoning_effort")


class Kept(TypedDict):
    reasoning: str  # as the server streamed it
    closed: bool  # the reasoning had ended: the answer had begun (or was about to)
    forced: bool  # its end was forced: the thinking budget was spent
    tokens: int  # reasoning tokens kept
    model: str  # the model that wrote it (the backend's)
    backend: str  # the backend that cut it
    digest: str  # of the messages and tools it was written for
    # the answer text a client already has (a gateway stream cut after its answer began): the
    # continuation goes on after it instead of answering again
    answer: NotRequired[str]


class ContinuationRefused(UpstreamError):
    """This backend will not take the continuation (its template, its completions route, no room
    left): the turn restarts with carry-over instead (a retry, like any upstream error)."""


def digest(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    return hashlib.sha256(json.dumps([messages, tools], sort_keys=True).encode()).hexdigest()


def keep(result: StreamResult | None, body: dict[str, Any], model: str, backend: str,
         answer: bool = False) -> Kept | None:
    """What a cut attempt leaves for a continuation; None when there is nothing worth keeping (too
    little reasoning, too much, tool calls begun). ``answer``: its answer text reached a client
    and is kept too, so the continuation goes on after it (None when that cannot be: an answer
    under a ``response_format``, whose grammar would start again mid-document)."""
    if result is None or result.tool_calls:
        return None
    tokens = result.reasoning_tokens + result.kept_tokens
    if tokens < MIN_KEPT_TOKENS or len(result.reasoning) + len(result.content) > MAX_KEPT_CHARS:
        return None
    kept = Kept(reasoning=result.reasoning, closed=bool(result.content) or result.thought_ended,
                forced=result.thinking_forced, tokens=tokens, model=model, backend=backend,
                digest=digest(body["messages"], body.get("tools")))
    if answer and result.content:
        if body.get("response_format") is not None:
            return None
        kept["answer"] = result.content
    return kept


def kept_only(kept: Kept) -> StreamResult:
    """An attempt that sent nothing: the kept reasoning, none of it this attempt's."""
    return StreamResult(reasoning=kept["reasoning"], content=kept.get("answer", ""), kept_tokens=kept["tokens"],
                        streamed_tokens=0,
                        thought_ended=kept["closed"], thinking_forced=kept["forced"])


PROBE_TTL_S = 600.0  # a backend restarted with another template is checked again within this
FAILED_TTL_S = 60.0  # a check that failed this recently is not made again for the next turn
_opens: dict[str, tuple[bool, float]] = {}  # key -> (verdict, monotonic time of the check)
_failed: dict[str, tuple[str, float]] = {}  # key -> (why, monotonic time of the failed check)
_opens_lock = threading.Lock()


def read_s(client: VllmClient, cancel: threading.Event, deadline: float | None) -> float:
    """The read timeout of a continuation's next tokenizer call, after a check of the cancel and
    the deadline: the plain one, at most ``timeouts.idle_s`` (the stream's silence limit) and the
    time left to the job's deadline."""
    if cancel.is_set():
        raise Cancelled("cancelled during the continuation")
    limit = min(PLAIN_READ_TIMEOUT_S, client.timeouts.idle_s)
    if deadline is not None:
        left = deadline - time.time()
        if left <= 0:
            raise DeadlineExceeded("the job's deadline passed during the continuation")
        limit = min(limit, left)
    return limit


def opens_think(client: VllmClient, key: str, limit_s: float, cancel: threading.Event | None = None) -> bool:
    """Whether the backend's chat template ends its generation prompt in an open ``<think>``
    (checked once per ``key``, the backend, and ``PROBE_TTL_S`` in this process). Each of the
    probe's two calls reads for at most ``limit_s`` (``read_s``) and ends at once on ``cancel``.
    A failed check is not kept as a verdict; one that failed after connecting is remembered for
    ``FAILED_TTL_S`` (``recent_failure``); a cancelled one is neither."""
    now = time.monotonic()
    with _opens_lock:
        known = _opens.get(key)
    if known is not None and now - known[1] < PROBE_TTL_S:
        return known[0]
    try:
        text = client.decode(client.render(PROBE, timeout_s=limit_s, cancel=cancel), timeout_s=limit_s,
                             cancel=cancel)
    except Cancelled:
        raise
    except FleetError as exc:
        # a backend that took the connection and then did not answer (or answered wrong): a
        # tokenizer that hangs or errs. One that is away is not remembered: its turns fail over
        # with their reasoning kept, to be continued where another backend's check passes.
        away = isinstance(exc, UpstreamUnavailable) or exc.code == Code.E_CONNECT_TIMEOUT
        if not away:
            with _opens_lock:
                _failed[key] = (exc.message, now)
        raise
    found = text.rstrip(" \n").endswith("<think>")
    with _opens_lock:
        _opens[key] = (found, now)
        _failed.pop(key, None)
    return found


def recent_failure(key: str) -> str | None:
    """Why the template check of ``key`` failed within ``FAILED_TTL_S``, or None."""
    with _opens_lock:
        failed = _failed.get(key)
    if failed is None or time.monotonic() - failed[1] >= FAILED_TTL_S:
        return None
    return failed[0]


NO_THINK = "the backend's chat template does not open <think> in its generation prompt"


def why_not(kept: Kept, body: dict[str, Any], model: str, client: VllmClient, key: str,
            cancel: threading.Event, deadline: float | None) -> str | None:
    """Why this turn cannot continue ``kept`` on this backend; None when it can (or when the
    template could not be checked because the backend is away: ``resume_turn`` checks it again).
    A check that failed within ``FAILED_TTL_S`` is a reason: the turn restarts with carry-over
    rather than fail again on a tokenizer that does not answer."""
    if kept["model"] != model:
        return f"the backend serves {model!r}, the reasoning is {kept['model']!r}'s"
    if body.get("tools") and body.get("tool_choice") not in (None, "auto", "none"):
        return "the request forces a tool call (tool_choice), which the completions route cannot"
    unkept = [field for field in NOT_CARRIED if body.get(field) is not None]
    if unkept:
        return f"the request sets {', '.join(unkept)}, which a continuation does not keep"
    if digest(body["messages"], body.get("tools")) != kept["digest"]:
        return "the prompt changed since the reasoning was written"
    failed = recent_failure(key)
    if failed is not None:
        return f"the backend's template check failed within {FAILED_TTL_S:.0f} s: {failed}"
    try:
        limit = read_s(client, cancel, deadline)
    except (Cancelled, DeadlineExceeded):  # no check: the attempt ends on it, the reasoning kept
        return None
    try:
        if not opens_think(client, key, limit, cancel):
            return NO_THINK
    except Cancelled:  # no verdict: the attempt ends on it, the reasoning kept
        return None
    except FleetError as exc:
        if exc.code.retryable:  # the backend is away: the attempt fails as it would, kept intact
            return None
        return f"the backend's template could not be checked: {exc.message}"
    return None


def resume_turn(client: VllmClient, body: dict[str, Any], kept: Kept, plan: Plan, key: str,
                on_delta: Callable[[Delta], None], cancel: threading.Event,
                deadline: float | None) -> StreamResult:
    """Continue ``kept`` with the chat request ``body`` (as built for this attempt) on
    ``client``'s backend (``key`` names it for the template check). Any exception (a FleetError,
    the loop watcher's verdict) carries ``.partial``: the attempt so far, the kept reasoning
    included, so a continuation cut again is kept again; ``ContinuationRefused`` when this
    backend will not take it."""
    run = _Continuation(client, body, kept, plan, cancel, deadline)
    try:
        if not opens_think(client, key, run.read_s(), cancel):
            raise ContinuationRefused(NO_THINK)
        return run.go(on_delta)
    except Exception as exc:
        exc.partial = run.joined(run.thought or run.cut(exc, "thought"),  # type: ignore[attr-defined]
                                 run.cut(exc, "answer"))
        raise


class _Continuation:
    def __init__(self, client: VllmClient, body: dict[str, Any], kept: Kept, plan: Plan,
                 cancel: threading.Event, deadline: float | None) -> None:
        self.client, self.body, self.kept, self.plan = client, body, kept, plan
        self.cancel, self.deadline = cancel, deadline
        self.common: dict[str, Any] = {key: body[key] for key in ("seed", "temperature", "cache_salt",
                                                                  "stream_options", *CARRIED) if key in body}
        self.rid = str(body.get("request_id", "resume"))
        self.t0 = time.monotonic()
        self.thought: StreamResult | None = None
        self.said = kept.get("answer", "")  # the answer text a client already has
        self.calls: hermes.Splitter | None = None  # the answer's tool-call splitter, when it is read for calls
        self.forced = kept["forced"]
        self.phase = "render"
        self.rendered: int | None = None  # the chat prompt's tokens
        self.prompts: dict[str, int] = {}  # phase -> prompt tokens sent
        self.offsets: dict[str, float] = {}  # phase -> seconds from the start to its request

    def cut(self, exc: Exception, phase: str) -> StreamResult | None:
        """The partial result of ``phase`` when the exception came from it; an answer's holds
        only the content passed on (what the tool-call splitter held back never reached anyone:
        the next attempt writes it again)."""
        partial = getattr(exc, "partial", None) if self.phase == phase else None
        if partial is not None and phase == "answer" and self.calls is not None:
            partial = replace(partial, content=partial.content[:self.calls.sent])
        return partial

    def _stream(self, phase: str, ask: dict[str, Any], on_delta: Callable[[Delta], None],
                text_is: str) -> StreamResult:
        self.phase, self.prompts[phase] = phase, len(ask["prompt"])
        self.offsets[phase] = time.monotonic() - self.t0
        try:
            return self.client.stream_completion(ask, on_delta, self.cancel, self.deadline, text_is)
        except (UpstreamRejected, PromptTooLong) as exc:  # the route, a field, the length
            refused = ContinuationRefused(f"the completions route refused the continuation: {exc.message}")
            refused.partial = getattr(exc, "partial", None)  # type: ignore[attr-defined]
            raise refused from exc

    def read_s(self) -> float:
        """The next tokenizer call's read timeout (module ``read_s``)."""
        return read_s(self.client, self.cancel, self.deadline)

    def _encode(self, text: str) -> list[int]:
        """``/tokenize`` of ``text`` within ``read_s``."""
        return self.client.encode(text, timeout_s=self.read_s(), cancel=self.cancel)

    def go(self, on_delta: Callable[[Delta], None]) -> StreamResult:
        limit = self.plan.max_model_len
        prompt = self.client.render(self.body["messages"], self.body.get("tools"), timeout_s=self.read_s(),
                                    cancel=self.cancel)
        self.rendered = len(prompt)
        so_far = prompt + self._encode(neutralise(self.kept["reasoning"]))
        if not self.kept["closed"]:
            plan = self.plan
            budget = plan.thinking_budget if plan.thinking_budget >= 0 else plan.max_tokens - plan.content_reserve
            # the answer keeps its reserve inside max_model_len, as the chat request's plan does
            left = min(budget - self.kept["tokens"], limit - len(so_far) - plan.content_reserve - END_TOKENS)
            if left > 0:
                ask = {**self.common, "prompt": so_far, "max_tokens": left, "stop": [THINK_END],
                       "request_id": f"{self.rid}-think"}
                self.thought = self._stream("thought", ask, on_delta, "reasoning")
                so_far = so_far + self._encode(neutralise(self.thought.reasoning))
            self.forced = self.forced or self.thought is None or self.thought.finish_reason == "length"
        self.phase = "render"
        done = self.thought.completion_tokens if self.thought is not None else 0
        answer_prompt = so_far + self._encode(f"\n{THINK_END}\n\n")
        said = self._encode(neutralise(self.said)) if self.said else []  # the answer the client has
        answer_prompt = answer_prompt + said
        room = min(self.plan.max_tokens - self.kept["tokens"] - done - len(said), limit - len(answer_prompt))
        if room < 1:
            raise ContinuationRefused(f"no room left for the answer ({len(answer_prompt)} prompt tokens)")
        ask = {**self.common, "prompt": answer_prompt, "max_tokens": room, "request_id": f"{self.rid}-answer"}
        if self.body.get("response_format") is not None:
            ask["response_format"] = self.body["response_format"]

        calls = self.calls = hermes.Splitter() if self.parses_calls() else None

        def on_answer(delta: Delta) -> None:  # running counts over the attempt, not this request
            if delta.streamed is not None and done:
                delta = replace(delta, streamed=(delta.streamed[0] + done, delta.streamed[1] + done))
            if calls is not None and delta.content:  # tool-call blocks held back until the end
                shown = calls.feed(delta.content)
                delta = replace(delta, content=shown, held=len(shown) < len(delta.content))
            on_delta(delta)

        answer = self._stream("answer", ask, on_answer, "content")
        if calls is not None:
            answer = self._calls_of(answer, calls, on_delta)
        return self.joined(self.thought, answer)

    def parses_calls(self) -> bool:
        """Whether the answer is read for tool calls, as the chat route's parser would (tools
        sent, ``tool_choice`` auto: ``why_not`` refuses the forcing ones)."""
        return bool(self.body.get("tools")) and self.body.get("tool_choice") in (None, "auto")

    @staticmethod
    def _calls_of(answer: StreamResult, calls: hermes.Splitter, on_delta: Callable[[Delta], None]) -> StreamResult:
        """The answer with its hermes tool-call blocks read as calls (fleet/infer/hermes.py), what
        the splitter held back sent on: the rest of the content, then the calls as one delta."""
        content, rest, found = calls.end()
        if rest or found:
            on_delta(Delta(content=rest, tool_calls=hermes.as_deltas(found)))
        finish = "tool_calls" if found and answer.finish_reason == "stop" else answer.finish_reason
        return replace(answer, content=content, tool_calls=found, finish_reason=finish)

    def joined(self, thought: StreamResult | None, answer: StreamResult | None) -> StreamResult:
        """The attempt's result from its requests: the whole reasoning (kept and new), the answer,
        the counts of what these requests generated only (never the kept part's: it was counted
        when it was generated). The usage is the server's when the answer came to its end; a
        continuation cut on the way has none and is counted by its parts' counts, as a cut chat
        stream is by its running count."""
        parts = [p for p in (thought, answer) if p is not None]
        new_reasoning = thought.completion_tokens if thought is not None else 0
        completion = sum(p.completion_tokens for p in parts)
        complete = answer is not None and answer.usage is not None and (thought is None or thought.usage is not None)
        usage = None
        if complete:
            prompt = sum(p.prompt_tokens or 0 for p in parts)
            usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                     "completion_tokens_details": {"reasoning_tokens": new_reasoning},
                     "prompt_tokens_details": {"cached_tokens": sum(p.cached_tokens for p in parts)}}
        served = [phase for phase, p in (("thought", thought), ("answer", answer))
                  if p is not None and (p.first_token_s is not None or p.usage is not None)]
        firsts = [self.offsets[phase] + p.first_token_s for phase, p in (("thought", thought), ("answer", answer))
                  if p is not None and p.first_token_s is not None]
        ended = (self.kept["closed"] or bool(answer is not None and answer.content)
                 or (thought is not None and thought.finish_reason in ("stop", "length")))
        return StreamResult(
            content=self.said + (answer.content if answer is not None else ""),
            tool_calls=answer.tool_calls if answer is not None else [],
            reasoning=self.kept["reasoning"] + (thought.reasoning if thought is not None else ""),
            finish_reason=answer.finish_reason if answer is not None else None,
            usage=usage, first_token_s=firsts[0] if firsts else None,
            duration_s=time.monotonic() - self.t0, thinking_forced=self.forced,
            reasoning_deltas=thought.reasoning_deltas if thought is not None else 0,
            content_deltas=answer.content_deltas if answer is not None else 0,
            response_id=parts[-1].response_id if parts else None,
            streamed_tokens=completion, streamed_reasoning=new_reasoning, kept_tokens=self.kept["tokens"],
            sent_prompt_tokens=sum(self.prompts[phase] for phase in served) if served else None,
            rendered_prompt_tokens=self.rendered, thought_ended=ended, opened=any(p.opened for p in parts),
        )
