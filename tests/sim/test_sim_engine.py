"""Unit tests of the simulator's engine model: decode curve, scheduling, KV blocks, prefix cache.

The engine is driven directly (``advance_until``) with a fake clock, so these run in milliseconds
and everything is in simulated time.
"""

from __future__ import annotations

import pytest

from fleet.sim.engine import Engine, SeqState, Sequence
from fleet.sim.kvcache import block_hashes
from fleet.sim.profiles import DEPLOYMENT_DECODE_POINTS, DecodeCurve, get_profile


def make_engine(**overrides: object) -> Engine:
    profile = get_profile("qwen3-next-tp2pp2").with_overrides(**overrides)
    return Engine(profile, speed=1.0, clock=lambda: 0.0)


def seq(name: str, prompt: int = 200, total: int = 10_000, ids: list[int] | None = None,
        block: int = 1072) -> Sequence:
    hashes = block_hashes(ids, block) if ids is not None else []
    return Sequence(request_id=name, prompt_len=prompt, hashes=hashes, total=total)


def test_curve_hits_the_deployments_points_and_extrapolates() -> None:
    curve = DecodeCurve()
    for n, tok_s in DEPLOYMENT_DECODE_POINTS:
        assert curve.aggregate(n) == pytest.approx(tok_s)
    assert curve.aggregate(32) == pytest.approx(624.0)
    assert curve.aggregate(12) == pytest.approx((334 + 464) / 2)
    rates = [curve.aggregate(n) for n in range(1, 33)]
    assert rates == sorted(rates)
    assert curve.per_sequence(32) < curve.per_sequence(1)


@pytest.mark.parametrize("n", [1, 4, 8, 16, 24, 32])
def test_engine_decode_rate_matches_curve(n: int) -> None:
    engine = make_engine()
    seqs = [seq(f"r{i}", prompt=100) for i in range(n)]
    for s in seqs:
        engine.submit(s)
    engine.advance_until(1.0)  # prefill
    before, t0 = sum(s.generated for s in seqs), engine.t
    engine.advance_until(61.0)
    rate = (sum(s.generated for s in seqs) - before) / (engine.t - t0)
    assert rate == pytest.approx(DecodeCurve().aggregate(n), rel=0.02)


def test_running_capped_rest_waits_fifo() -> None:
    engine = make_engine()
    seqs = [seq(f"r{i}") for i in range(40)]
    for s in seqs:
        engine.submit(s)
    engine.advance_until(1.0)
    assert len(engine.running) == 32
    assert [s.request_id for s in engine.waiting] == [f"r{i}" for i in range(32, 40)]
    engine.abort(seqs[0])
    engine.advance_until(2.0)
    assert len(engine.running) == 32
    assert seqs[32].state is SeqState.RUNNING


def test_long_prefill_slows_everybody_else() -> None:
    engine = make_engine()
    runners = [seq(f"r{i}", prompt=100) for i in range(8)]
    for s in runners:
        engine.submit(s)
    engine.advance_until(2.0)
    base = sum(s.generated for s in runners)
    engine.advance_until(3.0)
    alone = sum(s.generated for s in runners) - base
    engine.submit(seq("long", prompt=60_000))
    base, t0 = sum(s.generated for s in runners), engine.t
    engine.advance_until(t0 + 1.0)
    beside = sum(s.generated for s in runners) - base
    assert beside < alone / 3
    engine.advance_until(t0 + 20.0)
    long_seq = next(s for s in engine.running if s.request_id == "long")
    assert long_seq.computed >= long_seq.prompt_len
    # 60K tokens at 8,000 tok/s of prefill plus the decode share: several seconds
    assert long_seq.first_token_t is not None
    assert 5.0 < long_seq.first_token_t - t0 < 12.0


def _first_tokens(**flags: object) -> dict[str, float]:
    """Two 60K prompts, then a 300-token one, submitted at once: when each got its first token."""
    engine = make_engine(**flags)
    seqs = [seq("long1", prompt=60_000), seq("long2", prompt=60_000), seq("short", prompt=300)]
    for s in seqs:
        engine.submit(s)
    engine.advance_until(40.0)
    assert all(s.first_token_t is not None for s in seqs)
    return {s.request_id: s.first_token_t for s in seqs}  # type: ignore[misc]


def test_chunked_prefill_flags_let_a_short_prompt_pass_long_ones() -> None:
    """vLLM's defaults: the short prompt waits behind both long prefills (oldest first). With two
    partial prefills, one of them long, and a 1,000-token threshold, the second long prompt waits
    for the first and the short one prefills beside it at once."""
    default = _first_tokens()
    assert default["short"] > default["long1"] and default["short"] > default["long2"] - 0.5
    limited = _first_tokens(max_num_partial_prefills=2, max_long_partial_prefills=1,
                            long_prefill_token_threshold=1_000)
    assert limited["short"] < 1.0 < limited["long1"] < limited["long2"]
    assert limited["long2"] - limited["long1"] > 5.0  # one long prefill at a time


def test_long_prefill_threshold_defaults_to_4_percent_with_partial_prefills() -> None:
    profile = get_profile("qwen3-next-tp2pp2")
    assert profile.long_prefill_threshold() == 0
    assert profile.with_overrides(max_num_partial_prefills=4).long_prefill_threshold() == 10_485
    assert profile.with_overrides(long_prefill_token_threshold=500).long_prefill_threshold() == 500


def test_abort_frees_slot_and_blocks_at_once() -> None:
    engine = make_engine()
    s = seq("a", prompt=5_000)
    engine.submit(s)
    engine.advance_until(2.0)
    assert engine.pool.used == engine.pool.blocks_for(s.computed)
    engine.abort(s)
    assert engine.pool.used == 0 and not engine.running
    assert s.state is SeqState.ABORTED and s.closed


def test_pool_exhaustion_preempts_newest_and_recomputes() -> None:
    engine = make_engine(kv_pool_tokens=10 * 1072)
    a, b = seq("a", prompt=4_000, total=3_000), seq("b", prompt=4_000, total=3_000)
    engine.submit(a)
    engine.submit(b)
    engine.advance_until(300.0)
    assert engine.stats.preemptions >= 1
    assert a.state is SeqState.FINISHED and b.state is SeqState.FINISHED
    assert a.generated == 3_000 and b.generated == 3_000
    assert engine.pool.used == 0


def test_prefix_cache_whole_blocks_only() -> None:
    # The deployment: a ~600-token prefix sent 3 times gives no hit; ~3,000 tokens gives 2 blocks x 2.
    for prompt, expected in ((600, 0), (3_000, 4_288)):
        engine = make_engine()
        ids = list(range(prompt))
        for i in range(3):
            s = seq(f"p{i}", prompt=prompt, total=5, ids=ids)
            engine.submit(s)
            engine.advance_until(engine.t + 30.0)
            assert s.state is SeqState.FINISHED
        assert engine.cache.hits == expected
        assert engine.cache.queries == 3 * prompt


def test_prefix_hit_never_covers_last_token() -> None:
    engine = make_engine()
    ids = list(range(2 * 1072))
    for i in range(2):
        engine.submit(seq(f"p{i}", prompt=len(ids), total=5, ids=ids))
        engine.advance_until(engine.t + 30.0)
    assert engine.cache.hits == 1072  # at most prompt_len - 1 tokens: one block, not two


def test_hold_delays_first_token_in_simulated_time() -> None:
    engine = make_engine()
    s = seq("slow", prompt=100, total=50)
    s.slow_first_s = 40.0
    engine.submit(s)
    engine.advance_until(100.0)
    assert s.first_token_t is not None and s.first_token_t >= 40.0
    assert s.state is SeqState.FINISHED


def test_queue_time_and_ttft_never_negative_after_idle_time() -> None:
    """An idle engine's step clock lags the wall clock; a request arriving then was admitted at once."""
    now = [0.0]
    engine = Engine(get_profile("qwen3-next-tp2pp2"), speed=1.0, clock=lambda: now[0])
    engine.advance_until(1.0)
    now[0] = 50.0  # idle for a while, as between bursts of a long run
    s = seq("late", prompt=100, total=5)
    engine.submit(s)
    engine.advance_until(60.0)
    assert s.state is SeqState.FINISHED
    assert s.admitted_t is not None and s.first_token_t is not None
    assert s.admitted_t - s.arrival_t >= 0
    assert s.first_token_t - s.arrival_t >= 0


def test_every_prefilled_prompt_counts_prompt_tokens() -> None:
    """Prompts shorter than one KV block have no block hashes; they are prompts all the same."""
    engine = make_engine()
    short, long_ = seq("short", prompt=100, total=3), seq("long", prompt=3_000, total=3, ids=list(range(3_000)))
    engine.submit(short)
    engine.submit(long_)
    engine.advance_until(30.0)
    assert short.state is SeqState.FINISHED and long_.state is SeqState.FINISHED
    assert engine.stats.prompt_tokens == 3_100
