"""``fleet.Client``: what a project's code uses to talk to the fleet.

    client = Client()                                  # settings from fleet.toml / FLEET_*
    job_id = client.submit({"project": "reports", "messages": [...]})
    envelope = client.result(job_id, timeout=600)      # blocks on Redis, no polling
    client.cancel(job_id)

``submit`` validates the job locally (``InputInvalid`` with the field named), signs it with the
project's secret, claims the idempotency key (a second submit with the same key returns the
first job's id and sends nothing), records the job and sends ``fleet.prep`` to the project's queue.

Projects: job ids are unique per project (fleet/core/keys.py), so ``result``, ``status``,
``events`` and ``cancel`` act on a job of one project: the one named by ``project=``, else the
project this client submitted that id for, else the client's own (``Client(project=...)``, or
the only project in its settings). ``"<project>/<id>"`` names both. A job id already recorded in
its project is a duplicate: ``submit`` sends nothing and returns the id (the first job stands).

Unknown jobs and a dead broker: ``result``, ``status``, ``events`` and ``cancel`` raise NotFound
(E_NOT_FOUND) for a job its project does not have (never submitted, expired, or lost with a
Redis that kept no data), never wait for it; ``submit`` rides out a broker that does not answer
for ``retry_s`` with the same signed message (no duplicates), then raises BrokerUnavailable
(E_BROKER_UNAVAILABLE), as does ``result`` when the broker stays away past its timeout.

Cancel is a request signed with the project's secret, written where only the job's project may
write (``{p}cancel:{<ref>}``) and announced by a ``fleet.cancel`` task on the project's queue: the
prep worker that takes it verifies the signature, removes a queued job from the dispatcher and
publishes E_CANCELLED; a running job's lease keeper sees the same request within a second. The
producer itself never writes another process's keys, so it can run on a Redis user that can
only reach its own project (``fleet acl``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

import kombu.exceptions
import redis
from pydantic import ValidationError

from fleet.core.config import Settings, load_settings
from fleet.core.errors import InputInvalid, NotFound
from fleet.core.events import EventSink, decode_event
from fleet.core.keys import Keys, job_ref
from fleet.core.limits import check_job, check_message
from fleet.core.models import Envelope, Job, describe_invalid
from fleet.core.redisconn import UNREACHABLE, broker_unavailable
from fleet.core.redisconn import redis_client as connect
from fleet.core.results import ResultStore
from fleet.core.seal import digest, sign_cancel
from fleet.core.signing import sign
from fleet.worker.app import create_app
from fleet.worker.queues import CANCEL_TASK, PREP_TASK, prep_kind, shown

# What ``status`` shows of a job record: never the signed message, the prepared job or its seal.
STATUS_FIELDS = ("project", "kind", "state", "submitted_at", "pending_at", "running_at",
                 "finished_at", "code")
_REMEMBERED = 100_000  # job ids whose project a client remembers (oldest forgotten first)
SEND_ERRORS = (*UNREACHABLE, kombu.exceptions.OperationalError)


class Client:
    def __init__(self, settings: Settings | None = None, *, redis_client: redis.Redis | None = None,
                 secrets: Mapping[str, str] | None = None, project: str | None = None,
                 retry_s: float = 30.0) -> None:
        self.settings = settings or load_settings()
        only = list(self.settings.projects) if len(self.settings.projects) == 1 else []
        self.project = project or (only[0] if only else None)
        self._projects: dict[str, str] = {}  # job id -> project, for ids this client submitted
        self.redis: Any = redis_client or connect(self.settings)
        self.keys = Keys(self.settings.key_prefix)
        self.results = ResultStore(self.redis, self.keys, self.settings)
        self._secrets = dict(secrets or {})
        self._celery = create_app(self.settings)
        self.retry_s = retry_s  # how long submit rides out a broker that does not answer

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _secret(self, project: str) -> str:
        if project in self._secrets:
            return self._secrets[project]
        found = self.settings.project(project)
        if found is None:
            raise InputInvalid(f"unknown project {project!r}")
        return found.secret

    def ref(self, job_id: str, project: str | None = None) -> str:
        """The ``<project>/<id>`` a job id names for this client (module docstring)."""
        if "/" in job_id:
            return job_id
        chosen = project or self._projects.get(job_id) or self.project
        if not chosen:
            raise InputInvalid(f"job {job_id!r}: say which project (project=..., or '<project>/<id>')")
        return job_ref(chosen, job_id)

    def _remember(self, job_id: str, project: str) -> None:
        if len(self._projects) >= _REMEMBERED:
            self._projects.pop(next(iter(self._projects)))
        self._projects[job_id] = project

    # -- submitting -------------------------------------------------------------------------
    def submit(self, job: Job | Mapping[str, Any], *, record: Mapping[str, str] | None = None) -> str:
        """Send a job; its id. ``record``: more fields of its job hash, written with it (the
        gateway's sealed API-key tag, before any worker can read the record)."""
        if not isinstance(job, Job):
            try:
                job = Job.model_validate(job)
            except ValidationError as exc:
                raise InputInvalid(f"invalid job: {describe_invalid(exc, 1)}") from exc
        check_job(job, self.settings.limits)
        raw = job.model_dump(mode="json", exclude_none=True)
        if not job.idempotency_key:
            return self.submit_raw(raw, project=job.project, job_id=job.id, kind=job.kind, record=record)
        key = self.keys.idem(job.project, job.idempotency_key)
        try:
            claimed = self.redis.set(key, job.id, nx=True, ex=self.settings.result_ttl_s)
            existing = None if claimed else self.redis.get(key)
        except UNREACHABLE as exc:
            raise broker_unavailable(self.settings.broker_url, exc) from exc
        if not claimed:
            return existing.decode() if existing else job.id
        try:
            return self.submit_raw(raw, project=job.project, job_id=job.id, kind=job.kind, record=record)
        except BaseException:
            # The job never left: forget it entirely (the prep watchdog must not send it later),
            # so a retry with the same key sends it. (With the broker gone, the record is left to
            # the watchdog, which sends it once the broker is back; the key keeps it single.)
            ref = job_ref(job.project, job.id)
            with contextlib.suppress(*UNREACHABLE):
                self.redis.delete(key, self.keys.job(ref))
                self.redis.zrem(self.keys.prepping(job.project), ref)
            raise

    def submit_raw(self, raw: Mapping[str, Any], *, project: str, job_id: str,
                   kind: str = "infer", secret: str | None = None,
                   record: Mapping[str, str] | None = None) -> str:
        """Sign and send a job dict as is (no local validation): the worker judges it.

        A broker that does not answer is tried again for ``retry_s`` (then BrokerUnavailable,
        E_BROKER_UNAVAILABLE) with the very same signed message: its record is created once, so
        a second try after a blip finds this message's own record and sends the prep task again
        (prep runs a job once however often it is sent), never a second job."""
        signed = sign(raw, project, secret if secret is not None else self._secret(project))
        check_message(signed, self.settings.limits)  # the worker would refuse it unread
        self._remember(job_id, project)
        give_up_at = time.monotonic() + self.retry_s
        while True:
            try:
                return self._send(signed, project, job_id, kind, record or {})
            except SEND_ERRORS as exc:
                if time.monotonic() >= give_up_at:
                    raise broker_unavailable(self.settings.broker_url, exc) from exc
                time.sleep(0.5)

    def _send(self, signed: dict[str, Any], project: str, job_id: str, kind: str,
              record: Mapping[str, str]) -> str:
        now, ref, received = time.time(), job_ref(project, job_id), digest(signed)
        if not self.results.create(ref, project, now + self.settings.prep_unclaimed_s, **record,
                                   state="submitted", project=project, kind=kind, submitted_at=now,
                                   digest=received, signed=json.dumps(signed)):
            record = self.results.job_record(ref)
            if record.get("digest") != received or record.get("state") != "submitted":
                return job_id  # recorded already: a duplicate, the first submission stands
            # our own message, recorded by a try that a broker blip cut short: send it (again)
        EventSink(self.redis, self.keys, ref, self.settings.events_ttl_s).emit(
            "queued", project=project)
        self._celery.send_task(PREP_TASK, kwargs={"project": project, "job_id": job_id,
                                                  "signed": signed}, **shown(project, job_id, prep_kind(signed)))
        return job_id

    # -- reading ----------------------------------------------------------------------------
    def result(self, job_id: str, timeout: float | None = None, *,
               project: str | None = None) -> Envelope | None:
        """The job's Envelope, waiting up to ``timeout`` seconds (None: as long as it takes) for
        it; **None** when the timeout passes first (the job runs on: ask again later). NotFound
        (E_NOT_FOUND) for a job its project does not have, BrokerUnavailable when the broker
        stays away past the timeout."""
        return self.results.wait(self.ref(job_id, project), 10**9 if timeout is None else timeout)

    def status(self, job_id: str, *, project: str | None = None) -> dict[str, Any]:
        """The job's state; NotFound (E_NOT_FOUND) for a job its project does not have."""
        ref = self.ref(job_id, project)
        full = self.results.job_record(ref)
        record: dict[str, Any] = {k: full[k] for k in STATUS_FIELDS if k in full}
        envelope = self.results.final(ref)
        if envelope is not None:
            record.update(state="final", code=envelope.code.value, message=envelope.message)
        if not full and envelope is None:
            raise _not_found(ref)
        return record

    def events(self, job_id: str, *, follow: bool = True, block_ms: int = 1000,
               idle_timeout_s: float | None = None, project: str | None = None,
               after: str = "0-0") -> Iterator[dict[str, Any]]:
        """Yield the job's events from the start (or those after the event id ``after``: where
        a follower cut off by a broker outage resumes); with ``follow``, until its final event."""
        ref = self.ref(job_id, project)
        key, cursor = self.keys.events(ref), after
        if not self.redis.exists(self.keys.job(ref), key):
            raise _not_found(ref)
        idle_since = time.monotonic()
        while True:
            reply = self.redis.xread({key: cursor}, block=block_ms if follow else None, count=200)
            entries = reply[0][1] if reply else []
            for entry_id, fields in entries:
                cursor = entry_id
                event = decode_event(entry_id, fields)
                yield event
                if self._ends(ref, event):
                    return
            if entries:
                idle_since = time.monotonic()
                continue
            if not follow or (idle_timeout_s and time.monotonic() - idle_since > idle_timeout_s):
                return

    def _ends(self, ref: str, event: dict[str, Any]) -> bool:
        if event["type"] == "final":
            return True
        # a rejection ends the job only if it was of this client's own message (results.py)
        return event["type"] == "rejected" and self.results.final(ref) is not None

    # -- cancelling -------------------------------------------------------------------------
    def cancel(self, job_id: str, *, project: str | None = None) -> bool:
        """Ask the fleet to cancel a job of this client's project (module docstring): a queued
        one ends soon, a running one within about a second. False when the job already had its
        final result; NotFound (E_NOT_FOUND) when its project has no such job."""
        ref = self.ref(job_id, project)
        owner, plain_id = ref.split("/", 1)
        if not self.results.job_record(ref):
            raise _not_found(ref)
        if self.results.final(ref) is not None:
            return False
        self.redis.set(self.keys.cancel(ref), sign_cancel(owner, plain_id, self._secret(owner)),
                       ex=self.settings.result_ttl_s)
        self._celery.send_task(CANCEL_TASK, kwargs={"project": owner, "job_id": plain_id},
                               **shown(owner, plain_id, "cancel"))
        return True


def _not_found(ref: str) -> NotFound:
    return NotFound(f"no job {ref}: never submitted, expired after result_ttl_s, or lost with "
                    "the broker's data")
