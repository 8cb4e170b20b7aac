"""When to try again, how long to wait, and how much retrying a project may add to the load.

Backoff: exponential with full jitter (``delay = U(0, min(max_s, base_s * 2**(n-1)))`` for the
n-th retry), so workers that failed together do not come back together. The random source is
injected. A retry is only considered for a code whose catalogue entry is ``retryable``, and never
when waiting would reach the job's deadline.

Retry budget (per project, Redis hash ``{p}retry_budget:<project>``, fields ``tokens`` and
``ts``): a token bucket. Every first attempt credits ``ratio`` tokens (``retry.budget_ratio``,
0.2: retries may add at most 20% to the load of first attempts), a small reserve trickles in
over time (``reserve_per_s``, so a quiet project can still retry a lone failure) and the bucket
holds at most ``capacity`` tokens (which bounds the burst: the window the ratio applies over).
A retry takes one token or is refused. During an outage every first attempt fails, the bucket
drains, and the project's retries fall to ``ratio`` of its traffic instead of multiplying it by
``max_attempts``. The update is one Lua script (fleet/infer/lua/retry_bucket.lua, registered once per client), so
any number of workers share one bucket.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import redis

from fleet.core.codes import Code
from fleet.core.keys import Keys
from fleet.core.lua import shared


def backoff_s(
    retry_number: int, base_s: float, max_s: float, rand: Callable[[], float] = random.random
) -> float:
    """Full-jitter delay before the ``retry_number``-th retry (1 = first retry)."""
    ceiling = min(max_s, base_s * (2 ** max(0, retry_number - 1)))
    return rand() * ceiling


def should_retry(code: Code) -> bool:
    """Whether the worker itself tries again: retryable codes, except faults of the fleet."""
    return code.retryable and code is not Code.E_INTERNAL


def fits_deadline(delay_s: float, now: float, deadline: float | None) -> bool:
    return deadline is None or now + delay_s < deadline


class RetryBudget:
    """The per-project retry token bucket (see module doc). Clock injected (unix seconds)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        project: str,
        ratio: float,
        capacity: float = 10.0,
        reserve_per_s: float = 0.1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._key = keys.retry_budget(project)
        self._script = shared(client, "fleet.infer", ("retry_bucket",))["retry_bucket"]
        self.ratio = ratio
        self.capacity = capacity
        self.reserve_per_s = reserve_per_s
        self._clock = clock

    def _run(self, credit: float, spend: int) -> tuple[bool, float]:
        granted, tokens = self._script(
            keys=[self._key],
            args=[repr(self._clock()), repr(credit), repr(self.capacity),
                  repr(self.reserve_per_s), spend],
        )
        return bool(int(granted)), float(tokens)

    def first_attempt(self) -> float:
        """Credit the bucket for a first attempt; returns the tokens now available."""
        return self._run(self.ratio, 0)[1]

    def try_spend(self) -> bool:
        """Take one token for a retry; False when the project has used up its retry share."""
        return self._run(0.0, 1)[0]

    def tokens(self) -> float:
        return self._run(0.0, 0)[1]
