"""What one request will generate, decided up front: token counts, texts, finish reason, events.

The engine only needs the total number of completion tokens (and the token positions where a
stall happens); the response writer walks the same plan with an ``OutputCursor`` to turn the
engine's token counts into reasoning text, content text or tool-call pieces.

Length rules (docs/vllm-api.md):
- ``max_tokens`` M is already ``min(max_model_len - prompt_len, requested)`` (vLLM 0.33: too
  large a request is lowered silently, not rejected).
- Thinking on: R reasoning tokens (drawn, ``think=N``, or unbounded for loops), cut to the
  ``thinking_token_budget`` B when set (the forced end). If R >= M the output is all reasoning:
  ``finish_reason: "length"``, no content. Otherwise one ``</think>`` token follows (it counts as a
  completion token but is in neither text), then the answer, cut at M (``length``) or complete
  (``stop`` / ``tool_calls``).
- Thinking off (``chat_template_kwargs.enable_thinking: false``): the answer only.
- ``usage.completion_tokens_details.reasoning_tokens`` is R after the caps.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

from fleet.sim.jsongen import generate_json, generate_object
from fleet.sim.scenarios import MAX_PARALLEL, Scenario, breaking_of
from fleet.sim.textgen import (
    FixedPieces,
    LoopStream,
    PieceStream,
    ProseStream,
    ShortLoopStream,
    UnicodeStream,
)
from fleet.sim.tokenizer import split_pieces

REASONING, CONTENT, HIDDEN, TOOL_START, TOOL_ARGS = "reasoning", "content", "hidden", "tool", "args"
LOOPS = ("loop", "loop_fuzzy", "loop_short")  # markers whose reasoning never ends by itself
MIN_RESUMED_TOKENS = 32


@dataclass(frozen=True)
class LengthDistribution:
    """Log-uniform draws for thinking and answer lengths (tokens)."""

    think_min: int = 800
    think_max: int = 12_000
    answer_min: int = 120
    answer_max: int = 600

    def thinking(self, rng: random.Random) -> int:
        return _log_uniform(rng, self.think_min, self.think_max)

    def answer(self, rng: random.Random) -> int:
        return _log_uniform(rng, self.answer_min, self.answer_max)


def seeded(seed: int, parts: list[Any]) -> random.Random:
    """A request's own random source: the simulator's seed and the request's fields that shape
    its output, so the same request draws the same output in every run."""
    key = json.dumps([seed, *parts], sort_keys=True, default=str)
    return random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    lo, hi = max(1, lo), max(1, lo, hi)
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


@dataclass
class ToolCall:
    name: str
    arguments: str
    call_id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")


@dataclass
class RequestShape:
    """The parts of a validated request that shape its output."""

    max_tokens: int
    thinking: bool = True
    budget: int | None = None
    response_format: dict[str, Any] | None = None
    tool: dict[str, Any] | None = None  # the chosen tool definition, when a call is due
    thought: int = 0  # reasoning tokens the prompt already holds (a continued reasoning)
    answered: int = 0  # answer tokens the prompt already holds (a continued answer)
    stop_at_think_end: bool = False  # "</think>" is a stop string: end where the reasoning does


@dataclass
class OutputPlan:
    segments: list[tuple[str, int, PieceStream]]
    reasoning_tokens: int
    finish_reason: str
    tool_calls: list[ToolCall] = field(default_factory=list)  # in the order they are written
    stall_at: int | None = None
    break_at: int | None = None  # drop / error_event position (tokens)

    @property
    def total(self) -> int:
        return sum(n for _, n, _ in self.segments)


def _content_pieces(
    shape: RequestShape, scenario: Scenario, rng: random.Random, dist: LengthDistribution
) -> tuple[list[tuple[str, list[str]]] | PieceStream, int, list[ToolCall]]:
    """The answer as (kind, pieces) parts, or a prose stream and its length."""
    if scenario.has("empty"):
        return [], 0, []
    if shape.tool is not None:
        fn = shape.tool.get("function", shape.tool)
        calls: list[ToolCall] = []
        parts: list[tuple[str, list[str]]] = []
        # parallel=N: N hermes <tool_call> blocks in one answer (one TOOL_START each), N capped
        for _ in range(min(MAX_PARALLEL, max(1, scenario.integer("parallel") or 1))):
            # bad_args: arguments that fail any object schema (a JSON array), as a confused model's
            arguments = "[]" if scenario.has("bad_args") else generate_json(fn.get("parameters", {}), rng)
            call = ToolCall(str(fn.get("name", "tool")), arguments)
            opening = "\n<tool_call>" if calls else "<tool_call>"  # blocks one per line
            head = split_pieces(f'{opening}\n{{"name": "{call.name}", "arguments": ')
            tail = split_pieces("}\n</tool_call>")
            parts += [(HIDDEN, head[:-1]), (TOOL_START, head[-1:]),
                      (TOOL_ARGS, split_pieces(call.arguments)), (HIDDEN, tail)]
            calls.append(call)
        return parts, sum(len(p) for _, p in parts), calls
    text = _json_text(shape.response_format, rng)
    if scenario.has("bad_json"):
        text = _break_json(text if text is not None else generate_object(rng))
    if text is not None:
        pieces = split_pieces(text)
        return [(CONTENT, pieces)], len(pieces), []
    n = scenario.integer("answer")
    prose = UnicodeStream(rng) if scenario.has("unicode") else ProseStream(rng)
    length = dist.answer(rng) if n is None else n
    if shape.answered:  # a resumed answer writes the rest, and a little at least
        length = max(length - shape.answered, min(length, MIN_RESUMED_TOKENS))
    return prose, length, []


def _json_text(response_format: dict[str, Any] | None, rng: random.Random) -> str | None:
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        return generate_json(spec.get("schema", spec.get("schema_", {})), rng)
    if kind == "json_object":
        return generate_object(rng)
    return None


def _break_json(text: str) -> str:
    cut = text[: max(1, len(text) * 2 // 3)]
    try:
        json.loads(cut)
    except ValueError:
        return cut
    return "{" + cut + ","


def _reasoning_stream(scenario: Scenario, rng: random.Random) -> PieceStream:
    if scenario.has("loop"):
        return LoopStream(rng, exact=True)
    if scenario.has("loop_fuzzy"):
        return LoopStream(rng, exact=False)
    if scenario.has("loop_short"):
        return ShortLoopStream(rng)
    if scenario.has("unicode"):
        return UnicodeStream(rng)
    return ProseStream(rng)


def build_plan(
    shape: RequestShape, scenario: Scenario, rng: random.Random, dist: LengthDistribution
) -> OutputPlan:
    m = shape.max_tokens
    segments: list[tuple[str, int, PieceStream]] = []
    reasoning = 0
    if shape.thinking:
        looping = any(scenario.has(name) for name in LOOPS)
        fixed = scenario.integer("think")
        natural = m if looping else (dist.thinking(rng) if fixed is None else fixed)
        if shape.thought and not looping:  # a resumed thought needs the rest, and a little at least
            natural = max(natural - shape.thought, min(natural, MIN_RESUMED_TOKENS))
        reasoning = natural if shape.budget is None else min(natural, shape.budget)
        stream = _reasoning_stream(scenario, rng)
        if reasoning >= m:
            segments.append((REASONING, m, stream))
            return _with_events(OutputPlan(segments, m, "length"), scenario)
        segments.append((REASONING, reasoning, stream))
        if shape.stop_at_think_end:
            return _with_events(OutputPlan(segments, reasoning, "stop"), scenario)
        segments.append((HIDDEN, 1, FixedPieces(["</think>"])))
    content, full, calls = _content_pieces(shape, scenario, rng, dist)
    room = m - sum(n for _, n, _ in segments)
    finish = "tool_calls" if calls else "stop"
    if full > room:
        finish, full = "length", room
    if isinstance(content, PieceStream):
        segments.append((CONTENT, full, content))
    else:
        left = full
        for kind, pieces in content:
            take = min(left, len(pieces))
            if take:
                segments.append((kind, take, FixedPieces(pieces[:take])))
            left -= take
    return _with_events(OutputPlan(segments, reasoning, finish, calls), scenario)


def _with_events(plan: OutputPlan, scenario: Scenario) -> OutputPlan:
    middle = max(1, min(plan.reasoning_tokens, plan.total) // 2)
    if scenario.has("stall"):
        plan.stall_at = middle
    if breaking_of(scenario) is not None:
        at = scenario.integer("drop")  # drop=N: after N tokens of output (its answer too), else mid-reasoning
        plan.break_at = min(middle if at is None else max(1, at), max(0, plan.total - 1))
    return plan


class OutputCursor:
    """Walks a plan: ``take_pieces(k)`` -> the next k tokens as (kind, pieces) runs of one kind."""

    def __init__(self, plan: OutputPlan) -> None:
        self._segments: list[list[Any]] = [[kind, n, stream] for kind, n, stream in plan.segments]
        self._i = 0

    def take_pieces(self, k: int) -> list[tuple[str, list[str]]]:
        out: list[tuple[str, list[str]]] = []
        while k > 0 and self._i < len(self._segments):
            seg = self._segments[self._i]
            n = min(k, seg[1])
            if n:
                out.append((seg[0], seg[2].take(n)))
                seg[1] -= n
                k -= n
            if seg[1] == 0:
                self._i += 1
        return out

