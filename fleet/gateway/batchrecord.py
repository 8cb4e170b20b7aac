"""A batch's record in Redis, as the gateway's batch routes keep it (fleet/gateway/batches.py):
what one batch is (``State``, each settled line's ``Settled``) and ``BatchRecords``, the record's
reads and writes: write a new one (``_store_new``), load a batch whole (``_load``), change its
meta atomically (``_commit``), mark where its create ended (``_mark_ended``), keep lines'
outcomes (``_keep``), and Redis's clock (``_clock``), the one clock every gateway compares a
create's progress with. The batch lifecycle (fleet/gateway/batches.py ``BatchLifecycle``) builds
on these.

Records, all under the caller's project (another project's batch, file or cursor is 404
``E_NOT_FOUND`` exactly as an unknown id):

    {p}gwbatch:{<project>/<id>}      hash: meta (the batch object), lines (per input line: number,
                                     custom id, error and code, job id), submitted (lines the
                                     create has handled), touched (its last progress, Redis
                                     TIME), ended (the create ended: at which line), e:<i> (a
                                     line whose submit failed or that was never sent: error
                                     and code), cancelled_to (a cancel: jobs cancelled so far)
    {p}gwbatchdone:{<project>/<id>}  hash: line index -> its settled outcome (code, size of its
                                     result line, whether that line is its job's result, usage)
    {p}gwbatches:<project>           zset of the project's batch ids, score = created_at

A batch that is not there (never created, expired, another project's) is NotFound on ``_load``
and ``_commit``; a Redis error goes up to the route, which answers it (fleet/gateway/wire.py
``redis_failure``). A change that meets another writer's (a WatchError) is read again and retried.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from fleet.core.batchfile import BatchLine
from fleet.core.codes import Code
from fleet.core.config import GatewaySettings
from fleet.core.errors import NotFound
from fleet.core.keys import Keys, job_ref

Row = dict[str, Any]  # one input line: n, custom_id, error, code, job (its job id or None)


@dataclass
class Settled:
    """A line's outcome, kept once known: its code, the size of its result line, whether that
    line is its job's result (else its own error, e.g. a vanished job) and its token usage."""

    code: Code
    size: int
    from_result: bool
    usage: tuple[int, int, int, int] = (0, 0, 0, 0)  # prompt, completion, reasoning, cached tokens

    def dump(self) -> str:
        return json.dumps([self.code.value, self.size, self.from_result, *self.usage])

    @classmethod
    def load(cls, raw: bytes) -> Settled:
        code, size, from_result, *usage = json.loads(raw)
        usage += [0] * (4 - len(usage))  # kept before cached tokens were: none counted
        return cls(Code(code), size, from_result, (usage[0], usage[1], usage[2], usage[3]))


@dataclass
class State:
    """A batch as stored: meta, lines (with the errors of lines whose submit failed), how far
    its create got and when it last progressed, and the lines settled so far (index -> outcome)."""

    meta: dict[str, Any]
    rows: list[Row]
    submitted: int  # lines the create handled; once it ended, where it ended
    ended: bool  # the create ended (its remaining lines have their errors)
    touched: float
    settled: dict[int, Settled]
    cancelled_to: int = 0  # a cancelling batch: lines below it had their waiting jobs cancelled

    def line(self, index: int) -> BatchLine:
        row = self.rows[index]
        return BatchLine(row["n"], row["custom_id"], error=row["error"], code=Code(row["code"]))

    def waiting(self) -> list[int]:
        """Lines with a job and no outcome yet."""
        return [i for i, row in enumerate(self.rows)
                if row["job"] and not row["error"] and i not in self.settled]


class BatchRecords:
    """The batches' records of one gateway: its Redis, key names and the settings in force."""

    def __init__(self, client: redis.Redis, keys: Keys, settings: Callable[[], GatewaySettings]) -> None:
        self.redis = client
        self.keys = keys
        self._settings = settings  # the settings in force (reloaded with the keys)

    def _key(self, project: str, batch_id: str) -> str:
        return self.keys.gateway_batch(job_ref(project, batch_id))

    def _settled_key(self, project: str, batch_id: str) -> str:
        return self.keys.gateway_batch_settled(job_ref(project, batch_id))

    def _store_new(self, project: str, batch: dict[str, Any], rows: list[Row], kept_s: int) -> None:
        """Write a new batch's record: its meta and lines, no line submitted yet, touched now."""
        key = self._key(project, batch["id"])
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"meta": json.dumps(batch), "lines": json.dumps(rows),
                                    "submitted": 0, "touched": self._clock()})
            pipe.expire(key, kept_s)
            pipe.execute()

    def _load(self, project: str, batch_id: str) -> State:
        """The batch as stored, its lines' errors in place (NotFound: no such batch)."""
        key = self._key(project, batch_id)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(key)
            pipe.hgetall(self._settled_key(project, batch_id))
            fields, settled = pipe.execute()
        if b"meta" not in fields or b"lines" not in fields:
            raise NotFound(f"no batch {batch_id!r} for this project")
        rows: list[Row] = json.loads(fields[b"lines"])
        for name, raw in fields.items():
            if name.startswith(b"e:"):
                error, code = json.loads(raw)
                rows[int(name[2:])].update(error=error, code=code)
        ended = fields.get(b"ended")
        if b"touched" not in fields:  # written by a gateway that wrote a batch once all was sent
            ended = str(len(rows)).encode()
        return State(json.loads(fields[b"meta"]), rows,
                     int(ended if ended is not None else fields.get(b"submitted", 0)),
                     ended is not None, float(fields.get(b"touched", 0)),
                     {int(i): Settled.load(raw) for i, raw in settled.items()},
                     int(fields.get(b"cancelled_to", 0)))

    def _commit(self, project: str, batch_id: str,
                change: Callable[[dict[str, Any], redis.client.Pipeline], bool]) -> dict[str, Any]:
        """Change the batch's meta atomically: ``change`` updates the meta it is given and queues
        any other writes on the pipeline (False: nothing to do); retried when another request
        changed the batch meanwhile. The meta as stored afterwards."""
        key = self._key(project, batch_id)
        while True:
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)
                    raw = pipe.hget(key, "meta")
                    if raw is None:
                        raise NotFound(f"no batch {batch_id!r} for this project")
                    batch: dict[str, Any] = json.loads(raw)
                    pipe.multi()
                    if change(batch, pipe):
                        pipe.hset(key, "meta", json.dumps(batch))
                        pipe.execute()
                    return batch
                except redis.WatchError:
                    continue

    def _mark_ended(self, key: str) -> None:
        """End the create at the line it has got to as stored now: ``ended`` is set from
        ``submitted`` in one transaction on the WATCHed record, so a create that records another
        line meanwhile (its ``submitted``, then its check for ``ended``) makes this read again
        rather than end it at a line it has sent. The first to end a create sets where it ended;
        a second keeps that."""
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    ended, submitted = pipe.hmget(key, ["ended", "submitted"])
                    if ended is not None:
                        return
                    pipe.multi()
                    pipe.hset(key, "ended", int(submitted or 0))
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    def _keep(self, project: str, state: State, found: dict[int, Settled]) -> None:
        """Store these lines' outcomes (and note them in ``state``)."""
        if not found:
            return
        key = self._settled_key(project, state.meta["id"])
        settings = self._settings()
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={str(i): outcome.dump() for i, outcome in found.items()})
            pipe.expire(key, settings.batch_window_s + settings.files_ttl_s)
            pipe.execute()
        state.settled.update(found)

    def _clock(self) -> float:
        """Redis's time, the one clock of every gateway: a create's ``touched`` is written with it
        and compared with it on another host, so clock skew between hosts never ends a live
        create (nor keeps a dead one)."""
        seconds, micros = self.redis.time()
        return seconds + micros / 1_000_000
