"""The prep task's work (``fleet.prep``, queue fleet.<project> or its collect queue, kwargs
project, job_id, signed): make a producer's job ready to run, or end it.

verify signature (a rejection is keyed by the digest of the whole message) -> the job record must
be this project's and this message's -> parse Job -> cancelled/deadline? -> plan budget -> collect
+ trim
-> kinds collect/trim: publish OK_MATERIAL
-> otherwise store the prepared job + plan in the job hash under the workers' seal (over them and
   every other field that decides what runs or where the outcome goes; fleet/core/seal.py) and
   add it to the dispatcher's pending set, enqueued at this worker's clock (the producer's
   submitted_at is information only and never decides the order).
One delivery prepares a job at a time (``PrepClaim``, fleet/prep/watchdog.py); a job already
handed over is a "duplicate".

Failure cases: a message that fails verification or names another project's record is rejected
with its code; an invalid job ends E_INPUT_INVALID, any other failure E_INTERNAL (never a crashed
worker). A Redis outage is ridden out for ``prep_lease_s`` (``riding_out_broker_loss``), then goes
up to the task: the prep watchdog sends the job again.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from fleet.core.codes import Code
from fleet.core.errors import AuthError, FleetError, InputInvalid, QuotaExceeded
from fleet.core.keys import job_ref
from fleet.core.limits import check_job, check_message
from fleet.core.models import Envelope, Job, describe_invalid
from fleet.core.outagelog import BROKER_LOST
from fleet.core.routing import counting_backend, eligible, model_asked, route
from fleet.core.seal import digest, sealed
from fleet.core.signing import verify
from fleet.infer.budget import plan as plan_budget
from fleet.prep.cachehint import uncached_of
from fleet.prep.prepare import prepare
from fleet.prep.watchdog import HANDED_OVER, PrepClaim
from fleet.worker import repeats
from fleet.worker.jobs.common import cancel_requested, end_unleased, event_sink, fail, new_owner
from fleet.worker.jobs.tool import first_turn_tools
from fleet.worker.repeats import job_digest
from fleet.worker.runtime import Runtime
from schedulers.backoff import Backoff
from schedulers.policy.quota import NEVER_FITS
from schedulers.store.base import PendingItem, quota_entry

log = logging.getLogger(__name__)

NO_REPEAT_TAG = {"rcache": "", "rcache_seal": ""}


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
    claim = PrepClaim(rt.redis, rt.keys, ref, owner or new_owner(), rt.settings.prep_lease_s)
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


def _prep_claimed(rt: Runtime, project: str, job_id: str, raw: dict[str, Any]) -> str:
    if rt.results.get(job_ref(project, job_id)) is not None:
        return "already-final"
    try:
        job = Job.model_validate(raw)
    except ValidationError as exc:
        return fail(rt, job_id, project, Code.E_INPUT_INVALID, f"invalid job: {describe_invalid(exc)}")
    if job.id != job_id:
        return fail(rt, job_id, project, Code.E_INPUT_INVALID, "job id differs from the message")
    try:
        return _prepare_and_enqueue(rt, job)
    except BROKER_LOST:
        raise  # not the job's fault: the task tries again (riding_out_broker_loss)
    except FleetError as exc:
        return fail(rt, job.id, job.project, exc.code, exc.message, kind=job.kind)
    except Exception as exc:  # the last line of defence: close the job, keep the worker
        log.exception("prep failed job=%s", job.id)
        return fail(rt, job.id, job.project, Code.E_INTERNAL, f"prep failed: {type(exc).__name__}")


def _prepare_and_enqueue(rt: Runtime, job: Job) -> str:
    settings = rt.settings
    check_job(job, settings.limits)
    project = settings.projects[job.project]
    ref = job_ref(job.project, job.id)
    if cancel_requested(rt, ref):
        return fail(rt, job.id, job.project, Code.E_CANCELLED, "cancelled before preparation")
    if job.deadline is not None and job.deadline <= time.time():
        return fail(rt, job.id, job.project, Code.E_DEADLINE, "deadline passed while queued")
    # Prepared against the largest backend of its model (a model no backend serves: UnknownModel,
    # E_INPUT_INVALID, before any work); it may then run on any backend of that model it fits.
    counter = rt.on_backend(counting_backend(settings, project, job.model).name).counter
    settings = settings.on_backend(route(settings, project, job.model).name)
    first = plan_budget(job, project, settings, 0)
    prepared = prepare(job, settings, project, rt.redis, rt.keys, first.room_tokens, counter,
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
    # the exact-repeat cache (fleet/worker/repeats.py): an earlier identical job's answer ends it
    # here, before any quota; a job identical to one running now waits for it (``not_before``)
    request = job_digest(project, model_asked(settings, project, job.model), ready, plan, prepared.fence_tag)
    if request is not None and (cached := repeats.lookup(rt, ready, request, prepared.warnings)) is not None:
        rt.results.publish(cached)
        return cached.code.value
    _refuse_over_quota(rt, job, prepared.prompt_tokens, plan.max_tokens)
    # (an empty tag replaces any the producer wrote into its job hash: only prep tags a job)
    tag, not_before = repeats.join(rt, ready, request) if request is not None else (NO_REPEAT_TAG, None)
    job_json, plan_json = ready.model_dump_json(), json.dumps(plan.__dict__)
    rt.results.record(ref, **sealed(
        settings, ref, project=job.project, kind=job.kind, job=job_json, plan=plan_json,
        warnings=json.dumps(prepared.warnings), fence_tag=prepared.fence_tag,
    ), **tag)
    mask = eligible(settings, model_asked(settings, project, job.model), prepared.prompt_tokens + plan.max_tokens)
    cache = uncached_of(rt.redis, rt.keys, settings, ready, prepared,
                        tools=first_turn_tools(project, ready), eligible=mask)
    uncached = cache.uncached_tokens
    handed_over = time.time()  # the fleet's clock orders the queue, never the producer's
    rt.store.add_pending(PendingItem(
        job_id=ref, project=job.project, prompt_tokens=prepared.prompt_tokens,
        max_new_tokens=plan.max_tokens, band=job.band, priority=job.priority,
        enqueued_at=handed_over, deadline=job.deadline, uncached_tokens=uncached,
        eligible=mask, hint=cache.hint, not_before=not_before,
    ))
    if not_before is not None and request is not None:
        cached = repeats.joined(rt, ready, request, prepared.warnings)
        if cached is not None:  # the answer came while it joined: published first, then out of line
            rt.results.publish(cached)
            rt.store.cancel_pending(ref)
            return cached.code.value
    # Only now "pending": had this task died before add_pending, the job would still read
    # "submitted", and a redelivery or the prep watchdog would prepare it again.
    rt.results.record(ref, state="pending", pending_at=handed_over)
    if cancel_requested(rt, ref):
        # cancelled while this task prepared it: never let it take a slot
        return end_unleased(rt, ref, Code.E_CANCELLED, "cancelled while queued")
    event_sink(rt, ref).emit("prepared", prompt_tokens=prepared.prompt_tokens,
                             uncached_tokens=uncached, max_tokens=plan.max_tokens,
                             warnings=prepared.warnings)
    return "pending"


def _refuse_over_quota(rt: Runtime, job: Job, prompt_tokens: int, max_tokens: int) -> None:
    """QuotaExceeded (InputInvalid: no window could ever hold it) for a job its project's quota
    refuses, before its record: a refused job never runs."""
    over = rt.settings.projects[job.project].quota.over
    entry = quota_entry(rt.store, job.project, over, prompt_tokens, max_tokens, time.time())
    if entry.refused is not None:
        message, retry_s = entry.refused
        if retry_s is None and message.startswith(NEVER_FITS):
            raise InputInvalid(message)
        raise QuotaExceeded(message, retry_after_s=None if retry_s is None else math.ceil(retry_s))
