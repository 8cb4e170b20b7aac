"""The admission store on Redis: every decision is one atomic Lua script, so any number of
dispatcher processes on any number of hosts can admit at once and never pass a limit.

Key layout: fleet/core/keys.py (the dispatcher's keys, all under ``{p}{d}:``, one Redis Cluster
slot); the packed item and lease records are read by name (schedulers/store/records.py).

The scripts are files in schedulers/store/lua/ (``prelude.lua`` holds their shared helpers), each
opening with the KEYS it touches and its ARGV; they are registered once per store. Every key a
script touches is in its KEYS: where the job a script acts on is found by a read (expired leases,
due deadlines, a job's queue), Python reads first and passes that job's keys, and the script checks
again that what it was given still holds (an item in another queue, a lease renewed meanwhile: the
job is skipped, not touched).

Why one hash of items and one of leases, not a hash per job: a script then touches a fixed set of
keys plus the queues of the projects it is told about, so ``ADMIT`` can find the heads, order
them and grant several jobs in one call without the caller naming the jobs first; and a field
costs less memory than a key (about 225 bytes per pending job in all, against 330 with a hash per
job).

Admission is one ``ADMIT`` call for up to ``max_grants`` grants (the dispatcher asks for 8): the
store names the projects it last saw in the projects set (the script refuses to decide when the
set holds another, returns the set and is called again), and the script reads the head of each of
their queues (ZRANGE 0 0: O(log n) in the backlog), orders them with the fair policy (the rules
of schedulers/policy/fairshare.py ``order``, repeated in Lua), applies the backend gate and every
limit (the rules of schedulers/policy/limits.py, in the same order), and grants the first that
fits: pop from pending, counters, bucket, virtual times, fence, lease; then again with the heads
of the granted project read anew, until a hold or ``max_grants``. Projects whose queues are all
empty leave the set there. Because the script reads and decides in one atomic step, dispatchers
racing each other can only change who goes first, never what is allowed.

``GWADMIT`` is one ADMIT round under the worker gate: while no inference worker is live it grants
gateway requests only (each queue's first gateway request standing in for its head). ``GATEWAY``
(``enter_gateway``) is ADD, one GWADMIT round and the request's own CLAIM in one call, for the
gateway (fleet/gateway/admission.py); a dispatcher whose worker gate holds runs GWADMIT alone
(``admit_gateway_only``), so a freed slot goes to a waiting gateway request at once. Both are
composed from the other scripts (fleet/core/lua.py ``uses``).

``CLAIM`` (worker start), ``REQUEUE`` (a grant that could not be sent), ``REAP`` (expired
leases) and ``EXPIRE`` (pending deadlines), at most 200 jobs a call, are single scripts too, and
so are the continuations' (schedulers/store/base.py): ``READMIT`` (the lease given up for another
model turn, the job back in line or into ``deferred``), ``PROMOTE`` (due continuations into their
queue, at most 200 a call) and ``UNDEFER`` (``cancel_pending`` of a waiting continuation).
``wait_for_wake`` never blocks longer than ``MAX_BLOCK_S`` (or 80% of the client's socket
timeout, if that is shorter): redis-py 8 gives every connection a 5 s socket timeout, and a BLPOP
blocking past it raises TimeoutError.

Times come from the caller (``now``), not from Redis TIME, so tests can drive a fake clock;
dispatchers on several hosts need synchronised clocks (NTP) for lease expiry to mean the same.

Backends (schedulers/store/base.py): backend 0's counters stay in ``state`` and its scrape in
``backend``, backend b's are ``bstate:<name>`` and ``backend:<name>``; every script that frees or
claims a lease is given the bstate keys of backends 1, 2, ... (none with one backend, so a
one-backend fleet's calls are the calls of before) and frees the counters of the backend the
lease names. Queues are per (project, band, size, eligibility class); the projects set names
(project, class) groups, ``<project>`` for class 1 and ``<project>:<mask>`` otherwise, and
ADMIT reads the four queues of every group it is told about.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis

from fleet.core.config import ConfigError
from fleet.core.keys import Keys
from fleet.core.lua import Scripts
from schedulers.policy import fairshare, locality
from schedulers.policy.limits import kv_tokens
from schedulers.policy.quota import Usage, Windows
from schedulers.store.base import (
    AdmitResult,
    BackendSnapshot,
    Grant,
    PendingItem,
    StoreConfig,
    StoreSnapshot,
    snapshot_totals,
)
from schedulers.store.records import Item, Lease

log = logging.getLogger(__name__)

SCRIPTS = ("add", "admit", "claim", "renew", "release", "reap", "requeue", "cancel", "expire",
           "readmit", "promote", "undefer", "grow", "gwadmit", "gateway", "recount", "settle")
COMPOSED = {"gwadmit": ("admit",),  # scripts that call others (fleet/core/lua.py)
            "gateway": ("add", "admit", "gwadmit", "claim")}  # scripts that call others (fleet/core/lua.py)
_ROUNDS = 4  # ADMIT calls when the projects set keeps changing under us
_BATCH = 200  # expired leases or due deadlines handled by one script call
MAX_BLOCK_S = 4.0  # longest BLPOP; below redis-py 8's default 5 s socket timeout
RECOUNT_S = 10.0  # how often reap_expired also puts the lease counters right (recount.lua)


class BackendOrderChanged(ConfigError):
    """The settings' backends are not the stored order with entries appended (``register_backends``)."""


def order_conflict(names: list[str], stored: list[str] | None) -> str | None:
    """Why a process with the backends ``names`` must not work beside a dispatcher store written
    with ``stored`` (``D backends``), or None. A job's eligibility bits and a grant's backend are
    positions in the store's order: a prep worker or a gateway with another order would compute
    masks naming other backends. Entries either side appended at the end are fine."""
    if stored is None or all(a == b for a, b in zip(names, stored, strict=False)):
        return None
    return (f"the dispatcher store's backends are {', '.join(stored)} in this order, these settings "
            f"have {', '.join(names)}: a job's backends are positions in that order, so every "
            "dispatcher, worker and gateway needs [[backends]] in the same order (entries may only "
            "be added at the end)")


def stored_backends(client: redis.Redis, keys: Keys) -> list[str] | None:
    """The backends' order the dispatchers recorded (``register_backends``), None before any."""
    raw = client.get(keys.dispatch + "backends")
    return json.loads(_text(raw)) if raw is not None else None


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
        self._scripts = Scripts(client, "schedulers.store", SCRIPTS, prelude="prelude", uses=COMPOSED)
        self._groups: list[str] = []  # every group ADMIT has found in the projects set
        self._next_recount = 0.0  # reap_expired's next recount (RECOUNT_S)
        names = [b.name for b in config.backends]
        self._names = names
        # per backend: its counters' hash and its scrape's (backend 0: the keys of one backend)
        self._states = [self._key("state"), *(self._key(f"bstate:{n}") for n in names[1:])]
        self._scrapes = [self._key("backend"), *(self._key(f"backend:{n}") for n in names[1:])]
        self._more_states = self._states[1:]  # what the lease scripts get after their own keys
        self._packed = b""  # ADMIT's packed settings (_admit_settings), for _packed_for
        self._packed_for: StoreConfig | None = None

    # -- keys (all under D, one hash tag) -------------------------------------------------------
    def _key(self, name: str) -> str:
        return self._d + name

    def _queue(self, project: str, band: str, size: str, elig: str = "1") -> str:
        """A pending queue: ``pending:<project>:<band>:<size>``, ``:<elig>`` after it for an
        eligibility class other than 1 (so a one-backend fleet's queues keep their names)."""
        name = f"{self._d}pending:{project}:{band}:{size}"
        return name if elig in ("1", "") else f"{name}:{elig}"

    def _group_queues(self, group: str) -> list[str]:
        """The four queues of a projects-set member, in ADMIT's order."""
        project, _, elig = group.partition(":")
        return [self._queue(project, b, z, elig or "1") for b in fairshare.BANDS for z in fairshare.SIZES]

    def _run(self, name: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
        return self._scripts[name](keys=keys, args=args, client=client)

    def _where(self, job_ids: list[str]) -> list[tuple[str, str, str, str]]:
        """(project, band, size, elig) of each job's item as it is now: its queue; '' for a
        missing item."""
        if not job_ids:
            return []
        found = self._client.hmget(self._key("items"), job_ids)
        return [Item.unpack(_text(f)).where if f else ("", "", "", "") for f in found]

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
        if item.eligible < 1:
            raise ValueError(f"{item.job_id}: eligible {item.eligible} names no backend")
        enqueued_at = item.enqueued_at or self._clock()
        limits = self.config.limits
        long = item.prompt_tokens > limits.long_prompt_tokens
        size = "long" if long else "short"
        score = fairshare.pending_score(enqueued_at, item.priority, self.config.aging_s)
        elig = str(item.eligible)
        keys = [self._key("items"), self._queue(item.project, item.band, size, elig),
                *map(self._key, ("deadlines", "projects", "state", "vtime", "wake", "lease", "deferred"))]
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
            _uncached(item),
            elig,
            "" if item.hint is None else item.hint,
            "" if item.not_before is None else repr(float(item.not_before)),
            # with locality, the backend whose `filled` count the item records (locality.py)
            locality.cache_backend(item.eligible, item.hint) if self.config.locality.on else "",
        ]

    def cancel_pending(self, job_id: str) -> bool:
        """CANCEL takes a pending job out of line, else UNDEFER a waiting continuation."""
        where = self._where([job_id])[0]
        keys = [self._key("items"), self._key("lease"), self._queue(*where),
                self._key("deadlines"), self._key("state")]
        if self._run("cancel", keys, [job_id, *where]):
            return True
        keys = [self._key("deferred"), self._key("items"), self._key("lease")]
        return bool(self._run("undefer", keys, [job_id]))

    def due_deadlines(self, now: float) -> list[str]:
        return [_text(i) for i in self._client.zrangebyscore(self._key("deadlines"), "-inf", repr(now), 0, _BATCH)]

    def expire_deadlines(self, now: float, only: list[str] | None = None) -> list[str]:
        due = self.due_deadlines(now)
        if only is not None:
            due = [job_id for job_id in due if job_id in only]
        if not due:
            return []
        keys = [self._key(k) for k in ("deadlines", "state", "items", "lease")]
        args: list[Any] = [repr(now)]
        for job_id, where in zip(due, self._where(due), strict=True):
            keys.append(self._queue(*where))
            args += [job_id, *where]
        return [_text(job_id) for job_id in self._run("expire", keys, args)]

    def next_deadline(self) -> float | None:
        first = self._client.zrange(self._key("deadlines"), 0, 0, withscores=True)
        return float(first[0][1]) if first else None

    # -- admission ---------------------------------------------------------------------------
    def admit_next(self, now: float) -> AdmitResult:
        return self.admit_many(now, 1)[0]

    def enter_gateway(self, item: PendingItem, owner: str, now: float, worker_gate: bool,
                      max_grants: int, before: Callable[[Any], None] | None = None
                      ) -> tuple[list[AdmitResult], int]:
        """A gateway request's way in, one GATEWAY call (usually one round trip): ``add_pending``,
        one admission round of up to ``max_grants`` grants (0: none) and, when the round granted
        the item itself, its ``claim`` by ``owner``. With ``worker_gate`` and no live inference
        worker (by Redis's clock, not ``now``), the round grants gateway requests only, each
        queue's first gateway request standing in for its head (queued jobs keep their place). Returns
        the round's results as ``admit_many``'s and the fence of the own claimed lease (0: not
        granted in this call; the item is pending). ``before(pipeline)`` queues commands sent
        in the same round trip ahead of the script (the gateway's job record, which must exist
        before any dispatcher can admit the job). ``item.deadline`` is required."""
        assert item.deadline is not None, "a gateway request always has a deadline"
        group = _group(item.project, str(item.eligible))
        if group not in self._groups:  # else the first call would only learn of it
            self._groups = sorted({*self._groups, group})
        assert item.not_before is None, "a gateway request is in line at once"
        add_keys, add_args = self._add_call(item)
        add_keys = add_keys[:8]  # GATEWAY's ADD: no deferred key (not_before is none)
        keys = [*add_keys, *(self._key(k) for k in ("lease", "leases", "state", "workers", "gateway"))]
        args = [owner, repr(now), "1" if worker_gate else "0", *add_args]
        script = self._scripts["gateway"]
        for _ in range(_ROUNDS):
            admit_keys, admit_args = self._admit_call(now, max_grants)
            # EVALSHA by hand: a pipeline running a Script object asks SCRIPT EXISTS first, a
            # round trip more on every call.
            pipe = self._client.pipeline(transaction=False)
            if before is not None:
                before(pipe)
            pipe.evalsha(script.sha, len(keys) + len(admit_keys), *keys, *admit_keys, *args, *admit_args)
            try:
                fence, *reply = pipe.execute()[-1]
            except redis.exceptions.NoScriptError:  # a restarted Redis: load it, send it all again
                self._client.script_load(script.script)
                continue
            before = None
            if _text(reply[0]) == "stale":
                self._groups = sorted(set(self._groups) | {_text(p) for p in reply[1]})
                continue
            return self._admit_results(reply), int(fence)
        return [AdmitResult(None, "conflict", 0.0)], 0

    def admit_many(self, now: float, max_grants: int) -> list[AdmitResult]:
        """Up to ``max_grants`` grants in one ADMIT call, then the hold that stopped it (if any).

        The call names every group (a project and an eligibility class) this store has seen in
        the projects set (projects come from the configuration, classes from the backends: a short
        list); when the set holds another one, ADMIT decides nothing and returns the set, and the
        call is made again with it. A group that drained stays named, so its next job costs no
        extra call."""
        return self._admit_rounds(lambda keys, args: self._run("admit", keys, args), now, max_grants)

    def admit_gateway_only(self, now: float, max_grants: int) -> list[AdmitResult]:
        """``admit_many`` for a dispatcher whose worker gate holds: one GWADMIT call, which grants
        gateway requests only while no inference worker is live by Redis's clock (queued jobs are
        passed over with the hold 'no_workers' and keep their place), and is ADMIT's round when
        one became live meanwhile."""
        gate_keys = [self._key("workers"), self._key("gateway")]
        return self._admit_rounds(
            lambda keys, args: self._run("gwadmit", [*gate_keys, *keys], ["1", *args]), now, max_grants)

    def _admit_rounds(self, call: Callable[[list[str], list[Any]], Any], now: float,
                      max_grants: int) -> list[AdmitResult]:
        """``call(keys, args)`` an admission script with ADMIT's keys and arguments, again with the
        projects it found unnamed (at most ``_ROUNDS`` times)."""
        for _ in range(_ROUNDS):
            reply = call(*self._admit_call(now, max_grants))
            if _text(reply[0]) == "stale":
                self._groups = sorted(set(self._groups) | {_text(p) for p in reply[1]})
                continue
            return self._admit_results(reply)
        return [AdmitResult(None, "conflict", 0.0)]

    def _admit_call(self, now: float, max_grants: int) -> tuple[list[str], list[Any]]:
        """ADMIT's keys and arguments as it is sent them: now, max_grants, the settings packed in
        one argument (``_admit_settings``), the quota windows of ``now``, the groups."""
        config = self.config
        keys = [self._key(k) for k in ("state", "stats", "backend", "vtime", "fences", "leases",
                                       "deadlines", "projects", "items", "lease")]
        for b in range(1, len(config.backends)):
            keys += [self._states[b], self._scrapes[b]]
        windows = Windows.at(now)
        args: list[Any] = [repr(now), max_grants, self._admit_settings(),
                           windows.minute, repr(windows.minute_end), windows.day, repr(windows.day_end),
                           windows.month, repr(windows.month_end)]
        for group in self._groups:
            keys += self._group_queues(group)
            args += [group, repr(config.weight(group.partition(":")[0]))]
        quotas = self._limited_quotas()
        if quotas:
            keys.append(self._key("qres"))
            for name in quotas:
                keys += self._quota_keys(name, str(windows.minute), windows.day, windows.month)
        return keys, args

    def _limited_quotas(self) -> list[str]:
        """The projects with a quota that limits anything, in ADMIT's order."""
        return [name for name, quota in sorted(self.config.quotas.items()) if quota.limited]

    def _admit_settings(self) -> bytes:
        """ADMIT's arguments that only the settings decide, in its layout (admit.lua's header),
        with '' for the values of each call (now, max_grants, the quota windows), as one JSON
        array of strings: built once per settings. One argument instead of about 16 per backend:
        the client encodes a script's arguments one by one, and with 16 backends that was the
        largest part of an ADMIT call's time (``fleet bench backends``)."""
        config = self.config
        if self._packed_for is config:
            return self._packed
        limits = config.limits
        args: list[Any] = [
            "", repr(config.lease_ttl_s), limits.max_num_seqs, limits.kv_budget_tokens, limits.max_long,
            repr(limits.prefill_tokens_per_s), limits.prefill_burst_tokens, repr(limits.min_spacing_s),
            repr(limits.hol_bypass_s), "1" if config.gate else "0", repr(config.scrape_stale_s),
            repr(config.aging_s), "", repr(limits.long_prefill_tokens_per_s), limits.short_beside_long,
            limits.long_prefills, limits.long_prompt_tokens, repr(limits.short_job_s),
            len(config.more_backends),
        ]
        for backend in config.more_backends:
            more = backend.limits
            args += [more.max_num_seqs, more.kv_budget_tokens, more.max_long, repr(more.prefill_tokens_per_s),
                     more.prefill_burst_tokens, repr(more.min_spacing_s), repr(more.hol_bypass_s),
                     repr(more.long_prefill_tokens_per_s), more.short_beside_long, more.long_prefills,
                     more.long_prompt_tokens, repr(more.short_job_s), more.block_tokens]
        routing = config.routing
        args += [routing.policy, routing.balance_abs_seqs, repr(routing.balance_rel)]
        args += [repr(backend.charge_per_token) for backend in config.backends]
        args += [config.locality.lookahead, repr(config.locality.max_wait_s),
                 *(backend.limits.cache_tokens for backend in config.backends),
                 *(repr(backend.limits.queue_tokens_per_s) for backend in config.backends)]
        quotas = self._limited_quotas()
        args += [len(quotas), "", "", "", "", "", ""]
        for name in quotas:
            quota = config.quotas[name]
            args += [name, quota.tokens_per_minute, quota.requests_per_minute, quota.tokens_per_day,
                     quota.tokens_per_month, quota.max_in_flight, repr(quota.cost_prompt),
                     repr(quota.cost_cached), repr(quota.cost_output)]
        self._packed = json.dumps([str(a) for a in args], separators=(",", ":")).encode()
        self._packed_for = config
        return self._packed

    # -- quotas (schedulers/policy/quota.py) ----------------------------------------------------
    def _quota_keys(self, project: str, minute: str, day: str, month: str) -> list[str]:
        """A project's quota windows: the minute's hash (t, r), the day's and the month's cost."""
        return [self._key(f"quota:{project}:m:{minute}"), self._key(f"quota:{project}:d:{day}"),
                self._key(f"quota:{project}:mo:{month}")]

    def settle(self, job_id: str, fence: int, spent: int) -> bool:
        """Two round trips (the reservation, then SETTLE with its windows' keys); one HGET when
        the grant reserved nothing."""
        raw = self._client.hget(self._key("qres"), job_id)
        if raw is None:
            return False
        held = _text(raw)
        project, held_fence, _cost, minute, day, month, *_flags = held.split(" ")
        if int(held_fence) != fence:
            return False
        keys = [self._key("qres"), *self._quota_keys(project, minute, day, month)]
        return bool(self._run("settle", keys, [job_id, held, spent]))

    def quota_usage(self, project: str, now: float) -> Usage:
        windows = Windows.at(now)
        minute, day, month = self._quota_keys(project, str(windows.minute), windows.day, windows.month)
        pipe = self._client.pipeline(transaction=False)
        pipe.hmget(minute, "t", "r")
        pipe.get(day)
        pipe.get(month)
        quota = self.config.quota(project)
        flight = quota is not None and quota.max_in_flight > 0  # else no lease is read
        if flight:
            pipe.hvals(self._key("lease"))
        (t, r), d, mo, *leases = pipe.execute()
        in_flight = sum(1 for raw in (leases[0] if flight else ()) if Lease.unpack(_text(raw)).project == project)
        return Usage(tokens_minute=int(t or 0), requests_minute=int(r or 0), tokens_day=int(d or 0),
                     tokens_month=int(mo or 0), in_flight=in_flight)

    def _admit_results(self, reply: list[Any]) -> list[AdmitResult]:
        """ADMIT's 'ok' reply: a result per grant, then the hold that stopped the round (if any)."""
        results = [AdmitResult(self._grant(reply[i : i + 9])) for i in range(3, len(reply), 9)]
        reason, retry = _text(reply[1]), _text(reply[2])
        if reason:
            results.append(AdmitResult(None, reason, float(retry) if retry else None))
        return results

    def _grant(self, fields: list[Any]) -> Grant:
        job_id, project, fence, prompt, kv, long, expires, waited, backend = (_text(f) for f in fields)
        return Grant(
            job_id=job_id,
            project=project,
            fence=int(fence),
            prompt_tokens=int(prompt),
            kv_tokens=int(kv),
            long=long == "1",
            lease_expires_at=float(expires),
            waited_s=float(waited),
            backend=self._names[int(backend)],
        )

    # -- leases ------------------------------------------------------------------------------
    def claim(self, job_id: str, fence: int, owner: str, now: float) -> bool:
        return self.claim_on(job_id, fence, owner, now) is not None

    def claim_on(self, job_id: str, fence: int, owner: str, now: float) -> str | None:
        keys = [self._key("lease"), self._key("leases"), self._key("state"), *self._more_states]
        on = int(self._run("claim", keys, [job_id, fence, owner, repr(now), repr(self.config.lease_ttl_s)]))
        return None if not on else self._names[on - 1] if on <= len(self._names) else f"#{on - 1}"

    def renew(self, job_id: str, fence: int, now: float) -> bool:
        keys = [self._key("lease"), self._key("leases")]
        return bool(self._run("renew", keys, [job_id, fence, repr(now), repr(self.config.lease_ttl_s)]))

    def release(self, job_id: str, fence: int) -> bool:
        return bool(self._run("release", self._release_keys(), [job_id, fence]))

    def _release_keys(self) -> list[str]:
        return [*(self._key(k) for k in ("lease", "leases", "state", "items", "wake", "continuations")),
                *self._more_states]

    def release_many(self, leases: Iterable[tuple[str, int]]) -> list[bool]:
        """``release`` for several (job id, fence) pairs in one pipelined round trip, each release
        atomic on its own: what many workers finishing at once amount to (``fleet bench``)."""
        pipe = self._client.pipeline(transaction=False)
        keys = self._release_keys()
        for job_id, fence in leases:
            self._run("release", keys, [job_id, fence], client=pipe)
        return [bool(done) for done in pipe.execute()]

    def requeue(self, job_id: str, fence: int, unclaimed_only: bool = False) -> bool:
        where = self._where([job_id])[0]
        keys = [self._key("lease"), self._key("leases"), self._key("state"), self._key("items"),
                self._queue(*where), *map(self._key, ("projects", "deadlines", "wake")), *self._more_states]
        return bool(self._run("requeue", keys, [job_id, fence, *where, "1" if unclaimed_only else "0"]))

    def unclaimed_leases(self, admitted_before: float) -> dict[str, int]:
        """Live leases no worker has claimed, granted before ``admitted_before`` (job id ->
        fence): one HGETALL of the lease hash (at most ``max_num_seqs`` entries)."""
        found = {}
        for job_id, raw in self._client.hgetall(self._key("lease")).items():
            lease = Lease.unpack(_text(raw))
            if lease.owner is None and float(lease.admitted_at) < admitted_before:
                found[_text(job_id)] = int(lease.fence)
        return found

    def _lease(self, job_id: str) -> Lease | None:
        value = self._client.hget(self._key("lease"), job_id)
        return None if value is None else Lease.unpack(_text(value))

    # -- continuations -----------------------------------------------------------------------
    def readmit(self, job_id: str, fence: int, max_new_tokens: int, not_before: float,
                now: float, *, prompt_tokens: int | None = None, turn: int = 1,
                eligible: int | None = None) -> bool:
        raw = self._client.hget(self._key("items"), job_id)
        if raw is None:
            return False
        item = Item.unpack(_text(raw))
        project, band, prompt, uncached = item.project, item.band, int(item.prompt), int(item.uncached)
        if prompt_tokens is not None and prompt_tokens > prompt:
            uncached, prompt = uncached + prompt_tokens - prompt, prompt_tokens
        limits = self.config.limits
        size = "long" if prompt > limits.long_prompt_tokens else "short"
        kv = kv_tokens(prompt, max_new_tokens, limits.block_tokens)
        elig = item.elig if eligible is None else _mask(job_id, eligible)
        keys = [self._key("lease"), self._key("leases"), self._key("state"), self._key("items"),
                self._queue(project, band, size, elig),
                *map(self._key, ("projects", "deadlines", "wake", "deferred", "continuations")),
                *self._more_states]
        args = [job_id, fence, project, band, size, max_new_tokens, kv, repr(not_before), repr(now),
                prompt, uncached, turn, elig, "1" if self.config.locality.on else ""]
        return bool(self._run("readmit", keys, args))

    def grow(self, job_id: str, prompt_tokens: int, eligible: int | None = None) -> bool:
        limits = self.config.limits
        keys = [self._key("deferred"), self._key("items")]
        args = [job_id, prompt_tokens, limits.block_tokens, limits.long_prompt_tokens,
                "" if eligible is None else _mask(job_id, eligible)]
        return bool(self._run("grow", keys, args))

    def turn_of(self, job_id: str) -> int:
        raw = self._client.hget(self._key("items"), job_id)
        return 0 if raw is None else int(Item.unpack(_text(raw)).cont)

    def promote_due(self, now: float) -> list[str]:
        due = [_text(i) for i in self._client.zrangebyscore(self._key("deferred"), "-inf", repr(now), 0, _BATCH)]
        if not due:
            return []
        keys = [self._key(k) for k in ("deferred", "state", "projects", "deadlines", "wake", "items")]
        args: list[Any] = [repr(now)]
        for job_id, where in zip(due, self._where(due), strict=True):
            keys.append(self._queue(*where))
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

    def deferred_counts(self, limit: int = 10_000) -> dict[str, int]:
        """Per project, the jobs waiting for a not-before time (continuations in backoff, queue jobs
        waiting for an identical job's answer, turns held by their API key's quota): counted over
        the first ``limit`` of them (``fleet queues``)."""
        ids = [_text(i) for i in self._client.zrange(self._key("deferred"), 0, limit - 1)]
        counts: dict[str, int] = {}
        for raw in (self._client.hmget(self._key("items"), ids) if ids else []):
            if raw is not None:
                project = Item.unpack(_text(raw)).project
                counts[project] = counts.get(project, 0) + 1
        return counts

    def continuations(self) -> dict[str, dict[str, int]]:
        """Counted from the items the continuations set names; ids whose item is gone or is no
        continuation any more (submitted anew) leave the set."""
        ids = [_text(i) for i in self._client.smembers(self._key("continuations"))]
        found: dict[str, dict[str, int]] = {}
        gone = []
        for job_id, raw in zip(ids, self._client.hmget(self._key("items"), ids) if ids else [], strict=True):
            item = None if raw is None else Item.unpack(_text(raw))
            if item is None or item.cont == "0":
                gone.append(job_id)
                continue
            state = "deferred" if item.deferred is not None else "pending" if item.pending == "1" else ""
            if state:
                counts = found.setdefault(item.project, {})
                counts[state] = counts.get(state, 0) + 1
        if gone:
            self._client.srem(self._key("continuations"), *gone)
        return found

    def lease_valid(self, job_id: str, fence: int) -> bool:
        lease = self._lease(job_id)
        return lease is not None and int(lease.fence) == fence

    def lease_project(self, job_id: str) -> str | None:
        lease = self._lease(job_id)
        return None if lease is None else lease.project

    def reap_expired(self, now: float) -> list[str]:
        if now >= self._next_recount:
            self._next_recount = now + RECOUNT_S
            self.recount()
        due = [_text(i) for i in self._client.zrangebyscore(self._key("leases"), "-inf", f"({now!r}", 0, _BATCH)]
        if not due:
            return []
        keys = [self._key(k) for k in ("leases", "state", "projects", "deadlines", "wake", "lease", "items")]
        args: list[Any] = [repr(now)]
        for job_id, where in zip(due, self._where(due), strict=True):
            keys.append(self._queue(*where))
            args += [job_id, *where]
        expired = [_text(job_id) for job_id in self._run("reap", [*keys, *self._more_states], args)]
        if expired:
            log.warning("leases expired, jobs back in line: %s", ", ".join(expired))
        return expired

    def recount(self) -> dict[str, tuple[int, int]]:
        """Put the lease counters right (recount.lua); returns the ones that were off, as
        (was, now), and logs them: a counter off means a process of another version released a
        lease (docs/operations.md, upgrades)."""
        keys = [self._key("state"), self._key("lease"), *self._more_states]
        raw = [_text(v) for v in self._run("recount", keys, [])]
        off = {self._counter(raw[i]): (int(raw[i + 1]), int(raw[i + 2])) for i in range(0, len(raw), 3)}
        if off:
            log.warning("lease counters put right from the live leases: %s",
                        ", ".join(f"{k} {was} -> {now}" for k, (was, now) in off.items()))
        return off

    def _counter(self, field: str) -> str:
        """RECOUNT's name of a counter (``<b>:<field>`` for backend b > 0) with the backend's name."""
        index, sep, name = field.partition(":")
        return f"{self._names[int(index)]}:{name}" if sep else field

    def next_expiry(self) -> float | None:
        first = self._client.zrange(self._key("leases"), 0, 0, withscores=True)
        return float(first[0][1]) if first else None

    # -- the backends' order ------------------------------------------------------------------
    def register_backends(self) -> None:
        """Check this store's backends against the order the store was written with, and record
        it: a job's eligibility bits and a lease's backend are positions in that order, so the
        backends may only be appended to. A store with no job in line, waiting or in flight
        takes any order (nothing holds a position). ``BackendOrderChanged`` otherwise, naming
        both lists. Key ``D backends``: the names, JSON, in order."""
        names = [backend.name for backend in self.config.backends]
        key = self._key("backends")
        raw = self._client.get(key)
        stored = json.loads(_text(raw)) if raw is not None else None
        if stored is not None and names[:len(stored)] != stored and not self._drained():
            raise BackendOrderChanged(
                f"the dispatcher store's jobs were admitted with the backends {', '.join(stored)} in "
                f"this order, these settings have {', '.join(names)}: backends may only be added at "
                "the end while jobs are in the fleet (their backends are positions in that order). "
                "Put them back in that order, or let the fleet drain (no job pending, waiting or in "
                "flight) and start again")
        if stored != names:
            self._client.set(key, json.dumps(names))

    def _drained(self) -> bool:
        pipe = self._client.pipeline(transaction=False)
        pipe.hlen(self._key("lease"))
        pipe.zcard(self._key("deferred"))
        pipe.hget(self._key("state"), "queued")
        leases, deferred, queued = pipe.execute()
        return leases == 0 and deferred == 0 and int(queued or 0) == 0

    # -- backend gate, wakes, observation ----------------------------------------------------
    def record_backend(self, scraped_at: float, hold: str, figures: dict[str, str],
                       name: str | None = None) -> None:
        mapping: dict[Any, Any] = {**figures, "scraped_at": repr(scraped_at), "hold": hold}
        self._client.hset(self._scrapes[self.config.backend_index(name)], mapping=mapping)

    def backend(self, name: str | None = None) -> dict[str, str]:
        return _texts(self._client.hgetall(self._scrapes[self.config.backend_index(name)]))

    def oldest_pending(self) -> dict[str, float]:
        groups = sorted(_text(p) for p in self._client.smembers(self._d + "projects"))
        pipe = self._client.pipeline(transaction=False)
        for group in groups:
            for queue in self._group_queues(group):
                pipe.zrange(queue, 0, 0)
        heads = [_text(ids[0]) for ids in pipe.execute() if ids]
        found: dict[str, float] = {}
        for raw in self._client.hmget(self._key("items"), heads) if heads else []:
            if raw is not None:  # admitted between the two reads
                item = Item.unpack(_text(raw))
                found[item.project] = min(found.get(item.project, float("inf")), float(item.enq))
        return found

    def wake(self) -> None:
        pipe = self._client.pipeline()
        pipe.lpush(self._d + "wake", "1")
        pipe.ltrim(self._d + "wake", 0, 99)
        pipe.execute()

    def wait_for_wake(self, timeout_s: float) -> bool:
        """Block on the wake list; never longer than the client's socket timeout allows."""
        timeout_s = min(max(timeout_s, 0.001), self._max_block_s)
        return self._client.blpop([self._d + "wake"], timeout=timeout_s) is not None

    def count_hold(self, reason: str) -> None:
        self._client.hincrby(self._d + "stats", f"hold:{reason}", 1)

    def snapshot(self) -> StoreSnapshot:
        groups = sorted(_text(p) for p in self._client.smembers(self._d + "projects"))
        pipe = self._client.pipeline(transaction=False)
        for group in groups:
            for queue in self._group_queues(group):
                pipe.zcard(queue)
        for state_key in self._states:
            pipe.hgetall(state_key)
        pipe.hgetall(self._d + "stats")
        *found, raw_stats = pipe.execute()
        counts, states = found[: 4 * len(groups)], found[4 * len(groups) :]
        pending: dict[str, dict[str, int]] = {}
        for index, group in enumerate(groups):
            project = group.partition(":")[0]
            for b, band in enumerate(fairshare.BANDS):
                n = counts[index * 4 + b * 2] + counts[index * 4 + b * 2 + 1]
                if n:
                    bands = pending.setdefault(project, {})
                    bands[band] = bands.get(band, 0) + n
        stats = _texts(raw_stats)
        holds = {k[5:]: int(v) for k, v in stats.items() if k.startswith("hold:")}
        backends = {}
        for name, raw in zip(self._names, states, strict=True):
            state = _texts(raw)
            backends[name] = BackendSnapshot(
                in_flight=int(state.get("in_flight", 0)),
                reserved_kv_tokens=int(state.get("kv", 0)),
                long_in_flight=int(state.get("long", 0)),
                interactive_in_flight=int(state.get("inter", 0)),
                claimed=int(state.get("claimed", 0)),
            )
        quota_held = {k.removeprefix("quota_held:"): int(v) for k, v in stats.items() if k.startswith("quota_held:")}
        return snapshot_totals(pending, backends, int(stats.get("admissions", 0)), holds, quota_held)

    def lease_fences(self) -> dict[str, int]:
        """Live leases (job id -> fence), for invariant checks and ``fleet queues``."""
        leases = self._client.hgetall(self._key("lease"))
        return {_text(job_id): int(Lease.unpack(_text(v)).fence) for job_id, v in leases.items()}

    def waiting_items(self, project: str) -> list[tuple[str, int, int]]:
        """(id, prompt tokens, output limit) of every job of ``project`` in line or deferred (one
        HSCAN over the items: for a sweep at start, never per admission)."""
        found = []
        for job_id, raw in self._client.hscan_iter(self._key("items"), count=1000):
            try:
                item = Item.unpack(_text(raw))
            except ValueError:  # not an item this version reads: admission's concern, not the sweep's
                continue
            if item.project == project and (item.pending == "1" or item.deferred is not None):
                found.append((_text(job_id), int(item.prompt), int(item.max_new)))
        return found

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


def _uncached(item: PendingItem) -> int:
    """The item's uncached prompt tokens as the store keeps them (never more than the prompt)."""
    if item.uncached_tokens is None:
        return item.prompt_tokens
    return max(0, min(item.uncached_tokens, item.prompt_tokens))


def _text(value: Any) -> str:
    """Redis replies as str whether or not the client was made with decode_responses."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _texts(mapping: Any) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in mapping.items()}


def _mask(job_id: str, eligible: int) -> str:
    """An eligibility mask as the records keep it; ValueError for one naming no backend."""
    if eligible < 1:
        raise ValueError(f"{job_id}: eligible {eligible} names no backend")
    return str(eligible)


def _group(project: str, elig: str) -> str:
    """The projects set's member for a project's queues of one eligibility class."""
    return project if elig == "1" else f"{project}:{elig}"
