"""Which candidate goes next, and to which backend: the admission limits of every backend applied to
the candidates in fair order (docs/backends.md, sections 5 and 6).

Pure, like limits.py, whose rules it applies to each backend on its own; the Redis store's
admission script repeats it (schedulers/store/lua/admit.lua ``decide``), the in-memory twin calls
it. With one backend it is limits.py's admission of one server: the first candidate in fair order
that fits, and the first candidate's reservation.

For each candidate in fair order, the backends of its eligibility mask (bit b: backend b, in the
settings' order) are tried. A backend is usable for it when its gate passes (its scrape is fresh
and holds nothing: ``gates``), its global limits pass (sequences, outside clients, spacing) and
every limit of one job holds on it for this candidate (``limits.check_job`` with the candidate's
cost on that backend: its KV blocks, long threshold and prefill figures; its uncached tokens on
its ``hint`` backend, its whole prompt on the others). Among the usable ones ``pick`` chooses by
the routing policy (``Routing``): ``fleet`` takes the candidate's hint (the backend prep expects
to hold its longest cached prefix) unless the hint is loaded past both imbalance thresholds
against the least loaded (more than ``balance_abs_seqs`` sequences more, and a load above
``balance_rel`` times its load: SGLang's two thresholds), else the least loaded; load =
max(in flight / max_num_seqs, reserved KV / KV budget), ties by the settings' order.
``first_token`` takes the backend expected to give the candidate its first token soonest: the
prefill the fleet granted there and that should not be done yet (every grant adds its uncached
tokens / the server's prefill rate, ``queue_tokens_per_s``, one after another: ``queue_until``),
plus the candidate's own tokens that miss the cache there (its uncached tokens on its hint, its
whole prompt elsewhere), ties by load then order, with the same imbalance guard against the
least loaded (a backend with no rate falls back to ``fleet``'s rule): the cached prefix and the
line of prefills before it weighed in one figure, as NVIDIA Dynamo's KV router weighs the blocks
to prefill against the load. ``least_loaded`` ignores the hint; ``round_robin`` takes the first
usable backend after the one of the last grant (``Routing.last``; the benchmark's baselines). A
candidate no backend can take is passed over and the next one is tried, so a full backend never
stalls another; its reason is the one of its *best* backend: the least loaded whose gate passes
(else the least loaded), ties by order.

The head-of-line reservation (limits.py: ``hol_bypass_s``) is per backend. A backend's *head* is
the first candidate in fair order whose mask names it. A head no backend takes reserves its best
backend when that is one of the backends it heads and the reason there is a reserving one (kv,
bucket, the drain): once it has been blocked there for that backend's ``hol_bypass_s``, the
backend is closed to every candidate behind it until the head fits; its other backends stay open.
A head granted anywhere clears the reservation of every backend it headed.

The reason of a round that grants nothing is the first candidate's (its best backend's, or
``no_backend`` when its mask names no configured backend), with the soonest time-based lift of
any candidate on any backend tried.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from schedulers.policy.fairshare import Head
from schedulers.policy.limits import RESERVING_REASONS, Cost, Limits, LimitState, check_global, check_job

NO_BACKEND = "no_backend"
POLICIES = ("fleet", "first_token", "least_loaded", "round_robin")


@dataclass(frozen=True)
class Routing:
    """How ``pick`` chooses among the backends that can take a candidate (module docstring);
    ``last``: the backend of the last grant (round robin's position; -1: none yet)."""

    policy: str = "fleet"
    balance_abs_seqs: int = 4
    balance_rel: float = 1.5
    last: int = -1

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy {self.policy!r}: one of {', '.join(POLICIES)}")


@dataclass
class BackendView:
    """One backend as admission sees it: its limits, its counters (changed by the reservation) and
    what its gate said (``gate``: a hold reason, or None) and its outside clients hold."""

    limits: Limits
    state: LimitState
    gate: str | None = None
    outside: float = 0.0


@dataclass(frozen=True)
class Placement:
    """The candidate to admit (``index``) on ``backend``, or why none (``reason``, ``retry_in_s``)."""

    index: int | None
    backend: int | None = None
    reason: str | None = None
    retry_in_s: float | None = None


def eligible_on(mask: int, backend: int) -> bool:
    return (mask >> backend) & 1 == 1


def uncached_on(head: Head, backend: int) -> int | None:
    """The candidate's prompt tokens expected to miss the prefix cache on ``backend``: prep's
    estimate on its hint backend (or everywhere when it has none), its whole prompt elsewhere."""
    if head.hint is None or head.hint == backend:
        return head.uncached_tokens
    return head.prompt_tokens


def load(view: BackendView) -> float:
    """How full a backend is: its busier share of sequences or of the KV budget."""
    seqs = view.state.in_flight / view.limits.max_num_seqs
    kv = view.state.reserved_kv_tokens / view.limits.kv_budget_tokens if view.limits.kv_budget_tokens > 0 else 0.0
    return max(seqs, kv)


def first_token_s(view: BackendView, uncached: int, now: float) -> float:
    """When a prompt with ``uncached`` tokens missing this backend's cache would get its first
    token if sent now, in seconds from now: the prefill the fleet sent it before and that is not
    done yet (``queue_until``), then its own (module docstring, ``first_token``)."""
    rate = view.limits.queue_tokens_per_s
    return max(0.0, view.state.queue_until - now) + uncached / rate


def pick(views: Sequence[BackendView], usable: Sequence[int], hint: int | None,
         routing: Routing = Routing(), first_token: Callable[[int], float] | None = None) -> int:
    """The backend a candidate whose prefix is expected on ``hint`` goes to among ``usable``
    (the backends that can take it, in the settings' order): module docstring. ``first_token(b)``:
    the candidate's ``first_token_s`` on backend b (the ``first_token`` policy)."""
    if routing.policy == "round_robin":
        after = [b for b in usable if b > routing.last]
        return after[0] if after else usable[0]
    least = min(usable, key=lambda b: (load(views[b]), b))
    timed = first_token is not None and all(views[b].limits.queue_tokens_per_s > 0 for b in usable)
    if routing.policy == "first_token" and first_token is not None and timed:
        soonest = min(usable, key=lambda b: (first_token(b), load(views[b]), b))
        return least if soonest != least and imbalanced(views[soonest], views[least], routing) else soonest
    if routing.policy == "least_loaded" or hint is None or hint not in usable or hint == least:
        return least
    return least if imbalanced(views[hint], views[least], routing) else hint


def imbalanced(busy: BackendView, idle: BackendView, routing: Routing) -> bool:
    """Is ``busy`` loaded past both thresholds against ``idle``, so that load wins over a cached
    prefix? (more than ``balance_abs_seqs`` sequences more, and above ``balance_rel`` x its load)"""
    return (busy.state.in_flight - idle.state.in_flight > routing.balance_abs_seqs
            and load(busy) > routing.balance_rel * load(idle))


def best(views: Sequence[BackendView], tried: Sequence[int]) -> int:
    """The backend whose reason a passed-over candidate reports (and which it may reserve)."""
    return min(tried, key=lambda b: (views[b].gate is not None, load(views[b]), b))


def place(
    views: Sequence[BackendView],
    heads: Sequence[Head],
    costs: Callable[[int, int], Cost],
    now: float,
    only: Callable[[Head], bool] | None = None,
    routing: Routing = Routing(),
    quota: Callable[[Head], tuple[str, float | None] | None] | None = None,
) -> Placement:
    """Try ``heads`` (fair order) on ``views`` (settings' order); ``costs(i, b)`` is candidate i's
    cost on backend b; ``only``: candidates it refuses are passed over ('no_workers'); ``routing``:
    how ``pick`` chooses; ``quota(head)``: why its project's quota holds it and when that lifts
    (schedulers/policy/quota.py ``check``), or None: a held candidate is passed over before any
    backend is tried, so it neither reserves nor closes one. Updates the reservation fields of
    the states (module docstring)."""
    if not heads:
        return Placement(None, reason="empty")
    blocked = [_global(view, now) for view in views]
    protect = [
        view.state.interactive_in_flight > 0
        or any(h.band == "interactive" and eligible_on(h.eligible, b) for h in heads)
        for b, view in enumerate(views)
    ]
    headed = [False] * len(views)  # the backend's head was tried
    closed = [False] * len(views)  # reserved by its head: nobody behind it goes there
    first_reason: str | None = None
    soonest: float | None = None
    for index, head in enumerate(heads):
        over = quota(head) if quota is not None else None
        tried = [] if over else [b for b in range(len(views)) if eligible_on(head.eligible, b) and not closed[b]]
        if not tried:  # over its quota (tried nowhere), or no backend left to try
            if index == 0:
                first_reason = over[0] if over else NO_BACKEND
            soonest = _soonest(soonest, [over[1]] if over else [])
            continue
        refused = only is not None and not only(head)
        verdicts = {b: blocked[b] if blocked[b][0] is not None
                    else ("no_workers", None) if refused
                    else check_job(views[b].limits, views[b].state, costs(index, b), now, protect[b])
                    for b in tried}
        usable = [b for b in tried if verdicts[b][0] is None]
        if usable:
            for b in tried:
                if not headed[b]:
                    views[b].state.blocked_job = None
            first_token = partial(_first_token, views, costs, index, now)
            return Placement(index, pick(views, usable, head.hint, routing, first_token))
        soonest = _soonest(soonest, [retry for _why, retry in verdicts.values()])
        target = best(views, tried)
        why = verdicts[target][0]
        if index == 0:
            first_reason = why
        if not headed[target] and _reserves(views[target], head, why, now):
            closed[target] = True
        for b in tried:
            headed[b] = True
        if all(closed):
            break
    return Placement(None, reason=first_reason, retry_in_s=soonest)


def _first_token(views: Sequence[BackendView], costs: Callable[[int, int], Cost], index: int, now: float,
                 backend: int) -> float:
    """Candidate ``index``'s ``first_token_s`` on ``backend``."""
    return first_token_s(views[backend], costs(index, backend).uncached_tokens, now)


def _soonest(soonest: float | None, retries: Sequence[float | None]) -> float | None:
    """The soonest of ``soonest`` and ``retries`` (None: no time-based lift)."""
    found = [r for r in (soonest, *retries) if r is not None]
    return min(found) if found else None


def _global(view: BackendView, now: float) -> tuple[str | None, float | None]:
    """What stops every candidate on this backend: its gate, then ``limits.check_global``."""
    if view.gate is not None:
        return view.gate, None
    return check_global(view.limits, view.state, now, view.outside)


def _reserves(view: BackendView, head: Head, why: str | None, now: float) -> bool:
    """Does ``head``, blocked on this backend by ``why``, close it to the candidates behind it?
    (limits.py's reservation, on this backend's state and ``hol_bypass_s``)"""
    state = view.state
    if why not in RESERVING_REASONS or (why == "prefill" and state.prefill_until > now):
        return False  # the window lifts by itself: nothing to reserve
    if state.blocked_job != head.job_id:
        state.blocked_job, state.blocked_since = head.job_id, now
    return now - state.blocked_since >= view.limits.hol_bypass_s
