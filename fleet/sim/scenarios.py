"""Scenario markers: how a test asks the simulator to misbehave, inside a vLLM-shaped request.

Grammar (fixed; other parts of the fleet rely on it). In the LAST user message, any number of::

    [sim:NAME]  [sim:NAME=VALUE]  [sim:NAME/K]  [sim:NAME=VALUE/K]

``/K`` limits the marker to the first K requests that carry this exact marker text together with
the same first user message (counted per (marker, sha256 of the first user message)); from the
(K+1)-th such request on, the marker is ignored. ``POST /sim/reset`` clears those counts.

Names (times are simulated seconds):

===================  ======================================================================
``loop``             reasoning falls into one paragraph repeated verbatim, never answering
                     (until max tokens, or until ``thinking_token_budget`` forces the end)
``loop_fuzzy``       the same with near-duplicates: one word and one number change each time
``loop_short``       a short cycle: a passage of 40-80 words comes back again and again in one
                     paragraph, its numbers redrawn each time, now and then broken off and
                     restarted with "Wait," (no two repetitions equal, no paragraph break)
``slow_first_token=S``  the first token comes S seconds after prefill ends
``stall=S``          the stream pauses S seconds in the middle of the reasoning, then goes on
``http500``          500 InternalServerError JSON answer, before any streaming
``http503``          503 ServiceUnavailableError JSON answer ("engine busy")
``drop``             connection closed mid-reasoning without ``[DONE]`` (incomplete body);
                     ``drop=N``: after N tokens of output (reasoning, then answer)
``error_event``      mid-stream ``data: {"error": ...}`` then ``[DONE]``, HTTP 200
                     (non-streaming: a 500 error answer after the same delay)
``bad_json``         the answer is invalid JSON, even with ``response_format``
``empty``            reasoning, then an empty answer, ``finish_reason: "stop"``
``unicode``          reasoning and prose answer mix English, Japanese and U+2028, U+2029, U+0085
                     (sent raw inside the JSON chunks, as vLLM's encoder does)
``tool`` / ``tool=NAME``  answer with a tool call (first tool of the request, or NAME);
                     ``[sim:tool/3]`` calls it on the first 3 requests of the job (tool rounds
                     keep the first user message, so they count), then answers
``bad_args``         a tool call's arguments are ``[]`` (fail any object schema);
                     ``[sim:bad_args/1]``: only the first call's
``parallel=N``       a tool-call answer holds N calls of the tool (N hermes ``<tool_call>``
                     blocks, streamed as ``tool_calls`` deltas with indexes 0..N-1), each with
                     its own id and arguments: parallel tool calls; N is capped at
                     ``MAX_PARALLEL`` (64), as building the answer takes time linear in N
``think=N``          exactly N reasoning tokens (before budget and max-token caps)
``answer=N``         exactly N answer tokens (prose answers)
``prompt_pad=N``     count the prompt as N tokens longer (unique tokens, never prefix-cached)
``dead`` / ``dead=S``  the engine dies: in-flight requests fail, ``/health`` answers 503, new
                     requests get 500; for S seconds, or until ``POST /sim/reset``
``crash`` / ``crash=S``  this request brings the engine down mid-reasoning: its stream opens and
                     streams as ``drop`` does, then the engine dies as with ``dead`` (every
                     request in flight fails, the dropped connection included; dead for S
                     seconds): a request that crashes the server it runs on
===================  ======================================================================

Numeric values (``S`` and ``N`` above) must be finite numbers >= 0; anything else (``inf``,
``nan``, ``-1``, ``lots``, a number too large for a float) is refused as a 400 answer naming the
marker (``MarkerError``), so a prompt can neither crash the request nor hang the server. Counts
larger than the request allows are cut by the usual caps (``max_tokens``, ``max_model_len``).

``--fault-rate P`` adds, to each request with probability P, one of ``http500``, ``http503``,
``drop``, ``error_event``, drawn from a generator seeded by ``--seed``.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

MARKER_RE = re.compile(r"\[sim:([a-z0-9_]+)(?:=([^\]/\s]+))?(?:/(\d+))?\]")
FAULTS = ("http500", "http503", "drop", "error_event")
KNOWN = {
    "loop", "loop_fuzzy", "loop_short", "slow_first_token", "stall", "http500", "http503", "drop",
    "error_event", "bad_json", "empty", "tool", "bad_args", "parallel", "think", "answer", "prompt_pad",
    "dead", "unicode", "crash",
}
NUMERIC = {"slow_first_token", "stall", "parallel", "think", "answer", "prompt_pad", "dead", "crash", "drop"}
BREAKING = ("drop", "error_event", "crash")  # the markers that end a stream half-way (OutputPlan.break_at)


def chosen_tool(tools: list[dict[str, Any]] | None, tool_choice: Any, scenario: Scenario) -> dict[str, Any] | None:
    """The tool this request calls, if any: a named ``tool_choice`` or ``[sim:tool=NAME]`` (a name
    no tool has gets a bare definition), else the first tool; with ``auto`` only under a ``tool``
    marker; never with ``none`` or without tools."""
    if not tools or tool_choice == "none":
        return None
    wanted = scenario.active.get("tool") or None
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name") or wanted
    elif tool_choice == "auto" and not scenario.has("tool"):
        return None
    if wanted is None:
        return tools[0]
    for tool in tools:
        if (tool.get("function") or {}).get("name") == wanted:
            return tool
    return {"type": "function", "function": {"name": wanted, "parameters": {}}}


def breaking_of(scenario: Scenario) -> str | None:
    """The marker that ends this request's stream half-way, if any (``BREAKING``, in that order)."""
    return next((n for n in BREAKING if scenario.has(n)), None)
MAX_PARALLEL = 64


class MarkerError(ValueError):
    """A marker with a value it cannot take; the app answers 400 with this message."""


def _checked(marker: str, name: str, value: str) -> str:
    """``value`` if ``name`` takes no number or it is a finite number >= 0; else MarkerError."""
    if name not in NUMERIC or not value:
        return value
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise MarkerError(f"{marker}: the value must be a finite number >= 0")
    return value


@dataclass
class Scenario:
    """The active markers of one request: name -> value ("" when the marker has none)."""

    active: dict[str, str] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return name in self.active

    def number(self, name: str, default: float = 0.0) -> float:
        return float(self.active.get(name) or default)

    def integer(self, name: str) -> int | None:
        """The marker's value as a whole number; None when absent or given without a value."""
        value = self.active.get(name)
        return int(float(value)) if value else None


class ScenarioBook:
    """Parses markers and keeps the ``/K`` counts. One per server; reset by ``/sim/reset``."""

    def __init__(self, seed: int, fault_rate: float = 0.0) -> None:
        self._seed = seed
        self._fault_rate = fault_rate
        self._counts: Counter[tuple[str, str]] = Counter()
        self._faults = random.Random(seed ^ 0x5EED)

    def reset(self) -> None:
        self._counts.clear()
        self._faults = random.Random(self._seed ^ 0x5EED)

    def resolve(self, last_user: str, first_user: str) -> Scenario:
        """The active markers of a request; MarkerError for a numeric marker's bad value."""
        scenario = Scenario()
        digest = hashlib.sha256(first_user.encode()).hexdigest()
        for m in MARKER_RE.finditer(last_user):
            name, value, limit = m.group(1), m.group(2) or "", m.group(3)
            if name not in KNOWN:
                continue
            value = _checked(m.group(0), name, value)
            if limit is not None:
                key = (m.group(0), digest)
                self._counts[key] += 1
                if self._counts[key] > int(limit):
                    continue
            scenario.active[name] = value
        if self._fault_rate > 0 and self._faults.random() < self._fault_rate:
            scenario.active.setdefault(self._faults.choice(FAULTS), "")
        return scenario


def enact_refusals(scenario: Scenario, engine: Any) -> None:
    """The markers that refuse a request before it reaches the engine (``dead`` kills the engine
    first): an ``APIError`` as vLLM would answer; nothing when none is active."""
    from fleet.sim.validate import APIError

    if scenario.has("dead"):
        engine.kill(scenario.number("dead", float("inf")))
    if engine.dead:
        raise APIError(500, "EngineCore is dead (simulated).")
    if scenario.has("http500"):
        raise APIError(500, "Internal server error (simulated).")
    if scenario.has("http503"):
        raise APIError(503, "The engine is currently busy (simulated).")
