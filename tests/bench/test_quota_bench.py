"""``fleet bench quota`` (fleet/bench/quota.py) in small: the cost part admits on both stores and
leaves no key behind; a short exactness run on real processes (one gateway, one dispatcher)
holds every minute within its quota, finds every answered request in the simulator's log, and
its unlimited project served."""

from __future__ import annotations

import pytest
import redis

from fleet.bench.quota import cache_latency, minutes_markdown, quota_cost, quota_exactness


def test_the_quota_cost_runs_both_stores_and_cleans_up(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    before = set(client.scan_iter(match="bench-*"))
    figures = quota_cost(redis_url, jobs=2_000, decisions=64, rounds=2)
    assert figures["admission pairs/s, no quotas (baseline)"] > 0
    assert figures["admission pairs/s, quotas on every project"] > 0
    assert figures["admit + settle + release /s, quotas on"] > 0
    assert 100 < figures["Redis bytes per pending job, quotas on"] < 1_000
    assert set(client.scan_iter(match="bench-*")) == before


@pytest.mark.slow
def test_a_short_exactness_run_holds_every_minute_within_its_quota(redis_url: str) -> None:
    figures = quota_exactness(redis_url, quotas={"reports": 4_000, "translate": 2_000}, clients=3,
                              gateways=1, dispatchers=1, duration_s=8.0, baseline_s=3.0, speed=40.0)
    assert figures["minutes"], figures
    assert figures["worst served / quota"] <= 1.0
    assert figures["requests answered (quota run)"] == figures["of them found in the simulator's log"] > 0
    assert figures["triage output tok/s, with quotas"] > 0
    assert "| reports |" in minutes_markdown(figures)


@pytest.mark.slow
def test_the_cache_latency_bench_answers_every_repeat_from_the_cache(redis_url: str) -> None:
    figures = cache_latency(redis_url, requests=2, speed=40.0, think=20, answer=10)
    assert figures["repeats answered from the cache"] == figures["request pairs"] == 4
    assert figures["model requests the simulator saw"] == 4  # the misses only
    assert figures["admissions made for the repeats"] == 0
    assert figures["cache hit p50 ms"] > 0 and figures["model turn (miss) p50 ms"] > 0
    # the same as queue jobs: each repeat ends at prep
    assert figures["queue jobs: repeats ended from the cache"] == 4
    assert figures["queue jobs: model requests the simulator saw"] == 4
    assert figures["queue jobs: admissions made for the repeats"] == 0
