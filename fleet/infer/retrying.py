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
``max_attempts``. The update is one Lua script, so any number of workers share one bucket.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import redis

from fleet.core.codes import Code
from fleet.core.keys import Keys

# KEYS[1] bucket hash. ARGV: now_s, credit (tokens to add, 0 for a spend), capacity, reserve_per_s,
# spend (1 to take a token). Returns {granted (0/1), tokens after, as a string}.
_BUCKET_LUA = """
local key = KEYS[1]
local now = tonumber(ARGV[1])
local credit = tonumber(ARGV[2])
local capacity = tonumber(ARGV[3])
local reserve_per_s = tonumber(ARGV[4])
local spend = tonumber(ARGV[5])
local tokens = tonumber(redis.call('HGET', key, 'tokens') or ARGV[3])
local ts = tonumber(redis.call('HGET', key, 'ts') or ARGV[1])
if now > ts then tokens = tokens + (now - ts) * reserve_per_s end
tokens = math.min(capacity, tokens + credit)
local granted = 0
if spend > 0 and tokens >= spend then
  tokens = tokens - spend
  granted = 1
end
redis.call('HSET', key, 'tokens', tostring(tokens), 'ts', tostring(math.max(now, ts)))
redis.call('EXPIRE', key, 86400)
return {granted, tostring(tokens)}
"""


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
        self._script = client.register_script(_BUCKET_LUA)
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
