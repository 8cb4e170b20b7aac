"""``fleet.Client``: what a project's code uses to talk to the fleet.

    client = Client()                                  # settings from fleet.toml / FLEET_*
    job_id = client.submit({"project": "reports", "messages": [...]})
    envelope = client.result(job_id, timeout=600)      # blocks on Redis, no polling
    client.cancel(job_id)

``submit`` validates the job locally (``InputInvalid`` with the field named), signs it with the
project's secret, claims the idempotency key (a second submit with the same key returns the
first job's id and sends nothing), records the job and sends ``fleet.prep`` to the project's queue.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

import redis
from pydantic import ValidationError

from fleet.core.codes import Code
from fleet.core.config import Settings, load_settings
from fleet.core.errors import InputInvalid
from fleet.core.events import EventSink, decode_event
from fleet.core.keys import Keys
from fleet.core.models import Envelope, Job, describe_invalid
from fleet.core.results import ResultStore
from fleet.core.signing import sign
from fleet.worker.app import PREP_TASK, create_app, shown


class Client:
    def __init__(self, settings: Settings | None = None, *, redis_client: redis.Redis | None = None,
                 secrets: Mapping[str, str] | None = None) -> None:
        self.settings = settings or load_settings()
        self.redis: Any = redis_client or redis.Redis.from_url(self.settings.broker_url)
        self.keys = Keys(self.settings.key_prefix)
        self.results = ResultStore(self.redis, self.keys, self.settings)
        self._secrets = dict(secrets or {})
        self._celery = create_app(self.settings)

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

    # -- submitting -------------------------------------------------------------------------
    def submit(self, job: Job | Mapping[str, Any]) -> str:
        if not isinstance(job, Job):
            try:
                job = Job.model_validate(job)
            except ValidationError as exc:
                raise InputInvalid(f"invalid job: {describe_invalid(exc, 1)}") from exc
        raw = job.model_dump(mode="json", exclude_none=True)
        if not job.idempotency_key:
            return self.submit_raw(raw, project=job.project, job_id=job.id, kind=job.kind)
        key = self.keys.idem(job.project, job.idempotency_key)
        if not self.redis.set(key, job.id, nx=True, ex=self.settings.result_ttl_s):
            existing = self.redis.get(key)
            return existing.decode() if existing else job.id
        try:
            return self.submit_raw(raw, project=job.project, job_id=job.id, kind=job.kind)
        except BaseException:
            # The job never left: forget it entirely (the prep watchdog must not send it later),
            # so a retry with the same key sends it.
            self.redis.delete(key, self.keys.job(job.id))
            self.redis.zrem(self.keys.prepping, job.id)
            raise

    def submit_raw(self, raw: Mapping[str, Any], *, project: str, job_id: str,
                   kind: str = "infer", secret: str | None = None) -> str:
        """Sign and send a job dict as is (no local validation): the worker judges it."""
        signed = sign(raw, project, secret if secret is not None else self._secret(project))
        now = time.time()
        self.results.record(job_id, state="submitted", project=project, kind=kind,
                            submitted_at=now, nonce=signed["nonce"], signed=json.dumps(signed))
        self.redis.zadd(self.keys.prepping, {job_id: now + self.settings.prep_unclaimed_s})
        EventSink(self.redis, self.keys, job_id, self.settings.events_ttl_s).emit(
            "queued", project=project)
        self._celery.send_task(PREP_TASK, kwargs={"project": project, "job_id": job_id,
                                                  "signed": signed}, **shown(project, job_id))
        return job_id

    # -- reading ----------------------------------------------------------------------------
    def result(self, job_id: str, timeout: float | None = None) -> Envelope | None:
        return self.results.wait(job_id, 10**9 if timeout is None else timeout)

    def status(self, job_id: str) -> dict[str, Any]:
        record: dict[str, Any] = self.results.job_record(job_id)
        record.pop("job", None)
        record.pop("nonce", None)
        envelope = self.results.final(job_id)
        if envelope is not None:
            record.update(state="final", code=envelope.code.value, message=envelope.message)
        return record

    def events(self, job_id: str, *, follow: bool = True, block_ms: int = 1000,
               idle_timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield the job's events from the start; with ``follow``, until its final event."""
        key, cursor = self.keys.events(job_id), "0-0"
        idle_since = time.monotonic()
        while True:
            reply = self.redis.xread({key: cursor}, block=block_ms if follow else None, count=200)
            entries = reply[0][1] if reply else []
            for entry_id, fields in entries:
                cursor = entry_id
                event = decode_event(entry_id, fields)
                yield event
                if self._ends(job_id, event):
                    return
            if entries:
                idle_since = time.monotonic()
                continue
            if not follow or (idle_timeout_s and time.monotonic() - idle_since > idle_timeout_s):
                return

    def _ends(self, job_id: str, event: dict[str, Any]) -> bool:
        if event["type"] == "final":
            return True
        # a rejection ends the job only if it was of this client's own message (results.py)
        return event["type"] == "rejected" and self.results.final(job_id) is not None

    # -- cancelling -------------------------------------------------------------------------
    def cancel(self, job_id: str) -> bool:
        """Cancel a job: a queued one ends at once, a running one within about a second.
        False when the job is unknown or already had its final result."""
        record = self.results.job_record(job_id)
        if not record or self.results.final(job_id) is not None:
            return False
        self.redis.set(self.keys.cancel(job_id), "1", ex=self.settings.result_ttl_s)
        state = record.get("state", "")
        if state == "running":
            return True
        from schedulers.store import make_store

        pending = make_store(self.settings, self.redis).cancel_pending(job_id)
        if pending or state == "submitted":
            project = record.get("project", "")
            self.results.publish(Envelope.failure(job_id, project, Code.E_CANCELLED,
                                                  "cancelled while queued"))
        return True
