"""Admission limits for one backend, as pure functions of a small state and a clock.

Each backend has its own ``Limits`` and ``LimitState``; schedulers/policy/placement.py applies
these rules to every backend of a candidate's eligibility mask and picks one. The Redis store
(schedulers/store/redis_store.py) repeats exactly these rules inside its admission Lua script; the
in-memory twin (schedulers/store/memory_store.py) calls them directly. The shared store test suite
keeps the two in step.

Limits, checked in this order for every candidate job:

``seqs``     in-flight requests < ``max_num_seqs``. Global: when it fails nothing can go.
``outside``  in-flight requests + the sequences outside clients hold at the server (the backend's
             running count beyond the fleet's claimed leases, measured at the last scrape:
             ``outside``) < ``max_num_seqs``, so the server's own total stays at its ceiling
             while clients the fleet does not control share it. Global.
``spacing``  at least ``min_spacing_s`` since the last admission. Global.
``kv``       KV budget in whole blocks: the sum over in-flight requests of
             ``ceil((prompt + max_new) / block) * block`` stays <= ``kv_pool_tokens *
             kv_overcommit``. Why overcommit 1.5 by default: vLLM allocates KV blocks lazily as
             tokens are produced, and most requests stop far below ``max_tokens`` (a reasoning
             budget is a ceiling, not a forecast), so reserving the worst case would leave the
             pool mostly idle. 1.5x keeps the worst case (every request running to its ceiling at
             once) at the level where vLLM preempts and recomputes the newest request - slower,
             never wrong - and the backend gate (KV usage, preemptions) holds admissions before
             that happens. A single request larger than the whole budget is admitted when nothing
             else is in flight: otherwise it could never run and would block its project forever.
``long``     at most ``max_long`` requests with ``prompt_tokens > long_prompt_tokens`` at once
             (four or more ultra-long prefills bring the server to a crawl).
``prefill``  quiet long prefills (``long_prefill_tokens_per_s`` > 0). A *long prefill* is a prompt
             whose tokens expected to miss the prefix cache (``uncached_tokens``, estimated by prep:
             fleet/prep/cachehint.py) are above ``long_prompt_tokens``; a long but mostly cached
             prompt is not one. A long prefill goes only while at most ``short_beside_long``
             short sequences are in flight, and while the prefill window runs (until
             ``prefill_until``: the uncached tokens / the server's prefill rate after its
             admission, after the previous long prefill's end) nothing but further long
             prefills is admitted, and those only while fewer than ``long_prefills`` went into
             the current window (the server's ``--max-long-partial-prefills`` when its
             ``--max-num-partial-prefills`` > 1, else 1). A prefill chunk rides in every engine
             step, so each sequence decoding beside a 60K-token prefill runs several times slower
             for its whole length; short jobs wait in line instead, where they cost the backend
             nothing. Several long prefills in one window share one drain of the short
             sequences (the window is as long as their prefills together), which is what keeps
             the backend busier than one window per long prompt.
             The window and the drain hold slots only for what they protect: interactive work
             (the ``interactive`` band; gateway chats are in it unless their key says batch) in
             flight or among the candidates. Without it (batch work alone: nobody waits on a
             batch job's speed) a long prefill goes beside any number of short sequences and
             nothing waits for its window; the window is still recorded, so interactive work
             that arrives while a prefill runs waits for its end. And a drain is skipped when it
             costs more than it saves (``drain_pays``): with S short sequences in flight
             finishing evenly over ``short_job_s``, draining them to ``short_beside_long`` = b
             leaves (S - b)^2 x short_job_s / 2S slot-seconds idle, while the prefill beside them
             makes each of the S sequences U / rate seconds slower (U uncached tokens: the
             server adds every prefill chunk to each step they decode in, fleet/sim/engine.py).
             ``short_job_s`` 0: every drain pays (the rule before).
``bucket``   prefill pacing: a token bucket on admitted uncached prompt tokens (rate
             ``prefill_tokens_per_s``, size ``prefill_burst_tokens``). A prompt bigger than the
             bucket is admitted when the bucket is full and leaves the bucket in debt, so the
             long-run prompt rate is exact and the prefill after it waits its turn.

Per-candidate failures (``kv``, ``long``, ``bucket``) let the next candidate in fair order try
(no head-of-line blocking of short jobs behind a long one). The first candidate in fair order
holds a reservation: once it has been blocked by ``kv`` or ``bucket`` for ``hol_bypass_s``,
nobody may pass it any more until it fits, so a big job is delayed by at most that window plus
the drain, never starved. ``long`` needs no reservation: a project whose long head is blocked
does not advance its virtual time, so it is first in line when a long slot frees. (The
reservation is kept per backend: placement.py.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleet.core.config import BackendSettings, Settings

RESERVING_REASONS = ("kv", "bucket", "prefill")  # "prefill": the short-sequences rule, not the window


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int = 32
    kv_budget_tokens: int = 795_000
    block_tokens: int = 1072
    long_prompt_tokens: int = 32_768
    max_long: int = 3
    prefill_tokens_per_s: float = 60_000.0
    prefill_burst_tokens: int = 262_144
    min_spacing_s: float = 0.0
    hol_bypass_s: float = 10.0
    long_prefill_tokens_per_s: float = 0.0  # the server's prefill rate; 0: no quiet long prefills
    short_beside_long: int = 2
    long_prefills: int = 1  # long prefills one quiet window may take
    short_job_s: float = 0.0  # a short job's time at the backend, what a drain waits for; 0: always drain
    # the server's prefix cache room in tokens (its KV pool): how long a cached estimate holds
    # (schedulers/policy/locality.py); 0: no horizon
    cache_tokens: int = 0
    # the server's prefill rate for the first-token routing's queue model (placement.py
    # ``first_token``); 0: no model
    queue_tokens_per_s: float = 0.0

    @classmethod
    def from_settings(cls, settings: Settings, backend: BackendSettings | None = None) -> Limits:
        """The limits of ``backend``, one of ``settings.backends`` (default: the first), with the
        fleet's admission settings."""
        backend, admission = backend or settings.backend, settings.admission
        return cls(
            max_num_seqs=backend.max_num_seqs,
            kv_budget_tokens=int(backend.kv_pool_tokens * admission.kv_overcommit),
            block_tokens=backend.block_tokens,
            long_prompt_tokens=backend.long_prompt_tokens,
            max_long=backend.max_long,
            prefill_tokens_per_s=admission.prefill_tokens_per_s,
            prefill_burst_tokens=admission.prefill_burst_tokens,
            min_spacing_s=admission.min_spacing_ms / 1000.0,
            hol_bypass_s=admission.hol_bypass_s,
            long_prefill_tokens_per_s=backend.prefill_tokens_per_s if admission.quiet_long_prefill else 0.0,
            short_beside_long=admission.short_beside_long_prefill,
            long_prefills=long_prefills_at_once(settings, backend),
            short_job_s=admission.short_job_s,
            cache_tokens=backend.kv_pool_tokens,
            queue_tokens_per_s=backend.prefill_tokens_per_s,
        )


def long_prefills_at_once(settings: Settings, backend: BackendSettings | None = None) -> int:
    """How many long prompts the server prefills side by side: vLLM's --max-long-partial-prefills
    counts only when --max-num-partial-prefills > 1 (otherwise one prompt prefills at a time).
    ``backend``: one of ``settings.backends`` (default: the first)."""
    backend = backend or settings.backend
    if backend.max_num_partial_prefills <= 1:
        return 1
    return min(backend.max_long_partial_prefills, backend.max_num_partial_prefills)


@dataclass
class LimitState:
    """Counters of live leases plus the pacing state (bucket, last admission, reservation)."""

    in_flight: int = 0
    reserved_kv_tokens: int = 0
    long_in_flight: int = 0
    bucket_tokens: float | None = None  # None = full (never used)
    bucket_at: float = 0.0
    last_admit_at: float | None = None
    blocked_job: str | None = None
    blocked_since: float = 0.0
    claimed: int = 0  # live leases a worker has claimed (its request is at the backend)
    prefill_until: float = 0.0  # when the last admitted long prompt's prefill should be done
    prefill_longs: int = 0  # long prefills admitted into the window ending at prefill_until
    interactive_in_flight: int = 0  # live leases of interactive-band jobs
    filled: int = 0  # uncached prompt tokens ever granted here (locality.py's cache horizon)
    # when the prefill of every grant so far should be done, one after another at
    # ``queue_tokens_per_s`` (placement.py ``first_token``)
    queue_until: float = 0.0


@dataclass(frozen=True)
class Cost:
    """What admitting one job takes from the limits."""

    job_id: str
    prompt_tokens: int
    kv_tokens: int
    long: bool
    uncached_tokens: int  # expected to miss the prefix cache: what the prefill computes
    long_prefill: bool
    interactive: bool = False  # the interactive band: what quiet windows protect


def kv_tokens(prompt_tokens: int, max_new_tokens: int, block_tokens: int) -> int:
    """KV reserved by one request: whole blocks, at least one."""
    blocks = max(1, math.ceil((prompt_tokens + max_new_tokens) / block_tokens))
    return blocks * block_tokens


def cost_of(
    job_id: str, prompt_tokens: int, max_new_tokens: int, limits: Limits, uncached_tokens: int | None = None,
    interactive: bool = False,
) -> Cost:
    uncached = prompt_tokens if uncached_tokens is None else max(0, min(uncached_tokens, prompt_tokens))
    return Cost(
        job_id=job_id,
        prompt_tokens=prompt_tokens,
        kv_tokens=kv_tokens(prompt_tokens, max_new_tokens, limits.block_tokens),
        long=prompt_tokens > limits.long_prompt_tokens,
        uncached_tokens=uncached,
        long_prefill=uncached > limits.long_prompt_tokens,
        interactive=interactive,
    )


def bucket_level(limits: Limits, state: LimitState, now: float) -> float:
    if state.bucket_tokens is None:
        return float(limits.prefill_burst_tokens)
    refill = max(0.0, now - state.bucket_at) * limits.prefill_tokens_per_s
    return min(float(limits.prefill_burst_tokens), state.bucket_tokens + refill)


def check_global(
    limits: Limits, state: LimitState, now: float, outside: float = 0.0
) -> tuple[str | None, float | None]:
    """Limits that stop every candidate: ``(reason, retry_in_s)`` or ``(None, None)``."""
    if state.in_flight >= limits.max_num_seqs:
        return "seqs", None
    if state.in_flight + outside >= limits.max_num_seqs:
        return "outside", None
    if state.last_admit_at is not None and limits.min_spacing_s > 0:
        wait_s = state.last_admit_at + limits.min_spacing_s - now
        if wait_s > 0:
            return "spacing", wait_s
    return None, None


def check_job(
    limits: Limits, state: LimitState, cost: Cost, now: float, protect: bool = True
) -> tuple[str | None, float | None]:
    """Limits of one candidate: ``(reason, retry_in_s)`` or ``(None, None)`` when it fits.
    ``protect``: interactive work is in flight on this backend or among the candidates that may run
    on it (placement.py), so quiet windows hold."""
    quiet = limits.long_prefill_tokens_per_s > 0 and protect
    window = state.prefill_until - now
    if quiet and window > 0 and (not cost.long_prefill or state.prefill_longs >= limits.long_prefills):
        return "prefill", window
    over_kv = state.reserved_kv_tokens + cost.kv_tokens > limits.kv_budget_tokens
    if over_kv and state.in_flight > 0:
        return "kv", None
    if cost.long and state.long_in_flight >= limits.max_long:
        return "long", None
    if quiet and cost.long_prefill:
        short_in_flight = state.in_flight - state.long_in_flight
        if short_in_flight > limits.short_beside_long and drain_pays(limits, short_in_flight, cost):
            return "prefill", None
    need = min(cost.uncached_tokens, limits.prefill_burst_tokens)
    level = bucket_level(limits, state, now)
    if level < need:
        return "bucket", (need - level) / limits.prefill_tokens_per_s
    return None, None


def drain_pays(limits: Limits, short_in_flight: int, cost: Cost) -> bool:
    """Is draining ``short_in_flight`` short sequences to ``short_beside_long`` worth it before
    this long prefill: (S - b)^2 x short_job_s / 2S idle slot-seconds <= S x U / rate of
    slow-down (module docstring), compared multiplied out, the same arithmetic as admit.lua."""
    drained = short_in_flight - limits.short_beside_long
    idle = drained * drained * limits.short_job_s * limits.long_prefill_tokens_per_s
    return idle <= 2.0 * short_in_flight * short_in_flight * cost.uncached_tokens


def admit(limits: Limits, state: LimitState, cost: Cost, now: float) -> None:
    state.bucket_tokens = bucket_level(limits, state, now) - cost.uncached_tokens
    state.bucket_at = now
    state.last_admit_at = now
    state.in_flight += 1
    state.reserved_kv_tokens += cost.kv_tokens
    state.long_in_flight += 1 if cost.long else 0
    state.interactive_in_flight += 1 if cost.interactive else 0
    state.filled += cost.uncached_tokens
    if limits.queue_tokens_per_s > 0:
        state.queue_until = max(now, state.queue_until) + cost.uncached_tokens / limits.queue_tokens_per_s
    if cost.long_prefill and limits.long_prefill_tokens_per_s > 0:
        if now >= state.prefill_until:
            state.prefill_longs = 0
        start = max(now, state.prefill_until)
        state.prefill_until = start + cost.uncached_tokens / limits.long_prefill_tokens_per_s
        state.prefill_longs += 1


def free(state: LimitState, kv: int, long: bool, interactive: bool = False) -> None:
    state.in_flight -= 1
    state.reserved_kv_tokens -= kv
    state.long_in_flight -= 1 if long else 0
    state.interactive_in_flight -= 1 if interactive else 0
