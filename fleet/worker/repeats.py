"""The exact-repeat cache for queue jobs (docs/usage.md, "Exact-repeat cache"; the cache itself
and the gateway's side are fleet/core/repeatcache.py): a job identical to an earlier one ends
with that one's answer, before admission; identical jobs arriving together run once.

Identity. A job's digest is ``request_digest`` over what its first attempt sends vLLM, after prep:
the model, the messages as sent (untrusted parts fenced; the fence tag replaced by a fixed word),
the tools and tool choice, the response format (the job's schema or the project's), the sampling
fields, the seed, the plan's budgets (output limit, thinking budget, content reserve; not its token
counts, which the random fence tag moves by a few tokens), under a ``queue`` marker (a queue job's
digest never equals a gateway request's: their answers are kept in different shapes). The job's
id, metadata, priority, band, deadline and idempotency key are left out: they never reach vLLM. A
job is not looked up when it could not be repeated (``repeatable``: temperature 0, a seed of its
own, or the project's ``sampled``), when the fleet runs its tools (its answer depends on what they
return), or for the kinds that end at prep (collect, trim).

Keys (fleet/core/keys.py, the project's own ``rcache`` keys; no project user may read or write any)
  rcache:{<project>}:e, x, s             the entries, their expiries, the stats (the gateway's too)
  rcache:{<project>}:jrun:<digest>       string  the job computing that answer; PX wait_s
  rcache:{<project>}:jwait:<digest>      set     the jobs waiting for it; PX wait_s + 60 s

Flow
  prep, once the plan is made
    ``lookup``: an entry -> the job ends at once with it: its envelope, ``cached: true``, its own
                       id, metadata and warnings, no attempt, no usage (nothing was spent), no
                       slot, no quota
    then the project's quota check (a refused job never computes nor waits), then ``join``:
    SET jrun NX     -> this job computes it: its record carries the repeat tag (fleet/core/seal.py
                       ``repeat_tag``); in line as ever
    else            -> a waiter: SADD jwait; its record carries the tag; it joins the store with a
                       not-before time ``wait_s`` ahead (never past its deadline;
                       schedulers/store/base.py, Continuations: deferred, holding no slot and not
                       in line); ``joined`` checks once more: the answer that came meanwhile
                       ends it at once; a run that ended without one makes it the computing job
    a job not looked up gets an empty tag (replacing any its producer wrote)
  the computing job's final envelope (``on_final``: the on_publish hook of the worker process that
  published it, fleet/worker/tasks.py)
    OK or OK_THINKING_FORCED, not cached
                    -> the answer is kept (without its attempts, at most max_entry_bytes); the
                       first ``INLINE_WAITERS`` (500) waiters end with it (published first, then taken
                       out of the store: fleet/worker/jobs/common.py ``end_unleased``'s order), the
                       rest are put in line and served at their claim (no model turn)
    a whole answer too large to keep
                    -> every waiter goes in line now (each runs: none would be served)
    anything else   -> one waiter computes it now (``jrun`` names it; ``hurry`` puts it in line;
                       one that ended meanwhile passes it on); the others wait on
    (RCACHE_END takes the ended job out of the waiters first, whatever it was)
  a tagged job's first claim (``served``, fleet/worker/jobs/infer.py): an entry found ends it with
  that answer, its slot released and its quota reservation given back whole; else it leaves the
  waiters (SREM jwait) and runs: an answer arriving meanwhile does not cut its turn.

Failure cases. Nothing here loses a job: a waiter is a job in the store like any other, so if the
worker publishing the computing job's envelope dies before it serves them, or the envelope is
published by a process without the hook (a dispatcher ending a job past its deadline), or the
computing job outlives ``wait_s``, each waiter is promoted at its not-before time and runs (and
its claim finds the answer, if it came meanwhile). A Redis error in the hook is logged: the
waiters go the same way. A job cancelled while it waits ends as any waiting job does. An entry
that does not read as an envelope (another version's) is a miss, never a failed job.

Trust. The digest is computed by the prep worker from the prepared job; the record's tag is sealed,
so a producer that rewrites its job hash cannot have its job's answer kept under another digest,
nor be served one; entries and waiters are keyed by the job's own project, whose name the ref
and the lease carry.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

import redis

from fleet.core.codes import Code
from fleet.core.config import ProjectSettings
from fleet.core.keys import job_ref
from fleet.core.models import Envelope, Job, Timings
from fleet.core.repeatcache import Entry, RepeatCache, repeatable, request_digest
from fleet.core.request import build_request_messages, tools_allowed
from fleet.core.routing import model_asked
from fleet.core.seal import repeat_tag, tagged_repeat
from fleet.core.usage import QUEUE_KEY, TurnUsage
from fleet.infer.budget import Plan
from fleet.infer.tools import as_sent
from fleet.infer.validate import response_format

if TYPE_CHECKING:
    from fleet.worker.runtime import Runtime

log = logging.getLogger(__name__)

# the plan's fields that reach vLLM as they are: not its token counts, which the random fence tag
# moves by a few tokens (a tokenizer splits tags of one length differently)
PLAN_SENT = ("thinking_budget", "content_reserve", "max_tokens", "limit")
INLINE_WAITERS = 500  # served inside the publish hook; the rest are put in line and served at their claim
KEPT = (Code.OK, Code.OK_THINKING_FORCED)  # whole answers (never OK_TRUNCATED, never a failure)
UNSENT = {"id", "project", "metadata", "priority", "band", "deadline", "idempotency_key", "submitted_at",
          "messages", "sources"}  # job fields that never reach vLLM (messages go as sent)


def job_digest(project: ProjectSettings, model: str, job: Job, plan: Plan, fence_tag: str) -> str | None:
    """The digest of a prepared job's first request (module docstring), or None when the job is
    not one the cache serves."""
    settings = project.repeat_cache
    if job.kind in ("collect", "trim") or not repeatable(settings, job.temperature, job.seed):
        return None
    allowed, _, _ = tools_allowed(job, project)
    sent, runs, _ = as_sent(project, allowed)
    if runs:
        return None  # the fleet runs its tools: the answer depends on what they return
    messages, _ = build_request_messages(job, fence_tag)
    budgets = {name: getattr(plan, name) for name in PLAN_SENT}
    body = {"path": "queue", "messages": messages, "tools": sent, "plan": budgets,
            "response_format": response_format(job, project), "job": job.model_dump(mode="json", exclude=UNSENT)}
    return request_digest(model, body, fence_tag)


def cache_of(rt: Runtime, project: str) -> RepeatCache:
    return RepeatCache(rt.redis, rt.keys, project, rt.settings.projects[project].repeat_cache)


def served_envelope(entry: Entry | None, job: Job, warnings: list[str]) -> Envelope | None:
    """An earlier job's kept envelope as job ``job``'s own: its id, metadata and ``warnings``,
    ``cached``, no attempt, no usage (nothing was spent: the first job's envelope has its
    figures), its own timings. None for no entry, or one that does not read as an envelope (a
    newer or older format: a miss, never a failed job)."""
    if entry is None or "envelope" not in entry.extra:
        return None
    try:
        kept = dict(entry.extra["envelope"])
        kept.update(job_id=job.id, project=job.project, attempts=[], metadata=job.metadata, cached=True,
                    warnings=warnings, usage={}, finished_at=time.time())
        envelope = Envelope.model_validate(kept)
    except (ValueError, TypeError) as exc:
        log.warning("repeat cache: an entry for job=%s/%s does not read (%s): a miss", job.project, job.id, exc)
        return None
    total = round(time.time() - job.submitted_at, 4)
    return envelope.model_copy(update={"timings": Timings(queued_s=total, total_s=total)})


def lookup(rt: Runtime, job: Job, digest: str, warnings: list[str]) -> Envelope | None:
    """The kept answer of an identical job, as this job's envelope (None: a miss)."""
    envelope = served_envelope(cache_of(rt, job.project).get(digest), job, warnings)
    if envelope is not None:
        _count_hit(rt, job)
    return envelope


def join(rt: Runtime, job: Job, digest: str) -> tuple[dict[str, str], float | None]:
    """After a miss (and the quota check): the job computes the answer, or waits for the job that
    does. The record fields that tag it, and its not-before time (a waiter; never past its
    deadline, where it is put in line and ends E_DEADLINE as any waiting job) or None."""
    cache, ref = cache_of(rt, job.project), job_ref(job.project, job.id)
    tag = repeat_tag(rt.settings, ref, digest)
    if cache.take_run(digest, ref) is None:
        return tag, None
    cache.add_waiter(digest, ref)
    until = time.time() + cache.settings.wait_s
    return tag, until if job.deadline is None else min(until, job.deadline)


def joined(rt: Runtime, job: Job, digest: str, warnings: list[str]) -> Envelope | None:
    """A waiter now in the store, checked once more: the answer that came while it joined (the
    computing job's end read the waiters before this one was among them) is its envelope now
    (the caller publishes it and takes the item out); a run that ended without one while it
    joined is taken over, the job put in line to compute it. None: it waits."""
    cache, ref = cache_of(rt, job.project), job_ref(job.project, job.id)
    envelope = served_envelope(cache.get(digest, count=False), job, warnings)
    if envelope is not None:
        cache.leave(digest, ref)
        cache.count("hits")
        _count_hit(rt, job)
        return envelope
    if cache.take_run(digest, ref) is None:  # nobody computes it any more: this job does
        cache.leave(digest, ref)
        rt.store.hurry(ref, time.time())
    return None


def served(rt: Runtime, ref: str, record: dict[str, str], job: Job) -> Envelope | None:
    """At a tagged job's first claim: the kept answer, if one came (module docstring)."""
    digest = tagged_repeat(rt.settings, ref, record)
    settings = rt.settings.projects[job.project].repeat_cache
    if digest is None or not settings.enabled:
        return None
    cache = cache_of(rt, job.project)
    try:
        envelope = served_envelope(cache.get(digest, count=False), job, json.loads(record.get("warnings", "[]")))
        if envelope is None:
            cache.leave(digest, ref)  # it runs: on its own from now on, never cut by another's answer
            return None
    except redis.RedisError as exc:
        log.warning("repeat cache: job=%s not looked up (%r); it runs", ref, exc)
        return None
    cache.count("hits")
    _count_hit(rt, job)
    return envelope


def on_final(rt: Runtime, envelope: Envelope) -> None:
    """The hook on every final envelope this process publishes: a job that computed an answer
    keeps it and serves its waiters, or hands the run to one of them (module docstring). Never
    raises: the envelope is out, and the waiters run by themselves at their not-before time."""
    project = rt.settings.project(envelope.project)
    if project is None or not project.repeat_cache.enabled:
        return
    ref = job_ref(envelope.project, envelope.job_id)
    try:
        raw = rt.redis.hmget(rt.keys.job(ref), ["rcache", "rcache_seal"])
        tag = {name: value.decode("utf-8", "replace") if isinstance(value, bytes) else value
               for name, value in zip(("rcache", "rcache_seal"), raw, strict=True) if value}
        digest = tagged_repeat(rt.settings, ref, tag)
        if digest is not None:
            _ended(rt, ref, digest, envelope)
    except redis.RedisError as exc:
        log.warning("repeat cache: job=%s ended, its waiters not served (%r): they run at their time",
                    ref, exc)
    except Exception:
        log.exception("repeat cache: job=%s ended, its waiters not served", ref)


def _ended(rt: Runtime, ref: str, digest: str, envelope: Envelope) -> None:
    cache, now = cache_of(rt, envelope.project), time.time()
    whole = envelope.code in KEPT and not envelope.cached
    kept = (whole and _keep(cache, digest, envelope)) or envelope.cached  # cached: a waiter served at its claim
    if kept:
        entry = cache.get(digest, count=False)
        for n, other in enumerate(cache.end_run(digest, ref, True)):
            if n < INLINE_WAITERS and entry is not None:
                _serve_waiter(rt, cache, other, digest, entry)
            else:  # in line now, served at its claim (no model turn): this worker's turn is over
                rt.store.hurry(other, now)
        return
    if whole:  # a whole answer too large to keep: each waiter would run anyway, so all go now
        for other in cache.end_run(digest, ref, True):
            rt.store.hurry(other, now)
        return
    runner = ref
    for _ in range(16):  # one waiter computes it now; one that has ended meanwhile passes it on
        taken = cache.end_run(digest, runner, False)
        if not taken:
            return
        # not deferred any more but alive (promoted, granted, still joining): it computes it
        if rt.store.hurry(taken[0], now) or rt.results.get(taken[0]) is None:
            log.info("repeat cache: job=%s ended %s; job=%s computes the answer now", ref, envelope.code.value,
                     taken[0])
            return
        runner = taken[0]


def _keep(cache: RepeatCache, digest: str, envelope: Envelope) -> bool:
    """Keep ``envelope`` for the jobs to come: once (the entry's own content and reasoning fields
    stay empty: a queue entry is served whole from ``extra``), without its attempts."""
    now = time.time()
    slim = envelope.model_dump(mode="json", exclude={"attempts"})
    entry = Entry(content="", reasoning="", tool_calls=[], finish_reason="stop", usage=envelope.usage.model_dump(),
                  backend=envelope.backend, created_at=now, expires_at=now + cache.settings.ttl_s,
                  extra={"envelope": slim})
    return cache.put(digest, entry)


def _serve_waiter(rt: Runtime, cache: RepeatCache, ref: str, digest: str, entry: Entry) -> None:
    """End waiter ``ref`` with the kept answer: published first, then out of the store. A waiter
    whose record is not written yet (it is joining right now) goes in line instead, to be served
    at its claim."""
    record = rt.results.job_record(ref)
    if tagged_repeat(rt.settings, ref, record) != digest or "job" not in record:
        rt.store.hurry(ref, time.time())
        return
    job = Job.model_validate_json(record["job"])
    envelope = served_envelope(entry, job, json.loads(record.get("warnings", "[]")))
    if job_ref(job.project, job.id) != ref or envelope is None:
        rt.store.hurry(ref, time.time())
        return
    if rt.results.publish(envelope):
        cache.count("hits")
        _count_hit(rt, job)
    rt.store.cancel_pending(ref)


def _count_hit(rt: Runtime, job: Job) -> None:
    """The ledger's ``cache_hits`` for a job served from the cache (no model turn: nothing else)."""
    model = model_asked(rt.settings, rt.settings.projects[job.project], job.model)
    rt.ledger.count([TurnUsage(project=job.project, job_id=job.id, fence=0, turn=0, code=Code.OK.value,
                               key=QUEUE_KEY, model=model, cache_hit=True, ended_at=time.time())])
