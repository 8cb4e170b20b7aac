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


def test_an_aged_first_job_goes_itself_and_lends_its_age_to_no_other(make_store: StoreFactory) -> None:
    """Project a keeps one old uncached job at the head of its batch line and cached jobs behind
    it. Its line's age (its first job's) ranks it with the interactive work once aged; that first
    job is then the one the line offers, so the cached jobs behind it do not ride its age ahead of
    project b's batch work (with locality they would take every grant a got, and b none of 16)."""
    store = make_store(replace(config(lookahead=4, seqs=100, cache=0), aging_s=60.0,
                               limits=replace(BASE.limits, max_num_seqs=100, kv_budget_tokens=10**9)))
    store.add_pending(job("a_anchor", "a", prompt=1_000, uncached_tokens=1_000, enqueued_at=1_000.0))
    for i in range(8):
        for project in ("a", "b"):
            store.add_pending(job(f"{project}{i}", project, prompt=1_000, uncached_tokens=10,
                                  enqueued_at=1_095.0 + i / 100))
        store.add_pending(ijob(f"c{i}", project="c", prompt=1_000, uncached_tokens=10, enqueued_at=1_095.0 + i / 100))
    order = [grant(store, 1_100.0)[0] for _ in range(24)]
    assert order[0] == "a_anchor"
    assert [i for i in order if i[0] == "a"][:2] == ["a_anchor", "a0"]
    # after the anchor, a's batch line is young again: b's share is as a's
    assert sum(i[0] == "b" for i in order) >= sum(i[0] == "a" for i in order) - 2, order


def test_a_job_put_back_in_line_is_offered_once(make_store: StoreFactory) -> None:
    """j2, granted from behind the head and put back in line at once with its old place, is one
    job in its queue: the next grant is j3 (the most cached now), not j2 a second time."""
    store = make_store(config(lookahead=3, seqs=4, cache=0))
    store.add_pending(job("j1", prompt=3_000, uncached_tokens=3_000))
    store.add_pending(job("j2", prompt=3_000, uncached_tokens=100))
    j2 = grant(store, 1_010.0)
    assert j2[0] == "j2"
    assert store.readmit("j2", j2[1], 100, 1_010.0, 1_010.0)
    store.add_pending(job("j3", prompt=3_000, uncached_tokens=0))
    assert grant(store, 1_011.0)[0] == "j3"
    assert grant(store, 1_011.0)[0] == "j2"


def test_an_estimate_gone_stale_within_one_admission_call_counts_whole(make_store: StoreFactory) -> None:
    """One call grants x1 (6,000 uncached, past the 5,000-token room) then y1, whose 2,800 cached
    tokens went stale with x1: y1 takes its whole 3,000-token prompt from the bucket and the
    filled count, in both stores (Redis counted its queue-time 200 before)."""
    base = config(lookahead=2, seqs=8)
    store = make_store(replace(base, limits=replace(base.limits, prefill_tokens_per_s=1.0,
                                                     prefill_burst_tokens=10_000)))
    store.add_pending(job("y1", project="b", prompt=3_000, uncached_tokens=200, enqueued_at=1_002.0))
    store.add_pending(ijob("x1", project="a", prompt=6_000, uncached_tokens=6_000, enqueued_at=1_001.0))
    results = store.admit_many(1_010.0, 3)
    assert [r.grant.job_id for r in results if r.grant] == ["x1", "y1"]
    store.add_pending(job("z1", project="c", prompt=1_500, uncached_tokens=1_500, enqueued_at=1_003.0))
    # bucket 10,000 - 6,000 - 3,000 = 1,000 < 1,500 (with y1's 200 it would be 3,800: z1 would go)
    assert store.admit_next(1_010.0).hold_reason == "bucket"


def test_cache_backend_and_fresh_cached() -> None:
    assert loc.cache_backend(0b110, None) == 1
    assert loc.cache_backend(0b110, 2) == 2
    assert loc.fresh_cached(3_000, 1_000, fill=100, filled=5_099, cache_tokens=5_000) == 2_000
    assert loc.fresh_cached(3_000, 1_000, fill=100, filled=5_100, cache_tokens=5_000) == 0
    assert loc.fresh_cached(3_000, 1_000, fill=0, filled=10**9, cache_tokens=0) == 2_000
    assert loc.choose([0, 5, 5, 3], 0.0, Locality(4)) == 1
    assert loc.choose([0, 5], 31.0, Locality(4, 30.0)) == 0
    assert loc.choose([0, 5], 59.0, Locality(4), aging_s=60.0) == 1
    assert loc.choose([0, 5], 60.0, Locality(4), aging_s=60.0) == 0
