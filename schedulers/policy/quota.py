"""Quotas: what a project may spend per minute, day and month, decided inside admission.

A project's quota (``projects.<name>.quota``, docs/usage.md "Quotas") bounds the *cost* of the
turns admitted in each UTC window: a minute, a day and a calendar month, and the requests
admitted in a minute and the project's sequences in flight. A turn's cost is

    cost = prompt x cost_prompt (its tokens that missed the prefix cache)
         + cached x cost_cached + output x cost_output

rounded up to a whole number. Admission cannot know the split nor the output: a grant
*reserves* the worst case (the whole prompt at the dearer of the two prompt rates, plus the
output limit at ``cost_output``: ``reserve``) in the windows of its admission time, and the turn
*settles* when it ends, giving back what it did not spend (``spent``); a turn that never settles
(its worker died) keeps its reservation. So the windows' counters are never below what was
admitted, and admission grants a candidate only while its reservation fits under every limit
(``check``): however many dispatchers and gateways admit at once (one atomic script), the
reservations made in a window never pass the quota.

Windows are named by the admitting process's clock (the ``now`` every decision takes): minute
``floor(now / 60)``, day ``YYYYMMDD``, month ``YYYYMM`` (UTC). A candidate that does not fit is
passed over (reason ``quota``) and keeps its place; the hold lifts when the window that blocks
it ends (``retry_in_s``), or, for the in-flight cap, when one of the project's turns ends.

The Redis script (schedulers/store/lua/admit.lua) repeats ``check`` and the reservation; the
in-memory store calls them here; the differential test holds the two equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

QUOTA = "quota"  # the hold reason of a candidate over its project's quota
NEVER_FITS = "quota: larger than the quota"  # how ``refusal`` starts for a turn no window holds

MINUTE_S = 60


@dataclass(frozen=True)
class Quota:
    """One project's limits (0: none) and cost rates."""

    tokens_per_minute: int = 0
    requests_per_minute: int = 0
    tokens_per_day: int = 0
    tokens_per_month: int = 0
    max_in_flight: int = 0
    cost_prompt: float = 1.0
    cost_cached: float = 1.0
    cost_output: float = 1.0

    @property
    def limited(self) -> bool:
        return any((self.tokens_per_minute, self.requests_per_minute, self.tokens_per_day,
                    self.tokens_per_month, self.max_in_flight))

    @property
    def smallest_tokens(self) -> int:
        """The smallest token limit (0: none): a turn whose reservation passes it never fits."""
        limits = [t for t in (self.tokens_per_minute, self.tokens_per_day, self.tokens_per_month) if t]
        return min(limits) if limits else 0

    def reserve(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """A turn's worst case: nothing cached is assumed only where caching costs more."""
        dearer = max(self.cost_prompt, self.cost_cached)
        return math.ceil(prompt_tokens * dearer + max_new_tokens * self.cost_output - 1e-9)

    def spent(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> int:
        """What a turn cost, from the server's counts (``cached_tokens`` are part of the prompt)."""
        cached = max(0, min(cached_tokens, prompt_tokens))
        return math.ceil((prompt_tokens - cached) * self.cost_prompt + cached * self.cost_cached
                         + output_tokens * self.cost_output - 1e-9)

    def never_fits(self, cost: int) -> bool:
        """Would a reservation of ``cost`` pass a token limit even in an empty window?"""
        smallest = self.smallest_tokens
        return bool(smallest) and cost > smallest


@dataclass(frozen=True)
class Windows:
    """The UTC windows ``now`` falls in, and when each ends (unix seconds)."""

    now: float
    minute: int
    minute_end: float
    day: str
    day_end: float
    month: str
    month_end: float

    @classmethod
    def at(cls, now: float) -> Windows:
        minute = math.floor(now / MINUTE_S)
        t = datetime.fromtimestamp(now, UTC)
        day_start = datetime(t.year, t.month, t.day, tzinfo=UTC)
        next_month = datetime(t.year + (t.month == 12), t.month % 12 + 1, 1, tzinfo=UTC)
        return cls(now=now, minute=minute, minute_end=float((minute + 1) * MINUTE_S),
                   day=t.strftime("%Y%m%d"), day_end=(day_start + timedelta(days=1)).timestamp(),
                   month=t.strftime("%Y%m"), month_end=next_month.timestamp())


@dataclass
class Usage:
    """What a project's admitted turns hold in the current windows."""

    tokens_minute: int = 0
    requests_minute: int = 0
    tokens_day: int = 0
    tokens_month: int = 0
    in_flight: int = 0


def blocking(quota: Quota, usage: Usage, cost: int, windows: Windows) -> tuple[str, int, float | None] | None:
    """The first limit a turn of ``cost`` would pass now: its setting's name, its value and in
    how many seconds its window ends (None: when a turn of the project ends); None when it fits.
    The order is the Lua's."""
    now = windows.now
    if quota.max_in_flight and usage.in_flight + 1 > quota.max_in_flight:
        return "max_in_flight", quota.max_in_flight, None
    if quota.requests_per_minute and usage.requests_minute + 1 > quota.requests_per_minute:
        return "requests_per_minute", quota.requests_per_minute, windows.minute_end - now
    if quota.tokens_per_minute and usage.tokens_minute + cost > quota.tokens_per_minute:
        return "tokens_per_minute", quota.tokens_per_minute, windows.minute_end - now
    if quota.tokens_per_day and usage.tokens_day + cost > quota.tokens_per_day:
        return "tokens_per_day", quota.tokens_per_day, windows.day_end - now
    if quota.tokens_per_month and usage.tokens_month + cost > quota.tokens_per_month:
        return "tokens_per_month", quota.tokens_per_month, windows.month_end - now
    return None


def check(quota: Quota, usage: Usage, cost: int, windows: Windows) -> tuple[str, float | None] | None:
    """Admission's verdict: (``QUOTA``, when it lifts) while a limit holds the turn, else None."""
    held = blocking(quota, usage, cost, windows)
    return None if held is None else (QUOTA, held[2])


def refusal(quota: Quota, over: str, usage: Usage, prompt_tokens: int, max_new_tokens: int,
            windows: Windows) -> tuple[str, float | None] | None:
    """Whether a new job or gateway request is refused before it enters admission: a message for
    E_QUOTA_EXCEEDED and in how many seconds asking again may succeed (None: not by waiting), or
    None to let it in. A turn larger than a token limit is refused whatever ``over`` says (it
    would wait for ever); a turn that does not fit now, only when ``over`` is "refuse" (with
    "wait" it waits in line). Exactness is admission's (``check``): this is read outside it, so a
    request let in here may still wait there."""
    cost = quota.reserve(prompt_tokens, max_new_tokens)
    if quota.never_fits(cost):
        return (f"{NEVER_FITS}: this request may cost {cost:,} (prompt and output limit), more than "
                f"the project's smallest token quota ({quota.smallest_tokens:,}); ask for fewer tokens"), None
    held = blocking(quota, usage, cost, windows)
    if held is None or over != "refuse":
        return None
    name, limit, retry = held
    when = ("when one of its turns in flight ends" if retry is None
            else f"in {math.ceil(retry)} s")
    return f"quota: {name} = {limit:,} has no room for this request (cost {cost:,}); room again {when}", retry


def take(usage: Usage, cost: int) -> None:
    """A grant's reservation, added to the project's usage."""
    usage.tokens_minute += cost
    usage.requests_minute += 1
    usage.tokens_day += cost
    usage.tokens_month += cost
    usage.in_flight += 1


@dataclass(frozen=True)
class Remaining:
    """What a project may still spend in the current minute, for OpenAI's ``x-ratelimit-*``
    headers: limits (0: none), what is left, and seconds to the minute's end."""

    limit_requests: int
    remaining_requests: int
    limit_tokens: int
    remaining_tokens: int
    reset_s: float


def remaining(quota: Quota, usage: Usage, windows: Windows) -> Remaining:
    reset = windows.minute_end - windows.now
    return Remaining(
        limit_requests=quota.requests_per_minute,
        remaining_requests=max(0, quota.requests_per_minute - usage.requests_minute),
        limit_tokens=quota.tokens_per_minute,
        remaining_tokens=max(0, quota.tokens_per_minute - usage.tokens_minute),
        reset_s=reset,
    )
