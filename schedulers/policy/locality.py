"""Locality in a project's line: which of its first waiting jobs goes, by what is still cached.

The idea of locality-aware fair scheduling (DLPM, Cao et al. 2025: longest prefix match within a
bounded fairness deficit), with the deficit across projects at 0. The fair order across projects
(schedulers/policy/fairshare.py) is untouched: which project goes next, and how many tokens each
is charged, are exactly what they are without it. What changes is which of a project's jobs it
sends: with ``admission.locality_lookahead`` = K > 1, each of its queues offers, instead of its
first job in line, the one of its first K with the most cached tokens *still expected in the
cache* (ties: the first in line). Measured on a replay of the deployment's workload
(``fleet bench locality``): the cross-project part of DLPM gained nothing there, the choice inside
a project's line gained most of it (docs/performance.md).

What "still cached" means. An item's cached tokens are prep's estimate when it was queued
(``prompt - uncached`` on its cache backend: its hint, else the only backend of its mask). The
server's cache is least recently used over its KV pool, so a prefix last sent when the backend had
been *filled* with F tokens is gone once roughly ``cache_tokens`` (the pool) more tokens have been
computed there. Each backend counts the uncached prompt tokens granted to it (``filled``, never
reset; the Redis store's bstate field of the same name), and an item records that count when it
is queued or put back in line after a turn (``fill``: its prefix was sent at most that long ago).
Its cached tokens count while ``filled - fill < cache_tokens``, and as 0 after. This is an
estimate on the optimistic side: the server's cache also fills with generated tokens, and blocks
held by running sequences are not free for others, so the real horizon is shorter.

The price: a job passed over in its line waits longer. At most K - 1 later jobs of its own queue
can pass it at each grant, and only jobs of its own project: another project's share or wait does
not move. ``locality_max_wait_s`` bounds it: a queue whose first job has waited that long offers
it, cached or not (0: no bound). The aging time (``admission.aging_s``) bounds it too, whatever
that setting: a queue's age is its first job's, and a batch line whose first job has aged ranks
with the interactive work (fairshare.tier), so that first job is the one it offers. Otherwise a
project could keep one old uncached job at the head of its line and have the cached jobs behind it
ride its age ahead of other projects' batch work for as long as it liked.

Pure functions; the Redis store's admission script repeats them (admit.lua ``choose``), the
in-memory twin calls them, the differential test keeps them equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Locality:
    """``admission.locality_lookahead`` and ``admission.locality_max_wait_s``."""

    lookahead: int = 1  # 1: every queue offers its first job (the order without locality)
    max_wait_s: float = 0.0  # 0: no bound

    @property
    def on(self) -> bool:
        return self.lookahead > 1


def cache_backend(eligible: int, hint: int | None) -> int:
    """The backend whose cache an item's uncached estimate is about: its hint, else the lowest
    backend of its mask (with no hint and several backends nothing is cached anywhere, so which
    one does not matter)."""
    if hint is not None:
        return hint
    return (eligible & -eligible).bit_length() - 1


def fresh_cached(prompt: int, uncached: int, fill: int, filled: int, cache_tokens: int) -> int:
    """The item's cached tokens if its prefix is still expected in the cache (module docstring),
    else 0. ``cache_tokens`` 0: no horizon (every estimate holds)."""
    cached = max(0, prompt - uncached)
    if cache_tokens > 0 and filled - fill >= cache_tokens:
        return 0
    return cached


def choose(cached: Sequence[int], first_waited_s: float, locality: Locality, aging_s: float = 0.0) -> int:
    """Which of a queue's first jobs (in line order; ``cached``: each one's ``fresh_cached``)
    goes: the index of the most cached, the first of equals; the first when it has waited
    ``max_wait_s`` or ``aging_s`` (module docstring; 0: no such bound)."""
    if not cached:
        raise ValueError("choose needs at least one job")
    if locality.max_wait_s > 0 and first_waited_s >= locality.max_wait_s:
        return 0
    if aging_s > 0 and first_waited_s >= aging_s:
        return 0
    best = 0
    for i, c in enumerate(cached):
        if c > cached[best]:
            best = i
    return best
