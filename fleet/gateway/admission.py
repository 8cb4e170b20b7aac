"""A gateway request goes through the same admission as a queued job, without a broker hop.

Design: one atomic decision for queue and gateway traffic. The gateway

  1. records the job hash with ``origin=gateway`` and ``gateway=<this process's id>`` under the
     workers' seal (fleet/core/seal.py: the gateway holds ``security.worker_secret``), then
  2. adds the pending item with the request's prompt tokens and max tokens, band ``interactive``
     unless its key says ``batch``, and a ``deadline`` a little past ``gateway.max_queue_wait_s``;
  3. runs one admission round itself, as a dispatcher would, so on a fleet with room the request
     is admitted without waiting for a dispatcher process to wake; and claims its own lease when
     the round granted it. Steps 1-3 are one store call (``RedisStore.enter_gateway``: the
     record and the GATEWAY script, which is ADD + ADMIT + CLAIM, in one round trip, one hop
     off the event loop). Grants of this process's other waiting requests go straight to their
     futures; other grants go where a dispatcher's ``send`` sends them. While the worker gate is
     on (``admission.worker_gate``) and no inference worker is live (by Redis's clock, which
     stamps the heartbeats), the round grants gateway requests only, past queued jobs (even
     its own project's, in its own queue): a queued job keeps its place in line, as the
     dispatchers hold it; else
  4. waits for its grant on a future that this process's one listener resolves.

The admission (the one atomic Lua script) picks it by fair share like any job, counts it against
the sequence cap, the KV budget and the long-prompt limit and issues the lease; ``send``
(fleet/worker/dispatch.py ``make_send``) sees a sealed ``origin=gateway`` and pushes the grant onto
``{p}gwgrants:<gateway>`` instead of sending a Celery task. So fair share and the cap stay exact:
one script decides for queue and gateway traffic alike, whichever process runs it (any number of
dispatchers may admit; the gateway's round is one more, and a queued job it admits goes to the
inference workers exactly as a dispatcher would send it). The listener BLPOPs that one list (one
Redis connection per gateway, however many requests wait) and hands each grant to its request,
which claims the lease, keeps it renewed (fleet/worker/lease.py) and releases it the moment its
upstream stream closed.

Failure cases:
- no grant within ``max_queue_wait_s``: ``cancel_pending``; if that finds the job already admitted
  (the grant is on its way) the grant is taken after all; otherwise ``QueueTimeout`` (429);
- the client goes away while waiting: the same withdrawal; a grant that comes anyway is released;
- a grant nobody waits for any more (a request that gave up a moment before) is released by the
  listener at once, so it never holds a slot until its lease expires;
- the gateway dies while waiting: its pending item expires at its deadline (the dispatcher drops
  it); if it dies holding a lease, the lease expires after ``lease_ttl_s``, the job returns to
  pending past its deadline and is dropped: no slot stays taken;
- Redis fails under the listener: one log line, a pause, and it reads on (waiting requests run
  into their own time limit meanwhile);
- a grant whose lease the gateway cannot claim (already reaped): ``UpstreamUnavailable`` (503);
- the gateway's own admission round fails to send a queued job's task (broker down): the grant
  is given back at once (``send_grants``' requeue) and a dispatcher admits it again later.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.asyncio import Redis as AsyncRedis

from fleet.core.errors import QueueTimeout, UpstreamUnavailable
from fleet.core.keys import Keys, split_ref
from fleet.core.models import Band
from fleet.core.results import ResultStore
from fleet.core.seal import sealed
from fleet.prep.cachehint import CacheEstimate
from schedulers.dispatcher import GRANTS_PER_CALL, send_grants
from schedulers.store.base import Grant, PendingItem
from schedulers.store.redis_store import RedisStore

log = logging.getLogger(__name__)

# Past the gateway's own limit, so the dispatcher only drops what a dead gateway left behind.
DEADLINE_MARGIN_S = 10.0
LISTEN_SLICE_S = 2.0  # one BLPOP, below redis-py's socket timeouts
LATE_GRANT_S = 1.0
LISTENER_PAUSE_S = 0.5


@dataclass(frozen=True)
class Ticket:
    job_id: str
    project: str
    fence: int
    waited_s: float
    backend: str = ""  # the [[backends]] entry the grant names ('': the first)


class Admission:
    def __init__(self, store: RedisStore, results: ResultStore, aredis: AsyncRedis, keys: Keys,
                 run: Callable[..., Any], send: Callable[[Grant], None] | None = None) -> None:
        self.store = store
        self.send = send  # a dispatcher's send; None: only the dispatchers admit
        self.results = results
        self.worker_gate = results.settings.admission.worker_gate
        self.aredis = aredis
        self.keys = keys
        self.run = run  # runs a blocking call off the event loop: ``await run(fn, *args)``
        self.gateway_id = uuid.uuid4().hex[:16]
        self.owner = f"gateway-{self.gateway_id}"
        self._waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._deliveries: set[asyncio.Future[None]] = set()

    # -- the listener -----------------------------------------------------------------------
    async def listen(self) -> None:
        """Hand grants to their requests until cancelled (the app's lifespan runs it)."""
        key = self.keys.gateway_grants(self.gateway_id)
        while True:
            try:
                popped = await self.aredis.blpop([key], timeout=LISTEN_SLICE_S)
            except redis.RedisError as exc:
                log.warning("grant listener: redis error %r; again in %.1fs", exc, LISTENER_PAUSE_S)
                await asyncio.sleep(LISTENER_PAUSE_S)
                continue
            if popped is not None:
                await self._deliver(json.loads(popped[1]))

    async def _deliver(self, grant: dict[str, Any]) -> None:
        waiter = self._waiting.get(grant["job_id"])
        if waiter is not None and not waiter.done():
            waiter.set_result(grant)
            return
        log.info("grant of %s came after its request left; released", grant["job_id"])
        await self._unused(grant["job_id"], int(grant["fence"]))

    async def _unused(self, job_id: str, fence: int) -> None:
        """A grant no turn will use: its quota reservation goes back whole (none without a
        quota), its slot is freed."""
        if self.store.config.quota(split_ref(job_id)[0]) is not None:
            await self.run(self.store.settle, job_id, fence, 0)
        await self.run(self.store.release, job_id, fence)

    # -- one request --------------------------------------------------------------------------
    async def enqueue(self, job_id: str, project: str, band: Band, prompt_tokens: int,
                      max_tokens: int, max_wait_s: float, eligible: int = 1,
                      cache: CacheEstimate | None = None) -> float:
        now = time.time()
        loop = asyncio.get_running_loop()
        waiter = self._waiting[job_id] = loop.create_future()
        item = PendingItem(job_id=job_id, project=project, prompt_tokens=prompt_tokens,
                           max_new_tokens=max_tokens, band=band, enqueued_at=now,
                           deadline=now + max_wait_s + DEADLINE_MARGIN_S, eligible=eligible,
                           uncached_tokens=None if cache is None else cache.uncached_tokens,
                           hint=None if cache is None else cache.hint)
        fields = sealed(self.results.settings, job_id, project=project, kind="infer",
                        origin="gateway", gateway=self.gateway_id)

        def record(pipe: Any) -> None:
            self.results.queue_record(pipe, job_id, state="pending", submitted_at=now, **fields)

        def send(grant: Grant) -> None:
            """The round's send: this process's other waiting requests get their grant directly."""
            if grant.job_id in self._waiting:
                loop.call_soon_threadsafe(self._deliver_soon, _grant_dict(grant))
            else:
                self.send(grant)  # type: ignore[misc]

        def enter() -> Grant | None:
            """Record, pending item, admission round and own claim: one store call while the
            fleet has room; the round goes on (another call) only while it grants others."""
            before: Callable[[Any], None] | None = record
            while True:
                results, fence = self.store.enter_gateway(
                    item, self.owner, time.time(), self.worker_gate,
                    GRANTS_PER_CALL if self.send is not None else 0, before)
                before = None
                grants = [result.grant for result in results if result.grant is not None]
                sent = send_grants(self.store, send, [g for g in grants if g.job_id != job_id])
                if fence or not sent or not results or results[-1].grant is None:
                    return next((g for g in grants if g.job_id == job_id), None) if fence else None

        try:
            own = await self.run(enter)
        except BaseException:
            self._waiting.pop(job_id, None)
            raise
        if own is not None:
            waiter.set_result({**_grant_dict(own), "claimed": True})
        return now

    def _deliver_soon(self, grant: dict[str, Any]) -> None:
        task = asyncio.ensure_future(self._deliver(grant))
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

    async def next_grant(self, job_id: str, timeout_s: float, stop: asyncio.Event | None = None
                         ) -> dict[str, Any] | None:
        """The grant if it arrives within ``timeout_s`` (and before ``stop`` is set), else None."""
        waiter = asyncio.shield(self._waiting[job_id])  # a timeout must not cancel the future
        waits: list[asyncio.Future[Any]] = [waiter]
        if stop is not None:
            waits.append(asyncio.ensure_future(stop.wait()))
        done, pending = await asyncio.wait(waits, timeout=max(timeout_s, 0.001),
                                           return_when=asyncio.FIRST_COMPLETED)
        for left in pending:
            left.cancel()
        return waiter.result() if waiter in done else None

    def forget(self, job_id: str) -> None:
        """The request is done waiting: a grant that comes later is released by the listener."""
        self._waiting.pop(job_id, None)

    async def withdraw(self, job_id: str) -> dict[str, Any] | None:
        """Take the job out of line; the grant instead if it was admitted meanwhile (None when
        it was withdrawn; a grant that comes later still is released by the listener)."""
        if await self.run(self.store.cancel_pending, job_id):
            self.forget(job_id)
            return None
        grant = await self.next_grant(job_id, LATE_GRANT_S)
        self.forget(job_id)
        return grant

    async def claim(self, job_id: str, project: str, grant: dict[str, Any],
                    enqueued_at: float) -> Ticket:
        self.forget(job_id)
        fence = int(grant["fence"])
        backend: str | None = str(grant.get("backend") or "")  # claimed by GATEWAY: its own reply
        if not grant.get("claimed"):  # a dispatcher's grant: the lease names the backend
            backend = await self.run(self.store.claim_on, job_id, fence, self.owner, time.time())
        if backend is None:
            if self.store.config.quota(project) is not None:
                await self.run(self.store.settle, job_id, fence, 0)
            raise UpstreamUnavailable("the admission lease expired before the gateway claimed it")
        return Ticket(job_id, project, fence, time.time() - enqueued_at, backend)

    async def release(self, ticket: Ticket) -> None:
        await self.run(self.store.release, ticket.job_id, ticket.fence)

    async def give_back(self, job_id: str, grant: dict[str, Any]) -> None:
        """A grant nobody will use (the client left): free the slot at once."""
        await self._unused(job_id, int(grant["fence"]))

    @staticmethod
    def timeout_error(max_wait_s: float) -> QueueTimeout:
        """The fleet stayed full for the whole wait; asking again sooner would likely meet the
        same queue, so the Retry-After hint is one more such wait."""
        exc = QueueTimeout(f"not admitted within {max_wait_s:g} s: the fleet is busy; try again")
        exc.retry_after_s = math.ceil(max_wait_s)
        return exc


def _grant_dict(grant: Grant) -> dict[str, Any]:
    """A grant as the listener gets it from the list (fleet/worker/dispatch.py ``hand_to_gateway``)."""
    return {"job_id": grant.job_id, "fence": grant.fence, "backend": grant.backend,
            "lease_expires_at": grant.lease_expires_at, "waited_s": grant.waited_s}


