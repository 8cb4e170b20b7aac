"""The tool-call loop: a model turn that asks for tools ends, the tools run while the job holds no
inference slot, and the job re-enters admission for the next turn with their results.

Only for projects with ``tools = "run"`` (``"passthrough"``, the default, hands the calls back in
the envelope as before) and never for a job with untrusted content (fleet/core/request.py sends it
no tools at all). The tools a job may use are its ``tools`` names that the project allows
(``allowed_tools``) AND registers (``tool_registry``); the model is sent the registry's definition
(name, description, JSON Schema), never the job's.

One round, across processes::

  inference worker (turn N, holds the slot)
    model answers with tool_calls -> check every call: a name that was sent, arguments that parse
    as JSON and pass the tool's schema. Invalid calls are not run; their error becomes their
    result (at most ``tool_invalid_max`` rounds with invalid calls, then E_TOOL_INVALID); more
    than ``max_tool_rounds`` rounds -> E_TOOL_FAILED.
    -> the round (calls, checks) is saved in the sealed turn state, ``readmit`` gives the slot up
       with a not-before time of now + the longest timeout of the round's tools (deferred: the
       job waits in the store, no slot) and the next turn's prompt so far (the conversation and
       the calls, counted by the worker's token counter); the round is marked sent
       (``sent:<round>`` in the results hash), then one ``fleet.tool`` task per valid call goes
       to the tool's queue (all at once: they run in parallel) under Celery's time limits, soft
       at the tool's timeout, hard ``KILL_GRACE_S + SETTLE_S`` later (enforced by the prefork
       pool only).
  tool worker (``fleet worker --role tools --pool prefork``, imports ``tool_imports``)
    ``fleet.tool`` checks that the sealed turn of the job names this very call, runs the
    registered Celery task in-process (``task(**arguments)``; the soft limit inside it is a
    timeout), and stores the result or the error, sealed, in ``{p}tools:{<ref>}`` (field
    ``<round>:<call id>``) at once, then again with its size in tokens (the backend's tokenizer
    and ``RESULT_FRAMING_TOKENS``; a soft limit landing after the tool returned is ridden out);
    it then reads the round's results and grows the waiting job's admission size to the turn's
    prompt and the results counted so far (``store.grow``: never smaller, so two workers may
    report in any order). The worker that finds every result of the round in AND counted
    (``round_complete``; a result stored but not yet counted does not complete it) moves the
    job's not-before time to now (``store.hurry``), after its grow: the job is put in line at
    once, with every result's size in its admission. A job whose next turn can never be sent
    (``never_sent``: past max_model_len) ends there E_PROMPT_TOO_LONG, taken out of the store
    unadmitted: in line it would wait for nothing. A next prompt whose KV reservation passes the
    KV budget is grown like any other: admission takes such an item alone, when nothing else is
    in flight, exactly as it would a new job of that size.
  inference worker (turn N+1, admitted like any continuation)
    reads the round's results; a missing one is a timeout: E_TOOL_TIMEOUT, a failed one
    E_TOOL_FAILED, or either goes back to the model as the tool's result (``on_error = "model"``).
    The assistant message with the calls and one ``tool`` message per call are appended to the
    conversation, and the whole prompt is counted: past ``max_model_len`` with the plan's max
    tokens it ends E_PROMPT_TOO_LONG before sending. An untrusted tool's result is fenced like any
    untrusted material, and the job's later turns go out without tools (so untrusted text can
    never steer a tool call).

Failure cases: a tool worker that dies mid-tool (or a lost task, or a tool killed at its hard
time limit) leaves the result missing; the job's not-before time comes, the next turn runs and
the call counts as timed out - nothing waits for ever and exactly one envelope is published. A
round whose tasks never left (``readmit`` failed after the round was saved and the job came
back through its lease, or the worker died before sending) is not marked sent: the next turn
sends it again (at most ``MAX_ROUND_SENDS`` times, then E_BROKER_UNAVAILABLE) instead of
calling tools that never ran timed out. A task the broker refuses is a failed call saying so. A
tool task may run twice (broker redelivery): the result is written by call id, the last write
wins, the turn reads one. A result that comes in after its round's timeout (the job already in
line) is read but not counted in that turn's admission size.
The envelope's ``tool_rounds`` lists every round: its calls (name, arguments, the check's error),
their results (ok, content or error, started_at, duration_s) and the round's duration.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import redis
from celery.exceptions import SoftTimeLimitExceeded
from jsonschema.exceptions import best_match

from fleet.core.config import ProjectSettings, Settings, ToolSettings
from fleet.core.keys import Keys
from fleet.core.limits import loads
from fleet.core.request import fence
from fleet.core.schema import answer_validator
from fleet.core.seal import seal_turn
from fleet.infer.turns import ToolCall, ToolResult, ToolRound, ToolTask, TurnRecord

TOOL_TASK = "fleet.tool"
MAX_RESULT_CHARS = 20_000
# Counted with each result's text: its message's framing in the chat template and the markers of
# an untrusted tool's fence (an allowance: the text itself is counted by the backend's tokenizer).
RESULT_FRAMING_TOKENS = 32
# A tool still running this long after its timeout (the soft limit raised inside it) is killed:
# Celery's hard time limit, at KILL_GRACE_S + SETTLE_S past the timeout.
KILL_GRACE_S = 2.0
# More time under the hard limit for what follows the tool: storing its result, counting it
# (the backend's tokenizer, 5 s timeout; twice if the soft limit cut the first count), growing
# and hurrying the waiting job. The result is stored before it is counted, so a kill during the
# count loses only its size (the round is then not complete before its timeout; the next turn
# reads the result and counts its whole prompt before sending).
SETTLE_S = 12.0
# Sends of a round whose tasks never left (the worker lost Redis between saving and sending).
MAX_ROUND_SENDS = 3


def registered(project: ProjectSettings, names: list[str]) -> tuple[dict[str, ToolSettings], list[str]]:
    """The registry entries of ``names`` (tools the job may use) and the names left out."""
    kept = {n: project.tool_registry[n] for n in names if n in project.tool_registry}
    return kept, sorted(set(names) - set(kept))


def definitions(tools: dict[str, ToolSettings]) -> list[dict[str, Any]]:
    """What the model is told: the registry's definitions, in the job's order."""
    return [{"type": "function", "function": {"name": name, "description": tool.description,
                                               "parameters": tool.parameters}}
            for name, tool in tools.items()]


def as_sent(project: ProjectSettings, allowed: list[dict[str, Any]] | None,
            ) -> tuple[list[dict[str, Any]] | None, dict[str, ToolSettings], list[str]]:
    """(the tools a turn sends, the registry entries the fleet runs, the names left out) of the
    job's tools as ``tools_allowed`` left them: a project that runs its tools sends the registry's
    definitions of the registered ones (None: none is), any other the tools as they are. Prep
    looks the prompt up in what the project sent (fleet/prep/cachehint.py) with these tools."""
    if not allowed or project.tools != "run":
        return allowed, {}, []
    registry, unregistered = registered(
        project, [str((t.get("function") or {}).get("name")) for t in allowed])
    return definitions(registry) or None, registry, unregistered


@dataclass
class Call:
    id: str
    name: str
    arguments: str
    error: str | None = None  # why the call was not run (the check), None: it was run


def check_calls(raw: list[dict[str, Any]], tools: dict[str, ToolSettings],
                max_calls: int) -> list[Call]:
    """The model's calls of one turn, each with why it is not run (None: it is run). Results are
    keyed by call id, so a repeated id is not run (its twin's result would be taken for it and
    the round would never count as complete); nor are the calls past ``max_calls``."""
    calls: list[Call] = []
    seen: set[str] = set()
    for index, call in enumerate(raw):
        function = call.get("function") or {}
        name, arguments = str(function.get("name") or ""), str(function.get("arguments") or "")
        checked = Call(str(call.get("id") or f"call-{index}"), name, arguments)
        tool = tools.get(name)
        if checked.id in seen:
            checked.error = f"call id {checked.id!r} was used by an earlier call of this turn"
        elif index >= max_calls:
            checked.error = f"at most {max_calls} tool calls per turn are run; ask again for the rest"
        elif tool is None:
            checked.error = f"unknown tool {name!r}; the tools are: {', '.join(tools) or 'none'}"
        else:
            checked.error = _arguments_error(arguments, tool)
        seen.add(checked.id)
        calls.append(checked)
    return calls


def _arguments_error(arguments: str, tool: ToolSettings) -> str | None:
    try:
        value = loads(arguments or "{}")  # a model's arguments nested past MAX_JSON_DEPTH: refused
    except ValueError as exc:
        return f"arguments are not JSON: {exc}"
    failure = best_match(answer_validator(tool.parameters).iter_errors(value))
    if failure is None:
        return None
    where = failure.json_path if failure.path else "$"
    return f"arguments fail the tool's schema at {where}: {failure.message}"


def new_round(number: int, calls: list[Call], tools: dict[str, ToolSettings], now: float) -> ToolRound:
    run = [c for c in calls if c.error is None]
    return {"number": number, "calls": [ToolCall(**asdict(c)) for c in calls],  # type: ignore[typeddict-item]
            "started_at": now, "timeout_s": max((tools[c.name].timeout_s for c in run), default=0.0)}


def task_of(call: ToolCall, tool: ToolSettings, project: str) -> ToolTask:
    """What the inference worker sends for one valid call: the task runs under Celery's time
    limits, soft at the tool's timeout, hard ``KILL_GRACE_S`` later (prefork pool only)."""
    return {"id": call["id"], "name": call["name"], "queue": tool.queue_for(project),
            "timeout_s": tool.timeout_s, "time_limit_s": tool.timeout_s + KILL_GRACE_S + SETTLE_S}


# -- results (written by the tool worker, read by the next turn) -------------------------------
def result_field(round_number: int, call_id: str) -> str:
    return f"{round_number}:{call_id}"


def save_result(client: redis.Redis, keys: Keys, settings: Settings, ref: str, round_number: int,
                call_id: str, result: ToolResult) -> None:
    """Store one call's result, sealed (stored again once it carries its ``tokens``)."""
    text = json.dumps(result)
    field = result_field(round_number, call_id)
    sealed = json.dumps({"result": text, "seal": seal_turn(settings, f"{ref}#{field}", text)})
    pipe = client.pipeline()
    pipe.hset(keys.tools(ref), field, sealed)
    pipe.expire(keys.tools(ref), settings.result_ttl_s)
    pipe.execute()


def sent_field(round_number: int) -> str:
    """The round's mark in the results hash (call ids' fields start with the round's number)."""
    return f"sent:{round_number}"


def mark_sent(client: redis.Redis, keys: Keys, settings: Settings, ref: str, round_number: int) -> None:
    """The round's tasks are being sent (written just before them)."""
    pipe = client.pipeline()
    pipe.hset(keys.tools(ref), sent_field(round_number), "1")
    pipe.expire(keys.tools(ref), settings.result_ttl_s)
    pipe.execute()


def was_sent(client: redis.Redis, keys: Keys, ref: str, round_number: int) -> bool:
    return bool(client.hexists(keys.tools(ref), sent_field(round_number)))


def load_results(client: redis.Redis, keys: Keys, settings: Settings, ref: str,
                 round_: ToolRound) -> dict[str, ToolResult]:
    """The round's results by call id; one without the workers' seal counts as missing."""
    ids = [c["id"] for c in round_["calls"] if c["error"] is None]
    if not ids:
        return {}
    fields = [result_field(round_["number"], i) for i in ids]
    found: dict[str, ToolResult] = {}
    for call_id, field, raw in zip(ids, fields, client.hmget(keys.tools(ref), fields), strict=True):
        if raw is None:
            continue
        try:
            sealed = json.loads(raw)
            if sealed["seal"] == seal_turn(settings, f"{ref}#{field}", sealed["result"]):
                found[call_id] = json.loads(sealed["result"])
        except (ValueError, KeyError, TypeError):
            continue
    return found


def round_complete(round_: ToolRound, results: dict[str, ToolResult]) -> bool:
    """Every valid call of the round has its result in AND counted (``tokens``). A result is
    stored before it is counted (so a limit landing in the count never loses it): one without
    its size is not complete yet, else the job would be put in line before its size grew (the
    worker whose count lands last sees every size, grows the job by all of them, then hurries)."""
    return all("tokens" in results.get(c["id"], ToolResult()) for c in round_["calls"] if c["error"] is None)


def counted_text(result: ToolResult) -> str:
    """What the model will read of a result (before an untrusted tool's fence)."""
    if result.get("ok"):
        return result_text(result.get("content"))
    return f"The tool failed: {result.get('error')}"


def next_prompt_tokens(turn: TurnRecord, results: dict[str, ToolResult]) -> int:
    """The next turn's prompt once ``results`` are in: the prompt the round was readmitted with
    (the conversation and the calls) and each result's ``tokens``."""
    return int(turn["plan"]["prompt_tokens"]) + sum(int(r.get("tokens") or 0) for r in results.values())


def never_sent(turn: TurnRecord, results: dict[str, ToolResult], max_model_len: int | None = None) -> str | None:
    """Why the next turn can never be sent, whatever else comes in (None: it may be): the least
    its prompt will be (the prompt so far and each result's text, without the framing allowance)
    next to the plan's max tokens passes ``max_model_len`` (the largest of the backends serving
    the job's model: the next turn may run on any of them; None: the plan's, the backend the
    last turn ran on) - the next turn's own check, done early."""
    plan = turn["plan"]
    limit = int(plan["max_model_len"]) if max_model_len is None else max_model_len
    least = next_prompt_tokens(turn, results) - RESULT_FRAMING_TOKENS * len(results)
    if least + int(plan["max_tokens"]) <= limit:
        return None
    return (f"with the results of tool round {turn['tool_rounds'][-1]['number']} so far the prompt "
            f"is at least {least} tokens: with max_tokens {plan['max_tokens']} it passes "
            f"max_model_len {limit}")


def timeout_error(timeout_s: float) -> str:
    return f"no result within {timeout_s:g} s"


def result_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text[:MAX_RESULT_CHARS]


@dataclass(frozen=True)
class Outcome:
    """How a finished round goes on: its messages, or the code that ends the job."""

    messages: list[dict[str, Any]]
    untrusted: bool  # a result came from an untrusted tool: later turns go out without tools
    failure: tuple[str, str] | None = None  # (code name, cause)


def call_message(round_: ToolRound) -> dict[str, Any]:
    """The assistant message of a round: its calls, as the model made them."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": c["id"], "type": "function",
         "function": {"name": c["name"], "arguments": c["arguments"]}} for c in round_["calls"]]}


def finish_round(round_: ToolRound, results: dict[str, ToolResult],
                 tools: dict[str, ToolSettings], fence_tag: str, now: float) -> Outcome:
    """The tool messages of a round whose results are in (or whose time is up); records each
    call's result in ``round_`` (for the envelope)."""
    messages: list[dict[str, Any]] = [call_message(round_)]
    untrusted, failure = False, None
    for call in round_["calls"]:
        tool = tools.get(call["name"])
        if call["error"] is not None:
            content, call["result"] = f"The call was not run: {call['error']}", None
        else:
            assert tool is not None
            result = results.get(call["id"])
            if result is None:
                result = {"ok": False, "error": timeout_error(tool.timeout_s), "timed_out": True}
            code = "E_TOOL_TIMEOUT" if result.get("timed_out") else "E_TOOL_FAILED"
            call["result"] = result
            if not result.get("ok"):
                if tool.on_error == "fail" and failure is None:
                    failure = (code, f"tool {call['name']!r}: {result.get('error')}")
                content = f"The tool failed: {result.get('error')}"
            else:
                content = result_text(result.get("content"))
            if tool.untrusted:
                untrusted = True
                content = fence(content, fence_tag)
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
    round_["duration_s"] = round(now - round_["started_at"], 3)
    return Outcome(messages, untrusted, failure)


def run_tool(task: Any, arguments: str, timeout_s: float) -> ToolResult:
    """Run a registered tool task in this process; its result or error as stored. Celery's
    soft time limit (at ``timeout_s``) raises inside the tool: a timeout, not a failure."""
    started_at, started = time.time(), time.monotonic()
    try:
        value = task(**json.loads(arguments or "{}"))
    except SoftTimeLimitExceeded:
        return {"ok": False, "error": timeout_error(timeout_s), "timed_out": True,
                "started_at": started_at, "duration_s": round(time.monotonic() - started, 3)}
    except Exception as exc:  # the tool's own failure: reported, never the worker's
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                "started_at": started_at, "duration_s": round(time.monotonic() - started, 3)}
    return {"ok": True, "content": result_text(value), "started_at": started_at,
            "duration_s": round(time.monotonic() - started, 3)}
