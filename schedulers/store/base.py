"""The admission store interface: what the dispatcher, the prep worker and the inference worker
need from the shared dispatcher state. Two implementations ship: ``MemoryStore`` (in-memory twin,
schedulers/store/memory_store.py) and ``RedisStore`` (atomic Lua scripts, schedulers/store/redis_store.py).
The same test suite runs against both.

Jobs are named by an id the store does not interpret; the fleet passes the job's ref,
``<project>/<id>`` (fleet/core/keys.py), because job ids are unique per project only.

Life of a job in the store:
  add_pending -> [fair pick + admit_next: lease granted, fence issued] -> claim -> renew ...
                 |                                                               -> release
                 |\\-> cancel_pending (job removed, never admitted)
                 \\-> expire_deadlines (its ``deadline`` passed while pending: removed)
  a lease not renewed before its expiry is reaped by ``reap_expired``: the job goes back to
  pending at its original place in line, and the old fence is dead (renew/release with it fail).
  Fences are a sequence per project (each grant's is its project's next): a job's fence tells
  its project nothing of how many jobs other projects ran; a job admitted again gets a larger one.
  ``requeue`` does the same at once, for a grant the dispatcher could not hand to a worker.

Claims: the broker may deliver one inference task twice (redelivery after a worker loss, a
visibility timeout). The fence alone cannot tell the two deliveries apart, so the first worker
to start calls ``claim(job_id, fence, owner, now)``: it succeeds only while the lease is live,
carries that fence, and nobody else has claimed it (the same owner may claim again). The claim
renews the lease in the same step, so the worker's first renewal happens at claim time, not a
third of the TTL later. A second delivery's claim (another owner, same fence) returns False and
that delivery is dropped. ``renew`` and ``release`` check only the fence, as before.

Deadlines: a ``PendingItem`` may carry ``deadline`` (unix seconds). ``expire_deadlines(now)``
removes every pending job whose deadline is at or before ``now`` (like ``cancel_pending``) and
returns their ids, for the caller to publish E_DEADLINE. A job in flight is left alone; its
deadline comes back with it if its lease expires and it returns to pending.

Continuations: a job that needs another model turn (a retry, a re-ask, a tool round, a backend
outage) is not released but ``readmit``-ted: the lease is freed (fence-checked) and the job joins
its queue again at its original score - it keeps its place, so it is ahead of its project's newer
work, and every admission still charges its project's fair share - with ``max_new_tokens`` of its
new plan and its next prompt (a prompt grown by tool rounds: prompt, uncached tokens, KV and size
follow, and ``grow`` adds each tool result while the job waits), checked again like any job's;
the store keeps the number of that turn (``turn_of``). With ``not_before`` in the future
(a backoff) it waits outside the queues until ``promote_due(now)`` puts it in line; no slot is held
meanwhile. ``cancel_pending`` removes a waiting continuation as well. A continuation has no
deadline entry while it waits (its deadline comes back when it is promoted; the worker never
schedules a not-before time at or past the deadline). A new job may wait the same way from the
start (``PendingItem.not_before``: a job waiting for an identical job's answer).

Backends: the store admits into every backend of ``StoreConfig.backends`` (docs/backends.md,
sections 4 to 6). Each has its own limits, lease counters, prefill bucket, head-of-line
reservation and gate (``record_backend`` per name); fair share, the line and the virtual times
are one for all. A ``PendingItem`` names the backends it may run on (``eligible``, a bit mask in
the backends' order) and waits in the queue of that class; admission tries each candidate, in
fair order, on the backends of its mask and grants it on the least loaded that can take it
(schedulers/policy/placement.py); a candidate none can take is passed over. A grant names its
backend, and its lease frees that backend's counters only, whichever way it ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from schedulers.policy.limits import Limits
from schedulers.policy.locality import Locality
from schedulers.policy.placement import Routing
from schedulers.policy.quota import Quota, Remaining, Usage, Windows, refusal, remaining

if TYPE_CHECKING:
    from fleet.core.config import QuotaSettings, Settings

Band = Literal["interactive", "batch"]


@dataclass(frozen=True)
class PendingItem:
    job_id: str
    project: str
    prompt_tokens: int
    max_new_tokens: int
    band: Band = "batch"
    priority: int = 0  # higher first, inside a project's band
    enqueued_at: float = 0.0  # unix seconds; set by the store when 0
    deadline: float | None = None  # unix seconds; expire_deadlines drops it from pending after
    # prompt tokens expected to miss the prefix cache (fleet/prep/cachehint.py); None = all of
    # them. What a long prefill and the prefill bucket count (schedulers/policy/limits.py).
    uncached_tokens: int | None = None
    # the backends it may run on, a bit mask (bit b: backend b of StoreConfig.backends); its
    # eligibility class: a queue of its own (module docstring, Backends). 1: backend 0 only.
    eligible: int = 1
    # the backend (index) prep expects to hold the longest cached prefix of its prompt: its
    # ``uncached_tokens`` are counted there, the whole prompt on any other, and routing prefers it
    # (schedulers/policy/placement.py ``pick``). None: no backend holds any, ``uncached_tokens``
    # count everywhere.
    hint: int | None = None
    # not in line before this time (unix seconds): until then it waits as a continuation waits
    # for its backoff, keeping its score (a job waiting for an identical job's answer,
    # fleet/worker/repeats.py). None, or not after ``enqueued_at``: in line at once.
    not_before: float | None = None


@dataclass(frozen=True)
class Grant:
    job_id: str
    project: str
    fence: int
    prompt_tokens: int
    kv_tokens: int
    long: bool
    lease_expires_at: float
    waited_s: float
    backend: str = ""  # the name of the backend it was granted on (the lease's); '': the first


@dataclass(frozen=True)
class AdmitResult:
    """What one admission round decided: a grant, or why nothing was admitted."""

    grant: Grant | None
    # "empty", "seqs", "kv", "long", "bucket", "spacing", "backend_<why>" (stale, health,
    # waiting, kv_usage, preemptions; see schedulers/policy/backend_gate.py), "outside" (outside
    # clients hold the rest of the backend's sequences), "conflict" (other
    # dispatchers kept taking the candidates; try again at once); "send_failed" (set by the
    # dispatcher, not the store: the grant could not be sent and was requeued; back off)
    hold_reason: str | None = None
    retry_in_s: float | None = None  # when a time-based hold (bucket, spacing) lifts


@dataclass
class BackendSnapshot:
    """One backend's lease counters (sums over the live leases granted on it)."""

    in_flight: int = 0
    reserved_kv_tokens: int = 0
    long_in_flight: int = 0
    interactive_in_flight: int = 0
    claimed: int = 0


@dataclass
class StoreSnapshot:
    """The figures summed over every backend, and ``backends``: each one's own (by name, in the
    settings' order)."""

    pending: dict[str, dict[str, int]] = field(default_factory=dict)  # project -> band -> count
    in_flight: int = 0
    reserved_kv_tokens: int = 0
    long_in_flight: int = 0
    interactive_in_flight: int = 0  # live leases of interactive-band jobs (quiet windows protect them)
    claimed: int = 0  # live leases whose worker has claimed them (requests at the backend)
    admissions: int = 0
    holds: dict[str, int] = field(default_factory=dict)
    backends: dict[str, BackendSnapshot] = field(default_factory=dict)
    # admission calls that passed a project's work over for its quota (once per call and project)
    quota_held: dict[str, int] = field(default_factory=dict)


def snapshot_totals(pending: dict[str, dict[str, int]], backends: dict[str, BackendSnapshot],
                    admissions: int, holds: dict[str, int], quota_held: dict[str, int] | None = None
                    ) -> StoreSnapshot:
    """A snapshot whose totals are the sums over ``backends``."""
    each = list(backends.values())
    return StoreSnapshot(
        pending=pending,
        in_flight=sum(b.in_flight for b in each),
        reserved_kv_tokens=sum(b.reserved_kv_tokens for b in each),
        long_in_flight=sum(b.long_in_flight for b in each),
        interactive_in_flight=sum(b.interactive_in_flight for b in each),
        claimed=sum(b.claimed for b in each),
        admissions=admissions,
        holds=holds,
        backends=backends,
        quota_held=quota_held or {},
    )


@dataclass(frozen=True)
class BackendLimits:
    """A backend as the store knows it: its name (key names, grants) and its limits."""

    name: str
    limits: Limits
    charge_per_token: float = 1.0  # fair-share tokens one of its tokens counts for


@dataclass(frozen=True)
class StoreConfig:
    """Everything a store needs to decide; built from Settings by ``StoreConfig.from_settings``.

    Backend 0 is ``limits`` and ``backend_name`` (so a one-backend config is written as before);
    ``more_backends`` are backends 1, 2, ... in the settings' order; ``backends`` lists them all.
    Two fields, not one list, so that ``replace(config, limits=...)`` changes backend 0 and
    nothing else."""

    limits: Limits = field(default_factory=Limits)
    lease_ttl_s: float = 30.0
    aging_s: float = 60.0
    weights: dict[str, float] = field(default_factory=dict)  # project -> weight (default 1.0)
    gate: bool = True  # False: ignore the backend gate (unit tests without a scraper)
    scrape_stale_s: float = 5.0
    backend_name: str = "default"
    charge_per_token: float = 1.0  # backend 0's (BackendLimits.charge_per_token)
    more_backends: tuple[BackendLimits, ...] = ()
    # how a candidate's backend is chosen among those that can take it (placement.Routing)
    routing: Routing = field(default_factory=Routing)
    # project -> its quota (schedulers/policy/quota.py); a project not named has none
    quotas: dict[str, Quota] = field(default_factory=dict)
    # which of a queue's first jobs goes (schedulers/policy/locality.py); the default: its first
    locality: Locality = field(default_factory=Locality)

    def __post_init__(self) -> None:
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique: {names}")

    @classmethod
    def from_settings(cls, settings: Settings) -> StoreConfig:
        first, *more = settings.backends
        return cls(
            limits=Limits.from_settings(settings, first),
            lease_ttl_s=settings.admission.lease_ttl_s,
            aging_s=settings.admission.aging_s,
            weights={name: p.weight for name, p in settings.projects.items()},
            gate=settings.admission.backend_gate,
            scrape_stale_s=settings.admission.scrape_stale_s,
            backend_name=first.name,
            charge_per_token=first.charge_per_token,
            more_backends=tuple(BackendLimits(b.name, Limits.from_settings(settings, b), b.charge_per_token)
                                for b in more),
            routing=Routing(settings.routing.policy, settings.routing.balance_abs_seqs,
                            settings.routing.balance_rel),
            quotas=quotas_from_settings(settings),
            locality=Locality(settings.admission.locality_lookahead, settings.admission.locality_max_wait_s),
        )

    @classmethod
    def with_backends(cls, backends: Sequence[BackendLimits], **fields: Any) -> StoreConfig:
        """A config of these backends (settings' order; at least one) and ``fields``."""
        first, *more = backends
        return cls(limits=first.limits, backend_name=first.name, charge_per_token=first.charge_per_token,
                   more_backends=tuple(more), **fields)

    @property
    def backends(self) -> tuple[BackendLimits, ...]:
        return (BackendLimits(self.backend_name, self.limits, self.charge_per_token), *self.more_backends)

    def backend_index(self, name: str | None) -> int:
        """The index of the backend called ``name`` (None: backend 0); KeyError for no such one."""
        if name is None:
            return 0
        for index, backend in enumerate(self.backends):
            if backend.name == name:
                return index
        raise KeyError(f"no backend {name!r} (backends: {', '.join(b.name for b in self.backends)})")

    def weight(self, project: str) -> float:
        return self.weights.get(project, 1.0)

    def quota(self, project: str) -> Quota | None:
        """The project's quota, None when it has no limit."""
        quota = self.quotas.get(project)
        return quota if quota is not None and quota.limited else None


@dataclass(frozen=True)
class QuotaEntry:
    """What a project's quota says of a new job or gateway request (``quota_entry``)."""

    refused: tuple[str, float | None] | None = None  # E_QUOTA_EXCEEDED's message, Retry-After
    remaining: Remaining | None = None  # for the x-ratelimit-* headers (when usage was read)


def quota_entry(store: AdmissionStore, project: str, over: str, prompt_tokens: int, max_new_tokens: int,
                now: float, *, headers: bool = False) -> QuotaEntry:
    """Whether the project's quota refuses a new job or gateway request before admission
    (schedulers/policy/quota.py ``refusal``) and, with ``headers``, what remains of its minute.
    Reads the project's usage (one round trip) only when ``over`` is "refuse" or ``headers``;
    nothing at all for a project without a quota."""
    quota = store.config.quota(project)
    if quota is None:
        return QuotaEntry()
    windows = Windows.at(now)
    usage = store.quota_usage(project, now) if over == "refuse" or headers else Usage()
    return QuotaEntry(refused=refusal(quota, over, usage, prompt_tokens, max_new_tokens, windows),
                      remaining=remaining(quota, usage, windows) if headers else None)


def quota_of(q: QuotaSettings) -> Quota:
    """A ``quota`` (or ``key_quotas``) settings section as the store's ``Quota``."""
    return Quota(q.tokens_per_minute, q.requests_per_minute, q.tokens_per_day, q.tokens_per_month,
                 q.max_in_flight, q.cost_prompt, q.cost_cached, q.cost_output)


def quotas_from_settings(settings: Settings) -> dict[str, Quota]:
    """Every project's ``quota`` settings that limit anything, as the store's ``Quota``."""
    out = {}
    for name, project in settings.projects.items():
        quota = quota_of(project.quota)
        if quota.limited:
            out[name] = quota
    return out


class AdmissionStore(Protocol):
    config: StoreConfig

    def add_pending(self, item: PendingItem) -> None: ...

    def admit_next(self, now: float) -> AdmitResult: ...

    def waiting_items(self, project: str) -> list[tuple[str, int, int]]:
        """(id, prompt tokens, output limit) of every job of ``project`` in line or waiting for its
        not-before time."""
        ...

    def deferred_counts(self, limit: int = 10_000) -> dict[str, int]:
        """Per project, the jobs waiting for a not-before time, over the first ``limit``."""
        ...

    def admit_many(self, now: float, max_grants: int) -> list[AdmitResult]:
        """Up to ``max_grants`` grants decided at ``now`` (each as ``admit_next`` would, one after
        the other), followed by the hold that stopped them, if one did: a hold ends the list."""
        ...

    def admit_gateway_only(self, now: float, max_grants: int) -> list[AdmitResult]:
        """``admit_many`` while the worker gate holds (no live inference worker): only gateway
        requests are granted (they stream in the gateway, no inference worker runs them); a queued
        job is passed over with the hold 'no_workers' and keeps its place in line."""
        ...

    def claim(self, job_id: str, fence: int, owner: str, now: float) -> bool: ...

    def claim_on(self, job_id: str, fence: int, owner: str, now: float) -> str | None:
        """``claim``, answering the name of the backend the lease was granted on (None when
        refused): what the worker and the gateway stream to, whatever the task or the grant
        message says. A lease on an index these settings do not have answers ``#<index>``."""
        ...

    def renew(self, job_id: str, fence: int, now: float) -> bool: ...

    def release(self, job_id: str, fence: int) -> bool: ...

    def lease_project(self, job_id: str) -> str | None:
        """The project the job's live lease was granted to (None without a lease)."""
        ...

    def reap_expired(self, now: float) -> list[str]: ...

    def requeue(self, job_id: str, fence: int, unclaimed_only: bool = False) -> bool:
        """Give the lease up at once and put the job back at its place (a grant that could not be
        sent); with ``unclaimed_only``, only while no worker has claimed it (a grant whose message
        the broker lost: a worker that did get it keeps it). False for a stale fence."""
        ...

    def unclaimed_leases(self, admitted_before: float) -> dict[str, int]:
        """Live leases no worker has claimed yet, granted before ``admitted_before`` (job id ->
        fence): what a broker that lost its messages may have left with no message."""
        ...

    def cancel_pending(self, job_id: str) -> bool: ...

    def due_deadlines(self, now: float) -> list[str]:
        """Pending jobs whose deadline passed (``<= now``), oldest first, without changing
        anything: the dispatcher reports them before ``expire_deadlines`` drops them."""
        ...

    def expire_deadlines(self, now: float, only: list[str] | None = None) -> list[str]:
        """Drop pending jobs whose deadline passed (of ``only``, when given) and return them."""
        ...

    def next_deadline(self) -> float | None: ...

    def settle(self, job_id: str, fence: int, spent: int) -> bool:
        """The turn of this grant is over and cost ``spent``: give back what its quota
        reservation held beyond that (never more than it held). False when there is nothing to
        settle (no quota, another grant's, settled already)."""
        ...

    def quota_usage(self, project: str, now: float) -> Usage:
        """What the project's admitted turns hold in the windows ``now`` falls in."""
        ...

    def snapshot(self) -> StoreSnapshot: ...

    def count_hold(self, reason: str) -> None:
        """Count a round held outside the store (the dispatcher's gate: ``no_workers``) with the
        store's own holds, so ``fleet queues``, ``fleet top`` and the metrics show it."""
        ...

    def wait_for_wake(self, timeout_s: float) -> bool: ...

    def lease_valid(self, job_id: str, fence: int) -> bool: ...

    def readmit(self, job_id: str, fence: int, max_new_tokens: int, not_before: float,
                now: float, *, prompt_tokens: int | None = None, turn: int = 1,
                eligible: int | None = None) -> bool:
        """Another model turn (see Continuations above): give the lease up and re-enter
        admission with the new plan's ``max_new_tokens`` and the next turn's ``prompt_tokens``
        (None: unchanged; never smaller), at the job's original place in line, once
        ``not_before`` has come; the store keeps ``turn``, the number of that turn
        (``turn_of``), and ``eligible`` as the backends it may run on now (None: unchanged; a
        grown prompt may fit fewer, or only the long-context tier); its hint becomes the backend
        the lease was on, when it may run on several. False for a stale fence."""
        ...

    def grow(self, job_id: str, prompt_tokens: int, eligible: int | None = None) -> bool:
        """A waiting continuation's next prompt grows to ``prompt_tokens`` (a tool result came
        in; never smaller), its uncached tokens by as much, KV and size follow, and with it its
        eligibility (``eligible``: the backends that hold it now; None: unchanged); False when the
        job is not waiting or its prompt is already that large. No cap: an item whose KV
        reservation passes the whole KV budget is admitted alone, when nothing else is in
        flight, like a new job of that size (admission's rule, ``limits.check_job``)."""
        ...

    def turn_of(self, job_id: str) -> int:
        """The number of the turn ``readmit`` last put in line (0: none, or no item): only the
        fleet writes it, so the inference worker runs only the saved turn that carries it."""
        ...

    def promote_due(self, now: float) -> list[str]:
        """Continuations whose not-before time is at or before ``now`` join their queue."""
        ...

    def next_not_before(self) -> float | None: ...

    def hurry(self, job_id: str, not_before: float) -> bool:
        """Bring a waiting continuation's not-before time forward to ``not_before`` (never
        later); False when the job is not waiting."""
        ...

    def continuations(self) -> dict[str, dict[str, int]]:
        """Continuations waiting per project: {"pending": n, "deferred": n} (non-zero only)."""
        ...

    def wake(self) -> None: ...

    def next_expiry(self) -> float | None: ...

    def record_backend(self, scraped_at: float, hold: str, figures: dict[str, str],
                       name: str | None = None) -> None:
        """Store one scrape of the backend ``name`` (None: backend 0): the gate's verdict."""
        ...

    def backend(self, name: str | None = None) -> dict[str, str]:
        """The last scrape recorded for the backend ``name`` (None: backend 0)."""
        ...

    def oldest_pending(self) -> dict[str, float]:
        """Per project with jobs pending: the earliest enqueue time (unix s) among the heads of
        its queues (band x size), i.e. how long the next jobs in line have waited."""
        ...
