"""The two Celery tasks and what they hand each other.

Jobs are named by their ref, ``<project>/<id>`` (fleet/core/keys.py).

fleet.prep (queue fleet.<project>, kwargs project, job_id, signed)
  verify signature (a rejection is keyed by the digest of the whole message) -> the job record
  must be this project's and this message's -> parse Job -> cancelled/deadline? -> plan budget
  -> collect + trim
  -> kinds collect/trim: publish OK_MATERIAL
  -> otherwise store the prepared job + plan in the job hash under the workers' seal (over them
     and every other field that decides what runs or where the outcome goes; fleet/core/seal.py)
     and add it to the dispatcher's pending set, enqueued at this worker's clock (the
     producer's submitted_at is information only and never decides the order).
fleet.cancel (queue fleet.<project>, kwargs project, job_id; sent by fleet.Client.cancel)
  acts only on a cancel request signed by the project (``{p}cancel:{<ref>}``): publishes
  E_CANCELLED for a job not running yet and removes it from the dispatcher; a running job is left
  to its lease keeper.
fleet.tool (queue of the tool, kwargs ref, round_number, call_id; sent by an inference worker
  with Celery time limits from the tool's timeout)
  runs one tool call of a job's tool round (fleet/infer/tools.py): only a call the job's sealed
  current turn names (the same check as fleet.infer's), with the arguments it names; stores the
  result sealed (first, then again with its size in tokens), grows the waiting job's admission
  size by it and, once every result of the round is in and counted, puts the job in line at
  once; a job whose next turn can never be sent ends E_PROMPT_TOO_LONG there, unadmitted.
fleet.infer (queue fleet.infer, kwargs ref, project, fence; sent by a dispatcher)
  stale fence (duplicate or late delivery) -> drop; already final (ended while it waited: see
  below) -> release, drop;
  the ref, the task, the lease, the record and the sealed job must name one project, and the seal
  must verify, and a saved turn must be the one the store names (its number, recorded by
  ``readmit``; the producer may write its job hash but not the store), else E_AUTH before
  anything is sent; otherwise run ONE model turn under a LeaseKeeper (it stops the turn on a
  cancel request or on a final result published meanwhile). A final envelope is published (if
  the job has none yet), then the lease released. A continuation (the job
  needs another turn: retry, re-ask, backend outage) is saved sealed in the job hash (``turn``,
  state "pending"), then ``readmit`` gives the lease up and puts the job back in line at its place
  with the next turn's plan and prompt, not before its backoff (schedulers/store/base.py,
  Continuations), and records the turn's number; then a job cancelled meanwhile ends, else a
  tool round's tasks go out (before anything else: the job waits for them). A
  worker whose lease was lost publishes nothing: the job is already pending again.
  Between two turns nothing runs and nothing is held: a worker dying after saving the turn and
  before ``readmit`` leaves the lease to expire, and the reaped job resumes from the saved turn
  (attempts are recorded as they end, fleet/infer/carryover.py); a cancel or a deadline between
  turns ends the job like any pending job's.

Each task runs only for a message taken from a queue it belongs on, as the fleet's transport
stamped it on delivery (fleet/worker/transport.py; ``off_its_queue``): fleet.infer from
fleet.infer, fleet.prep and fleet.cancel from the queues of the project they name (its queue or
its collect queue; the unrouted queue for a project the fleet does not know), fleet.tool from a
tool queue. Celery runs any task it has registered whatever queue the message came from, and a
producer may push raw messages onto its own project queue (routing key and delivery_info
included, which is why they are never trusted): without this, a fleet.infer message naming
another project's job and a guessed fence ran that job's turn, and a fleet.prep message naming
another project wrote a ``rejected`` event into that project's job. A message off its queue runs
nothing, is acknowledged (never redelivered) and logs one WARNING.

Ending a job that holds no lease (in line, or waiting between turns: a cancel while prep hands it
over, ``fleet.cancel``, a cancel between turns, a tool result its next turn can never be sent
with): its final envelope is published FIRST, then its item is taken out of the dispatcher store
(``_end_unleased``). A worker dying in between leaves an item whose job is final: the dispatcher
admits it and ``fleet.infer`` finds the result, releases the slot and drops it. The other order
would leave a job "pending" with no item and no envelope, which nothing ever ends (no lease to
expire; the prep watchdog looks only at jobs not handed over). A job admitted just before it was
ended finds its result at its claim, or, running already, its lease keeper sees the result (as it
sees a cancel) and stops; publishing is first-wins, so the job keeps exactly one envelope.

Failure cases: every exception inside either task becomes an Envelope (E_INTERNAL at worst), so
a bad job never crashes a worker, poisons a queue or stays without a final result.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from celery import Celery, Task
from celery.exceptions import SoftTimeLimitExceeded
from pydantic import ValidationError

from fleet.core.codes import Code
from fleet.core.errors import AuthError, FleetError, InputInvalid
from fleet.core.events import EventSink
from fleet.core.keys import job_ref, split_ref
from fleet.core.limits import check_job, check_message
from fleet.core.models import Envelope, Job, Timings, describe_invalid
from fleet.core.outagelog import BROKER_LOST
from fleet.core.request import tools_allowed
from fleet.core.seal import cancel_valid, check_seal, check_turn, digest, seal_turn, sealed
from fleet.core.signing import verify
from fleet.prep.watchdog import HANDED_OVER, PrepClaim
from fleet.worker.app import (
    INFER_QUEUE,
    JobEnded,
    QueuedRequest,
    ShownRequest,
    arrived_on,
    home_queues,
    task_outcome,
    tool_queues,
)
from fleet.worker.heartbeat import beat_when_ready
from fleet.worker.lease import LeaseKeeper
from fleet.worker.metrics import WorkerMetrics, serve_when_started
from fleet.worker.runtime import Runtime
from schedulers.backoff import Backoff
from schedulers.store.base import PendingItem

if TYPE_CHECKING:  # the inference modules are imported on first use, in the worker that runs one
    from fleet.infer.attempts import Continuation

log = logging.getLogger(__name__)
_T = TypeVar("_T")



def register_tasks(app: Celery, tools: bool = True) -> None:
    """Register the fleet's tasks on ``app``; ``fleet.tool`` only when this worker runs tools: a
    prep worker that knew it would run it for a message a producer pushed onto its own project
    queue (the call still had to be its own job's, but it ended as "task not registered")."""
    metrics = WorkerMetrics()
    runtime = Runtime(app.fleet_settings, on_publish=metrics.observe,  # type: ignore[attr-defined]
                      send_task=app.send_task)
    serve_when_started(app, metrics, runtime.settings.worker_metrics_port)
    beat_when_ready(app, runtime.redis, runtime.keys, INFER_QUEUE)

    # A non-OK final code raises JobEnded (fleet/worker/app.py): FAILURE in Flower, no redelivery.
    @app.task(name="fleet.prep", bind=True, acks_late=True, throws=(JobEnded,), Request=ShownRequest)
    def prep(task: Task, *, project: str, job_id: str, signed: dict[str, Any]) -> str:
        if off_its_queue(task, home_queues(runtime.settings, project), job_ref(project, job_id)):
            return WRONG_QUEUE
        owner = _owner()  # one owner across retries: the claim of an attempt cut short is ours
        outcome = riding_out_broker_loss(
            lambda: prep_job(runtime, project, job_id, signed, owner), job_ref(project, job_id),
            runtime.settings.prep_lease_s)
        return task_outcome(outcome, job_id)

    @app.task(name="fleet.cancel", bind=True, acks_late=True, Request=ShownRequest)
    def cancel(task: Task, *, project: str, job_id: str) -> str:
        if off_its_queue(task, home_queues(runtime.settings, project), job_ref(project, job_id)):
            return WRONG_QUEUE
        return cancel_job(runtime, project, job_id)

    @app.task(name="fleet.infer", bind=True, acks_late=True, throws=(JobEnded,), Request=ShownRequest)
    def infer(task: Task, *, ref: str, project: str, fence: int) -> str:
        if off_its_queue(task, {INFER_QUEUE}, ref):
            return WRONG_QUEUE
        return task_outcome(infer_job(runtime, ref, project, fence), split_ref(ref)[1])

    if not tools:
        return

    @app.task(name="fleet.tool", bind=True, acks_late=True, Request=QueuedRequest)
    def tool(task: Task, *, ref: str, round_number: int, call_id: str) -> str:
        if off_its_queue(task, set(tool_queues(runtime.settings)), ref):
            return WRONG_QUEUE
        return f"{tool_job(runtime, app.tasks, ref, round_number, call_id)} job={split_ref(ref)[1]}"


WRONG_QUEUE = "wrong-queue"  # the outcome of a task refused by ``off_its_queue``


def off_its_queue(task: Task, allowed: Collection[str], ref: str) -> bool:
    """True (and one WARNING) when the task's message was not taken from one of the ``allowed``
    queues, as the transport stamped it: the task then runs nothing and its message is
    acknowledged. A producer may push raw messages onto its own project queue, and Celery runs
    any registered task whatever queue it came from; the queue the message names itself is
    the sender's word (module docstring)."""
    queue = arrived_on(task.request)
    if queue in allowed:
        return False
    log.warning("%s task for job=%.80s taken from queue %.80s, where it never belongs: not run",
                task.name, ref, queue)
    return True


def _events(rt: Runtime, ref: str) -> EventSink:
    return EventSink(rt.redis, rt.keys, ref, rt.settings.events_ttl_s)


def cancel_requested(rt: Runtime, ref: str) -> bool:
    """A cancel request signed by the job's own project exists (anything else is ignored)."""
    project, job_id = split_ref(ref)
    return cancel_valid(rt.settings, project, job_id, rt.redis.get(rt.keys.cancel(ref)))


def _fail(rt: Runtime, job_id: str, project: str, code: Code, message: str, **extra: Any) -> str:
    rt.results.publish(Envelope.failure(job_id, project, code, message, **extra))
    return code.value


def riding_out_broker_loss(run: Callable[[], str], ref: str, patience_s: float) -> str:
    """``run()``, again after a pause while Redis is unreachable (0.5 s doubling to 5 s), for
    ``patience_s`` at most; then the error goes up (the prep watchdog sends the job again).
    Without this a prep task cut by a Redis restart would end and be acknowledged, and its job
    would wait for the watchdog's ``prep_unclaimed_s``."""
    backoff = Backoff()
    give_up_at = time.monotonic() + patience_s
    while True:
        try:
            return run()
        except BROKER_LOST as exc:
            if time.monotonic() >= give_up_at:
                raise
            pause_s = backoff.next_s()
            log.warning("prep of job=%s: redis unreachable (%r); again in %.1fs", ref, exc, pause_s)
            time.sleep(pause_s)


# -- prep -------------------------------------------------------------------------------------
def prep_job(rt: Runtime, project: str, job_id: str, signed: dict[str, Any],
             owner: str | None = None) -> str:
    received = digest(signed)
    ref = job_ref(str(project), str(job_id))
    try:
        check_message(signed, rt.settings.limits)  # before verifying or parsing: size is the cost
        raw = verify(signed, rt.settings, rt.redis, rt.keys)
        # The task's routing kwargs are not signed: they must agree with what is.
        if signed.get("project") != project or raw.get("id") != job_id:
            raise AuthError("task arguments differ from the signed job (project or job id)")
        _check_record(rt.results.job_record(ref), project, received)
    except (AuthError, InputInvalid) as exc:
        rt.results.reject(str(job_id), str(project), exc.message, received, code=exc.code)
        return exc.code.value
    claim = PrepClaim(rt.redis, rt.keys, ref, owner or _owner(), rt.settings.prep_lease_s)
    if not claim.acquire():
        return "duplicate"  # another delivery is preparing it right now
    try:
        if rt.results.job_record(ref).get("state") in HANDED_OVER:
            return "duplicate"  # checked under the claim: an earlier delivery handed it over
        return _prep_claimed(rt, project, job_id, raw)
    finally:
        claim.release()


def _check_record(record: dict[str, str], project: str, received: str) -> None:
    """The job record (if any) must be this project's, made for this very message: a message
    the record does not name (a second message with the same id) never prepares the job."""
    if record.get("project", project) != project:
        raise AuthError("the job record belongs to another project")
    if record.get("digest", received) != received:
        raise AuthError("the job record was made for another message with this job id")


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _prep_claimed(rt: Runtime, project: str, job_id: str, raw: dict[str, Any]) -> str:
    if rt.results.get(job_ref(project, job_id)) is not None:
        return "already-final"
    try:
        job = Job.model_validate(raw)
    except ValidationError as exc:
        return _fail(rt, job_id, project, Code.E_INPUT_INVALID, f"invalid job: {describe_invalid(exc)}")
    if job.id != job_id:
        return _fail(rt, job_id, project, Code.E_INPUT_INVALID, "job id differs from the message")
    try:
        return _prepare_and_enqueue(rt, job)
    except BROKER_LOST:
        raise  # not the job's fault: the task tries again (riding_out_broker_loss)
    except FleetError as exc:
        return _fail(rt, job.id, job.project, exc.code, exc.message, kind=job.kind)
    except Exception as exc:  # the last line of defence: close the job, keep the worker
        log.exception("prep failed job=%s", job.id)
        return _fail(rt, job.id, job.project, Code.E_INTERNAL, f"prep failed: {type(exc).__name__}")


def _prepare_and_enqueue(rt: Runtime, job: Job) -> str:
    from fleet.infer import tools as tools_mod
    from fleet.infer.budget import plan as plan_budget
    from fleet.prep.cachehint import uncached_of
    from fleet.prep.prepare import prepare

    settings = rt.settings
    check_job(job, settings.limits)
    project = settings.projects[job.project]
    ref = job_ref(job.project, job.id)
    if cancel_requested(rt, ref):
        return _fail(rt, job.id, job.project, Code.E_CANCELLED, "cancelled before preparation")
    if job.deadline is not None and job.deadline <= time.time():
        return _fail(rt, job.id, job.project, Code.E_DEADLINE, "deadline passed while queued")
    first = plan_budget(job, project, settings, 0)
    prepared = prepare(job, settings, project, rt.redis, rt.keys, first.room_tokens, rt.counter,
                       collector=rt.collector)
    if job.kind in ("collect", "trim"):
        envelope = Envelope(
            job_id=job.id, project=job.project, kind=job.kind, code=Code.OK_MATERIAL,
            message=f"{len(prepared.material)} sources, {prepared.prompt_tokens} tokens",
            material=prepared.material, warnings=prepared.warnings, metadata=job.metadata,
            content="\n\n".join(str(m.get("text", "")) for m in prepared.material) or None,
        )
        rt.results.publish(envelope)
        return envelope.code.value
    plan = plan_budget(job, project, settings, prepared.prompt_tokens, prepared.prefix_tokens)
    ready = job.model_copy(update={"messages": prepared.messages, "sources": []})
    job_json, plan_json = ready.model_dump_json(), json.dumps(plan.__dict__)
    rt.results.record(ref, **sealed(
        settings, ref, project=job.project, kind=job.kind, job=job_json, plan=plan_json,
        warnings=json.dumps(prepared.warnings), fence_tag=prepared.fence_tag,
    ))
    allowed, _, _ = tools_allowed(ready, project)
    uncached = uncached_of(rt.redis, rt.keys, settings, ready, prepared,
                           tools=tools_mod.as_sent(project, allowed)[0])
    handed_over = time.time()  # the fleet's clock orders the queue, never the producer's
    rt.store.add_pending(PendingItem(
        job_id=ref, project=job.project, prompt_tokens=prepared.prompt_tokens,
        max_new_tokens=plan.max_tokens, band=job.band, priority=job.priority,
        enqueued_at=handed_over, deadline=job.deadline, uncached_tokens=uncached,
    ))
    # Only now "pending": had this task died before add_pending, the job would still read
    # "submitted", and a redelivery or the prep watchdog would prepare it again.
    rt.results.record(ref, state="pending", pending_at=handed_over)
    if cancel_requested(rt, ref):
        # cancelled while this task prepared it: never let it take a slot
        return _end_unleased(rt, ref, Code.E_CANCELLED, "cancelled while queued")
    _events(rt, ref).emit("prepared", prompt_tokens=prepared.prompt_tokens,
                             uncached_tokens=uncached, max_tokens=plan.max_tokens,
                             warnings=prepared.warnings)
    return "pending"


# -- cancel -----------------------------------------------------------------------------------
def cancel_job(rt: Runtime, project: str, job_id: str) -> str:
    ref = job_ref(str(project), str(job_id))
    if not cancel_requested(rt, ref):
        log.warning("cancel of job=%s refused: no request signed by project %s", ref, project)
        return "refused"
    state = rt.results.job_record(ref).get("state", "")
    if state in ("running", "final"):
        return state  # a running job's lease keeper sees the request; a final one stays final
    if state in ("pending", "submitted"):
        # "submitted": not prepared yet; its prep task sees the request and stops anyway
        _end_unleased(rt, ref, Code.E_CANCELLED, "cancelled while queued")
    return "cancelled"


def _end_unleased(rt: Runtime, ref: str, code: Code, message: str, **extra: Any) -> str:
    """End a job that holds no lease (in line, waiting between turns, or not handed over yet):
    its final envelope FIRST, then its item out of the dispatcher store (module docstring). A
    worker dying in between leaves an item whose job is final, which the inference task releases
    and drops; the other order would leave a job with neither, which nothing ever ends."""
    project, job_id = split_ref(ref)
    _fail(rt, job_id, project, code, message, **extra)
    rt.store.cancel_pending(ref)
    return code.value


# -- infer ------------------------------------------------------------------------------------
def infer_job(rt: Runtime, ref: str, project: str, fence: int) -> str:
    store = rt.store
    # Claim first (it checks the fence itself: one round trip on the way to the backend); only a
    # refused claim reads the lease, to tell a stale delivery from a duplicate one.
    if not store.claim(ref, fence, _owner(), time.time()):
        if not store.lease_valid(ref, fence):
            log.info("dropped stale delivery job=%s fence=%d", ref, fence)
            return "stale"
        log.info("dropped duplicate delivery job=%s fence=%d", ref, fence)
        return "duplicate"
    owner, job_id = split_ref(ref)  # envelopes go to the ref's own job, whatever the task says
    if rt.results.get(ref) is not None:
        store.release(ref, fence)  # ours: claimed above
        return "already-final"
    cancel_key, result_key = rt.keys.cancel(ref), rt.keys.result(ref)
    keeper = LeaseKeeper(  # a cancel request, or a final result published meanwhile, stops it
        rt.lease_store,
        lambda: (cancel_valid(rt.settings, owner, job_id, rt.lease_redis.get(cancel_key))
                 or bool(rt.lease_redis.exists(result_key))),
        ref, fence, rt.settings.admission.lease_ttl_s)
    try:
        with keeper:
            rt.results.record(ref, state="running", running_at=time.time(), fence=fence)
            envelope = _run(rt, ref, project, keeper)
    except BROKER_LOST as exc:
        # Not the job's fault: its lease expires (or is given back here) and it runs again.
        log.warning("redis lost while running job=%s (%r); the job goes back in line", ref, exc)
        with contextlib.suppress(redis.RedisError):
            store.requeue(ref, fence)
        return "broker-lost"
    except Exception as exc:  # a bug or Redis failure: end the job, keep the worker
        log.exception("infer failed job=%s", ref)
        envelope = Envelope.failure(job_id, owner, Code.E_INTERNAL,
                                    f"inference task failed: {type(exc).__name__}")
    # (A worker shutting down mid-stream raises BaseException: the lease is left to expire and
    # the job is admitted again at its place in line.)
    if keeper.lost and not keeper.cancelled:
        # Put it back in line (fence-checked: if the lease was already reaped this is a no-op,
        # the job is pending again anyway); its next attempt will publish.
        store.requeue(ref, fence)
        return "lease-lost"
    if not isinstance(envelope, Envelope):
        return _continue(rt, ref, fence, envelope)
    # Publish first, then release: a crash or a Redis error in between leaves the lease to
    # expire and the job to run again (which finds its result and stops), never a lost job.
    published = rt.results.publish(envelope)
    store.release(ref, fence)
    return envelope.code.value if published else "already-final"


def _continue(rt: Runtime, ref: str, fence: int, cont: Continuation) -> str:
    """Save the next turn, give the lease up, back in line (module docstring). A Redis error
    before ``readmit`` is done leaves the lease to expire: the reaped job resumes from what was
    saved. One after it leaves the job readmitted (no lease): its next turn goes on from the
    saved turn, and sends a tool round that was not marked sent again. Once readmitted: a job
    cancelled meanwhile ends (checked first, whether or not its tools could go out), else the
    round's tools are sent, then the ``continuation`` event is recorded."""
    turn_json = json.dumps(cont.turn)
    try:
        rt.results.record(ref, state="pending", pending_at=time.time(), turn=turn_json,
                          turn_seal=seal_turn(rt.settings, ref, turn_json))
        if not rt.store.readmit(ref, fence, cont.max_tokens, cont.not_before, time.time(),
                                prompt_tokens=cont.prompt_tokens, turn=cont.turn["number"]):
            return "lease-lost"  # reaped meanwhile: pending again, resuming from the saved turn
    except redis.RedisError as exc:
        log.warning("continuation of job=%s not readmitted (%r): its lease will expire", ref, exc)
        return "readmit-failed"
    try:
        if cancel_requested(rt, ref):  # cancelled while this turn ran: never run another
            return _end_unleased(rt, ref, Code.E_CANCELLED, "cancelled between turns")
    except redis.RedisError as exc:
        log.warning("continuation of job=%s readmitted, then Redis failed (%r): its next turn goes "
                    "on from the saved turn", ref, exc)
    # The round's tools go out before the event: a record for watchers, it must never keep
    # them from going out (the job would wait its round's whole timeout for them).
    sent = not cont.tool_calls or _send_tools(rt, ref, cont)
    try:
        _events(rt, ref).emit("continuation", how=cont.how, cause=cont.cause.value,
                              delay_s=round(cont.delay_s, 3), max_tokens=cont.max_tokens)
    except Exception:  # the job is readmitted and its tools are out: the turn is done
        log.exception("continuation event of job=%s not recorded", ref)
    return "continued" if sent else "tools-unsent"


def _send_tools(rt: Runtime, ref: str, cont: Continuation) -> bool:
    """One ``fleet.tool`` task per call, all at once (they run in parallel on the tool workers),
    after the round is marked sent (fleet/infer/tools.py). A send that fails is that call's
    result: a failure saying so (no tool ran, so it did not time out). False when the round could
    not be marked sent: nothing is sent, and the job (readmitted, waiting for the round) is put in
    line at once, so its next turn sends the round again now rather than at its timeout."""
    from fleet.infer import tools as tools_mod

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
    for call in cont.tool_calls:
        try:
            rt.send_task("fleet.tool", kwargs={"ref": ref, "round_number": number,
                                               "call_id": call["id"]},
                         queue=call["queue"], argsrepr="()", time_limit=call["time_limit_s"],
                         soft_time_limit=call["timeout_s"],
                         kwargsrepr=f"job={ref} tool={call['name']} round={number}")
        except Exception as exc:  # the broker: the call fails as not sent, the job goes on
            log.warning("tool task of job=%s call=%s not sent: %r", ref, call["id"], exc)
            failed = _counted(rt, {"ok": False, "error": f"the tool task could not be sent: "
                                                         f"{type(exc).__name__}"})
            with contextlib.suppress(redis.RedisError):
                tools_mod.save_result(rt.redis, rt.keys, rt.settings, ref, number, call["id"], failed)
    return True


def _counted(rt: Runtime, result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with its size in the next turn's prompt (``tokens``: what the model will read,
    counted by the backend's tokenizer, and its message's framing); a round is complete only
    once each of its results carries it (fleet/infer/tools.py ``round_complete``)."""
    from fleet.infer import tools as tools_mod

    text = tools_mod.counted_text(result)
    return {**result, "tokens": rt.counter.count_text(text)[0] + tools_mod.RESULT_FRAMING_TOKENS}


def tool_job(rt: Runtime, tasks: Any, ref: str, round_number: int, call_id: str) -> str:
    """Run one call of a tool round (module docstring); returns what became of it."""
    from fleet.infer import tools as tools_mod

    try:
        turn = _current_turn(rt, ref, rt.results.job_record(ref)) or {"tool_rounds": []}
    except AuthError as exc:
        log.warning("tool call %s of job=%s refused: %s", call_id, ref, exc.message)
        return "refused"
    rounds = turn["tool_rounds"]
    pending = next((r for r in rounds if r["number"] == round_number and "duration_s" not in r), None)
    call = next((c for c in (pending or {}).get("calls", [])
                 if c["id"] == call_id and c["error"] is None), None)
    if pending is None or call is None:
        return "stale"  # not a call of the job's open round (late, duplicate or forged)
    if rt.results.get(ref) is not None:
        return "stale"  # the job ended meanwhile (another call of its round ended it)
    tool = rt.settings.projects[split_ref(ref)[0]].tool_registry[call["name"]]
    task = tasks.get(tool.task)
    if task is None:
        result = {"ok": False, "error": f"the tool task {tool.task!r} is not registered on this worker"}
    else:
        result = tools_mod.run_tool(task, call["arguments"], tool.timeout_s)
    return _settle_result(rt, ref, turn, pending, call, result)


def _settle_result(rt: Runtime, ref: str, turn: dict[str, Any], round_: dict[str, Any],
                   call: dict[str, Any], result: dict[str, Any]) -> str:
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
    from fleet.infer import tools as tools_mod

    number, call_id = round_["number"], call["id"]

    def save(stored: dict[str, Any]) -> None:
        tools_mod.save_result(rt.redis, rt.keys, rt.settings, ref, number, call_id, stored)

    _past_soft_limit(lambda: save(result))
    counted = _past_soft_limit(lambda: _counted(rt, result))
    _past_soft_limit(lambda: save(counted))
    _past_soft_limit(lambda: _events(rt, ref).emit(
        "tool_result", number=number, call=call_id, name=call["name"], ok=result["ok"],
        duration_s=result.get("duration_s")))
    results = _past_soft_limit(lambda: tools_mod.load_results(rt.redis, rt.keys, rt.settings, ref, round_))
    why = tools_mod.never_sent(turn, results)
    if why is not None:
        return _end_waiting(rt, ref, turn, Code.E_PROMPT_TOO_LONG, why)
    _past_soft_limit(lambda: rt.store.grow(ref, tools_mod.next_prompt_tokens(turn, results)))
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


def _end_waiting(rt: Runtime, ref: str, turn: dict[str, Any], code: Code, message: str) -> str:
    """End a job that waits between turns (no lease): its envelope, then out of the store
    (``_end_unleased``). A job no longer waiting (running already) is left to its turn, which
    ends it too; one admitted between the two reads here finds its result and stops."""
    if _past_soft_limit(lambda: rt.results.job_record(ref).get("state")) != "pending":
        return "not-waiting"
    log.info("job=%s ended between turns: %s", ref, message)
    return _past_soft_limit(lambda: _end_unleased(rt, ref, code, message,
                                                  tool_rounds=turn["tool_rounds"]))


def _sealed_job(rt: Runtime, ref: str, project: str, record: dict[str, str]) -> Job:
    """The prepared job, once the seal verifies and everything names the same project."""
    check_seal(rt.settings, ref, record)
    job = Job.model_validate_json(record["job"])
    named = {split_ref(ref)[0], project, record.get("project"), job.project,
             rt.store.lease_project(ref)}
    if len(named) != 1 or job_ref(job.project, job.id) != ref:
        raise AuthError("the task, the lease, the record and the job name different projects or ids")
    return job


def _current_turn(rt: Runtime, ref: str, record: dict[str, str]) -> dict[str, Any] | None:
    """The saved turn to run (None: the first); AuthError unless the workers sealed it AND it is
    the job's current turn. The producer may write its job hash, so the seal alone would let it
    put an earlier turn back (or delete it) and reset every counter the turn carries; the number
    of the turn that may run is in the dispatcher store, which only the fleet writes (``readmit``
    records it). A saved turn one ahead of the store's is the turn of a worker that died (or lost
    Redis) between saving it and ``readmit``: the reaped job resumes from it."""
    turn_json = check_turn(rt.settings, ref, record)
    turn = None if turn_json is None else json.loads(turn_json)
    number = 0 if turn is None else turn.get("number")
    expected = rt.store.turn_of(ref)
    if number not in (expected, expected + 1):
        raise AuthError(f"the saved turn ({number}) is not the job's current turn ({expected}): "
                        f"an earlier turn put back")
    return turn


def _run(rt: Runtime, ref: str, project: str, keeper: LeaseKeeper) -> Envelope | Continuation:
    from fleet.infer.attempts import InferenceContext, run_inference
    from fleet.infer.budget import Plan

    owner, job_id = split_ref(ref)
    record = rt.results.job_record(ref)
    try:
        job = _sealed_job(rt, ref, project, record)
        plan = Plan(**json.loads(record["plan"]))
        turn = _current_turn(rt, ref, record)
    except AuthError as exc:
        log.warning("refused to run job=%s: %s", ref, exc.message)
        return Envelope.failure(job_id, owner, Code.E_AUTH, exc.message)
    except (KeyError, ValueError) as exc:
        return Envelope.failure(job_id, owner, Code.E_INTERNAL, f"job record unreadable: {exc}")
    if cancel_requested(rt, ref):  # asked between two turns (the keeper checks only from now on)
        return Envelope.failure(job_id, owner, Code.E_CANCELLED, "cancelled between turns")
    admitted_at = time.time()
    events = _events(rt, ref)
    events.emit("admitted", queued_s=round(admitted_at - job.submitted_at, 3))
    ctx = InferenceContext(
        settings=rt.settings, project=rt.settings.projects[job.project], redis=rt.redis,
        keys=rt.keys, events=events, cancel=keeper.cancel, client=rt.vllm,
        fence_tag=record.get("fence_tag") or None, count_prompt=rt.counter.count_messages,
    )
    envelope = run_inference(job, plan, ctx, turn)
    if not isinstance(envelope, Envelope):
        return envelope  # a Continuation
    warnings = json.loads(record.get("warnings", "[]"))
    # Queued until the job's FIRST admission: its first attempt (a later turn's admission
    # would count the earlier turns as queueing).
    first_admitted = envelope.attempts[0].started_at if envelope.attempts else admitted_at
    return envelope.model_copy(update={
        "warnings": warnings + envelope.warnings,
        "metadata": job.metadata,
        "timings": Timings(
            queued_s=round(min(first_admitted, admitted_at) - job.submitted_at, 4),
            first_token_s=envelope.timings.first_token_s,
            total_s=round(time.time() - job.submitted_at, 4),
        ),
    })
