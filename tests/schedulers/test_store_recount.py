"""The lease counters put right from the live leases (schedulers/store/lua/recount.lua): a
release by a process of another version (one that reads a lease's ``long`` field as the code
before interactive leases did) leaves ``long`` and ``inter`` one too high, and every long prompt
would be held for good; the recount, which reap_expired runs every RECOUNT_S, frees them."""

from __future__ import annotations

import redis

from fleet.core.keys import Keys
from schedulers.store.redis_store import RECOUNT_S, RedisStore
from tests.support.store_cases import BASE, FakeClock, ijob, job


def released_by_an_older_version(client: redis.Redis, d: str, job_id: str) -> None:
    """What the release of the code before interactive leases did with a ``1i`` lease: in_flight
    and kv given back, ``long`` kept (it compared the field with ``1``), ``inter`` unknown."""
    fence, kv, *_ = client.hget(d + "lease", job_id).decode().split(" ")
    assert _[0] == "1i"  # long, interactive: the lease as this version writes it
    client.hincrby(d + "state", "in_flight", -1)
    client.hincrby(d + "state", "kv", -int(kv))
    client.hdel(d + "lease", job_id)
    client.zrem(d + "leases", job_id)


def test_a_counter_left_off_by_another_version_is_put_right(redis_client: redis.Redis,
                                                             key_prefix: str) -> None:
    clock = FakeClock()
    store = RedisStore(redis_client, Keys(key_prefix), BASE, clock=clock)
    store.add_pending(ijob("l1", prompt=12_000))
    assert store.admit_next(clock.now).grant is not None
    released_by_an_older_version(redis_client, Keys(key_prefix).dispatch, "l1")
    store.add_pending(job("l2", prompt=12_000))
    assert store.admit_next(clock.now).grant is None  # held: max_long 1, and "long" is still 1
    assert store.recount() == {"long": (1, 0), "inter": (1, 0)}
    assert store.admit_next(clock.now).grant.job_id == "l2"
    assert store.recount() == {}  # nothing off: the counters are the live leases' sums


def test_reap_expired_recounts_every_recount_s(redis_client: redis.Redis, key_prefix: str) -> None:
    clock = FakeClock()
    store = RedisStore(redis_client, Keys(key_prefix), BASE, clock=clock)
    store.reap_expired(clock.now)  # the first pass recounts
    d = Keys(key_prefix).dispatch
    redis_client.hincrby(d + "state", "long", 1)
    store.reap_expired(clock.now + RECOUNT_S / 2)
    assert redis_client.hget(d + "state", "long") == b"1"  # not yet
    store.reap_expired(clock.now + RECOUNT_S)
    assert redis_client.hget(d + "state", "long") == b"0"
