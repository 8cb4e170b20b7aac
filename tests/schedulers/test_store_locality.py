"""Locality in a project's line (schedulers/policy/locality.py), against the in-memory twin and Redis.

Each queue offers the one of its first ``lookahead`` jobs with the most cached tokens still
expected in the server's cache; an estimate goes stale once the backend has taken in its cache room
of uncached tokens since the job was queued; a first job that waited ``max_wait_s`` goes anyway;
which project goes next and what each is charged do not change; off (lookahead 1) the order is
the line's.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from schedulers.policy import locality as loc
from schedulers.policy.locality import Locality
from schedulers.store.base import StoreConfig
from tests.support.store_cases import BASE, FakeClock, StoreFactory, admit_ids, ijob, job, make_store

__all__ = ["make_store"]  # the parametrised fixture, memory and Redis

CACHE = 5_000  # the backend's cache room in these tests: a few jobs' prompts


def config(lookahead: int = 4, max_wait_s: float = 0.0, seqs: int = 1, cache: int = CACHE) -> StoreConfig:
    return replace(BASE, limits=replace(BASE.limits, max_num_seqs=seqs, cache_tokens=cache),
                   locality=Locality(lookahead, max_wait_s))


def release_all(store, granted: list[tuple[str, int]]) -> None:
    for job_id, fence in granted:
        assert store.release(job_id, fence)


def grant(store, now: float) -> tuple[str, int]:
    result = store.admit_next(now)
    assert result.grant is not None, result.hold_reason
    return result.grant.job_id, result.grant.fence


def test_a_queue_offers_its_most_cached_job_among_the_first(make_store: StoreFactory) -> None:
    store = make_store(config(lookahead=3))
    store.add_pending(job("j1", prompt=3_000, uncached_tokens=3_000))  # nothing cached
    store.add_pending(job("j2", prompt=3_000, uncached_tokens=1_000))
    store.add_pending(job("j3", prompt=3_000, uncached_tokens=200))  # the most cached of the first 3
    store.add_pending(job("j4", prompt=3_000, uncached_tokens=0))  # beyond the look-ahead
    first = grant(store, 1_010.0)
    assert first[0] == "j3"
    release_all(store, [first])
    # j4 is now among the first three and the most cached; then j2 over j1
    order = []
    for _ in range(3):
        g = grant(store, 1_010.0)
        order.append(g[0])
        release_all(store, [g])
    assert order == ["j4", "j2", "j1"]


def test_off_the_line_order_holds(make_store: StoreFactory) -> None:
    store = make_store(config(lookahead=1, seqs=4))
    store.add_pending(job("j1", prompt=3_000, uncached_tokens=3_000))
    store.add_pending(job("j2", prompt=3_000, uncached_tokens=0))
    assert admit_ids(store, 1_010.0) == ["j1", "j2"]


def test_an_estimate_goes_stale_once_the_cache_took_in_its_room(make_store: StoreFactory) -> None:
    """j1 was queued before the backend computed 6,000 uncached tokens (more than its 5,000-token
    cache room): its 3,000 cached tokens are likely evicted, j2's 2,000, queued after, are not."""
    store = make_store(config(lookahead=4))
    store.add_pending(job("j1", prompt=3_000, uncached_tokens=0))
    store.add_pending(ijob("x5", project="b", prompt=6_000, uncached_tokens=6_000))  # interactive: first
    x = grant(store, 1_010.0)
    assert x[0] == "x5"
    release_all(store, [x])
    store.add_pending(job("j2", prompt=3_000, uncached_tokens=1_000))
    assert grant(store, 1_010.0)[0] == "j2"


def test_a_stale_estimate_is_a_whole_prompt_to_the_prefill_limits(make_store: StoreFactory) -> None:
    """j1's 3,000 cached tokens went stale while it waited: its grant takes 3,000 tokens from the
    prefill bucket (its whole prompt, computed again), so j2's 2,000 uncached wait for the refill;
    counted by the estimate made at queue time, j1 would have taken nothing and j2 gone at once."""
    base = config(lookahead=4, seqs=4)
    store = make_store(replace(base, limits=replace(base.limits, prefill_tokens_per_s=1.0,
                                                     prefill_burst_tokens=10_000)))
    store.add_pending(job("j1", prompt=3_000, uncached_tokens=0))
    store.add_pending(ijob("x5", project="b", prompt=6_000, uncached_tokens=6_000))  # bucket 10,000 -> 4,000
    release_all(store, [x := grant(store, 1_010.0)])
    assert x[0] == "x5"
    assert grant(store, 1_010.0)[0] == "j1"  # bucket 4,000 -> 1,000
    store.add_pending(job("j2", project="c", prompt=3_000, uncached_tokens=2_000))
    assert store.admit_next(1_010.0).hold_reason == "bucket"


def test_a_cached_estimate_within_the_room_holds(make_store: StoreFactory) -> None:
    store = make_store(config(lookahead=4))
    store.add_pending(job("j1", prompt=3_000, uncached_tokens=0))
    store.add_pending(ijob("x5", project="b", prompt=4_000, uncached_tokens=4_000))  # less than the room
    x = grant(store, 1_010.0)
    release_all(store, [x])
    store.add_pending(job("j2", prompt=3_000, uncached_tokens=1_000))
    assert grant(store, 1_010.0)[0] == "j1"


def test_a_first_job_that_waited_the_bound_goes_cached_or_not(make_store: StoreFactory) -> None:
    clock = FakeClock(1_000.0)
    store = make_store(config(lookahead=4, max_wait_s=30.0), clock=clock)
    store.add_pending(job("j1", prompt=3_000, uncached_tokens=3_000))
    store.add_pending(job("j2", prompt=3_000, uncached_tokens=0))
    assert grant(store, 1_020.0)[0] == "j2"  # j1 (queued at 1,001) has waited 19 s
    store.add_pending(job("j3", prompt=3_000, uncached_tokens=0))
    g = store.admit_next(1_020.0)
    assert g.grant is None  # one sequence
    # released at 1,040: j1 has waited 39 s, past the bound
    store.release("j2", 1)
    assert grant(store, 1_040.0)[0] == "j1"


@pytest.mark.parametrize("lookahead", [1, 4])
def test_which_project_goes_next_does_not_change(make_store: StoreFactory, lookahead: int) -> None:
    """Locality picks inside a project's line only: the projects alternate as without it (equal
    weights, equal sizes; a's line first, as its first job is older), whatever is cached."""
    store = make_store(config(lookahead=lookahead, seqs=8, cache=0))  # no horizon
    for i in range(4):
        store.add_pending(job(f"a{i}", "a", prompt=1_000, uncached_tokens=1_000 - 200 * i,
                              enqueued_at=1_000.0 + i))
        store.add_pending(job(f"b{i}", "b", prompt=1_000, uncached_tokens=1_000, enqueued_at=1_000.5 + i))
    ids = admit_ids(store, 1_010.0)
    assert [i[0] for i in ids] == ["a", "b"] * 4, (lookahead, ids)
    expected_a = ["a0", "a1", "a2", "a3"] if lookahead == 1 else ["a3", "a2", "a1", "a0"]
    assert [i for i in ids if i[0] == "a"] == expected_a


def test_cache_backend_and_fresh_cached() -> None:
    assert loc.cache_backend(0b110, None) == 1
    assert loc.cache_backend(0b110, 2) == 2
    assert loc.fresh_cached(3_000, 1_000, fill=100, filled=5_099, cache_tokens=5_000) == 2_000
    assert loc.fresh_cached(3_000, 1_000, fill=100, filled=5_100, cache_tokens=5_000) == 0
    assert loc.fresh_cached(3_000, 1_000, fill=0, filled=10**9, cache_tokens=0) == 2_000
    assert loc.choose([0, 5, 5, 3], 0.0, Locality(4)) == 1
    assert loc.choose([0, 5], 31.0, Locality(4, 30.0)) == 0
