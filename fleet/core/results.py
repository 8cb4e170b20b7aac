"""Job records and final results in Redis (keys in fleet/core/keys.py).

Jobs are named by their ref, ``<project>/<id>`` (fleet/core/keys.py); an Envelope carries project and
id, so ``publish`` finds the ref itself. ``create`` writes a record once: a second submission of
the same id in the same project never overwrites the first. It runs on the producers' Redis user,
which may run no Lua at all (fleet/cli/acl.py), so it is a WATCH/MULTI transaction, not a
script: WATCH the job hash, find it absent, then MULTI: HSET, EXPIRE and the prep watchdog's
ZADD. A record created between the check and EXEC (the same id submitted twice at once) fails
the EXEC; the retry then finds it and answers False. It takes three round trips (WATCH, EXISTS,
then MULTI...EXEC in one) where a script took one: alone, a create ran at a third to a half of
the script's rate in the same run on one host; within a whole submit (idempotency key, event,
task send) the difference stayed inside the noise of that loaded host. Redis Cluster: the
watchdog zset is in the ``{prep}`` slot, not the job's (a transaction, like a script, needs one
slot), so a Cluster move writes it in a second step.

A job's life as the job hash records it (``{p}job:{<ref>}`` field ``state``):
    submitted (client) -> pending (prep handed it to the dispatcher) -> running (an inference
    worker claimed its lease) -> final
A job ends with exactly one final Envelope. ``publish`` is one Lua script (fleet/core/lua/publish.lua): it writes
``{p}result:{<ref>}`` only if absent (SET NX) and, in the same atomic step, appends the envelope to
``{p}results:<project>``, adds the ``final`` event to ``{p}events:{<ref>}`` and sets the TTLs. A
second publish for the same job (a duplicate delivery, a late worker, a cancel racing a finish)
changes nothing and returns False, so consumers never see two results for one job.

Rejected messages (E_AUTH) are kept apart: ``{p}rejected:{<ref>}:<digest>`` and the operator's
``{p}rejections`` stream; never the claimed project's results stream, never the claimed job's
result key. The digest is the sha256 of the whole message received (fleet/core/seal.py); the
submitting client recorded the digest of the message it sent in the job hash, so ``final`` shows
it the rejection of its own message, while a forged message naming someone else's job (even one
copying its nonce) has another digest and changes nothing for that job.

Waiting: ``wait`` reads the last event id, then the result key, then blocks on the event stream
from that id (XREAD BLOCK, at most 2 s at a time: redis-py's default socket timeout is 5 s).
Because ``publish`` writes the result before the final event, a result missed by the GET is
always seen by the XREAD: no sleep-polling, no lost wake-up. Only a ``final`` or ``rejected``
event (or 2 s without any) makes it read the result again: a job's progress events (prepared,
admitted, reasoning, ...) cost the waiting client no round trip beyond the XREAD itself.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

import redis

from fleet.core.codes import Code
from fleet.core.config import Settings
from fleet.core.errors import NotFound
from fleet.core.events import EVENTS_MAXLEN
from fleet.core.keys import Keys, job_ref
from fleet.core.lua import Scripts
from fleet.core.models import Envelope
from fleet.core.redisconn import UNREACHABLE, broker_unavailable

log = logging.getLogger(__name__)

ENDING_EVENTS = frozenset({"final", "rejected"})  # the events after which ``wait`` reads the result


def _ends_wait(fields: dict[Any, Any]) -> bool:
    kind = fields.get(b"type", fields.get("type"))
    return (kind.decode() if isinstance(kind, bytes) else kind) in ENDING_EVENTS


def _field_values(fields: dict[str, Any]) -> dict[str, str | int | float]:
    """Hash field values as Redis takes them: strings and numbers as they are, the rest as JSON."""
    return {k: v if isinstance(v, str | int | float) else json.dumps(v) for k, v in fields.items()}


class ResultStore:
    def __init__(self, client: redis.Redis, keys: Keys, settings: Settings,
                 on_publish: Callable[[Envelope], None] | None = None) -> None:
        self.client: Any = client  # redis-py's response types are unions; we know the shapes
        self.keys = keys
        self.settings = settings
        self.on_publish = on_publish  # called once per envelope this store wrote (worker metrics)
        self._publish = Scripts(client, "fleet.core", ("publish",))["publish"]

    # -- job records ----------------------------------------------------------------------
    def create(self, ref: str, project: str, watch_at: float, /, **fields: Any) -> bool:
        """Record a new job and put it under the prep watchdog; False when the ref exists
        (module docstring: a transaction, no script)."""
        job = self.keys.job(ref)
        values = _field_values(fields)

        def create_if_absent(pipe: Any) -> bool:
            if pipe.exists(job):
                return False
            pipe.multi()
            pipe.hset(job, mapping=values)
            pipe.expire(job, self.settings.result_ttl_s)
            pipe.zadd(self.keys.prepping(project), {ref: watch_at})
            return True

        return bool(self.client.transaction(create_if_absent, job, value_from_callable=True))

    def record(self, ref: str, **fields: Any) -> None:
        pipe = self.client.pipeline(transaction=False)
        self.queue_record(pipe, ref, **fields)
        pipe.execute()

    def queue_record(self, pipe: Any, ref: str, **fields: Any) -> None:
        """``record``'s commands on the caller's pipeline, sent with its other commands."""
        pipe.hset(self.keys.job(ref), mapping=_field_values(fields))
        pipe.expire(self.keys.job(ref), self.settings.result_ttl_s)

    def job_record(self, ref: str) -> dict[str, str]:
        raw = self.client.hgetall(self.keys.job(ref))
        return {k.decode(): v.decode() for k, v in raw.items()}

    # -- results --------------------------------------------------------------------------
    def publish(self, envelope: Envelope, *, stream: Literal["project", "gateway"] | None = "project"
                ) -> bool:
        """Write the one final envelope; False if the job already had one. ``stream``: the
        project's results stream (its consumer groups' jobs), its gateway results stream (a
        gateway request's: counted by fleet top, never handed to a consumer), or neither."""
        ref = job_ref(envelope.project, envelope.job_id)
        keys = [
            self.keys.result(ref),
            self.keys.events(ref),
            self.keys.job(ref),
            self.keys.code_counts,
        ]
        if stream == "project":
            keys.append(self.keys.results(envelope.project))
        elif stream == "gateway":
            keys.append(self.keys.gateway_results(envelope.project))
        written = self._publish(
            keys=keys,
            args=[
                envelope.model_dump_json(),
                self.settings.result_ttl_s,
                self.settings.results_stream_maxlen,
                self.settings.events_ttl_s,
                f"{time.time():.6f}",
                envelope.code.value,
                EVENTS_MAXLEN,
                f"{envelope.project}|{envelope.code.value}",
            ],
        )
        if written:
            log.info(
                "result job=%s project=%s code=%s attempts=%d",
                envelope.job_id,
                envelope.project,
                envelope.code.value,
                len(envelope.attempts),
            )
            if self.on_publish is not None:
                self.on_publish(envelope)
        return bool(written)

    def reject(self, job_id: str, claimed_project: str, reason: str, digest: str,
               code: Code = Code.E_AUTH) -> None:
        """Record a rejection of an unverified message (E_AUTH, or E_INPUT_INVALID for one too
        large to verify) where operators look, not in the project's results; ``digest`` is the
        sha256 of the whole message received (fleet/core/seal.py)."""
        envelope = Envelope.failure(job_id, claimed_project, code, reason)
        ref = job_ref(claimed_project, job_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.rejected(ref, digest), envelope.model_dump_json(), nx=True,
                 ex=self.settings.result_ttl_s)
        pipe.xadd(
            self.keys.rejections,
            {"job_id": job_id, "project": claimed_project, "reason": reason,
             "ts": f"{time.time():.3f}"},
            maxlen=self.settings.results_stream_maxlen,
            approximate=True,
        )
        pipe.xadd(self.keys.events(ref),
                  {"type": "rejected", "ts": f"{time.time():.6f}",
                   "data": json.dumps({"code": code.value, "digest": digest})},
                  maxlen=EVENTS_MAXLEN, approximate=True)
        pipe.expire(self.keys.events(ref), self.settings.events_ttl_s)
        pipe.execute()
        log.warning("rejected job=%s claimed_project=%s reason=%s", job_id, claimed_project, reason)

    def get(self, ref: str) -> Envelope | None:
        """The job's final envelope, if it has one (what the workers go by)."""
        raw = self.client.get(self.keys.result(ref))
        return Envelope.model_validate_json(raw) if raw else None

    def final(self, ref: str) -> Envelope | None:
        """What a submitter sees: the final envelope, else the rejection of its own message."""
        envelope = self.get(ref)
        if envelope is not None:
            return envelope
        digest = self.client.hget(self.keys.job(ref), "digest")
        raw = self.client.get(self.keys.rejected(ref, digest.decode())) if digest else None
        return Envelope.model_validate_json(raw) if raw else None

    def wait(self, ref: str, timeout_s: float) -> Envelope | None:
        """Block until the job's final envelope exists or ``timeout_s`` passes. A job with neither
        a record nor a final envelope raises NotFound (E_NOT_FOUND): never submitted, expired, or
        lost with the broker's data - waiting for it would never end. A broker that stops
        answering is waited for (a restart is an ordinary event) until ``timeout_s``, then
        BrokerUnavailable."""
        deadline = time.monotonic() + timeout_s
        events = self.keys.events(ref)
        cursor: Any = None
        check = True
        while True:
            try:
                if cursor is None:
                    last = self.client.xrevrange(events, count=1)
                    cursor = last[0][0] if last else b"0-0"
                if check:
                    envelope = self.final(ref)
                    if envelope is not None:
                        return envelope
                    if not self.client.exists(self.keys.job(ref)):
                        raise NotFound(f"no job {ref}: never submitted, expired after "
                                       "result_ttl_s, or lost with the broker's data")
            except UNREACHABLE as exc:
                if time.monotonic() >= deadline:
                    raise broker_unavailable(self.settings.broker_url, exc) from exc
                time.sleep(1.0)
                continue
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                return None
            try:
                reply = self.client.xread({events: cursor}, block=min(remaining_ms, 2000), count=100)
            except UNREACHABLE:
                check = True
                continue  # the next round waits for the broker
            entries = [entry for _stream, batch in reply or [] for entry in batch]
            if entries:
                cursor = entries[-1][0]
            # Progress events (prepared, admitted, reasoning, ...) end nothing: only a final or
            # rejected event, or a quiet stream (expired job?), is worth reading the result for.
            check = not entries or any(_ends_wait(fields) for _id, fields in entries)


class ResultFollower:
    """Collects the final envelopes of many jobs as they finish (``fleet batch``, the demo).

    Create it BEFORE submitting: it notes the tail of each project's results stream, then
    blocks on those streams (XREAD BLOCK). When nothing arrives for a second it also reads the
    remaining jobs' result keys directly, which catches rejections (never in a project stream)
    and results that fell out of a capped stream.
    """

    def __init__(self, store: ResultStore, projects: set[str]) -> None:
        self.store = store
        self.cursors: dict[str, Any] = {}
        for project in projects:
            key = store.keys.results(project)
            last = store.client.xrevrange(key, count=1)
            self.cursors[key] = last[0][0] if last else "0-0"

    def follow(self, refs: set[str], timeout_s: float, block_ms: int = 1000):  # type: ignore[no-untyped-def]
        """Yield the envelopes of ``refs`` (``<project>/<id>``) as they finish."""
        remaining = set(refs)
        deadline = time.monotonic() + timeout_s
        while remaining and time.monotonic() < deadline:
            try:
                reply = self.store.client.xread(self.cursors, block=block_ms, count=500)
                found = self._arrived(reply, remaining)
            except UNREACHABLE as exc:  # a broker restart: wait for it, up to the deadline
                log.warning("results: the broker does not answer (%r); waiting for it", exc)
                time.sleep(1.0)
                continue
            for envelope in found:
                remaining.discard(job_ref(envelope.project, envelope.job_id))
                yield envelope

    def _arrived(self, reply: Any, remaining: set[str]) -> list[Envelope]:
        """The envelopes of ``remaining`` in one XREAD reply, else (nothing new) in result keys.
        Nothing is taken off ``remaining`` here: a broker error half-way loses nothing."""
        found = []
        for stream, entries in reply or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in entries:
                self.cursors[name] = entry_id
                envelope = Envelope.model_validate_json(fields[b"envelope"])
                if job_ref(envelope.project, envelope.job_id) in remaining:
                    found.append(envelope)
        if not found:
            found = [envelope for envelope in map(self.store.final, remaining) if envelope is not None]
        return found
