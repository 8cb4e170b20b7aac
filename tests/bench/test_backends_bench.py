"""``fleet bench backends`` on a small backlog (fleet/bench/backends.py): both stores admit (the
bench's own loop asserts every round granted), the figures are there and the bench leaves no key
behind."""

from __future__ import annotations

import redis

from fleet.bench.backends import many_backends_cost


def test_the_many_backend_cost_runs_both_stores_and_cleans_up(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    before = {key for key in client.scan_iter(match="bench-*")}
    figures = many_backends_cost(redis_url, jobs=2_000, backends=4, decisions=64, rounds=2)
    assert figures["backends"] == 4 and figures["backlog jobs"] == 2_000
    assert figures["admission pairs/s, 1 backend (baseline)"] > 0 and figures["admission pairs/s, 4 backends"] > 0
    assert 100 < figures["Redis bytes per pending job, 4 backends"] < 1_000
    assert {key for key in client.scan_iter(match="bench-*")} == before
