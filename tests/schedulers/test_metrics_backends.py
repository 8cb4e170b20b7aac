"""Per-backend figures in the dispatcher's metrics (schedulers/metrics.py ``StoreCollector``), read
from a real Redis store with two backends, through prometheus-client's own parser: each series
carries its backend's configured name, the counters are that backend's own and the scrape
figures (health, hold, prefix cache hit rate) are each backend's own last scrape."""

from __future__ import annotations

import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleet.core.keys import Keys
from schedulers.metrics import StoreCollector
from schedulers.policy.limits import Limits
from schedulers.store.base import BackendLimits, PendingItem, StoreConfig
from schedulers.store.redis_store import RedisStore


def samples(store: RedisStore) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("backend", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_each_backend_has_its_own_labelled_series(redis_client: redis.Redis, key_prefix: str) -> None:
    config = StoreConfig.with_backends(
        [BackendLimits("big", Limits(max_num_seqs=4)), BackendLimits("small", Limits(max_num_seqs=2)),
         BackendLimits("never", Limits(max_num_seqs=2))],
        gate=False)
    store = RedisStore(redis_client, Keys(key_prefix), config, clock=lambda: 1_000.0)
    store.add_pending(PendingItem("a/1", "a", 100, 100, enqueued_at=1_000.0, eligible=0b10))
    store.add_pending(PendingItem("a/2", "a", 100, 100, enqueued_at=1_000.0, eligible=0b10))
    grants = [store.admit_next(1_000.0).grant for _ in range(2)]
    assert [g.backend for g in grants if g] == ["small", "small"]
    store.record_backend(999.0, "", {"healthy": "1", "prefix_cache_queries": "1000",
                                     "prefix_cache_hits": "250"}, "small")
    store.record_backend(999.0, "health", {"healthy": "0"}, "big")
    found = samples(store)
    assert found[("fleet_dispatch_backend_in_flight", "small")] == 2
    assert found[("fleet_dispatch_backend_in_flight", "big")] == 0
    assert (found[("fleet_dispatch_backend_cap", "big")], found[("fleet_dispatch_backend_cap", "small")]) == (4, 2)
    assert found[("fleet_dispatch_in_flight", "")] == 2  # the fleet's total
    assert (found[("fleet_backend_up", "big")], found[("fleet_backend_up", "small")]) == (0, 1)
    assert found[("fleet_backend_held", "big")] == 1
    assert found[("fleet_backend_prefix_cache_hit_rate", "small")] == 0.25
    assert ("fleet_backend_prefix_cache_hit_rate", "big") not in found  # its scrape had no counters
    # never scraped: down and held, so its alerts fire as for a backend that went away
    assert (found[("fleet_backend_up", "never")], found[("fleet_backend_held", "never")]) == (0, 1)
    assert ("fleet_backend_scrape_age_seconds", "never") not in found
