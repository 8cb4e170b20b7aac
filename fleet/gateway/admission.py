"""A gateway request goes through the same admission as a queued job, without a broker hop.

Design: the dispatchers stay the only ones that admit. The gateway

  1. records the job hash with ``origin=gateway`` (``{p}job:{<id>}``), then
  2. ``add_pending`` with the request's prompt tokens and max tokens, band ``interactive`` unless
     its key says ``batch``, and a ``deadline`` a little past ``gateway.max_queue_wait_s``;
  3. waits on ``{p}gwgrant:{<id>}`` (BLPOP, in slices so a keep-alive can be written between them).

A dispatcher's admission (the one atomic Lua script) picks it by fair share like any job, counts
it against the sequence cap, the KV budget and the long-prompt limit, issues the lease, and its
``send`` sees ``origin=gateway`` and pushes the grant onto that list instead of sending a Celery
task (fleet/worker/dispatch.py ``hand_to_gateway``). So fair share and the cap stay exact: one
script decides for queue and gateway traffic alike, and no process besides a dispatcher ever
calls ``admit_next``. The gateway then claims the lease, keeps it renewed (fleet/worker/lease.py)
and releases it the moment its upstream stream has closed.

Failure cases:
- no grant within ``max_queue_wait_s``: ``cancel_pending``; if that finds the job already admitted
  (the grant is on its way) the grant is taken after all; otherwise ``QueueTimeout`` (429);
- the client goes away while waiting: the same withdrawal; a grant that already came is released;
- the gateway dies while waiting: its pending item expires at its deadline (the dispatcher drops
  it); if it dies holding a lease, the lease expires after ``lease_ttl_s``, the job returns to
  pending past its deadline and is dropped: no slot stays taken;
- a grant whose lease the gateway cannot claim (already reaped): ``UpstreamUnavailable`` (503).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis as AsyncRedis

from fleet.core.errors import QueueTimeout, UpstreamUnavailable
from fleet.core.keys import Keys
from fleet.core.models import Band
from fleet.core.results import ResultStore
from schedulers.store.base import AdmissionStore, PendingItem

# Past the gateway's own limit, so the dispatcher only drops what a dead gateway left behind.
DEADLINE_MARGIN_S = 10.0
# Longest single BLPOP: short enough to notice a client gone, below redis-py's socket timeouts.
MAX_SLICE_S = 2.0
LATE_GRANT_S = 1.0


@dataclass(frozen=True)
class Ticket:
    job_id: str
    project: str
    fence: int
    waited_s: float


def owner_name() -> str:
    return f"gateway@{socket.gethostname()}:{os.getpid()}"


class Admission:
    def __init__(self, store: AdmissionStore, results: ResultStore, aredis: AsyncRedis, keys: Keys,
                 run: Callable[..., Any]) -> None:
        self.store = store
        self.results = results
        self.aredis = aredis
        self.keys = keys
        self.run = run  # runs a blocking call off the event loop: ``await run(fn, *args)``
        self.owner = owner_name()

    async def enqueue(self, job_id: str, project: str, band: Band, prompt_tokens: int,
                      max_tokens: int, max_wait_s: float) -> float:
        now = time.time()

        def add() -> None:
            self.results.record(job_id, project=project, kind="infer", origin="gateway",
                                state="pending", submitted_at=now)
            self.store.add_pending(PendingItem(
                job_id=job_id, project=project, prompt_tokens=prompt_tokens,
                max_new_tokens=max_tokens, band=band, enqueued_at=now,
                deadline=now + max_wait_s + DEADLINE_MARGIN_S))

        await self.run(add)
        return now

    async def next_grant(self, job_id: str, timeout_s: float) -> dict[str, Any] | None:
        """The grant if it arrives within ``timeout_s`` (at most MAX_SLICE_S), else None."""
        timeout_s = min(max(timeout_s, 0.01), MAX_SLICE_S)
        popped = await self.aredis.blpop([self.keys.gateway_grant(job_id)], timeout=timeout_s)
        if popped is None:
            return None
        grant: dict[str, Any] = json.loads(popped[1])
        return grant

    async def withdraw(self, job_id: str) -> dict[str, Any] | None:
        """Take the job out of line; the grant instead if it was admitted meanwhile (None when
        it was withdrawn, or its lease will simply expire)."""
        if await self.run(self.store.cancel_pending, job_id):
            return None
        return await self.next_grant(job_id, LATE_GRANT_S)

    async def claim(self, job_id: str, project: str, grant: dict[str, Any],
                    enqueued_at: float) -> Ticket:
        fence = int(grant["fence"])
        if not await self.run(self.store.claim, job_id, fence, self.owner, time.time()):
            raise UpstreamUnavailable("the admission lease expired before the gateway claimed it")
        return Ticket(job_id, project, fence, time.time() - enqueued_at)

    async def release(self, ticket: Ticket) -> None:
        await self.run(self.store.release, ticket.job_id, ticket.fence)

    async def give_back(self, job_id: str, grant: dict[str, Any]) -> None:
        """A grant nobody will use (the client left): free the slot at once."""
        await self.run(self.store.release, job_id, int(grant["fence"]))

    @staticmethod
    def timeout_error(max_wait_s: float) -> QueueTimeout:
        return QueueTimeout(f"not admitted within {max_wait_s:g} s: the fleet is busy; try again")
