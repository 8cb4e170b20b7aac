"""Nothing is lost before the dispatcher either: claims on preparation and a watchdog.

Inference has leases (schedulers/store/base.py). Preparation has its own, simpler guard, because a
prep message reserved or running on a worker that dies would otherwise wait for the broker's
visibility timeout (hours) before anyone looks at it again.

Keys (fleet/core/keys.py; <ref> = <project>/<id>)
  {p}{prep}:claim:<ref>  string  the worker preparing the job; TTL prep_lease_s, renewed while it runs
  {p}{prep}:prepping:<project>
                         zset    the project's jobs (refs) not yet handed over, score = when the
                                 watchdog should look (submitted + prep_unclaimed_s, then claim
                                 expiry while preparing); one per project, so a producer that may
                                 write its own project's zset cannot touch another's. Its members
                                 (and the job records) are the producer's to write too: a member
                                 that is not a ref of the zset's project, or whose stored message
                                 names another job, is dropped (and logged), never acted on
  {p}job:{<ref>}         hash    field ``signed``: the signed message as submitted, to send it again

Flow
  submit     -> ZADD prepping (now + prep_unclaimed_s); the job hash keeps the signed message
  prep start -> SET {prep}:claim:<ref> NX PX (a second delivery running at the same time stops
                here); ZADD prepping (claim expiry); a keeper thread renews both every third of the TTL
  prep end   -> DEL {prep}:claim:<ref>, ZREM prepping (whatever the outcome)
  watchdog   -> (run_prep_watchdog, fleet/prep/recover.py: a thread of every dispatcher) due entries
                whose job is neither handed over nor
                final and has no live claim get their signed message sent again (the signature
                check accepts the same message for the same job id); one watchdog takes each due
                entry atomically. Jobs that were claimed and lost count: after ``MAX_RESENDS``
                such losses the job ends E_INTERNAL, so a poison message cannot circulate
                forever. Jobs never claimed are only waiting in a queue and are not counted.
A job that merely waits long in a deep queue may be sent twice; the claim and the job's state
make the copy a no-op.

The claim and watchdog scripts are in fleet/prep/lua/; the ``{prep}`` hash tag keeps a claim and
the zset in one Cluster slot.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from fleet.core.codes import Code
from fleet.core.keys import Keys, job_ref, split_ref
from fleet.core.lua import Scripts, shared
from fleet.core.models import Envelope
from fleet.core.results import ResultStore

log = logging.getLogger(__name__)

HANDED_OVER = ("pending", "running", "final")
MAX_RESENDS = 5
WATCH_INTERVAL_S = 2.0


def _scripts(client: Any) -> Scripts:
    """renew, release (owner-checked) and take_due, registered once per client (fleet/prep/lua/)."""
    return shared(client, "fleet.prep", ("renew", "release", "take_due"))


class PrepClaim:
    """Held by one prep task while it prepares one job (a context manager)."""

    def __init__(self, client: redis.Redis, keys: Keys, job_id: str, owner: str, ttl_s: float) -> None:
        self.client: Any = client
        self.keys = keys
        self.job_id = job_id  # the ref
        self.prepping = keys.prepping(split_ref(job_id)[0])
        self.owner = owner
        self.ttl_ms = int(ttl_s * 1000)
        self._stop = threading.Event()
        self._scripts = _scripts(client)
        self._thread = threading.Thread(target=self._renew, name=f"prep-{job_id[:8]}", daemon=True)

    def acquire(self) -> bool:
        """Take the claim; True as well when it is already this owner's (a task trying again
        after a Redis blip cut its first attempt short)."""
        key = self.keys.prep(self.job_id)
        if not self.client.set(key, self.owner, nx=True, px=self.ttl_ms):
            if self.client.get(key) != self.owner.encode():
                return False
            self.client.pexpire(key, self.ttl_ms)
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(self.prepping, {self.job_id: time.time() + self.ttl_ms / 1000})
        pipe.hset(self.keys.job(self.job_id), "prep_claimed", "1")
        pipe.execute()
        self._thread.start()
        return True

    def renew_once(self) -> bool:
        """Extend the claim and move the watchdog's look on; False once the claim is not ours."""
        next_look = time.time() + self.ttl_ms / 1000
        return bool(self._scripts["renew"](keys=[self.keys.prep(self.job_id), self.prepping],
                                           args=[self.owner, self.ttl_ms, self.job_id, next_look]))

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                if not self.renew_once():
                    log.warning("prep claim of job=%s lapsed", self.job_id)
                    return
            except redis.RedisError as exc:
                log.warning("prep claim of job=%s not renewed: %s", self.job_id, exc)
            except Exception:  # a dead keeper would let the claim lapse unseen
                log.exception("prep claim keeper of job=%s failed", self.job_id)
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._scripts["release"](
            keys=[self.keys.prep(self.job_id), self.prepping], args=[self.owner, self.job_id])


def watch_once(results: ResultStore, resend: Callable[[dict[str, Any]], None], now: float,
               unclaimed_s: float) -> list[str]:
    """One pass over every configured project: send again what stalled before hand-over;
    returns the refs sent again. A project whose entries cannot be read is logged and passed
    over: its producer writes that zset and its job records, and must never stop the pass for
    the projects after it (a Redis error still ends the pass: it concerns them all)."""
    sent = []
    for project in results.settings.projects:
        try:
            sent += _watch_project(results, project, resend, now, unclaimed_s)
        except redis.RedisError:
            raise
        except Exception:
            log.exception("prep watchdog: project %s passed over this round", project)
    return sent


def _watch_project(results: ResultStore, project: str, resend: Callable[[dict[str, Any]], None],
                   now: float, unclaimed_s: float) -> list[str]:
    client, prepping = results.client, results.keys.prepping(project)
    sent = []
    for member in client.zrangebyscore(prepping, "-inf", now, start=0, num=100):
        try:
            job_id = member.decode()
        except UnicodeDecodeError:
            _drop(client, prepping, member, "not a job id")
            continue
        if split_ref(job_id)[0] != project:
            _drop(client, prepping, job_id, "not a job of the project")
            continue
        try:
            if _watch_job(results, project, prepping, job_id, resend, now, unclaimed_s):
                sent.append(job_id)
        except redis.RedisError:
            raise
        except Exception as exc:  # e.g. a record its producer wrote as bytes that do not decode
            _drop(client, prepping, job_id, f"its record cannot be read ({type(exc).__name__})")
    return sent


def _watch_job(results: ResultStore, project: str, prepping: str, job_id: str,
               resend: Callable[[dict[str, Any]], None], now: float, unclaimed_s: float) -> bool:
    """One due entry: True when its prep message was sent again."""
    client, keys = results.client, results.keys
    record = results.job_record(job_id)
    if (record.get("state") in HANDED_OVER or results.final(job_id) is not None
            or "signed" not in record):
        client.zrem(prepping, job_id)
        return False
    signed = _own_message(record["signed"], job_id)
    if signed is None:
        _drop(client, prepping, job_id, "its stored message is not this job's")
        return False
    if client.exists(keys.prep(job_id)):
        return False  # a live claim: its keeper moves the entry on
    if not _scripts(client)["take_due"](keys=[prepping], args=[job_id, now, now + unclaimed_s]):
        return False  # another dispatcher's watchdog took it
    if record.get("prep_claimed"):
        # a worker started preparing it and vanished: that counts against a poison message
        resends = client.hincrby(keys.job(job_id), "prep_resends", 1)
        client.hdel(keys.job(job_id), "prep_claimed")
        if resends > MAX_RESENDS:
            client.zrem(prepping, job_id)
            results.publish(Envelope.failure(
                split_ref(job_id)[1], project, Code.E_INTERNAL,
                f"preparation never completed ({MAX_RESENDS} workers lost it)"))
            return False
    # never claimed: it may just wait in a deep queue; sending it again is harmless and
    # is not counted (prep refuses it as stale after security.max_age_s)
    resend(signed)
    log.warning("prep of job=%s stalled before hand-over; sent again", job_id)
    return True


def _own_message(stored: str, ref: str) -> dict[str, Any] | None:
    """The signed message stored with job ``ref``, or None when it does not name that job: the
    producer may write its own job records, and the watchdog would send the message on to the
    queue of whatever project it names."""
    try:
        signed = json.loads(stored)
        named = job_ref(signed["project"], signed["job"]["id"])
    except (ValueError, TypeError, KeyError):
        return None
    return signed if named == ref else None


def _drop(client: Any, prepping: str, member: str | bytes, why: str) -> None:
    """A project's producer may write its own zset (members included): an entry that is not one
    of the project's jobs is removed, never acted on."""
    client.zrem(prepping, member)
    log.warning("prep watchdog: dropped %.80r from %s: %s", member, prepping, why)
