"""In-memory twin of the Redis admission store: same rules, same answers, one process.

For unit tests, the fair-share simulations and ``fleet demo`` dry runs. It calls the pure
policy (schedulers/policy/fairshare.py) and limits (schedulers/policy/limits.py) directly; the Redis store
runs the same rules inside Lua. A lock makes it safe for threads; a condition variable stands in
for the wake list.

Queues are heaps with lazy deletion: a cancelled or admitted job stays in its heap until it
reaches the top, where it is recognised (no live item, or a different score) and dropped. The
deadline heap works the same way (a popped deadline counts only if the job is still pending
with that deadline).

Backends: one ``LimitState`` and one gate verdict per backend of ``config.backends``; queues are
keyed by eligibility class too; a lease remembers its backend's index and frees that backend's
counters only. Admission is schedulers/policy/placement.py over the fair order.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from schedulers.policy import fairshare, limits, locality, placement, quota
from schedulers.policy.backend_gate import gate_reason
from schedulers.store.base import (
    AdmitResult,
    BackendSnapshot,
    Grant,
    PendingItem,
    StoreConfig,
    StoreSnapshot,
    snapshot_totals,
)

QueueKey = tuple[str, str, str, int]  # project, band, size, eligibility mask


@dataclass(frozen=True)
class _Entry:
    item: PendingItem
    score: float
    size: str
    turn: int = 0  # readmitted for another model turn: that turn's number
    fill: int = 0  # its cache backend's ``filled`` when it was queued (locality.py)


@dataclass(frozen=True)
class _Lease:
    entry: _Entry
    fence: int
    kv_tokens: int
    long: bool
    expires_at: float
    owner: str | None = None  # set by the first claim
    admitted_at: float = 0.0
    backend: int = 0  # the index of the backend it was granted on


class MemoryStore:
    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._woken = threading.Condition(self._lock)
        self._wakes = 0
        self._queues: dict[QueueKey, list[tuple[float, str]]] = {}
        self._pending: dict[str, _Entry] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._deferred: dict[str, tuple[float, _Entry]] = {}  # continuations before not-before
        self._not_before: list[tuple[float, str]] = []
        self._leases: dict[str, _Lease] = {}
        count = len(config.backends)
        self._states = [limits.LimitState() for _ in range(count)]  # per backend
        self._vtime = 0.0
        self._last_backend = -1  # the backend of the last grant (round robin's position)
        self._finish: dict[str, float] = {}
        self._fences: dict[str, int] = {}  # per project (base.py: fencing tokens)
        self._admissions = 0
        self._holds: dict[str, int] = {}
        self._scrapes: list[tuple[float, str] | None] = [None] * count  # per backend
        self._figures: list[dict[str, str]] = [{} for _ in range(count)]
        # quotas: (project, window kind, window) -> tokens or requests held; job id -> its
        # grant's reservation (fence, cost, project, windows)
        self._quota_used: dict[tuple[str, str, str], int] = {}
        # job id -> (fence, cost, project, windows, the window kinds it wrote)
        self._reserved: dict[str, tuple[int, int, str, quota.Windows, tuple[str, ...]]] = {}
        self._quota_held: dict[str, int] = {}  # as the Redis store's quota_held:<project>
        self._held_now: set[str] = set()  # projects held in the current admit_many call

    # -- submit / cancel ---------------------------------------------------------------------
    def add_pending(self, item: PendingItem) -> None:
        if item.eligible < 1:
            raise ValueError(f"{item.job_id}: eligible {item.eligible} names no backend")
        if not item.enqueued_at:
            item = replace(item, enqueued_at=self._clock())
        size = "long" if item.prompt_tokens > self.config.limits.long_prompt_tokens else "short"
        score = fairshare.pending_score(item.enqueued_at, item.priority, self.config.aging_s)
        with self._lock:
            if item.job_id in self._pending or item.job_id in self._leases or item.job_id in self._deferred:
                return  # pending, in flight or a waiting continuation: each comes back itself
            if not self._pending and not self._leases:
                self._vtime = fairshare.forgive(self._vtime, self._finish.values())
            entry = _Entry(item, score, size, fill=self._filled(item))
            if item.not_before is not None and item.not_before > item.enqueued_at:
                self._deferred[item.job_id] = (item.not_before, entry)
                heapq.heappush(self._not_before, (item.not_before, item.job_id))
            else:
                self._push(entry)
            self._signal()

    def add_pending_many(self, items: Iterable[PendingItem]) -> None:
        for item in items:
            self.add_pending(item)

    def cancel_pending(self, job_id: str) -> bool:
        with self._lock:
            return (self._pending.pop(job_id, None) or self._deferred.pop(job_id, None)) is not None

    def due_deadlines(self, now: float) -> list[str]:
        with self._lock:
            return [job_id for deadline, job_id in sorted(self._deadlines)
                    if deadline <= now and (entry := self._pending.get(job_id)) is not None
                    and entry.item.deadline == deadline]

    def expire_deadlines(self, now: float, only: list[str] | None = None) -> list[str]:
        expired: list[str] = []
        kept: list[tuple[float, str]] = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                deadline, job_id = heapq.heappop(self._deadlines)
                entry = self._pending.get(job_id)
                if entry is None or entry.item.deadline != deadline:
                    continue
                if only is not None and job_id not in only:
                    kept.append((deadline, job_id))
                    continue
                del self._pending[job_id]
                expired.append(job_id)
            for entry_kept in kept:
                heapq.heappush(self._deadlines, entry_kept)
        return expired

    def next_deadline(self) -> float | None:
        with self._lock:
            while self._deadlines:
                deadline, job_id = self._deadlines[0]
                entry = self._pending.get(job_id)
                if entry is not None and entry.item.deadline == deadline:
                    return deadline
                heapq.heappop(self._deadlines)
            return None

    # -- admission ---------------------------------------------------------------------------
    def admit_next(self, now: float) -> AdmitResult:
        return self.admit_many(now, 1)[0]

    def admit_many(self, now: float, max_grants: int) -> list[AdmitResult]:
        results: list[AdmitResult] = []
        with self._lock:
            self._held_now = set()  # a project held counts once per call, as in ADMIT
            while len(results) < max_grants:
                result = self._admit(now)
                if result.grant is None:
                    reason = result.hold_reason or "empty"
                    self._holds[reason] = self._holds.get(reason, 0) + 1
                    return [*results, result]
                self._admissions += 1
                results.append(result)
        return results

    def admit_gateway_only(self, now: float, max_grants: int) -> list[AdmitResult]:
        """No grant: this store never holds a gateway request (the gateway admits through the
        Redis store only, ``RedisStore.enter_gateway``), so under the worker gate every job it
        holds is passed over, and the round is counted as held by 'no_workers'."""
        self.count_hold("no_workers")
        return [AdmitResult(None, "no_workers")]

    def _admit(self, now: float) -> AdmitResult:
        heads = self._heads(now)
        if not heads:
            return AdmitResult(None, "empty")
        views = [placement.BackendView(b.limits, state) for b, state in zip(self.config.backends, self._states,
                                                                              strict=True)]
        if self.config.gate:
            for view, scrape, figures in zip(views, self._scrapes, self._figures, strict=True):
                scraped_at, hold = scrape or (None, "")
                view.gate = gate_reason(scraped_at, hold, now, self.config.scrape_stale_s)
                view.outside = float(figures.get("outside", 0.0))

        def cost(index: int, backend: int) -> limits.Cost:
            h = heads[index]
            return limits.cost_of(h.job_id, h.prompt_tokens, h.max_new_tokens, views[backend].limits,
                                  placement.uncached_on(h, backend), h.band == "interactive")

        routing = replace(self.config.routing, last=self._last_backend)
        windows = quota.Windows.at(now)

        def over(head: fairshare.Head) -> tuple[str, float | None] | None:
            q = self.config.quota(head.project)
            if q is None:
                return None
            verdict = quota.check(q, self._usage(head.project, windows),
                                  q.reserve(head.prompt_tokens, head.max_new_tokens), windows)
            if verdict is not None and head.project not in self._held_now:
                self._held_now.add(head.project)
                self._quota_held[head.project] = self._quota_held.get(head.project, 0) + 1
            return verdict

        chosen = placement.place(views, heads, cost, now, routing=routing, quota=over)
        if chosen.index is None or chosen.backend is None:
            return AdmitResult(None, chosen.reason, chosen.retry_in_s)
        index, backend = chosen.index, chosen.backend
        self._last_backend = backend
        grant = self._grant(heads[0], heads[index], cost(index, backend), backend, now)
        self._reserve(heads[index], grant.fence, windows)
        return AdmitResult(grant)

    # -- quotas (schedulers/policy/quota.py) ----------------------------------------------------
    def _usage(self, project: str, windows: quota.Windows) -> quota.Usage:
        used = self._quota_used
        return quota.Usage(
            tokens_minute=used.get((project, "m", str(windows.minute)), 0),
            requests_minute=used.get((project, "r", str(windows.minute)), 0),
            tokens_day=used.get((project, "d", windows.day), 0),
            tokens_month=used.get((project, "mo", windows.month), 0),
            in_flight=self._in_flight(project, windows),
        )

    def _in_flight(self, project: str, windows: quota.Windows) -> int:
        """The project's live leases, counted only when its quota caps them (as on Redis)."""
        q = self.config.quota(project)
        if q is None or not q.max_in_flight:
            return 0
        return sum(1 for lease in self._leases.values() if lease.entry.item.project == project)

    def _windows_of(self, project: str, windows: quota.Windows) -> list[tuple[str, str, str]]:
        return [(project, "m", str(windows.minute)), (project, "d", windows.day), (project, "mo", windows.month)]

    def _reserve(self, head: fairshare.Head, fence: int, windows: quota.Windows) -> None:
        """As ADMIT: only the windows the quota limits count (so a project without a day limit
        shows 0 for its day, as on Redis)."""
        q = self.config.quota(head.project)
        if q is None:
            return
        cost = q.reserve(head.prompt_tokens, head.max_new_tokens)
        used = self._quota_used
        tokens = (q.tokens_per_minute, q.tokens_per_day, q.tokens_per_month)
        wrote = []
        for key, limit in zip(self._windows_of(head.project, windows), tokens, strict=True):
            if limit:
                used[key] = used.get(key, 0) + cost
                wrote.append(key[1])
        if q.requests_per_minute:
            requests = (head.project, "r", str(windows.minute))
            used[requests] = used.get(requests, 0) + 1
        if wrote:
            self._reserved[head.job_id] = (fence, cost, head.project, windows, tuple(wrote))
        if len(used) > 4096:  # minutes long past (Redis lets them lapse after 180 s)
            for old in [k for k in used if k[1] in ("m", "r") and int(k[2]) < windows.minute - 3]:
                del used[old]

    def settle(self, job_id: str, fence: int, spent: int) -> bool:
        with self._lock:
            held = self._reserved.get(job_id)
            if held is None or held[0] != fence:
                return False
            _, cost, project, windows, wrote = self._reserved.pop(job_id)
            change = max(0, spent) - cost  # what it spent beyond the reservation counts too
            for key in self._windows_of(project, windows):
                if key[1] in wrote and key in self._quota_used:
                    self._quota_used[key] += change
            return True

    def quota_usage(self, project: str, now: float) -> quota.Usage:
        with self._lock:
            return self._usage(project, quota.Windows.at(now))

    def _filled(self, item: PendingItem) -> int:
        """The ``filled`` count of the item's cache backend now (locality.py)."""
        b = locality.cache_backend(item.eligible, item.hint)
        return self._states[b].filled if b < len(self._states) else 0

    def _offered(self, key: QueueKey, heap: list[tuple[float, str]], band: str,
                 now: float) -> fairshare.Head | None:
        """The job a queue offers: its first, or with locality the most cached of its first
        ``lookahead`` (locality.choose)."""
        first = self._top(key, heap)
        if first is None or not self.config.locality.on:
            return None if first is None else _head(first, band)
        # each job once, in the queue it is in now (a job put back in line with its old score is
        # pushed again: its older pair, here or in the queue it left, is not a second entry)
        valid = {pair for pair in heap if self._live(key, pair)}
        valid_first = heapq.nsmallest(self.config.locality.lookahead, valid)
        line = [self._pending[job_id] for _, job_id in valid_first]
        cached = []
        for e in line:
            item, b = e.item, locality.cache_backend(e.item.eligible, e.item.hint)
            uncached = item.prompt_tokens if item.uncached_tokens is None else item.uncached_tokens
            filled = self._states[b].filled if b < len(self._states) else 0
            cache = self.config.backends[b].limits.cache_tokens if b < len(self._states) else 0
            cached.append(locality.fresh_cached(item.prompt_tokens, uncached, e.fill, filled, cache))
        at = locality.choose(cached, now - first.item.enqueued_at, self.config.locality, self.config.aging_s)
        head = replace(_head(line[at], band), line_score=first.score, line_enqueued_at=first.item.enqueued_at)
        # a prefix evicted since it was queued is a whole prompt to compute again, for the quiet
        # long prefills, the prefill bucket and first_token alike
        return replace(head, uncached_tokens=head.prompt_tokens) if cached[at] == 0 else head

    def _heads(self, now: float) -> list[fairshare.Head]:
        views: dict[str, list[fairshare.Head]] = {}
        for key, heap in self._queues.items():
            project, band = key[0], key[1]
            head = self._offered(key, heap, band, now)
            if head is not None:
                views.setdefault(project, []).append(head)
        snapshot = fairshare.FairSnapshot(
            projects=tuple(
                fairshare.ProjectView(
                    project=p,
                    weight=self.config.weight(p),
                    finish_tag=self._finish.get(p, 0.0),
                    heads=tuple(h),
                )
                for p, h in views.items()
            ),
            vtime=self._vtime,
            now=now,
        )
        return fairshare.order(snapshot, self.config.aging_s)

    def _top(self, key: QueueKey, heap: list[tuple[float, str]]) -> _Entry | None:
        while heap:
            if self._live(key, heap[0]):
                return self._pending[heap[0][1]]
            heapq.heappop(heap)
        return None

    def _live(self, key: QueueKey, pair: tuple[float, str]) -> bool:
        """Is (score, job id) of queue ``key`` the job's place now (pending, with that score, in
        that queue)?"""
        entry = self._pending.get(pair[1])
        if entry is None or entry.score != pair[0]:
            return False
        item = entry.item
        return (item.project, item.band, entry.size, item.eligible) == key

    def _grant(
        self, top: fairshare.Head, head: fairshare.Head, cost: limits.Cost, backend: int, now: float
    ) -> Grant:
        entry = self._pending.pop(head.job_id)
        self._free_lease(head.job_id)  # a superseded attempt of the same job
        limits.admit(self.config.backends[backend].limits, self._states[backend], cost, now)
        self._vtime = max(self._vtime, self._finish.get(top.project, 0.0))
        _, self._finish[head.project] = fairshare.charge(
            self._vtime,
            self._finish.get(head.project, 0.0),
            self.config.weight(head.project),
            head.cost * self.config.backends[backend].charge_per_token,
        )
        fence = self._fences[head.project] = self._fences.get(head.project, 0) + 1
        expires_at = now + self.config.lease_ttl_s
        self._leases[head.job_id] = _Lease(
            entry, fence, cost.kv_tokens, cost.long, expires_at, admitted_at=now, backend=backend
        )
        return Grant(
            job_id=head.job_id,
            project=head.project,
            fence=fence,
            prompt_tokens=head.prompt_tokens,
            kv_tokens=cost.kv_tokens,
            long=cost.long,
            lease_expires_at=expires_at,
            waited_s=max(0.0, now - entry.item.enqueued_at),
            backend=self.config.backends[backend].name,
        )

    # -- leases ------------------------------------------------------------------------------
    def claim(self, job_id: str, fence: int, owner: str, now: float) -> bool:
        return self.claim_on(job_id, fence, owner, now) is not None

    def claim_on(self, job_id: str, fence: int, owner: str, now: float) -> str | None:
        with self._lock:
            lease = self._leases.get(job_id)
            if lease is None or lease.fence != fence or lease.expires_at < now:
                return None
            if lease.owner is not None and lease.owner != owner:
                return None
            if lease.owner is None:
                self._states[lease.backend].claimed += 1
            expires_at = now + self.config.lease_ttl_s
            self._leases[job_id] = replace(lease, owner=owner, expires_at=expires_at)
            return self.config.backends[lease.backend].name

    def renew(self, job_id: str, fence: int, now: float) -> bool:
        with self._lock:
            lease = self._leases.get(job_id)
            if lease is None or lease.fence != fence or lease.expires_at < now:
                return False
            self._leases[job_id] = replace(lease, expires_at=now + self.config.lease_ttl_s)
            return True

    def release(self, job_id: str, fence: int) -> bool:
        with self._lock:
            lease = self._leases.get(job_id)
            if lease is None or lease.fence != fence:
                return False
            self._free_lease(job_id)
            self._signal()
            return True

    def requeue(self, job_id: str, fence: int, unclaimed_only: bool = False) -> bool:
        with self._lock:
            lease = self._leases.get(job_id)
            if lease is None or lease.fence != fence or (unclaimed_only and lease.owner is not None):
                return False
            self._free_lease(job_id)
            if job_id not in self._pending:
                self._push(lease.entry)
            self._signal()
            return True

    # -- continuations -----------------------------------------------------------------------
    def readmit(self, job_id: str, fence: int, max_new_tokens: int, not_before: float,
                now: float, *, prompt_tokens: int | None = None, turn: int = 1,
                eligible: int | None = None) -> bool:
        with self._lock:
            lease = self._leases.get(job_id)
            if lease is None or lease.fence != fence:
                return False
            if eligible is not None:
                _check_mask(job_id, eligible)
            self._free_lease(job_id)
            entry = self._grown(lease.entry, prompt_tokens)
            item = replace(entry.item, max_new_tokens=max_new_tokens)
            if eligible is not None:
                item = replace(item, eligible=eligible)
            # the next turn's prompt starts with this one's, now cached where it ran
            several = item.eligible & (item.eligible - 1) != 0
            item = replace(item, hint=lease.backend if several else None)
            entry = replace(entry, item=item, turn=turn, fill=self._filled(item))
            if not_before > now:
                self._deferred[job_id] = (not_before, entry)
                heapq.heappush(self._not_before, (not_before, job_id))
            elif job_id not in self._pending:
                self._push(entry)
            self._signal()
            return True

    def _grown(self, entry: _Entry, prompt_tokens: int | None) -> _Entry:
        """``entry`` with its prompt grown to ``prompt_tokens`` (never shrunk), its uncached
        tokens grown by as much, and the size that follows."""
        item = entry.item
        if prompt_tokens is None or prompt_tokens <= item.prompt_tokens:
            return entry
        uncached = item.prompt_tokens if item.uncached_tokens is None else item.uncached_tokens
        item = replace(item, prompt_tokens=prompt_tokens,
                       uncached_tokens=uncached + prompt_tokens - item.prompt_tokens)
        size = "long" if prompt_tokens > self.config.limits.long_prompt_tokens else "short"
        return replace(entry, item=item, size=size)

    def grow(self, job_id: str, prompt_tokens: int, eligible: int | None = None) -> bool:
        with self._lock:
            waiting = self._deferred.get(job_id)
            if waiting is None or prompt_tokens <= waiting[1].item.prompt_tokens:
                return False
            entry = self._grown(waiting[1], prompt_tokens)
            if eligible is not None:
                _check_mask(job_id, eligible)
                entry = replace(entry, item=replace(entry.item, eligible=eligible))
            self._deferred[job_id] = (waiting[0], entry)
            return True

    def turn_of(self, job_id: str) -> int:
        with self._lock:
            lease = self._leases.get(job_id)
            if lease is not None:
                return lease.entry.turn
            entry = self._pending.get(job_id) or self._deferred.get(job_id, (0.0, None))[1]
            return 0 if entry is None else entry.turn

    def promote_due(self, now: float) -> list[str]:
        promoted: list[str] = []
        with self._lock:
            while self._not_before and self._not_before[0][0] <= now:
                due, job_id = heapq.heappop(self._not_before)
                waiting = self._deferred.get(job_id)
                if waiting is not None and waiting[0] == due:
                    del self._deferred[job_id]
                    if job_id not in self._pending:
                        self._push(waiting[1])
                        promoted.append(job_id)
            if promoted:
                self._signal()
        return promoted

    def hurry(self, job_id: str, not_before: float) -> bool:
        with self._lock:
            waiting = self._deferred.get(job_id)
            if waiting is None:
                return False
            if not_before < waiting[0]:
                self._deferred[job_id] = (not_before, waiting[1])
                heapq.heappush(self._not_before, (not_before, job_id))
                self._signal()
            return True

    def next_not_before(self) -> float | None:
        with self._lock:
            return min((due for due, _entry in self._deferred.values()), default=None)

    def continuations(self) -> dict[str, dict[str, int]]:
        with self._lock:
            found: dict[str, dict[str, int]] = {}
            waiting = [("pending", e) for e in self._pending.values() if e.turn]
            waiting += [("deferred", e) for _due, e in self._deferred.values() if e.turn]
            for state, entry in waiting:
                counts = found.setdefault(entry.item.project, {})
                counts[state] = counts.get(state, 0) + 1
            return found

    def deferred_counts(self, limit: int = 10_000) -> dict[str, int]:
        with self._lock:
            counts: dict[str, int] = {}
            for _due, entry in sorted(self._deferred.values(), key=lambda w: w[0])[:limit]:
                counts[entry.item.project] = counts.get(entry.item.project, 0) + 1
            return counts

    def waiting_items(self, project: str) -> list[tuple[str, int, int]]:
        with self._lock:
            entries = [*self._pending.values(), *(e for _due, e in self._deferred.values())]
            return [(e.item.job_id, e.item.prompt_tokens, e.item.max_new_tokens) for e in entries
                    if e.item.project == project]

    def lease_valid(self, job_id: str, fence: int) -> bool:
        with self._lock:
            lease = self._leases.get(job_id)
            return lease is not None and lease.fence == fence

    def lease_project(self, job_id: str) -> str | None:
        with self._lock:
            lease = self._leases.get(job_id)
            return None if lease is None else lease.entry.item.project

    def reap_expired(self, now: float) -> list[str]:
        with self._lock:
            expired = sorted(j for j, lease in self._leases.items() if lease.expires_at < now)
            for job_id in expired:
                entry = self._leases[job_id].entry
                self._free_lease(job_id)
                if job_id not in self._pending:
                    self._push(entry)
            if expired:
                self._signal()
            return expired

    def next_expiry(self) -> float | None:
        with self._lock:
            return min((lease.expires_at for lease in self._leases.values()), default=None)

    def _free_lease(self, job_id: str) -> None:
        lease = self._leases.pop(job_id, None)
        if lease is not None:
            state = self._states[lease.backend]
            limits.free(state, lease.kv_tokens, lease.long, lease.entry.item.band == "interactive")
            state.claimed -= 1 if lease.owner is not None else 0

    def _push(self, entry: _Entry) -> None:
        item = entry.item
        self._pending[item.job_id] = entry
        key = (item.project, item.band, entry.size, item.eligible)
        heapq.heappush(self._queues.setdefault(key, []), (entry.score, item.job_id))
        if item.deadline is not None:
            heapq.heappush(self._deadlines, (item.deadline, item.job_id))

    # -- backend gate, wakes, observation ----------------------------------------------------
    def record_backend(self, scraped_at: float, hold: str, figures: dict[str, str],
                       name: str | None = None) -> None:
        index = self.config.backend_index(name)
        with self._lock:
            self._scrapes[index] = (scraped_at, hold)
            self._figures[index] = {**figures, "scraped_at": repr(scraped_at), "hold": hold}

    def backend(self, name: str | None = None) -> dict[str, str]:
        index = self.config.backend_index(name)
        with self._lock:
            return dict(self._figures[index])

    def oldest_pending(self) -> dict[str, float]:
        with self._lock:
            found: dict[str, float] = {}
            for (project, _band, _size, _mask), queue in self._queues.items():
                live = [(score, job_id) for score, job_id in queue if job_id in self._pending]
                if live:
                    enqueued_at = self._pending[min(live)[1]].item.enqueued_at
                    found[project] = min(found.get(project, float("inf")), enqueued_at)
            return found

    def wake(self) -> None:
        with self._lock:
            self._signal()

    def wait_for_wake(self, timeout_s: float) -> bool:
        with self._lock:
            if not self._wakes:
                self._woken.wait(timeout_s)
            if self._wakes:
                self._wakes -= 1
                return True
            return False

    def _signal(self) -> None:
        self._wakes = min(self._wakes + 1, 100)
        self._woken.notify()

    def count_hold(self, reason: str) -> None:
        with self._lock:
            self._holds[reason] = self._holds.get(reason, 0) + 1

    def snapshot(self) -> StoreSnapshot:
        with self._lock:
            pending: dict[str, dict[str, int]] = {}
            for entry in self._pending.values():
                bands = pending.setdefault(entry.item.project, {})
                bands[entry.item.band] = bands.get(entry.item.band, 0) + 1
            backends = {
                b.name: BackendSnapshot(state.in_flight, state.reserved_kv_tokens, state.long_in_flight,
                                        state.interactive_in_flight, state.claimed)
                for b, state in zip(self.config.backends, self._states, strict=True)
            }
            return snapshot_totals(pending, backends, self._admissions, dict(self._holds), dict(self._quota_held))

    def unclaimed_leases(self, admitted_before: float) -> dict[str, int]:
        with self._lock:
            return {job_id: lease.fence for job_id, lease in self._leases.items()
                    if lease.owner is None and lease.admitted_at < admitted_before}

    def lease_fences(self) -> dict[str, int]:
        """Live leases (job id -> fence), for invariant checks."""
        with self._lock:
            return {job_id: lease.fence for job_id, lease in self._leases.items()}

    def pending_ids(self) -> set[str]:
        with self._lock:
            return set(self._pending)


def _check_mask(job_id: str, eligible: int) -> None:
    if eligible < 1:
        raise ValueError(f"{job_id}: eligible {eligible} names no backend")


def _head(entry: _Entry, band: str) -> fairshare.Head:
    item = entry.item
    return fairshare.Head(
        job_id=item.job_id,
        project=item.project,
        band=band,
        prompt_tokens=item.prompt_tokens,
        max_new_tokens=item.max_new_tokens,
        enqueued_at=item.enqueued_at,
        score=entry.score,
        long=entry.size == "long",
        uncached_tokens=item.uncached_tokens,
        eligible=item.eligible,
        hint=item.hint,
    )
