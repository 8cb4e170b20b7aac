"""The inference task's work (``fleet.infer``, queue fleet.infer, kwargs ref, project, fence; sent
by a dispatcher): ONE model turn of a job, under its lease.

stale fence (duplicate or late delivery) -> drop; already final (ended while it waited:
fleet/worker/jobs/common.py) -> release, drop;
the ref, the task, the lease, the record and the sealed job must name one project, and the seal
must verify, and a saved turn must be the one the store names (its number, recorded by
``readmit``; the producer may write its job hash but not the store), else E_AUTH before anything
is sent; otherwise run ONE model turn (fleet/infer/attempts.py) under a LeaseKeeper (it stops the
turn on a cancel request or on a final result published meanwhile). A final envelope is
published (if the job has none yet), then the lease released. A continuation (the job needs
another turn: retry, re-ask, backend outage, tool round) is saved sealed in the job hash
(``turn``, a ``TurnRecord``: fleet/infer/turns.py; state "pending"), then ``readmit`` gives the
lease up and puts the job back in line at its place with the next turn's plan and prompt, not
before its backoff (schedulers/store/base.py, Continuations), and records the turn's number; then
a job cancelled meanwhile ends, else a tool round's tasks go out (``send_round``,
fleet/worker/jobs/tool.py; before anything else: the job waits for them). A worker whose lease
was lost publishes nothing: the job is already pending again.
Between two turns nothing runs and nothing is held: a worker dying after saving the turn and
before ``readmit`` leaves the lease to expire, and the reaped job resumes from the saved turn
(attempts are recorded as they end, fleet/infer/carryover.py); a cancel or a deadline between
turns ends the job like any pending job's.

Failure cases: a Redis outage puts the job back in line ("broker-lost"); any other exception
ends the job E_INTERNAL with an ERROR and its traceback. A worker shutting down mid-stream leaves
the lease to expire: the job is admitted again at its place in line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import redis

from fleet.core.codes import Code
from fleet.core.config import Settings
from fleet.core.errors import AuthError
from fleet.core.keys import job_ref, split_ref
from fleet.core.models import Envelope, Job, Timings
from fleet.core.outagelog import BROKER_LOST
from fleet.core.seal import cancel_valid, check_seal, seal_turn, tagged_key
from fleet.core.usage import QUEUE_KEY, TurnUsage
from fleet.infer.attempts import Continuation, InferenceContext, run_inference
from fleet.infer.budget import Plan
from fleet.infer.turns import TurnRecord
from fleet.infer.turnusage import TurnProgress
from fleet.worker import keyquotas as key_quotas
from fleet.worker.jobs.common import cancel_requested, current_turn, end_unleased, event_sink, new_owner
from fleet.worker.jobs.tool import send_round
from fleet.worker.keyquotas import KeyQuotaHeld
from fleet.worker.lease import LeaseKeeper
from fleet.worker.outcome import CONTINUED, backend_label, continued_detail, ended_detail
from fleet.worker.repeats import served
from fleet.worker.runtime import OnBackend, Runtime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnOutcome:
    """What one turn came to: ``outcome`` (a code, "continued", "stale", ...) and, for a turn
    that ran, what its task's line adds (fleet/worker/outcome.py: turn, attempts, tokens,
    backend; or how the next turn goes on)."""

    outcome: str
    detail: str = ""


def infer_job(rt: Runtime, ref: str, project: str, fence: int, backend: str = "") -> str:
    """``run_turn``'s outcome alone."""
    return run_turn(rt, ref, project, fence, backend).outcome


def run_turn(rt: Runtime, ref: str, project: str, fence: int, backend: str = "") -> TurnOutcome:
    """One model turn of the job, on the backend its lease was granted on: the claim answers it,
    so a task naming another (``backend``, '' for any) changes nothing. A task naming a backend
    these settings do not have is not claimed (another delivery of the grant still runs it; none
    coming, the dispatcher takes the unclaimed lease back). A lease on a backend these settings do
    not have, or a task that names another known backend than its lease, runs nothing: the lease,
    claimed and never renewed, expires and the job is admitted again (a grant given back at once
    would come straight back to the same dispatcher)."""
    store = rt.store
    # before the claim: a copy naming a backend unknown here leaves the lease to a delivery that
    # knows it (or to the dispatcher's reaper of unclaimed leases)
    if backend and backend not in {b.name for b in rt.settings.backends}:
        log.error("task for job=%s names backend %r, which this worker's [[backends]] do not have: "
                  "nothing run, not claimed", ref, backend)
        return TurnOutcome("unknown-backend")
    # Claim first (it checks the fence itself: one round trip on the way to the backend); only a
    # refused claim reads the lease, to tell a stale delivery from a duplicate one.
    granted = store.claim_on(ref, fence, new_owner(), time.time())
    if granted is None:
        if not store.lease_valid(ref, fence):
            log.info("dropped stale delivery job=%s fence=%d", ref, fence)
            return TurnOutcome("stale")
        log.info("dropped duplicate delivery job=%s fence=%d", ref, fence)
        return TurnOutcome("duplicate")
    try:
        if backend and backend != granted:
            raise KeyError(f"{backend!r} in the task, {granted!r} in its lease")
        on = rt.on_backend(granted)
    except KeyError as exc:
        log.error("grant of job=%s names %s: nothing run, the lease expires; the dispatcher's "
                  "[[backends]] and this worker's differ", ref, exc)
        return TurnOutcome("unknown-backend")
    owner, job_id = split_ref(ref)  # envelopes go to the ref's own job, whatever the task says
    if rt.results.get(ref) is not None:
        _settle_quota(rt, ref, fence, 0)
        store.release(ref, fence)  # ours: claimed above
        return TurnOutcome("already-final")
    cancel_key, result_key = rt.keys.cancel(ref), rt.keys.result(ref)
    progress = TurnProgress(owner, job_id, fence, on.settings.backend.model)
    keeper = LeaseKeeper(  # a cancel request, or a final result published meanwhile, stops it
        rt.lease_store,
        lambda: (cancel_valid(rt.settings, owner, job_id, rt.lease_redis.get(cancel_key))
                 or bool(rt.lease_redis.exists(result_key))),
        ref, fence, rt.settings.admission.lease_ttl_s, on_renew=lambda: _checkpoint(rt, progress))
    try:
        with keeper:
            rt.results.record(ref, state="running", running_at=time.time(), fence=fence)
            envelope, turn = _run(rt, on, ref, project, keeper, progress)
    except KeyQuotaHeld as held:  # its API key's window is full: back in line until it resets
        return _wait_for_key_quota(rt, ref, fence, held)
    except BROKER_LOST as exc:
        # Not the job's fault: its lease expires (or is given back here) and it runs again.
        log.warning("redis lost while running job=%s (%r); the job goes back in line", ref, exc)
        with contextlib.suppress(redis.RedisError):
            store.requeue(ref, fence)
        return TurnOutcome("broker-lost")
    except Exception as exc:  # a bug or Redis failure: end the job, keep the worker
        log.exception("infer failed job=%s", ref)
        envelope, turn = Envelope.failure(job_id, owner, Code.E_INTERNAL,
                                          f"inference task failed: {type(exc).__name__}"), 0
    # (A worker shutting down mid-stream raises BaseException: the lease is left to expire and
    # the job is admitted again at its place in line.)
    if keeper.lost and not keeper.cancelled:
        # Put it back in line (fence-checked: if the lease was already reaped this is a no-op,
        # the job is pending again anyway); its next attempt will publish.
        store.requeue(ref, fence)
        return TurnOutcome("lease-lost")
    return _finish(rt, on.settings, ref, fence, envelope, turn)


def _finish(rt: Runtime, settings: Settings, ref: str, fence: int, envelope: Envelope | Continuation,
            turn: int) -> TurnOutcome:
    """A turn that ran to its end: the next turn saved and in line, or the final envelope out."""
    if not isinstance(envelope, Envelope):
        envelope = _within_quota(rt, ref, envelope)
    if not isinstance(envelope, Envelope):
        outcome = _continue(rt, ref, fence, envelope)
        handed_on = outcome in CONTINUED  # else ended between turns, or not readmitted
        return TurnOutcome(outcome, continued_detail(turn, envelope.how.value, envelope.cause)
                           if handed_on else f"turn={turn}")
    # Publish first, then release: a crash or a Redis error in between leaves the lease to
    # expire and the job to run again (which finds its result and stops), never a lost job.
    if envelope.attempts:  # a turn ran: the backend it ran on
        envelope = envelope.model_copy(update={"backend": settings.backend.name})
    published = rt.results.publish(envelope)
    rt.store.release(ref, fence)
    if not published:
        return TurnOutcome("already-final")
    return TurnOutcome(envelope.code.value, ended_detail(envelope, turn, backend_label(settings)))


def _wait_for_key_quota(rt: Runtime, ref: str, fence: int, held: KeyQuotaHeld) -> TurnOutcome:
    """Give the grant back (nothing was sent), the job at its place in line, not before its API
    key's window resets (fleet/worker/keyquotas.py). A Redis error leaves the lease to expire."""
    log.info("job=%s waits for its key's quota: %s", ref, held)
    try:
        rt.results.record(ref, state="pending", pending_at=time.time())
        if not rt.store.readmit(ref, fence, held.max_tokens, held.not_before, time.time(), turn=held.turn):
            return TurnOutcome("lease-lost")
    except redis.RedisError as exc:
        log.warning("job=%s not put back after its key's quota held it (%r): its lease will expire", ref, exc)
        return TurnOutcome("readmit-failed")
    return TurnOutcome("key-quota-held", f"turn={held.turn}")


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
                                prompt_tokens=cont.prompt_tokens, turn=cont.turn["number"],
                                eligible=cont.eligible):
            return "lease-lost"  # reaped meanwhile: pending again, resuming from the saved turn
    except redis.RedisError as exc:
        log.warning("continuation of job=%s not readmitted (%r): its lease will expire", ref, exc)
        return "readmit-failed"
    try:
        if cancel_requested(rt, ref):  # cancelled while this turn ran: never run another
            return end_unleased(rt, ref, Code.E_CANCELLED, "cancelled between turns")
    except redis.RedisError as exc:
        log.warning("continuation of job=%s readmitted, then Redis failed (%r): its next turn goes "
                    "on from the saved turn", ref, exc)
    # The round's tools go out before the event: a record for watchers, it must never keep
    # them from going out (the job would wait its round's whole timeout for them).
    sent = not cont.tool_calls or send_round(rt, ref, cont)
    try:
        event_sink(rt, ref).emit("continuation", how=cont.how, cause=cont.cause.value,
                              delay_s=round(cont.delay_s, 3), max_tokens=cont.max_tokens)
    except Exception:  # the job is readmitted and its tools are out: the turn is done
        log.exception("continuation event of job=%s not recorded", ref)
    return "continued" if sent else "tools-unsent"


def _sealed_job(rt: Runtime, ref: str, project: str, record: dict[str, str]) -> Job:
    """The prepared job, once the seal verifies and everything names the same project."""
    check_seal(rt.settings, ref, record)
    job = Job.model_validate_json(record["job"])
    named = {split_ref(ref)[0], project, record.get("project"), job.project,
             rt.store.lease_project(ref)}
    if len(named) != 1 or job_ref(job.project, job.id) != ref:
        raise AuthError("the task, the lease, the record and the job name different projects or ids")
    return job


def _settle(rt: Runtime, job: Job, fence: int) -> None:
    """Count the turn of an earlier delivery whose worker died mid-stream (fleet/core/usage.py
    ``settle``); a Redis error leaves it for the job's next turn."""
    try:
        if rt.ledger.settle(job.project, job.id, fence):
            log.info("usage: counted the turn a dead worker left of job=%s", job_ref(job.project, job.id))
    except redis.RedisError as exc:
        log.warning("usage: the turn a dead worker left of job=%s not settled (%r)", job.id, exc)


def _within_quota(rt: Runtime, ref: str, cont: Continuation) -> Envelope | Continuation:
    """The continuation, or E_QUOTA_EXCEEDED when its next turn (a prompt grown by tool rounds)
    could never fit the project's smallest token quota: it would wait in line for ever."""
    project, job_id = split_ref(ref)
    quota = rt.store.config.quota(project)
    if quota is None or cont.prompt_tokens is None:
        return cont
    cost = quota.reserve(cont.prompt_tokens, cont.max_tokens)
    if not quota.never_fits(cost):
        return cont
    return Envelope.failure(job_id, project, Code.E_QUOTA_EXCEEDED,
                            f"quota: the next turn may cost {cost:,} (prompt {cont.prompt_tokens:,} and "
                            f"output limit), more than the project's smallest token quota "
                            f"({quota.smallest_tokens:,})")


def _quota_settler(rt: Runtime, ref: str, fence: int, project: str,
                   progress: TurnProgress) -> Callable[[TurnUsage], None] | None:
    """What settles this grant's quota reservation with its attempt's usage (None: no quota)."""
    quota = rt.store.config.quota(project)
    if quota is None:
        return None
    # a prompt sent counts whole even when the attempt was cut before its first token (the plan's
    # count: vLLM computed some of it, a cancel mid-prefill gets nothing back)
    return lambda usage: _settle_quota(rt, ref, fence, quota.spent(
        max(usage.prompt_tokens, progress.prompt_tokens), usage.cached_tokens,
        usage.reasoning_tokens + usage.answer_tokens))


def _infer(rt: Runtime, on: OnBackend, ref: str, job: Job, plan: Plan, turn: TurnRecord | None,
           record: dict[str, str], keeper: LeaseKeeper, progress: TurnProgress,
           key_spent: Callable[[TurnUsage], None] | None) -> Envelope | Continuation:
    """The turn itself (fleet/infer/attempts.py ``run_inference``), once everything checked."""
    _settle(rt, job, progress.fence)
    progress.key = tagged_key(rt.settings, ref, record) or QUEUE_KEY
    events = event_sink(rt, ref)
    events.emit("admitted", queued_s=round(time.time() - job.submitted_at, 3))
    ctx = InferenceContext(
        settings=on.settings, project=rt.settings.projects[job.project], redis=rt.redis,
        keys=rt.keys, events=events, cancel=keeper.cancel, client=on.vllm,
        fence_tag=record.get("fence_tag") or None, count_prompt=on.counter.count_messages,
        ledger=rt.ledger, fence=progress.fence, progress=progress, usage_key=progress.key,
        settle=_settlers(_quota_settler(rt, ref, progress.fence, job.project, progress), key_spent),
    )
    return run_inference(job, plan, ctx, turn)


def _settlers(*settlers: Callable[[TurnUsage], None] | None) -> Callable[[TurnUsage], None] | None:
    """One callback for an attempt's usage that gives it to each of ``settlers`` (None: none)."""
    given = [s for s in settlers if s is not None]
    if not given:
        return None

    def each(usage: TurnUsage) -> None:
        for settle in given:
            settle(usage)

    return each


def _settle_quota(rt: Runtime, ref: str, fence: int, spent: int) -> None:
    """Give back what the grant's reservation held beyond ``spent`` (nothing to do without one);
    a Redis error leaves the reservation standing: the window keeps the turn's worst case."""
    if rt.store.config.quota(split_ref(ref)[0]) is None:
        return
    try:
        rt.store.settle(ref, fence, spent)
    except redis.RedisError as exc:
        log.warning("quota: the reservation of job=%s fence=%d not settled (%r); it stands", ref, fence, exc)


def _checkpoint(rt: Runtime, progress: TurnProgress) -> None:
    """The streaming turn's progress into the usage ledger (at each lease renewal), on the lease
    keeper's client: a worker killed mid-stream leaves what it saw for the next turn to count."""
    seen = progress.snapshot()
    if seen is not None:
        rt.ledger.checkpoint(seen, rt.lease_redis)


def _run(rt: Runtime, on: OnBackend, ref: str, project: str, keeper: LeaseKeeper,
         progress: TurnProgress) -> tuple[Envelope | Continuation, int]:
    """The turn's envelope or continuation, and the turn's number (0: the first)."""
    owner, job_id = split_ref(ref)
    record = rt.results.job_record(ref)
    try:
        job = _sealed_job(rt, ref, project, record)
        plan = Plan(**json.loads(record["plan"]))
        if plan.max_model_len > on.settings.backend.max_model_len:  # prepared for a larger one
            plan = replace(plan, max_model_len=on.settings.backend.max_model_len)
        turn = current_turn(rt, ref, record)
    except AuthError as exc:
        log.warning("refused to run job=%s: %s", ref, exc.message)
        _settle_quota(rt, ref, progress.fence, 0)
        return Envelope.failure(job_id, owner, Code.E_AUTH, exc.message), 0
    except (KeyError, ValueError) as exc:
        _settle_quota(rt, ref, progress.fence, 0)
        return Envelope.failure(job_id, owner, Code.E_INTERNAL, f"job record unreadable: {exc}"), 0
    number = 0 if turn is None else int(turn["number"])
    if cancel_requested(rt, ref):  # asked between two turns (the keeper checks only from now on)
        _settle_quota(rt, ref, progress.fence, 0)
        return Envelope.failure(job_id, owner, Code.E_CANCELLED, "cancelled between turns"), number
    if turn is None and (cached := served(rt, ref, record, job)) is not None:
        _settle_quota(rt, ref, progress.fence, 0)  # the answer of an identical job: no turn
        return cached, 0
    admitted_at = time.time()
    turn_plan = plan if turn is None else Plan(**turn["plan"])
    try:
        ticket = key_quotas.reserve(rt, ref, progress.fence, record, turn_plan, job.deadline)
    except KeyQuotaHeld as held:
        _settle_quota(rt, ref, progress.fence, 0)
        held.max_tokens, held.turn = turn_plan.max_tokens, number
        raise
    if isinstance(ticket, Envelope):  # over its API key's quota, and not to wait
        _settle_quota(rt, ref, progress.fence, 0)
        return ticket, number
    try:  # from the key's reservation on: whatever ends the turn (but the worker dying), it is settled
        envelope = _infer(rt, on, ref, job, plan, turn, record, keeper, progress,
                          None if ticket is None else ticket.add)
    except Exception:
        key_quotas.settle(rt, ticket)
        raise
    key_quotas.settle(rt, ticket)
    # a turn that ended without an attempt (cancelled or past its deadline before it sent, a
    # tool round not sent): its reservation goes back whole; a no-op once an attempt settled
    _settle_quota(rt, ref, progress.fence, 0)
    if not isinstance(envelope, Envelope):
        return envelope, number  # a Continuation
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
    }), number
