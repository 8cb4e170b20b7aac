"""``fleet bench chaos`` (fleet/bench/chaos.py): a tiny kill storm through real processes holds the
invariants the bench reports (exactly one envelope per job, the backend never above the cap, no
process exiting by itself), and the bench's own accounting can tell a broken round from a good one.
No timing is asserted."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from fleet.bench.chaos import ROUNDS, ChaosFleet, RoundResult, chaos_bench, markdown, plans
from fleet.bench.chaosgateway import GatewayAccount


@pytest.mark.slow
def test_a_small_kill_storm_keeps_every_invariant() -> None:
    [result] = chaos_bench(["storm"], jobs=24, cap=4, speed=20.0, think=200, answer=20, kills=3,
                           stall_s=30.0)
    assert result.error == ""
    assert (result.jobs, result.envelopes) == (24, 24)
    assert result.lost == [] and result.stuck == [] and result.doubled == []
    assert 0 < result.max_running <= 4
    assert not result.exited
    assert len(result.recoveries) == 3
    assert len(result.all_final) == 3 and None not in result.all_final  # every job ended
    assert result.verdict() == "ok"
    assert sum(result.codes.values()) == 24
    assert {"dispatcher-0", "infer-0", "prep-0", "sim", "redis"} <= set(result.rss_mb)


@pytest.mark.slow
def test_a_backend_killed_during_a_storm_keeps_every_invariant_on_both() -> None:
    """Two backends of 4 sequences: the second simulator is killed, three kills hit the fleet
    while it is down, it comes back: every job one envelope, no simulator ever ran more than 4,
    no process exited by itself (the killed simulator is not an exit)."""
    [result] = chaos_bench(["backends-storm"], jobs=24, cap=4, speed=20.0, think=200, answer=20, kills=3,
                           stall_s=30.0)
    assert result.error == ""
    assert (result.jobs, result.envelopes) == (24, 24)
    assert result.lost == [] and result.stuck == [] and result.doubled == []
    assert 0 < result.max_running <= 4
    assert not result.exited
    assert len(result.all_final) == 4 and None not in result.all_final
    # the gateway's streaming clients through the same storm: every stream ended with a code,
    # each had exactly one envelope with that code, and nothing was left in the store
    gateway = result.gateway
    assert gateway is not None and gateway.requests > 0, gateway
    assert (gateway.unended, gateway.unmatched, gateway.left) == (0, 0, 0), gateway
    assert result.verdict() == "ok", gateway
    assert sum(gateway.codes.values()) == gateway.requests
    assert gateway.tool_calls > 0  # the editor's clients were answered with their tool calls
    # the first simulator is sampled throughout; the killed one only once a sampling second (1 s)
    # passed after its return, which a loaded machine may end the round before
    assert "sim" in result.rss_mb


@pytest.mark.slow
def test_a_redis_without_persistence_loses_its_jobs_and_nothing_else() -> None:
    # the bench's own sizes: the backend is busy when Redis goes (a tiny round may be idle by then)
    [result] = chaos_bench(["redis-none-kill9"], stall_s=10.0)
    assert result.error == ""
    assert result.lost and not result.stuck and not result.doubled
    assert result.envelopes + len(result.lost) == 80
    assert not result.exited and result.max_running <= 8
    # the lost jobs never run again: they are no backend level to wait for ("never" before)
    assert None not in result.recoveries
    assert result.verdict() == "loss (no persistence)"


def test_every_round_has_a_plan_and_unknown_rounds_are_refused() -> None:
    assert set(plans(kills=1)) == set(ROUNDS)
    with pytest.raises(ValueError, match="unknown rounds"):
        chaos_bench(["storm", "meteor"])


def test_the_verdict_names_what_broke() -> None:
    good = RoundResult("storm", "x", jobs=3, envelopes=3, max_running=4, cap=4)
    assert good.verdict() == "ok"
    broken = RoundResult("redis-aof-kill9", "x", jobs=3, envelopes=1, lost=["a"], stuck=["b"],
                         stuck_states=Counter(pending=1), doubled=["c"], max_running=5, cap=4,
                         exited=Counter({"infer-0": 1}))
    assert broken.verdict() == ("FAIL: 2 missing (stuck: pending 1), 1 doubled, cap 4 exceeded, "
                                "1 process exits")
    # a Redis without persistence loses what it held: reported as such, not as a fleet failure
    assert RoundResult("redis-none-kill9", "x", lost=["a"], cap=4).verdict() == "loss (no persistence)"
    assert RoundResult("storm", "x", error="TimeoutError: no").verdict() == "error: TimeoutError: no"
    streams = RoundResult("backends-storm", "x", cap=4, gateway=GatewayAccount(requests=5, unended=1, unmatched=2,
                                                                             left=3))
    assert streams.verdict() == ("FAIL: 1 gateway streams without an end, 2 gateway envelopes missing, "
                                 "doubled or disagreeing, 3 entries left in the store")
    assert "| storm |" in markdown([good])


def test_the_longest_wait_after_a_fault_counts_the_jobs_open_then() -> None:
    """From the fault's end to the first envelope of the last job open then; a job that never had
    one makes it 'never' (None); none open: 0."""
    cf = SimpleNamespace(seen={("r", b"1"): ("a", "OK", 5.0), ("r", b"2"): ("b", "OK", 12.0),
                               ("r", b"3"): ("b", "OK", 14.0), ("r", b"4"): ("c", "OK", 9.0)})
    assert ChaosFleet.last_final(cf, ["a", "b", "c"], 6.0) == 6.0  # type: ignore[arg-type]
    assert ChaosFleet.last_final(cf, ["a", "d"], 6.0) is None  # type: ignore[arg-type]
    assert ChaosFleet.last_final(cf, ["a"], 6.0) == 0.0  # type: ignore[arg-type]
    row = markdown([RoundResult("storm", "x", jobs=1, envelopes=1, cap=4, all_final=[6.0, None])])
    assert "| 6.0, never |" in row
