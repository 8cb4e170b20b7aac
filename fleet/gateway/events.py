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
- A Redis failure: one log line, a pause, then the hub reads on from its cursors (followers wait
  meanwhile; they lose nothing, the streams keep their entries).

One ``XREAD`` names many keys, so it needs them on one server: the fleet's single Redis, not a
Redis Cluster (fleet/core/keys.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.asyncio import Redis as AsyncRedis

from fleet.core.events import decode_event
from fleet.core.keys import Keys

log = logging.getLogger(__name__)

BLOCK_MS = 2000  # below redis-py's socket timeouts
READ_COUNT = 200
PAUSE_S = 0.5
WAKE_TTL_S = 86_400


@dataclass(eq=False)
class _Follower:
    key: str
    queue: asyncio.Queue[list[tuple[Any, Any]]] = field(default_factory=asyncio.Queue)
    left: bool = False


class EventHub:
    def __init__(self, url: str, keys: Keys, gateway_id: str) -> None:
        self._reader = AsyncRedis.from_url(url)  # the hub's one blocking connection
        self._waker = AsyncRedis.from_url(url)
        self._wake_key = keys.gateway_wake(gateway_id)
        self._cursors: dict[str, str] = {}
        self._followers: dict[str, list[_Follower]] = {}
        self._joins: list[_Follower] = []
        self._wake_owed = False  # a follower joined since the hub last took the joins

    async def run(self) -> None:
        """Read for every follower until cancelled (the app's lifespan runs it)."""
        wake_cursor = await self._wake()
        while True:
            try:
                await self._take_joins()
                streams: dict[Any, Any] = {self._wake_key: wake_cursor, **self._cursors}
                reply: Any = await self._reader.xread(streams, block=BLOCK_MS, count=READ_COUNT)
            except redis.RedisError as exc:
                log.warning("event hub: redis error %r; again in %.1fs", exc, PAUSE_S)
                await asyncio.sleep(PAUSE_S)
                continue
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

    async def _take_joins(self) -> None:
        joins, self._joins = self._joins, []
        self._wake_owed = False
        for follower in joins:
            if follower.left:
                continue
            cursor = self._cursors.get(follower.key)
            if cursor is None:  # a stream nobody follows yet: the next read starts at its beginning
                self._cursors[follower.key] = "0-0"
            elif cursor != "0-0":
                backlog = await self._reader.xrange(follower.key, "-", cursor)
                if backlog:
                    follower.queue.put_nowait(backlog)
                if follower.left:  # it left while the backlog was read
                    continue
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
        """The events of one stream from its start, as they come, until the caller stops."""
        follower = _Follower(key)
        self._joins.append(follower)
        try:
            if not self._wake_owed:
                self._wake_owed = True
                await self._wake()
            while True:
                for entry_id, fields in await follower.queue.get():
                    yield decode_event(entry_id, fields)
        finally:
            self._leave(follower)
