"""Task-event followers of one gateway share one Redis reader (``GET /v1/tasks/{id}/events``).

A follower per blocking ``XREAD`` would hold one pooled Redis connection for as long as its client
listens: redis-py's pool stops at 100 connections, and those are the same connections every other
request of the gateway needs. So one ``EventHub`` task reads for all of them:

    hub loop:  joins -> XREAD BLOCK over {wake stream, every followed job's events stream}
               -> each entry to the queues of that job's followers

- One cursor per followed stream; a follower joining a stream already followed first gets the
  entries up to that cursor (``XRANGE``), read by the hub itself between two reads, so nothing
  is delivered twice or out of order.
- A new follower wakes the blocked read by adding to the gateway's wake stream
  ``{p}gwwake:<gateway>`` (kept to one entry, TTL a day); the hub reads from the id of its own
  first entry, so a wake added between two reads is never missed. Wakes are coalesced: a follower
  that joins while a wake is already owed (the hub has not taken the joins yet) adds none, so 200
  followers joining at once cost a few writes, not 200 connections.
- A follower that leaves (client gone, final event seen) is dropped from its stream; the stream
  leaves the read when it has no followers.
- A Redis failure (a restart, an outage): one log line per outage, a pause, then the hub reads on
  from its cursors once Redis answers again, so each follower resumes right after the last entry
  it got (nothing twice; with the append-only file nothing lost). A join or a wake that fails is
  taken up again on the next read. A follower that has waited ``gateway.broker_wait_s`` for a
  Redis that does not answer is ended with ``BrokerUnavailable`` (E_BROKER_UNAVAILABLE), which
  its HTTP stream reports as an error event: a client never mistakes an outage for a stream that
  simply ended.

One ``XREAD`` names many keys, so it needs them on one server: the fleet's single Redis, not a
Redis Cluster (fleet/core/keys.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis

from fleet.core.config import Settings
from fleet.core.errors import BrokerUnavailable
from fleet.core.events import decode_event
from fleet.core.keys import Keys
from fleet.core.redisconn import async_redis_client

log = logging.getLogger(__name__)

BLOCK_MS = 2000
READ_TIMEOUT_S = BLOCK_MS / 1000 + 3.0
READ_COUNT = 200
PAUSE_S = 0.5
WAKE_TTL_S = 86_400


@dataclass(eq=False)
class _Follower:
    key: str
    queue: asyncio.Queue[list[tuple[Any, Any]] | BrokerUnavailable] = field(default_factory=asyncio.Queue)
    left: bool = False
    joined_at: float = field(default_factory=time.monotonic)


class EventHub:
    def __init__(self, settings: Settings, keys: Keys, gateway_id: str) -> None:
        # The hub's one blocking connection; its timeout is past the XREAD block, so a Redis that
        # stops answering (not only one that closes the connection) counts as a failure.
        self._reader = async_redis_client(settings, socket_timeout=READ_TIMEOUT_S,
                                          socket_connect_timeout=READ_TIMEOUT_S)
        self._waker = async_redis_client(settings, socket_timeout=READ_TIMEOUT_S,
                                         socket_connect_timeout=READ_TIMEOUT_S)
        self._wake_key = keys.gateway_wake(gateway_id)
        self._give_up_s = settings.gateway.broker_wait_s
        self._cursors: dict[str, str] = {}
        self._followers: dict[str, list[_Follower]] = {}
        self._joins: list[_Follower] = []
        self._wake_owed = False  # a follower joined since the hub last took the joins
        self._down_since: float | None = None  # Redis has failed every read since then

    async def run(self) -> None:
        """Read for every follower until cancelled (the app's lifespan runs it)."""
        wake_cursor: str | None = None
        while True:
            try:
                if wake_cursor is None:  # the hub's own first wake entry: the read starts there
                    wake_cursor = await self._wake()
                await self._take_joins()
                streams: dict[Any, Any] = {self._wake_key: wake_cursor, **self._cursors}
                reply: Any = await self._reader.xread(streams, block=BLOCK_MS, count=READ_COUNT)
            except redis.RedisError as exc:
                self._failed(exc)
                await asyncio.sleep(PAUSE_S)
                continue
            if self._down_since is not None:
                log.warning("event hub: redis answers again; followers resume from their cursors")
                self._down_since = None
            for raw_key, entries in reply or []:
                key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
                last = entries[-1][0]
                last = last.decode() if isinstance(last, bytes) else last
                if key == self._wake_key:
                    wake_cursor = last
                elif key in self._cursors:
                    self._cursors[key] = last
                    for follower in self._followers.get(key, []):
                        follower.queue.put_nowait(entries)

    async def close(self) -> None:
        with contextlib.suppress(redis.RedisError):  # else it expires after a day
            await self._waker.delete(self._wake_key)
        await self._reader.aclose()
        await self._waker.aclose()

    async def _wake(self) -> str:
        async with self._waker.pipeline(transaction=False) as pipe:
            pipe.xadd(self._wake_key, {"w": "1"}, maxlen=1, approximate=False)
            pipe.expire(self._wake_key, WAKE_TTL_S)
            entry_id, _ = await pipe.execute()
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    def _failed(self, exc: redis.RedisError) -> None:
        """One log line per outage; followers that have waited ``broker_wait_s`` for it are ended."""
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            log.warning("event hub: redis error %r; reading again every %.1fs", exc, PAUSE_S)
        waiting = [f for followers in self._followers.values() for f in followers] + self._joins
        for follower in waiting:
            if now - max(self._down_since, follower.joined_at) >= self._give_up_s:
                follower.queue.put_nowait(BrokerUnavailable(
                    f"the fleet's Redis has not answered for {self._give_up_s:g}s "
                    f"({type(exc).__name__}); follow the task again later"))
                self._leave(follower)

    async def _take_joins(self) -> None:
        """Attach the followers that joined; one whose attach fails stays in line for the next
        round (a failed backlog read must not lose it)."""
        self._wake_owed = False
        while self._joins:
            follower = self._joins[0]
            if not follower.left:
                await self._attach(follower)
            with contextlib.suppress(ValueError):  # it may have left while attached
                self._joins.remove(follower)

    async def _attach(self, follower: _Follower) -> None:
        cursor = self._cursors.get(follower.key)
        if cursor is None:  # a stream nobody follows yet: the next read starts at its beginning
            self._cursors[follower.key] = "0-0"
        elif cursor != "0-0":
            backlog = await self._reader.xrange(follower.key, "-", cursor)
            if backlog:
                follower.queue.put_nowait(backlog)
            if follower.left:  # it left while the backlog was read
                return
        self._followers.setdefault(follower.key, []).append(follower)

    def _leave(self, follower: _Follower) -> None:
        follower.left = True
        if follower in self._joins:
            self._joins.remove(follower)
        followers = self._followers.get(follower.key, [])
        if follower in followers:
            followers.remove(follower)
        if not followers:
            self._followers.pop(follower.key, None)
            self._cursors.pop(follower.key, None)

    async def follow(self, key: str) -> AsyncIterator[dict[str, Any]]:
        """The events of one stream from its start, as they come, until the caller stops;
        BrokerUnavailable once Redis has not answered for ``gateway.broker_wait_s``."""
        follower = _Follower(key)
        self._joins.append(follower)
        try:
            if not self._wake_owed:
                self._wake_owed = True
                with contextlib.suppress(redis.RedisError):  # the hub takes the join at its next read
                    await self._wake()
            while True:
                batch = await follower.queue.get()
                if isinstance(batch, BrokerUnavailable):
                    raise batch
                for entry_id, fields in batch:
                    yield decode_event(entry_id, fields)
        finally:
            self._leave(follower)
