"""Quotas inside admission (schedulers/policy/quota.py, docs/usage.md "Quotas"), on the in-memory
twin and on Redis (Lua): a grant reserves its worst case in the minute, day and month of its
admission; a candidate that does not fit is passed over (reason ``quota``) while other projects
go on; settling gives back what the turn did not spend, once; the in-flight and request caps;
several stores on one Redis never pass a quota together."""

from __future__ import annotations

from dataclasses import replace

import pytest
import redis

from fleet.core.keys import Keys
from schedulers.policy.quota import Quota, Windows, check, remaining
from schedulers.store.redis_store import RedisStore
from tests.support.store_cases import BASE, FakeClock, StoreFactory, admit_ids, job, make_store

__all__ = ["make_store"]

NOW = 1_800_000_030.0  # 30 s into a UTC minute


def quota_config(**quotas: Quota):
    """BASE with room for every job of these tests (16 sequences, a large KV pool)."""
    return replace(BASE, quotas=dict(quotas),
                   limits=replace(BASE.limits, max_num_seqs=16, kv_budget_tokens=10**6))


def test_a_project_over_its_minute_quota_waits_and_others_go_on(make_store: StoreFactory) -> None:
    # each job reserves 500 + 400 = 900; 2,000 a minute holds two of them
    store = make_store(quota_config(a=Quota(tokens_per_minute=2000)))
    for i in range(4):
        store.add_pending(job(f"a{i}", project="a"))
    store.add_pending(job("b9", project="b"))
    ids = admit_ids(store, NOW)
    assert sorted(ids) == ["a0", "a1", "b9"]
    held = store.admit_next(NOW)
    assert held.hold_reason == "quota"
    assert held.retry_in_s == pytest.approx(30.0)
    assert store.quota_usage("a", NOW).tokens_minute == 1800
    # the next minute has room again: the waiting jobs kept their place
    assert admit_ids(store, NOW + 30.0) == ["a2", "a3"]


def test_settle_gives_back_what_the_turn_did_not_spend_once(make_store: StoreFactory) -> None:
    store = make_store(quota_config(a=Quota(tokens_per_minute=2000, tokens_per_day=10**6)))
    for i in range(3):
        store.add_pending(job(f"a{i}", project="a"))
    grants = [r.grant for r in store.admit_many(NOW, 8) if r.grant]
    assert [g.job_id for g in grants] == ["a0", "a1"]
    first = grants[0]
    assert not store.settle(first.job_id, first.fence + 1, 100)  # another grant's fence
    assert store.settle(first.job_id, first.fence, 100)
    assert not store.settle(first.job_id, first.fence, 100)  # settled already
    assert store.quota_usage("a", NOW).tokens_minute == 900 + 100
    assert store.quota_usage("a", NOW).tokens_day == 1000
    assert store.quota_usage("a", NOW).tokens_month == 0  # no month limit: not counted
    assert [r.grant.job_id for r in store.admit_many(NOW, 8) if r.grant] == ["a2"]


def test_settle_charges_what_the_turn_spent_beyond_its_reservation(make_store: StoreFactory) -> None:
    """A prompt the fleet counted short: the window holds what was spent, and holds the next."""
    store = make_store(quota_config(a=Quota(tokens_per_minute=2000)))
    store.add_pending(job("a0", project="a"))
    store.add_pending(job("a1", project="a"))
    grant = store.admit_next(NOW).grant
    assert store.settle(grant.job_id, grant.fence, 1500)
    assert store.quota_usage("a", NOW).tokens_minute == 1500
    assert store.admit_next(NOW).hold_reason == "quota"


def test_settle_changes_only_the_windows_its_reservation_wrote(make_store: StoreFactory) -> None:
    """A day limit added between a grant and its settle (a restart with new settings): the day's
    counter, which the reservation never added to, gets nothing back."""
    store = make_store(quota_config(a=Quota(requests_per_minute=10)))
    store.add_pending(job("a0", project="a"))
    grant = store.admit_next(NOW).grant
    store.config = replace(store.config, quotas={"a": Quota(requests_per_minute=10, tokens_per_day=5000)})
    assert not store.settle(grant.job_id, grant.fence, 0)  # it reserved no tokens: nothing to settle
    assert store.quota_usage("a", NOW).tokens_day == 0
    store.config = replace(store.config, quotas={"a": Quota(tokens_per_minute=2000)})
    store.add_pending(job("a1", project="a"))
    second = store.admit_next(NOW).grant
    store.config = replace(store.config, quotas={"a": Quota(tokens_per_minute=2000, tokens_per_day=5000)})
    assert store.settle(second.job_id, second.fence, 0)
    usage = store.quota_usage("a", NOW)
    assert (usage.tokens_minute, usage.tokens_day) == (0, 0)


def test_a_grant_of_a_project_without_quota_reserves_nothing(make_store: StoreFactory) -> None:
    store = make_store(quota_config(a=Quota(tokens_per_minute=2000)))
    store.add_pending(job("b0", project="b"))
    grant = store.admit_next(NOW).grant
    assert not store.settle(grant.job_id, grant.fence, 1)
    assert store.quota_usage("b", NOW).tokens_minute == 0


def test_requests_per_minute_and_the_in_flight_cap(make_store: StoreFactory) -> None:
    store = make_store(quota_config(a=Quota(max_in_flight=2), c=Quota(requests_per_minute=1)))
    for i in range(3):
        store.add_pending(job(f"a{i}", project="a"))
        store.add_pending(job(f"c{i}", project="c"))
    grants = {r.grant.job_id: r.grant for r in store.admit_many(NOW, 8) if r.grant}
    assert sorted(grants) == ["a0", "a1", "c0"]
    assert store.admit_next(NOW).hold_reason == "quota"
    assert store.quota_usage("a", NOW).in_flight == 2
    store.release("a0", grants["a0"].fence)  # a turn of a ends: its seat is free
    assert [r.grant.job_id for r in store.admit_many(NOW, 8) if r.grant] == ["a2"]


def test_cost_rates_the_day_window_and_its_reset(make_store: StoreFactory) -> None:
    # output tokens cost 2: each job reserves 500 + 2 x 400 = 1,300; 3,000 a day holds two
    store = make_store(quota_config(a=Quota(tokens_per_day=3000, cost_output=2.0)))
    for i in range(3):
        store.add_pending(job(f"a{i}", project="a"))
    assert admit_ids(store, NOW) == ["a0", "a1"]
    held = store.admit_next(NOW + 120)
    windows = Windows.at(NOW + 120)
    assert held.hold_reason == "quota"
    assert held.retry_in_s == pytest.approx(windows.day_end - (NOW + 120))
    assert admit_ids(store, windows.day_end + 1) == ["a2"]


def test_check_and_the_headers_figures() -> None:
    q = Quota(tokens_per_minute=1000, requests_per_minute=5, cost_cached=0.5)
    assert q.reserve(100, 50) == 150
    assert q.spent(100, 60, 10) == 40 + 30 + 10
    windows = Windows.at(NOW)
    from schedulers.policy.quota import Usage
    assert check(q, Usage(tokens_minute=900), 150, windows) == ("quota", pytest.approx(30.0))
    assert check(q, Usage(tokens_minute=850), 150, windows) is None
    left = remaining(q, Usage(tokens_minute=850, requests_minute=2), windows)
    assert (left.remaining_tokens, left.remaining_requests, left.reset_s) == (150, 3, pytest.approx(30.0))
    assert q.never_fits(1001) and not q.never_fits(1000)


def test_month_window_names_and_ends() -> None:
    w = Windows.at(1_798_761_599.0)  # 2026-12-31T23:59:59Z
    assert (w.day, w.month) == ("20261231", "202612")
    assert w.month_end == w.day_end == 1_798_761_600.0


def test_several_dispatchers_never_pass_the_quota_together(redis_client: redis.Redis, key_prefix: str) -> None:
    """Three stores on one Redis, admitting in turn with settles between: the minute's reservations
    never pass it, whoever admits."""
    config = quota_config(a=Quota(tokens_per_minute=5000))
    stores = [RedisStore(redis_client, Keys(key_prefix), config, clock=FakeClock(NOW)) for _ in range(3)]
    for i in range(30):
        stores[0].add_pending(job(f"a{i}", project="a"))
    granted = []
    for rnd in range(6):
        for store in stores:
            granted += [r.grant for r in store.admit_many(NOW, 8) if r.grant]
        assert stores[rnd % 3].quota_usage("a", NOW).tokens_minute <= 5000
        for grant in granted[-2:]:
            stores[(rnd + 1) % 3].settle(grant.job_id, grant.fence, 300)
    # 5 reservations fit (4,500); each settle frees 600, so more go, never past the quota
    assert len(granted) > 5
    assert stores[1].quota_usage("a", NOW).tokens_minute <= 5000


def test_the_metrics_show_each_window_against_its_limit_and_the_holds(make_store: StoreFactory) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from schedulers.metrics import DispatcherMetrics

    store = make_store(quota_config(a=Quota(tokens_per_minute=2000, max_in_flight=5)))
    for i in range(3):
        store.add_pending(job(f"a{i}", project="a"))
    store.admit_many(NOW, 8)  # two granted, the third held once
    store.admit_many(NOW, 8)  # held again
    text = generate_latest(DispatcherMetrics(store).registry).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    # the figures are read at scrape time (wall clock): the grants' minute is long past
    assert samples[("fleet_quota_limit", (("project", "a"), ("window", "tokens_minute")))] == 2000
    assert samples[("fleet_quota_used", (("project", "a"), ("window", "in_flight")))] == 2
    assert samples[("fleet_quota_held_total", (("project", "a"),))] == 2
    assert store.snapshot().quota_held == {"a": 2}


def test_a_quota_lowered_below_waiting_jobs_ends_them_at_the_next_start(make_store: StoreFactory) -> None:
    """A restart with a smaller quota: the waiting jobs (in line or deferred) it can never admit end
    E_QUOTA_EXCEEDED, envelope first and then out of the store, so they no longer head their
    project's queue for ever; the ones that fit, and other projects', stay in line."""
    from fleet.core.codes import Code
    from fleet.worker.dispatch import end_never_fitting

    class Results:
        def __init__(self) -> None:
            self.published: list = []

        def publish(self, envelope) -> bool:  # type: ignore[no-untyped-def]
            self.published.append(envelope)
            return True

        def job_record(self, ref: str) -> dict[str, str]:
            return {"origin": "gateway"} if ref == "a9" else {}

    # a day's quota of 1,000: 500 + 400 fits, 900 + 400 never does
    store = make_store(quota_config(a=Quota(tokens_per_day=1000)))
    store.add_pending(job("a1", project="a", prompt=900))
    store.add_pending(job("a2", project="a"))
    store.add_pending(job("a3", project="a", prompt=900, not_before=NOW + 60))  # deferred
    store.add_pending(job("b1", project="b", prompt=900))
    store.add_pending(job("a9", project="a", prompt=900))  # a gateway request: the gateway's to answer
    results = Results()
    assert sorted(end_never_fitting(store, results)) == ["a1", "a3"]  # type: ignore[arg-type]
    assert sorted(e.job_id for e in results.published) == ["a1", "a3"]
    assert all(e.code == Code.E_QUOTA_EXCEEDED and "quota was lowered" in e.message for e in results.published)
    assert sorted(j for j, *_ in store.waiting_items("a")) == ["a2", "a9"]
    assert sorted(admit_ids(store, NOW)) == ["a2", "b1"]
