"""``fleet bench backends``: what several backends cost the dispatcher's store.

Cost of many servers: admission decisions (admit + release pairs, the dispatcher's way: up to 8
grants per ADMIT call, releases one by one) at a steady backlog, with one backend against
``backends`` backends in the same run. Every job of the many-backend store may run on every
backend (one model on that many replicas: the widest mask, so each candidate is tried on the most
backends), and each backend's cap is the one backend's cap divided among them, so both stores
admit into the same total room. Both backlogs stay in one Redis and the rounds alternate
between them (the median round counts), so a machine busy with other work slows both alike; the
figure is the ratio. Redis bytes per pending job are measured on each backlog.

Not measured here (docs/backends.md, section 9): routing against round-robin and least-loaded on
real simulators, and the failover figures.
"""

from __future__ import annotations

import redis

from fleet.bench.dispatch import _Backlog, _delete
from fleet.bench.measure import percentile
from schedulers.dispatcher import GRANTS_PER_CALL
from schedulers.policy.limits import Limits
from schedulers.store.base import BackendLimits, StoreConfig

CAP = 512  # sequences in all: room enough that the backlog, not a cap, decides


def many_backends_cost(redis_url: str, jobs: int = 1_000_000, backends: int = 16,
                       decisions: int = 500, rounds: int = 8) -> dict[str, float]:
    """Pairs/s with one backend and with ``backends`` (module docstring), and bytes per job."""
    client = redis.Redis.from_url(redis_url)
    share = max(1, CAP // backends)
    many = StoreConfig.with_backends(
        [BackendLimits(f"b{i}", Limits(max_num_seqs=share, kv_budget_tokens=10**12, max_long=share))
         for i in range(backends)], gate=False)
    one = StoreConfig(limits=Limits(max_num_seqs=CAP, kv_budget_tokens=10**12, max_long=CAP), gate=False)
    single = _Backlog(client, jobs, one)
    wide = _Backlog(client, jobs, many, eligible=(1 << backends) - 1)
    try:
        times: dict[str, list[float]] = {"one": [], "many": []}
        for _ in range(rounds):
            for name, backlog in (("one", single), ("many", wide)):
                pair_s, _server_s = backlog.decide(decisions, GRANTS_PER_CALL, pipelined=False)
                times[name].append(pair_s)
        one_s, many_s = percentile(times["one"], 50), percentile(times["many"], 50)
        return {
            "backlog jobs": float(jobs),
            "backends": float(backends),
            "admission pairs/s, 1 backend (baseline)": 1 / one_s,
            f"admission pairs/s, {backends} backends": 1 / many_s,
            "ratio to the baseline": one_s / many_s,
            "Redis bytes per pending job, 1 backend": single.bytes / jobs,
            f"Redis bytes per pending job, {backends} backends": wide.bytes / jobs,
        }
    finally:
        for backlog in (single, wide):
            _delete(client, backlog.prefix)
        client.close()
