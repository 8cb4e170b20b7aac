"""The two Celery tasks and what they hand each other.

fleet.prep (queue fleet.<project>, kwargs project, job_id, signed)
  verify signature -> parse Job -> cancelled/deadline? -> plan budget -> collect + trim
  -> kinds collect/trim: publish OK_MATERIAL
  -> otherwise store the prepared job + plan in the job hash and add it to the dispatcher's
     pending set (the dispatcher, not this task, decides when it reaches vLLM).
fleet.infer (queue fleet.infer, kwargs job_id, project, fence; sent by a dispatcher)
  stale fence (duplicate or late delivery) -> drop; already final (cancelled) -> release, drop;
  otherwise stream under a LeaseKeeper, release the lease in ``finally`` and publish the envelope.
  A worker whose lease was lost publishes nothing: the job is already pending again.

Failure cases: every exception inside either task becomes an Envelope (E_INTERNAL at worst), so
a bad job never crashes a worker, poisons a queue or stays without a final result.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from typing import Any

import redis
from celery import Celery
from pydantic import ValidationError

from fleet.core.codes import Code
from fleet.core.errors import AuthError, FleetError, InputInvalid
from fleet.core.events import EventSink
from fleet.core.limits import check_job, check_message
from fleet.core.models import Envelope, Job, Timings, describe_invalid
from fleet.core.signing import verify
from fleet.prep.watchdog import HANDED_OVER, PrepClaim
from fleet.worker.app import JobEnded, task_outcome
from fleet.worker.lease import LeaseKeeper
from fleet.worker.metrics import WorkerMetrics, serve_when_started
from fleet.worker.runtime import Runtime
from schedulers.store.base import PendingItem

log = logging.getLogger(__name__)



def register_tasks(app: Celery) -> None:
    metrics = WorkerMetrics()
    runtime = Runtime(app.fleet_settings, on_publish=metrics.observe)  # type: ignore[attr-defined]
    serve_when_started(app, metrics, runtime.settings.worker_metrics_port)

    # A non-OK final code raises JobEnded (fleet/worker/app.py): FAILURE in Flower, no redelivery.
    @app.task(name="fleet.prep", acks_late=True, throws=(JobEnded,))
    def prep(*, project: str, job_id: str, signed: dict[str, Any]) -> str:
        return task_outcome(prep_job(runtime, project, job_id, signed), job_id)

    @app.task(name="fleet.infer", acks_late=True, throws=(JobEnded,))
    def infer(*, job_id: str, project: str, fence: int) -> str:
        return task_outcome(infer_job(runtime, job_id, project, fence), job_id)


def _events(rt: Runtime, job_id: str) -> EventSink:
    return EventSink(rt.redis, rt.keys, job_id, rt.settings.events_ttl_s)


def _fail(rt: Runtime, job_id: str, project: str, code: Code, message: str, **extra: Any) -> str:
    rt.results.publish(Envelope.failure(job_id, project, code, message, **extra))
    return code.value


# -- prep -------------------------------------------------------------------------------------
def prep_job(rt: Runtime, project: str, job_id: str, signed: dict[str, Any]) -> str:
    nonce = str(signed.get("nonce", "")) if isinstance(signed, dict) else ""
    try:
        check_message(signed, rt.settings.limits)  # before verifying or parsing: size is the cost
        raw = verify(signed, rt.settings, rt.redis, rt.keys)
        # The task's routing kwargs are not signed: they must agree with what is.
        if signed.get("project") != project or raw.get("id") != job_id:
            raise AuthError("task arguments differ from the signed job (project or job id)")
    except (AuthError, InputInvalid) as exc:
        rt.results.reject(job_id, project, exc.message, nonce, code=exc.code)
        return exc.code.value
    claim = PrepClaim(rt.redis, rt.keys, job_id, _owner(), rt.settings.prep_lease_s)
    if not claim.acquire():
        return "duplicate"  # another delivery is preparing it right now
    try:
        if rt.results.job_record(job_id).get("state") in HANDED_OVER:
            return "duplicate"  # checked under the claim: an earlier delivery handed it over
        return _prep_claimed(rt, project, job_id, raw)
    finally:
        claim.release()


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _prep_claimed(rt: Runtime, project: str, job_id: str, raw: dict[str, Any]) -> str:
    if rt.results.get(job_id) is not None:
        return "already-final"
    try:
        job = Job.model_validate(raw)
    except ValidationError as exc:
        return _fail(rt, job_id, project, Code.E_INPUT_INVALID, f"invalid job: {describe_invalid(exc)}")
    if job.id != job_id:
        return _fail(rt, job_id, project, Code.E_INPUT_INVALID, "job id differs from the message")
    try:
        return _prepare_and_enqueue(rt, job)
    except FleetError as exc:
        return _fail(rt, job.id, job.project, exc.code, exc.message, kind=job.kind)
    except Exception as exc:  # the last line of defence: close the job, keep the worker
        log.exception("prep failed job=%s", job.id)
        return _fail(rt, job.id, job.project, Code.E_INTERNAL, f"prep failed: {type(exc).__name__}")


def _prepare_and_enqueue(rt: Runtime, job: Job) -> str:
    from fleet.infer.budget import plan as plan_budget
    from fleet.prep.prepare import prepare

    settings = rt.settings
    check_job(job, settings.limits)
    project = settings.projects[job.project]
    if rt.redis.exists(rt.keys.cancel(job.id)):
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
    plan = plan_budget(job, project, settings, prepared.prompt_tokens)
    ready = job.model_copy(update={"messages": prepared.messages, "sources": []})
    rt.results.record(
        job.id, project=job.project, kind=job.kind, job=ready.model_dump_json(),
        plan=json.dumps(plan.__dict__), warnings=json.dumps(prepared.warnings),
        submitted_at=job.submitted_at, fence_tag=prepared.fence_tag,
    )
    rt.store.add_pending(PendingItem(
        job_id=job.id, project=job.project, prompt_tokens=prepared.prompt_tokens,
        max_new_tokens=plan.max_tokens, band=job.band, priority=job.priority,
        enqueued_at=job.submitted_at, deadline=job.deadline,
    ))
    # Only now "pending": had this task died before add_pending, the job would still read
    # "submitted", and a redelivery or the prep watchdog would prepare it again.
    rt.results.record(job.id, state="pending", pending_at=time.time())
    if rt.redis.exists(rt.keys.cancel(job.id)) and rt.store.cancel_pending(job.id):
        # cancelled while this task prepared it: never let it take a slot
        return _fail(rt, job.id, job.project, Code.E_CANCELLED, "cancelled while queued")
    _events(rt, job.id).emit("prepared", prompt_tokens=prepared.prompt_tokens,
                             max_tokens=plan.max_tokens, warnings=prepared.warnings)
    return "pending"


# -- infer ------------------------------------------------------------------------------------
def infer_job(rt: Runtime, job_id: str, project: str, fence: int) -> str:
    store = rt.store
    if not store.lease_valid(job_id, fence):
        log.info("dropped stale delivery job=%s fence=%d", job_id, fence)
        return "stale"
    if not store.claim(job_id, fence, _owner(), time.time()):
        log.info("dropped duplicate delivery job=%s fence=%d", job_id, fence)
        return "duplicate"
    if rt.results.get(job_id) is not None:
        store.release(job_id, fence)  # ours: claimed above
        return "already-final"
    keeper = LeaseKeeper(rt.lease_store, rt.lease_redis, rt.keys.cancel(job_id), job_id, fence,
                         rt.settings.admission.lease_ttl_s)
    try:
        with keeper:
            rt.results.record(job_id, state="running", running_at=time.time(), fence=fence)
            envelope = _run(rt, job_id, project, keeper)
    except Exception as exc:  # a bug or Redis failure: end the job, keep the worker
        log.exception("infer failed job=%s", job_id)
        envelope = Envelope.failure(job_id, project, Code.E_INTERNAL,
                                    f"inference task failed: {type(exc).__name__}")
    # (A worker shutting down mid-stream raises BaseException: the lease is left to expire and
    # the job is admitted again at its place in line.)
    if keeper.lost and not keeper.cancelled:
        # Put it back in line (fence-checked: if the lease was already reaped this is a no-op,
        # the job is pending again anyway); its next attempt will publish.
        store.requeue(job_id, fence)
        return "lease-lost"
    # Publish first, then release: a crash or a Redis error in between leaves the lease to
    # expire and the job to run again (which finds its result and stops), never a lost job.
    rt.results.publish(envelope)
    store.release(job_id, fence)
    return envelope.code.value


def _resize(rt: Runtime, job_id: str, fence: int, max_tokens: int) -> None:
    try:
        rt.store.resize(job_id, fence, max_tokens)
    except redis.RedisError as exc:  # accounting only: never end a healthy retry over it
        log.warning("lease of job=%s not resized: %s", job_id, exc)


def _run(rt: Runtime, job_id: str, project: str, keeper: LeaseKeeper) -> Envelope:
    from fleet.infer.attempts import InferenceContext, run_inference
    from fleet.infer.budget import Plan

    record = rt.results.job_record(job_id)
    try:
        job = Job.model_validate_json(record["job"])
        plan = Plan(**json.loads(record["plan"]))
    except (KeyError, ValueError) as exc:
        return Envelope.failure(job_id, project, Code.E_INTERNAL, f"job record unreadable: {exc}")
    admitted_at = time.time()
    events = _events(rt, job_id)
    events.emit("admitted", queued_s=round(admitted_at - job.submitted_at, 3))
    ctx = InferenceContext(
        settings=rt.settings, project=rt.settings.projects[job.project], redis=rt.redis,
        keys=rt.keys, events=events, cancel=keeper.cancel, client=rt.vllm,
        sleep=keeper.cancel.wait,
        on_plan=lambda grown: _resize(rt, job_id, keeper.fence, grown.max_tokens),
        fence_tag=record.get("fence_tag") or None,
    )
    envelope = run_inference(job, plan, ctx)
    warnings = json.loads(record.get("warnings", "[]"))
    return envelope.model_copy(update={
        "warnings": warnings + envelope.warnings,
        "metadata": job.metadata,
        "timings": Timings(
            queued_s=round(admitted_at - job.submitted_at, 4),
            first_token_s=envelope.timings.first_token_s,
            total_s=round(time.time() - job.submitted_at, 4),
        ),
    })
