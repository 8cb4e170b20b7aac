"""``fleet bench backends`` on a small backlog (fleet/bench/backends.py): both stores admit (the
bench's own loop asserts every round granted), the figures are there and the bench leaves no key
behind; and a short routing comparison on real fleets (fleet/bench/routing.py)."""

from __future__ import annotations

import pytest
import redis

from fleet.bench.backends import many_backends_cost
from fleet.bench.routing import markdown, oracle_hit_rate, routing_bench


def test_the_oracle_sends_each_request_where_its_longest_prefix_is_cached() -> None:
    """Two prompts of 3 blocks of 10 tokens, A B A B A: the oracle keeps each on its own server
    (B goes to the one that took fewer), so every repeat hits its 2 servable blocks (the last
    prompt token is never served from cache); one server of 3 blocks' room evicts in turn."""
    a = {"blocks": [1, 2, 3], "prompt_tokens": 30}
    b = {"blocks": [7, 8, 9], "prompt_tokens": 30}
    log = [{**e, "received_at": float(t)} for t, e in enumerate([a, b, a, b, a])]
    rate, placed = oracle_hit_rate([log[:2], log[2:]], pool_tokens=30, block_tokens=10)
    assert placed == 5 and rate == 60 / 150  # 3 repeats x 20 tokens of 5 x 30
    rate_one, _ = oracle_hit_rate([log], pool_tokens=30, block_tokens=10)
    assert rate_one == 0.0  # one cache of 3 blocks: A and B evict each other


def test_the_many_backend_cost_runs_both_stores_and_cleans_up(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    before = {key for key in client.scan_iter(match="bench-*")}
    figures = many_backends_cost(redis_url, jobs=2_000, backends=4, decisions=64, rounds=2)
    assert figures["backends"] == 4 and figures["backlog jobs"] == 2_000
    assert figures["admission pairs/s, 1 backend (baseline)"] > 0 and figures["admission pairs/s, 4 backends"] > 0
    assert 100 < figures["Redis bytes per pending job, 4 backends"] < 1_000
    assert {key for key in client.scan_iter(match="bench-*")} == before


@pytest.mark.slow
def test_the_routing_comparison_runs_real_fleets_and_accounts_for_every_job(redis_url: str) -> None:
    """A short routing run on two simulators and its one-server oracle: every job has its one
    envelope, the figures come from the simulators' counters, both replicas served, and no key
    of either fleet is left behind."""
    client = redis.Redis.from_url(redis_url)
    runs = routing_bench(redis_url, sizes=(2,), loads=(0.5,), seats=4, duration_s=6.0, speed=40.0,
                         policies=("least_loaded", "fleet", "first_token"), one_server=True)
    assert [r.policy for r in runs] == ["one server", "least_loaded", "fleet", "first_token"]
    for run in runs:
        assert run.jobs > 0 and run.lost == 0, run
        assert 0.0 < run.hit_rate < 1.0 and run.ttft_p90 >= run.ttft_p50 > 0 and run.tokens_per_s > 0, run
        assert 0.0 < run.jain <= 1.0, run
        assert run.server_ttft_p90 >= run.server_ttft_p50 > 0, run  # the servers' own, simulated s
        assert run.server_ttft_p90_others > 0, run
        # the oracle placed this run's own requests (at least one per job), from the servers' logs
        assert run.oracle_requests >= run.jobs and 0.0 < run.oracle_hit_rate < 1.0, run
    assert runs[1].jain == 1.0  # least-loaded against itself
    for run in runs[1:]:
        assert sorted(run.per_backend) == ["gpu-a", "gpu-b"] and sum(run.per_backend.values()) == run.jobs
    assert list(runs[0].per_backend) == ["gpu-a"]
    table = markdown(runs)
    assert table.count("\n") == 5 and "| 2 | 50% | fleet |" in table and "| 2 | 50% | first_token |" in table
    for run in runs:
        assert run.prefix and not list(client.scan_iter(match=f"{run.prefix}*"))
