"""The admission store on Redis: every decision is one atomic Lua script, so any number of
dispatcher processes on any number of hosts can admit at once and never pass a limit.

Key schema (D = ``Keys(prefix).dispatch`` = ``{p}{d}:``; the same list is in fleet/core/keys.py).
Every key carries the hash tag ``{d}``, so all of them share one Redis Cluster slot: admission is
one serialisation point anyway, and a script may touch the shared counters and any job's keys.
  D pending:<project>:<band>:<size>  zset  pending job ids; band interactive|batch, size
                                           short|long; score = fairshare.pending_score (ms)
  D item:<id>      hash    project band size prompt max_new kv long enq score pending(1|0)
                           deadline (absent: none); lives while the job is pending or leased
                           (a lease needs it to requeue)
  D deadlines      zset    pending job ids that have a deadline, score = deadline (unix
                           seconds); an entry leaves at admission, cancel or expiry and comes
                           back when an expired lease requeues the job
  D projects       set     projects that may have pending work (pruned when found empty)
  D vtime          hash    project -> finish tag F_p (start-time fair queuing, tokens/weight)
  D leases         zset    in-flight job ids, score = lease expiry (unix seconds)
  D lease:<id>     hash    fence kv long expires admitted_at project owner (absent until
                           the first ``claim``; a delivery of another owner is refused)
  D state          hash    in_flight kv long (counters of live leases), queued (pending jobs),
                           bucket bucket_at (prefill token bucket), last_admit, blocked_job
                           blocked_since (head-of-line reservation), vtime (V)
  D fence          string  fencing token counter (INCR; every grant gets a new, larger one)
  D wake           list    LPUSHed on submit/release/expiry, capped at 100; dispatchers BLPOP it
  D backend        hash    scraped_at hold (gate verdict) + raw figures (schedulers/scrape.py)
  D stats          hash    admissions, hold:<reason>
  Continuations (``readmit``, ``promote_due``; added beside the scripts above, not inside them):
  D deferred       zset    continuations waiting for their not-before time (score, unix s); their
                           item has pending=0, deferred=<time>, no lease and no deadline entry
  D continuations  set     ids of jobs readmitted at least once (a hint list for ``fleet queues``;
                           ``continuations`` drops ids whose item is gone); their item has cont=1

The scripts are files in schedulers/store/lua/ (``prelude.lua`` holds their shared helpers), each
opening with the KEYS it touches and its ARGV; they are registered once per store. Every key a
script touches is in its KEYS: where the job a script acts on is found by a read (expired leases,
due deadlines, a job's queue), Python reads first and passes that job's keys, and the script checks
again that what it was given still holds (an item in another queue, a lease renewed meanwhile: the
job is skipped, not touched).

Admission reads the heads without a script, in three pipelined round trips (projects and virtual
times; the head of each queue; the heads' items), then ``ADMIT``; a project with no head is
dropped from the set by ``PRUNE``, which checks its queues again atomically. Python orders the
heads with the pure policy (schedulers/policy/fairshare.py); ``ADMIT`` then, atomically, re-reads
those candidates, drops any that another dispatcher took meanwhile, applies the backend gate and
every limit (the rules of schedulers/policy/limits.py, in the same order), and grants the first
that fits: pop from pending, counters, bucket, virtual times, fence, lease. A race between
dispatchers can only change who goes first, never what is allowed; when every candidate was taken,
admission reads the heads again.

``CLAIM`` (worker start), ``REQUEUE`` (a grant that could not be sent), ``REAP`` (expired
leases) and ``EXPIRE`` (pending deadlines), at most 200 jobs a call, are single scripts too.
``wait_for_wake`` never blocks longer than ``MAX_BLOCK_S`` (or 80% of the client's socket
timeout, if that is shorter): redis-py 8 gives every connection a 5 s socket timeout, and a BLPOP
blocking past it raises TimeoutError.

Times come from the caller (``now``), not from Redis TIME, so tests can drive a fake clock;
dispatchers on several hosts need synchronised clocks (NTP) for lease expiry to mean the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis

from fleet.core.keys import Keys
from fleet.core.lua import Scripts
from schedulers.policy import fairshare
from schedulers.policy.limits import kv_tokens
from schedulers.store.base import AdmitResult, Grant, PendingItem, StoreConfig, StoreSnapshot

log = logging.getLogger(__name__)

SCRIPTS = ("add", "prune", "admit", "claim", "renew", "resize", "release", "reap", "requeue",
           "cancel", "expire", "readmit", "promote", "undefer")
_ROUNDS = 4  # admission attempts when other dispatchers keep taking our candidates
_BATCH = 200  # expired leases or due deadlines handled by one script call
MAX_BLOCK_S = 4.0  # longest BLPOP; below redis-py 8's default 5 s socket timeout


class RedisStore:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        config: StoreConfig,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._client = client
        self._d = keys.dispatch
        self._clock = clock
        self._max_block_s = max_block_s(client)
        self._scripts = Scripts(client, "schedulers.store", SCRIPTS, prelude="prelude")

    # -- keys (all under D, one hash tag) -------------------------------------------------------
    def _key(self, name: str) -> str:
        return self._d + name

    def _item(self, job_id: str) -> str:
        return f"{self._d}item:{job_id}"

    def _lease(self, job_id: str) -> str:
        return f"{self._d}lease:{job_id}"

    def _queue(self, project: str, band: str, size: str) -> str:
        return f"{self._d}pending:{project}:{band}:{size}"

    def _run(self, name: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
        return self._scripts[name](keys=keys, args=args, client=client)

    def _where(self, job_ids: list[str]) -> list[tuple[str, str, str]]:
        """(project, band, size) of each job's item as it is now; '' for a missing item."""
        pipe = self._client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(self._item(job_id), "project", "band", "size")
        return [(_text(p or ""), _text(b or ""), _text(z or "")) for p, b, z in pipe.execute()]

    # -- submit / cancel ---------------------------------------------------------------------
    def add_pending(self, item: PendingItem) -> None:
        self._run("add", *self._add_call(item))

    def add_pending_many(self, items: Iterable[PendingItem]) -> None:
        """``add_pending`` for a batch, in one pipelined round trip (each add stays atomic)."""
        pipe = self._client.pipeline(transaction=False)
        for item in items:
            self._run("add", *self._add_call(item), client=pipe)
        pipe.execute()

    def _add_call(self, item: PendingItem) -> tuple[list[str], list[Any]]:
        enqueued_at = item.enqueued_at or self._clock()
        limits = self.config.limits
        long = item.prompt_tokens > limits.long_prompt_tokens
        size = "long" if long else "short"
        score = fairshare.pending_score(enqueued_at, item.priority, self.config.aging_s)
        keys = [self._item(item.job_id), self._queue(item.project, item.band, size),
                *map(self._key, ("deadlines", "projects", "state", "vtime", "wake")), self._lease(item.job_id)]
        return keys, [
            item.job_id,
            item.project,
            item.band,
            size,
            item.prompt_tokens,
            item.max_new_tokens,
            kv_tokens(item.prompt_tokens, item.max_new_tokens, limits.block_tokens),
            "1" if long else "0",
            repr(enqueued_at),
            repr(score),
            "" if item.deadline is None else repr(float(item.deadline)),
        ]

    def cancel_pending(self, job_id: str) -> bool:
        where = self._where([job_id])[0]
        keys = [self._item(job_id), self._lease(job_id), self._queue(*where),
                self._key("deadlines"), self._key("state")]
        if self._run("cancel", keys, [job_id, *where]):
            return True
        keys = [self._key("deferred"), self._item(job_id), self._lease(job_id)]
        return bool(self._run("undefer", keys, [job_id]))

    def expire_deadlines(self, now: float) -> list[str]:
        due = [_text(i) for i in self._client.zrangebyscore(self._key("deadlines"), "-inf", repr(now), 0, _BATCH)]
        keys, args = [self._key("deadlines"), self._key("state")], [repr(now)]
        for job_id, where in zip(due, self._where(due), strict=True):
            keys += [self._item(job_id), self._lease(job_id), self._queue(*where)]
            args += [job_id, *where]
        return [_text(job_id) for job_id in self._run("expire", keys, args)] if due else []

    def next_deadline(self) -> float | None:
        first = self._client.zrange(self._key("deadlines"), 0, 0, withscores=True)
        return float(first[0][1]) if first else None

    # -- admission ---------------------------------------------------------------------------
    def admit_next(self, now: float) -> AdmitResult:
        for _ in range(_ROUNDS):
            heads = self._heads(now)
            if not heads:
                self._client.hincrby(self._key("stats"), "hold:empty", 1)
                return AdmitResult(None, "empty")
            result = self._admit(heads, now)
            if result.hold_reason != "conflict":
                return result
        return AdmitResult(None, "conflict", 0.0)

    def _heads(self, now: float) -> list[fairshare.Head]:
        """The head of every queue of every project, ordered by the fair policy. Read without a
        script (which keys it reads depends on what it finds); ADMIT checks every candidate again."""
        pipe = self._client.pipeline(transaction=False)
        pipe.smembers(self._key("projects"))
        pipe.hget(self._key("state"), "vtime")
        pipe.hgetall(self._key("vtime"))
        members, v, tags = pipe.execute()
        projects, tags = sorted(_text(p) for p in members), _texts(tags)
        queues = [(p, b, z) for p in projects for b in fairshare.BANDS for z in fairshare.SIZES]
        for queue in queues:
            pipe.zrange(self._queue(*queue), 0, 0, withscores=True)
        found = [(queue, top[0]) for queue, top in zip(queues, pipe.execute(), strict=True) if top]
        for _q, (job_id, _score) in found:
            pipe.hmget(self._item(_text(job_id)), "prompt", "max_new", "enq")
        heads: dict[str, list[fairshare.Head]] = {}
        for ((project, band, size), (job_id, score)), fields in zip(found, pipe.execute(), strict=True):
            if None not in fields:  # the item left between the two reads
                head = _head(project, [band, size, job_id, score, *fields])
                heads.setdefault(project, []).append(head)
        for project in projects:
            if project not in heads:
                keys = [self._queue(project, b, z) for b in fairshare.BANDS for z in fairshare.SIZES]
                self._run("prune", [self._key("projects"), *keys], [project])
        views = tuple(
            fairshare.ProjectView(p, self.config.weight(p), float(tags.get(p, 0)), tuple(h))
            for p, h in heads.items()
        )
        snapshot = fairshare.FairSnapshot(views, float(v or 0), now)
        return fairshare.order(snapshot, self.config.aging_s)

    def _admit(self, heads: list[fairshare.Head], now: float) -> AdmitResult:
        limits, config = self.config.limits, self.config
        args: list[Any] = [
            repr(now),
            repr(config.lease_ttl_s),
            limits.max_num_seqs,
            limits.kv_budget_tokens,
            limits.max_long,
            repr(limits.prefill_tokens_per_s),
            limits.prefill_burst_tokens,
            repr(limits.min_spacing_s),
            repr(limits.hol_bypass_s),
            "1" if config.gate else "0",
            repr(config.scrape_stale_s),
        ]
        keys = [self._key(k) for k in ("state", "stats", "backend", "vtime", "fence", "leases", "deadlines")]
        for head in heads:
            size = "long" if head.long else "short"
            keys += [self._item(head.job_id), self._lease(head.job_id),
                     self._queue(head.project, head.band, size)]
            args += [head.job_id, head.project, repr(config.weight(head.project)), head.band, size]
        reply = self._run("admit", keys, args)
        if reply[0] == 0:
            retry = _text(reply[2])
            return AdmitResult(None, _text(reply[1]), float(retry) if retry else None)
        return AdmitResult(
            Grant(
                job_id=_text(reply[1]),
                project=_text(reply[2]),
                fence=int(reply[3]),
                prompt_tokens=int(reply[4]),
                kv_tokens=int(reply[5]),
                long=bool(reply[6]),
                lease_expires_at=float(reply[7]),
                waited_s=float(reply[8]),
            )
        )

    # -- leases ------------------------------------------------------------------------------
    def claim(self, job_id: str, fence: int, owner: str, now: float) -> bool:
        keys = [self._lease(job_id), self._key("leases")]
        return bool(self._run("claim", keys, [job_id, fence, owner, repr(now), repr(self.config.lease_ttl_s)]))

    def renew(self, job_id: str, fence: int, now: float) -> bool:
        keys = [self._lease(job_id), self._key("leases")]
        return bool(self._run("renew", keys, [job_id, fence, repr(now), repr(self.config.lease_ttl_s)]))

    def resize(self, job_id: str, fence: int, max_new_tokens: int) -> bool:
        prompt = self._client.hget(self._item(job_id), "prompt")
        if prompt is None:
            return False
        kv = kv_tokens(int(prompt), max_new_tokens, self.config.limits.block_tokens)
        keys = [self._lease(job_id), self._key("state"), self._item(job_id)]
        return bool(self._run("resize", keys, [fence, max_new_tokens, kv]))

    def release(self, job_id: str, fence: int) -> bool:
        keys = [self._lease(job_id), self._key("leases"), self._key("state"), self._item(job_id),
                self._key("wake")]
        return bool(self._run("release", keys, [job_id, fence]))

    def requeue(self, job_id: str, fence: int) -> bool:
        where = self._where([job_id])[0]
        keys = [self._lease(job_id), self._key("leases"), self._key("state"), self._item(job_id),
                self._queue(*where), *map(self._key, ("projects", "deadlines", "wake"))]
        return bool(self._run("requeue", keys, [job_id, fence, *where]))

    # -- continuations -----------------------------------------------------------------------
    def readmit(self, job_id: str, fence: int, max_new_tokens: int, not_before: float,
                now: float) -> bool:
        where = self._where([job_id])[0]
        prompt = self._client.hget(self._item(job_id), "prompt")
        if prompt is None:
            return False
        kv = kv_tokens(int(prompt), max_new_tokens, self.config.limits.block_tokens)
        keys = [self._lease(job_id), self._key("leases"), self._key("state"), self._item(job_id),
                self._queue(*where), *map(self._key, ("projects", "deadlines", "wake", "deferred",
                                                      "continuations"))]
        args = [job_id, fence, *where, max_new_tokens, kv, repr(not_before), repr(now)]
        return bool(self._run("readmit", keys, args))

    def promote_due(self, now: float) -> list[str]:
        due = [_text(i) for i in self._client.zrangebyscore(self._key("deferred"), "-inf", repr(now), 0, _BATCH)]
        if not due:
            return []
        keys = [self._key(k) for k in ("deferred", "state", "projects", "deadlines", "wake")]
        args: list[Any] = [repr(now)]
        for job_id, where in zip(due, self._where(due), strict=True):
            keys += [self._item(job_id), self._queue(*where)]
            args += [job_id, *where]
        return [_text(job_id) for job_id in self._run("promote", keys, args)]

    def hurry(self, job_id: str, not_before: float) -> bool:
        """One ZADD XX LT (only an existing entry, only earlier), then a wake."""
        pipe = self._client.pipeline()
        pipe.zadd(self._key("deferred"), {job_id: not_before}, xx=True, lt=True)
        pipe.zscore(self._key("deferred"), job_id)
        pipe.lpush(self._key("wake"), "1")
        pipe.ltrim(self._key("wake"), 0, 99)
        return pipe.execute()[1] is not None

    def next_not_before(self) -> float | None:
        first = self._client.zrange(self._key("deferred"), 0, 0, withscores=True)
        return float(first[0][1]) if first else None

    def continuations(self) -> dict[str, dict[str, int]]:
        ids = [_text(i) for i in self._client.smembers(self._key("continuations"))]
        pipe = self._client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(self._item(job_id), "project", "pending", "deferred")
        found: dict[str, dict[str, int]] = {}
        gone = []
        for job_id, (project, pending, deferred) in zip(ids, pipe.execute(), strict=True):
            if project is None:
                gone.append(job_id)
                continue
            state = "deferred" if deferred is not None else "pending" if _text(pending) == "1" else ""
            if state:
                counts = found.setdefault(_text(project), {})
                counts[state] = counts.get(state, 0) + 1
        if gone:
            self._client.srem(self._key("continuations"), *gone)
        return found

    def lease_valid(self, job_id: str, fence: int) -> bool:
        value = self._client.hget(self._lease(job_id), "fence")
        return value is not None and int(value) == fence

    def lease_project(self, job_id: str) -> str | None:
        value = self._client.hget(self._lease(job_id), "project")
        return None if value is None else _text(value)

    def reap_expired(self, now: float) -> list[str]:
        due = [_text(i) for i in self._client.zrangebyscore(self._key("leases"), "-inf", f"({now!r}", 0, _BATCH)]
        if not due:
            return []
        keys = [self._key(k) for k in ("leases", "state", "projects", "deadlines", "wake")]
        args: list[Any] = [repr(now)]
        for job_id, where in zip(due, self._where(due), strict=True):
            keys += [self._lease(job_id), self._item(job_id), self._queue(*where)]
            args += [job_id, *where]
        expired = [_text(job_id) for job_id in self._run("reap", keys, args)]
        if expired:
            log.warning("leases expired, jobs back in line: %s", ", ".join(expired))
        return expired

    def next_expiry(self) -> float | None:
        first = self._client.zrange(self._key("leases"), 0, 0, withscores=True)
        return float(first[0][1]) if first else None

    # -- backend gate, wakes, observation ----------------------------------------------------
    def record_backend(self, scraped_at: float, hold: str, figures: dict[str, str]) -> None:
        mapping: dict[Any, Any] = {**figures, "scraped_at": repr(scraped_at), "hold": hold}
        self._client.hset(self._d + "backend", mapping=mapping)

    def backend(self) -> dict[str, str]:
        return _texts(self._client.hgetall(self._d + "backend"))

    def wake(self) -> None:
        pipe = self._client.pipeline()
        pipe.lpush(self._d + "wake", "1")
        pipe.ltrim(self._d + "wake", 0, 99)
        pipe.execute()

    def wait_for_wake(self, timeout_s: float) -> bool:
        """Block on the wake list; never longer than the client's socket timeout allows."""
        timeout_s = min(max(timeout_s, 0.001), self._max_block_s)
        return self._client.blpop([self._d + "wake"], timeout=timeout_s) is not None

    def snapshot(self) -> StoreSnapshot:
        projects = sorted(_text(p) for p in self._client.smembers(self._d + "projects"))
        pipe = self._client.pipeline(transaction=False)
        for project in projects:
            for band in fairshare.BANDS:
                for size in fairshare.SIZES:
                    pipe.zcard(f"{self._d}pending:{project}:{band}:{size}")
        pipe.hgetall(self._d + "state")
        pipe.hgetall(self._d + "stats")
        *counts, state, stats = pipe.execute()
        pending: dict[str, dict[str, int]] = {}
        for index, project in enumerate(projects):
            for b, band in enumerate(fairshare.BANDS):
                n = counts[index * 4 + b * 2] + counts[index * 4 + b * 2 + 1]
                if n:
                    pending.setdefault(project, {})[band] = n
        state, stats = _texts(state), _texts(stats)
        holds = {k[5:]: int(v) for k, v in stats.items() if k.startswith("hold:")}
        return StoreSnapshot(
            pending=pending,
            in_flight=int(state.get("in_flight", 0)),
            reserved_kv_tokens=int(state.get("kv", 0)),
            long_in_flight=int(state.get("long", 0)),
            admissions=int(stats.get("admissions", 0)),
            holds=holds,
        )

    def lease_fences(self) -> dict[str, int]:
        """Live leases (job id -> fence), for invariant checks and ``fleet queues``."""
        ids = [_text(i) for i in self._client.zrange(self._d + "leases", 0, -1)]
        pipe = self._client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(f"{self._d}lease:{job_id}", "fence")
        return {job_id: int(f) for job_id, f in zip(ids, pipe.execute(), strict=True)}

    def pending_ids(self) -> set[str]:
        ids: set[str] = set()
        for key in self._client.scan_iter(match=f"{self._d}pending:*", count=500):
            ids.update(_text(i) for i in self._client.zrange(key, 0, -1))
        return ids


def max_block_s(client: redis.Redis) -> float:
    """The longest BLPOP ``client`` survives: ``MAX_BLOCK_S``, or 80% of a shorter socket timeout.

    redis-py 8 connections default to a 5 s socket timeout (not in ``connection_kwargs`` when
    the client was made with ``from_url``); ``None`` means no timeout at all.
    """
    socket_timeout_s = client.connection_pool.connection_kwargs.get("socket_timeout", 5.0)
    if socket_timeout_s is None:
        return MAX_BLOCK_S
    return max(0.01, min(MAX_BLOCK_S, 0.8 * float(socket_timeout_s)))


def _text(value: Any) -> str:
    """Redis replies as str whether or not the client was made with decode_responses."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _texts(mapping: Any) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in mapping.items()}


def _head(project: str, fields: list[Any]) -> fairshare.Head:
    band, size, job_id, score, prompt, max_new, enq = (_text(f) for f in fields)
    return fairshare.Head(
        job_id=job_id,
        project=project,
        band=band,
        prompt_tokens=int(prompt),
        max_new_tokens=int(max_new),
        enqueued_at=float(enq),
        score=float(score),
        long=size == "long",
    )
