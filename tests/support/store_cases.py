"""What the admission store tests share: a fake clock, the base limits, the parametrised
``make_store`` fixture (the in-memory twin and the Redis store; imported by name where used) and
small builders of jobs, limits and admissions."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from fleet.core.keys import Keys
from schedulers.policy.limits import Limits
from schedulers.store.base import PendingItem, StoreConfig
from schedulers.store.memory_store import MemoryStore
from schedulers.store.redis_store import RedisStore


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


StoreFactory = Callable[..., "MemoryStore | RedisStore"]


BASE = StoreConfig(
    limits=Limits(
        max_num_seqs=4,
        kv_budget_tokens=20 * 1000,
        block_tokens=1000,
        long_prompt_tokens=10_000,
        max_long=1,
        prefill_tokens_per_s=1e9,
        prefill_burst_tokens=10**9,
        hol_bypass_s=5.0,
    ),
    lease_ttl_s=30.0,
    aging_s=60.0,
    gate=False,
)


@pytest.fixture(params=["memory", "redis"])
def make_store(
    request: pytest.FixtureRequest, key_prefix: str, redis_client: redis.Redis
) -> StoreFactory:
    def factory(config: StoreConfig = BASE, clock: FakeClock | None = None):
        clock = clock or FakeClock()
        if request.param == "memory":
            return MemoryStore(config, clock=clock)
        return RedisStore(redis_client, Keys(key_prefix), config, clock=clock)

    return factory


def job(job_id: str, project: str = "a", prompt: int = 500, new: int = 400, **kw) -> PendingItem:
    kw.setdefault("enqueued_at", 1_000.0 + int(job_id.strip("abcdefghijklmnopqrstuvwxyz_") or 0))
    return PendingItem(job_id, project, prompt, new, **kw)


def ijob(job_id: str, **kw) -> PendingItem:
    """An interactive-band job: what quiet long prefills protect."""
    return job(job_id, band="interactive", **kw)


def limits(**changes) -> StoreConfig:
    values = {**BASE.limits.__dict__, **changes}
    return StoreConfig(limits=Limits(**values), lease_ttl_s=30.0, aging_s=60.0, gate=False)


def admit_ids(store, now: float) -> list[str]:
    ids = []
    while (result := store.admit_next(now)).grant:
        ids.append(result.grant.job_id)
    return ids
