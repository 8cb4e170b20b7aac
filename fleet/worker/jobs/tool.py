"""The tool task's work and everything the worker does with tools (fleet/infer/tools.py is imported
here only): sending a round's ``fleet.tool`` tasks, running one call, settling its result, and the
tools a job's first turn sends (which prep looks its prompt up with).

fleet.tool (queue of the tool, kwargs ref, round_number, call_id; sent by an inference worker
with Celery time limits from the tool's timeout)
  runs one tool call of a job's tool round: only a call the job's sealed current turn names (the
  same check as fleet.infer's, ``current_turn``), with the arguments it names; stores the result
  sealed (first, then again with its size in tokens), grows the waiting job's admission size by
  it and, once every result of the round is in and counted, puts the job in line at once; a job
  whose next turn can never be sent ends E_PROMPT_TOO_LONG there, unadmitted (``end_unleased``,
  fleet/worker/jobs/common.py).

Failure cases: a call the job's current turn does not name is "stale" (late, duplicate or
forged), a turn that fails its seal "refused"; a tool task that could not be sent is that call's
failed result; a tool that raises or times out is a failed result, never the worker's failure.
Celery's soft time limit landing after the tool returned is ridden out (``_past_soft_limit``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from celery.exceptions import SoftTimeLimitExceeded

from fleet.core.codes import Code
from fleet.core.config import ProjectSettings
from fleet.core.errors import AuthError
from fleet.core.keys import split_ref
from fleet.core.models import Job
from fleet.core.request import tools_allowed
from fleet.core.routing import job_eligible, route
from fleet.core.seal import check_seal
from fleet.infer import tools as tools_mod
from fleet.infer.turns import ToolCall, ToolResult, ToolRound, TurnRecord
from fleet.worker.jobs.common import current_turn, end_unleased, event_sink
from fleet.worker.runtime import Runtime

if TYPE_CHECKING:
    from fleet.infer.attempts import Continuation

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def first_turn_tools(project: ProjectSettings, job: Job) -> list[dict[str, Any]] | None:
    """The tools a prepared job's first turn sends (fleet/infer/tools.py ``as_sent``)."""
    allowed, _, _ = tools_allowed(job, project)
    return tools_mod.as_sent(project, allowed)[0]


def send_round(rt: Runtime, ref: str, cont: Continuation) -> bool:
    """One ``fleet.tool`` task per call, all at once (they run in parallel on the tool workers),
    after the round is marked sent (fleet/infer/tools.py). A send that fails is that call's
    result: a failure saying so (no tool ran, so it did not time out). False when the round could
    not be marked sent: nothing is sent, and the job (readmitted, waiting for the round) is put in
    line at once, so its next turn sends the round again now rather than at its timeout."""
    assert rt.send_task is not None, "a worker runtime sends tasks"
    number = cont.turn["tool_rounds"][-1]["number"]
    try:
        tools_mod.mark_sent(rt.redis, rt.keys, rt.settings, ref, number)
    except redis.RedisError as exc:
        log.warning("tool round %d of job=%s not sent (%r): the job is readmitted, its next turn "
                    "sends the round again", number, ref, exc)
        with contextlib.suppress(redis.RedisError):
            rt.store.hurry(ref, time.time())
        return False
    owner, job_id = split_ref(ref)
    for call in cont.tool_calls:
        try:
            rt.send_task("fleet.tool", kwargs={"ref": ref, "round_number": number,
                                               "call_id": call["id"]},
                         queue=call["queue"], argsrepr="tool", time_limit=call["time_limit_s"],
                         soft_time_limit=call["timeout_s"],
                         kwargsrepr=f"project={owner} job={job_id} tool={call['name']} round={number}")
        except Exception as exc:  # the broker: the call fails as not sent, the job goes on
            log.warning("tool task of job=%s call=%s not sent: %r", ref, call["id"], exc)
            failed = _counted(rt, {"ok": False, "error": f"the tool task could not be sent: "
                                                         f"{type(exc).__name__}"})
            with contextlib.suppress(redis.RedisError):
                tools_mod.save_result(rt.redis, rt.keys, rt.settings, ref, number, call["id"], failed)
    return True


def _counted(rt: Runtime, result: ToolResult) -> ToolResult:
    """``result`` with its size in the next turn's prompt (``tokens``: what the model will read,
    counted by the backend's tokenizer, and its message's framing); a round is complete only
    once each of its results carries it (fleet/infer/tools.py ``round_complete``)."""
    text = tools_mod.counted_text(result)
    return {**result, "tokens": rt.counter.count_text(text)[0] + tools_mod.RESULT_FRAMING_TOKENS}


def tool_job(rt: Runtime, tasks: Any, ref: str, round_number: int, call_id: str) -> str:
    """Run one call of a tool round (module docstring); returns what became of it."""
    try:
        record = rt.results.job_record(ref)
        check_seal(rt.settings, ref, record)  # the job's model (below) only from the prep worker's seal
        turn = current_turn(rt, ref, record)
    except AuthError as exc:
        log.warning("tool call %s of job=%s refused: %s", call_id, ref, exc.message)
        return "refused"
    rounds = turn["tool_rounds"] if turn is not None else []
    pending = next((r for r in rounds if r["number"] == round_number and "duration_s" not in r), None)
    call = next((c for c in (pending["calls"] if pending is not None else [])
                 if c["id"] == call_id and c["error"] is None), None)
    if turn is None or pending is None or call is None:
        return "stale"  # not a call of the job's open round (late, duplicate or forged)
    if rt.results.get(ref) is not None:
        return "stale"  # the job ended meanwhile (another call of its round ended it)
    tool = rt.settings.projects[split_ref(ref)[0]].tool_registry[call["name"]]
    task = tasks.get(tool.task)
    if task is None:
        result: ToolResult = {"ok": False, "error": f"the tool task {tool.task!r} is not registered on this worker"}
    else:
        result = tools_mod.run_tool(task, call["arguments"], tool.timeout_s)
    return _settle_result(rt, ref, turn, pending, call, result, _model_of(record))


def _model_of(record: dict[str, str]) -> str | None:
    """The model the job named (None: its project's default), from its record, whose seal the
    caller checked."""
    try:
        return json.loads(record.get("job") or "{}").get("model")
    except ValueError:
        return None


def _settle_result(rt: Runtime, ref: str, turn: TurnRecord, round_: ToolRound, call: ToolCall,
                   result: ToolResult, model: str | None = None) -> str:
    """After the tool returned: store its result FIRST (the tool has run and its effects are
    done: a limit or a kill landing later must not turn them into a timeout), then count it
    where the text is (the next turn's admission reserves for it), grow the waiting job by it
    and, once the round is complete, put the job in line at once. Celery's soft time limit
    (meant for the tool) may still fire here: each step runs again once (all are idempotent);
    the hard limit leaves ``tools.SETTLE_S`` for these steps. The round is complete once every
    result is in with its size, as read back after this one is stored counted: the worker whose
    count lands last grows the job by all of them, then hurries it (a result stored but not yet
    counted keeps the round open: the job is never put in line with a result's size missing
    from its KV reservation). A job whose next prompt can never be sent (past max_model_len next
    to its max tokens) ends here E_PROMPT_TOO_LONG instead of waiting in line for nothing."""
    number, call_id = round_["number"], call["id"]

    def save(stored: ToolResult) -> None:
        tools_mod.save_result(rt.redis, rt.keys, rt.settings, ref, number, call_id, stored)

    _past_soft_limit(lambda: save(result))
    counted = _past_soft_limit(lambda: _counted(rt, result))
    _past_soft_limit(lambda: save(counted))
    _past_soft_limit(lambda: event_sink(rt, ref).emit(
        "tool_result", number=number, call=call_id, name=call["name"], ok=result["ok"],
        duration_s=result.get("duration_s")))
    results = _past_soft_limit(lambda: tools_mod.load_results(rt.redis, rt.keys, rt.settings, ref, round_))
    project = split_ref(ref)[0]
    largest = route(rt.settings, rt.settings.projects.get(project), model).max_model_len
    why = tools_mod.never_sent(turn, results, largest)
    if why is not None:
        return _end_waiting(rt, ref, turn, Code.E_PROMPT_TOO_LONG, why)
    grown = tools_mod.next_prompt_tokens(turn, results)
    quota = rt.store.config.quota(project)
    if quota is not None and quota.never_fits(quota.reserve(grown, int(turn["plan"]["max_tokens"]))):
        return _end_waiting(rt, ref, turn, Code.E_QUOTA_EXCEEDED,
                            f"quota: the next turn (prompt {grown:,} with the tool results, and its output "
                            f"limit) may cost more than the project's smallest token quota "
                            f"({quota.smallest_tokens:,}): it could never be admitted")
    mask = job_eligible(rt.settings, project, model, grown + int(turn["plan"]["max_tokens"]))
    _past_soft_limit(lambda: rt.store.grow(ref, grown, eligible=mask))
    if tools_mod.round_complete(round_, results):  # in line now, not at the round's timeout
        _past_soft_limit(lambda: rt.store.hurry(ref, time.time()))
    return "ok" if result["ok"] else "failed"


def _past_soft_limit(step: Callable[[], _T]) -> _T:
    """``step()``, run again if Celery's soft time limit cut it: the limit is meant for the tool,
    which has returned, and it fires once per task."""
    try:
        return step()
    except SoftTimeLimitExceeded:
        return step()


def _end_waiting(rt: Runtime, ref: str, turn: TurnRecord, code: Code, message: str) -> str:
    """End a job that waits between turns (no lease): its envelope, then out of the store
    (``end_unleased``). A job no longer waiting (running already) is left to its turn, which
    ends it too; one admitted between the two reads here finds its result and stops."""
    if _past_soft_limit(lambda: rt.results.job_record(ref).get("state")) != "pending":
        return "not-waiting"
    log.info("job=%s ended between turns: %s", ref, message)
    return _past_soft_limit(lambda: end_unleased(rt, ref, code, message,
                                                  tool_rounds=turn["tool_rounds"]))
