"""The admission store contract, run against the in-memory twin and against Redis (Lua).

A fake clock drives every time-based rule; nothing sleeps. The hypothesis state machine throws
random sequences of submit (with or without a deadline), admit, claim, renew, release, requeue,
crash, expire, stale-fence release, cancel and deadline expiry at both stores and checks after
every step that no limit is exceeded, no job is lost, no lease has two owners and the counters
equal the sum over live leases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from fleet.core.keys import Keys
from schedulers.dispatcher import expire_deadlines
from schedulers.policy.limits import Limits, kv_tokens
from schedulers.store.base import PendingItem, StoreConfig
from schedulers.store.memory_store import MemoryStore
from schedulers.store.redis_store import RedisStore, max_block_s
from tests.support.store_cases import BASE, FakeClock, StoreFactory, admit_ids, ijob, job, limits, make_store
from tests.support.testenv import TEST_REDIS_URL, delete_prefix

__all__ = ["make_store"]  # the parametrised fixture, memory and Redis


# -- limits ----------------------------------------------------------------------------------
def test_sequence_cap(make_store: StoreFactory) -> None:
    store = make_store()
    for i in range(6):
        store.add_pending(job(f"j{i}"))
    assert admit_ids(store, 1_010.0) == ["j0", "j1", "j2", "j3"]
    result = store.admit_next(1_010.0)
    assert result.grant is None and result.hold_reason == "seqs"
    assert store.snapshot().in_flight == 4


def test_a_gateway_only_round_passes_queued_jobs_over_while_no_worker_is_live(
    make_store: StoreFactory,
) -> None:
    """The round a dispatcher runs while its worker gate holds grants no queued job (only gateway
    requests, which the memory store never holds): a 'no_workers' hold, counted, the job kept."""
    store = make_store()
    store.add_pending(job("j1"))
    assert [r.hold_reason for r in store.admit_gateway_only(1_010.0, 8)] == ["no_workers"]
    assert store.snapshot().holds == {"no_workers": 1}
    assert store.snapshot().pending == {"a": {"batch": 1}}

def test_kv_budget_counts_whole_blocks(make_store: StoreFactory) -> None:
    store = make_store(limits(kv_budget_tokens=5_000))
    store.add_pending(job("j0", prompt=2_001, new=0))  # 3 blocks = 3,000 tokens
    store.add_pending(job("j1", prompt=1_500, new=600))  # 3 blocks: 6,000 > 5,000
    assert admit_ids(store, 1_010.0) == ["j0"]
    assert store.snapshot().reserved_kv_tokens == 3_000
    assert store.admit_next(1_010.0).hold_reason == "kv"


def test_job_bigger_than_the_budget_goes_alone(make_store: StoreFactory) -> None:
    store = make_store(limits(kv_budget_tokens=5_000))
    store.add_pending(job("big", prompt=9_000, new=0))
    store.add_pending(job("j2"))
    first = store.admit_next(1_010.0).grant
    assert first is not None and first.job_id == "big" and first.kv_tokens == 9_000
    assert store.admit_next(1_010.0).hold_reason == "kv"
    assert store.release("big", first.fence)
    assert admit_ids(store, 1_011.0) == ["j2"]


def test_long_cap_lets_short_jobs_pass(make_store: StoreFactory) -> None:
    store = make_store()
    store.add_pending(job("l1", prompt=12_000, new=0))
    store.add_pending(job("l2", prompt=12_000, new=0))
    store.add_pending(job("s3"))
    granted = admit_ids(store, 1_010.0)
    assert granted == ["l1", "s3"]  # l2 waits: one long at a time, but s3 need not
    snap = store.snapshot()
    assert snap.long_in_flight == 1 and snap.pending == {"a": {"batch": 1}}


def test_a_long_prefill_runs_beside_few_short_sequences_and_alone_after(make_store: StoreFactory) -> None:
    """Quiet long prefills: the long prompt waits while more than one short job is in flight
    (shorts pass it meanwhile), goes once they are down to one, and then nothing is admitted
    until its prefill (12,000 tokens at 1,000 tok/s: 12 s) should be done."""
    store = make_store(limits(max_num_seqs=10, max_long=2, long_prefill_tokens_per_s=1_000.0,
                              short_beside_long=1, hol_bypass_s=100.0))
    for i in range(2):
        store.add_pending(ijob(f"s{i}", project="b"))
    assert admit_ids(store, 1_010.0) == ["s0", "s1"]
    store.add_pending(ijob("l2", prompt=12_000, new=0))
    store.add_pending(ijob("s3", project="b"))
    held = store.admit_next(1_010.0)  # l2 first in fair order, two shorts in flight: s3 passes it
    assert held.grant is not None and held.grant.job_id == "s3"
    assert store.admit_next(1_010.0).hold_reason == "prefill"
    for name in ("s0", "s1"):
        assert store.release(name, store.lease_fences()[name])
    assert admit_ids(store, 1_011.0) == ["l2"]  # one short in flight now
    store.add_pending(ijob("s4", project="b"))
    store.add_pending(ijob("l5", project="c", prompt=12_000, new=0))
    held = store.admit_next(1_015.0)
    assert held.hold_reason == "prefill" and held.retry_in_s == pytest.approx(8.0)
    assert admit_ids(store, 1_023.0) == ["s4"]  # l5 waits: two shorts in flight again


def test_a_long_prompt_kept_waiting_by_short_ones_reserves_its_turn(make_store: StoreFactory) -> None:
    """Shorts keep coming; after hol_bypass_s the long prompt first in line stops them, the
    shorts in flight drain, and it goes: no starvation."""
    store = make_store(limits(max_num_seqs=10, long_prefill_tokens_per_s=1_000.0,
                              short_beside_long=0, hol_bypass_s=5.0))
    store.add_pending(ijob("s0", project="b"))
    assert admit_ids(store, 1_010.0) == ["s0"]
    store.add_pending(ijob("l1", prompt=12_000, new=0))
    store.add_pending(ijob("s2", project="b"))
    assert admit_ids(store, 1_010.0) == ["s2"]  # l1 first in line, held: shorts in flight
    store.add_pending(ijob("s3", project="b"))
    assert admit_ids(store, 1_016.0) == []  # l1 reserved its turn: s3 waits too
    for name in ("s0", "s2"):
        assert store.release(name, store.lease_fences()[name])
    assert admit_ids(store, 1_016.0) == ["l1"]


def test_a_mostly_cached_long_prompt_is_no_long_prefill(make_store: StoreFactory) -> None:
    """Prep expects 11,000 of the 12,000-token prompt to hit the prefix cache: it goes beside
    three short sequences and opens no quiet window (a short goes right after it); the same
    prompt uncached waits for the shorts to drain. The long-sequence cap still counts both."""
    store = make_store(limits(max_num_seqs=10, max_long=2, long_prefill_tokens_per_s=1_000.0,
                              short_beside_long=1, hol_bypass_s=100.0))
    for i in range(3):
        store.add_pending(ijob(f"s{i}", project="b"))
    assert admit_ids(store, 1_010.0) == ["s0", "s1", "s2"]
    store.add_pending(ijob("l3", prompt=12_000, new=0, uncached_tokens=1_000))
    store.add_pending(ijob("s4", project="b"))
    assert admit_ids(store, 1_010.0) == ["l3", "s4"]
    store.add_pending(ijob("l5", prompt=12_000, new=0))  # nothing cached: a long prefill
    store.add_pending(ijob("s6", project="b"))
    assert admit_ids(store, 1_010.0) == ["s6"]
    assert store.snapshot().long_in_flight == 1


def test_one_quiet_window_takes_the_servers_long_partial_prefills(make_store: StoreFactory) -> None:
    """With long_prefills 2 (vLLM --max-num-partial-prefills > 1, --max-long-partial-prefills
    2) a second long prefill joins the window of the first (one drain of the shorts for both);
    a third waits, and so do shorts, until both prefills (2 x 12 s at 1,000 tok/s) are done."""
    store = make_store(limits(max_num_seqs=10, max_long=3, long_prefill_tokens_per_s=1_000.0,
                              short_beside_long=0, hol_bypass_s=100.0, long_prefills=2,
                              kv_budget_tokens=100_000))
    for name, project in (("l0", "a"), ("l1", "b"), ("l2", "c")):
        store.add_pending(ijob(name, project=project, prompt=12_000, new=0))
    store.add_pending(ijob("s3", project="d"))
    assert admit_ids(store, 1_010.0) == ["l0", "l1"]
    held = store.admit_next(1_020.0)
    assert held.hold_reason == "prefill" and held.retry_in_s == pytest.approx(14.0)
    assert admit_ids(store, 1_034.0) == ["l2"]  # a new window, the short waits for it too
    assert admit_ids(store, 1_046.0) == ["s3"]


QUIET = {"max_num_seqs": 10, "max_long": 2, "long_prefill_tokens_per_s": 1_000.0, "short_beside_long": 1,
         "hol_bypass_s": 100.0, "kv_budget_tokens": 100_000}


def test_batch_work_alone_runs_beside_a_long_prefill_and_interactive_work_waits_for_it(
    make_store: StoreFactory,
) -> None:
    """Nothing interactive in flight or in line: the batch long prompt goes beside three batch
    short sequences and batch shorts follow during its prefill (12,000 tokens at 1,000 tok/s:
    12 s); an interactive job arriving then waits for the prefill's end, and a second long
    prefill waits with it."""
    store = make_store(limits(**QUIET))
    for i in range(3):
        store.add_pending(job(f"s{i}", project="b"))
    assert admit_ids(store, 1_010.0) == ["s0", "s1", "s2"]
    store.add_pending(job("l3", prompt=12_000, new=0))
    store.add_pending(job("s4", project="b"))
    assert admit_ids(store, 1_010.0) == ["l3", "s4"]
    store.add_pending(ijob("i5", project="c"))
    store.add_pending(job("l6", project="d", prompt=12_000, new=0))
    held = store.admit_next(1_015.0)
    assert held.hold_reason == "prefill" and held.retry_in_s == pytest.approx(7.0)
    assert admit_ids(store, 1_022.0) == ["i5"]  # the window is over; l6: interactive in flight now
    assert store.snapshot().interactive_in_flight == 1


def test_an_interactive_sequence_in_flight_keeps_the_drain_until_it_ends(make_store: StoreFactory) -> None:
    """An interactive job in flight and none waiting: the batch long prompt still waits for the
    shorts to drain; once the interactive one is released, it goes beside the batch shorts."""
    store = make_store(limits(**QUIET))
    store.add_pending(ijob("i0", project="b"))
    store.add_pending(job("s1", project="b"))
    store.add_pending(job("s2", project="b"))
    assert admit_ids(store, 1_010.0) == ["i0", "s1", "s2"]
    store.add_pending(job("l2", prompt=12_000, new=0))
    assert store.admit_next(1_010.0).hold_reason == "prefill"
    assert store.release("i0", store.lease_fences()["i0"])
    assert store.snapshot().interactive_in_flight == 0
    store.add_pending(job("s3", project="c"))
    store.add_pending(job("s4", project="c"))
    assert admit_ids(store, 1_011.0) == ["l2", "s3", "s4"]


@pytest.mark.parametrize(("band", "expected"), [("batch", ["l2", "s0", "s1"]), ("interactive", ["s0", "s1"])])
def test_in_the_batch_band_a_projects_long_prompt_goes_before_its_short_jobs(
    make_store: StoreFactory, band: str, expected: list[str]
) -> None:
    """Batch: the long prompt submitted last goes first, and the shorts after it; interactive:
    the shorts go in their order and the long prompt waits for them to drain."""
    store = make_store(limits(**QUIET))
    for name in ("s0", "s1"):
        store.add_pending(job(name, band=band))
    store.add_pending(job("l2", prompt=12_000, new=0, band=band))
    assert admit_ids(store, 1_010.0) == expected


@pytest.mark.parametrize(("short_job_s", "drained"), [(50.0, True), (60.0, False)])
def test_a_drain_goes_only_when_it_idles_fewer_slot_seconds_than_the_prefill_slows(
    make_store: StoreFactory, short_job_s: float, drained: bool
) -> None:
    """Three interactive shorts in flight, one may stay: the drain idles (3 - 1)^2 x short_job_s
    / 6 slot-seconds (33.3 at 50 s, 40 at 60 s), the prefill (12 s) slows three sequences: 36.
    At 50 s the long prompt waits for the drain; at 60 s it goes at once, and its window holds
    the interactive job behind it all the same."""
    store = make_store(limits(**QUIET, short_job_s=short_job_s))
    for i in range(3):
        store.add_pending(ijob(f"s{i}", project="b"))
    assert admit_ids(store, 1_010.0) == ["s0", "s1", "s2"]
    store.add_pending(ijob("l3", prompt=12_000, new=0))
    assert admit_ids(store, 1_010.0) == ([] if drained else ["l3"])
    store.add_pending(ijob("s4", project="c"))
    held = store.admit_next(1_012.0)
    if drained:  # the short passes the long one waiting for the drain
        assert held.grant is not None and held.grant.job_id == "s4"
    else:
        assert held.hold_reason == "prefill" and held.retry_in_s == pytest.approx(10.0)


def test_prefill_bucket_counts_uncached_tokens(make_store: StoreFactory) -> None:
    store = make_store(limits(prefill_tokens_per_s=1_000.0, prefill_burst_tokens=2_000))
    for i in range(3):
        store.add_pending(job(f"j{i}", prompt=1_900, uncached_tokens=100))
    store.add_pending(job("j3", prompt=2_000))
    assert admit_ids(store, 1_010.0) == ["j0", "j1", "j2"]  # 300 of the bucket's 2,000
    held = store.admit_next(1_010.0)
    assert held.hold_reason == "bucket" and held.retry_in_s == pytest.approx(0.3)


def test_prefill_bucket_paces_prompts(make_store: StoreFactory) -> None:
    store = make_store(limits(prefill_tokens_per_s=1_000.0, prefill_burst_tokens=2_000))
    for i in range(3):
        store.add_pending(job(f"j{i}", prompt=1_000))
    assert admit_ids(store, 1_010.0) == ["j0", "j1"]
    held = store.admit_next(1_010.0)
    assert held.hold_reason == "bucket" and held.retry_in_s == pytest.approx(1.0)
    assert admit_ids(store, 1_010.5) == []
    assert admit_ids(store, 1_011.0) == ["j2"]


def test_prompt_bigger_than_the_bucket_goes_when_full(make_store: StoreFactory) -> None:
    store = make_store(limits(prefill_tokens_per_s=1_000.0, prefill_burst_tokens=2_000))
    store.add_pending(job("j0", prompt=1_500, new=0))
    store.add_pending(job("j1", prompt=5_000, new=0))
    assert admit_ids(store, 1_010.0) == ["j0"]
    assert store.admit_next(1_011.0).hold_reason == "bucket"  # 1,500 of 2,000
    assert admit_ids(store, 1_011.5) == ["j1"]  # full: goes, leaves a debt of 3,000
    store.add_pending(job("j9", prompt=100, new=0))
    assert store.admit_next(1_013.0).hold_reason == "bucket"
    assert admit_ids(store, 1_014.6) == ["j9"]


def test_min_spacing(make_store: StoreFactory) -> None:
    store = make_store(limits(min_spacing_s=0.5))
    for i in range(2):
        store.add_pending(job(f"j{i}"))
    assert admit_ids(store, 1_010.0) == ["j0"]
    held = store.admit_next(1_010.2)
    assert held.hold_reason == "spacing" and held.retry_in_s == pytest.approx(0.3)
    assert admit_ids(store, 1_010.5) == ["j1"]


def test_kv_blocked_head_is_passed_only_for_a_while(make_store: StoreFactory) -> None:
    store = make_store(limits(kv_budget_tokens=20_000, max_num_seqs=10, hol_bypass_s=5.0))
    store.add_pending(job("j0", prompt=12_000, new=0))
    first = store.admit_next(1_010.0).grant
    assert first is not None
    store.add_pending(job("big1", project="b", prompt=9_000, new=0))
    for i in range(2, 6):
        store.add_pending(job(f"s{i}", project="c", prompt=900, new=0, enqueued_at=1_100 + i))
    # big1 is first in fair order but does not fit the KV budget: smaller jobs may pass it ...
    assert admit_ids(store, 1_010.0) == ["s2", "s3", "s4", "s5"]
    store.add_pending(job("s6", project="c", prompt=900, new=0, enqueued_at=1_106))
    # ... for hol_bypass_s only; then nobody passes it any more, though s6 would fit.
    held = store.admit_next(1_016.0)
    assert held.grant is None and held.hold_reason == "kv"
    assert store.release("j0", first.fence)
    assert admit_ids(store, 1_016.0) == ["big1", "s6"]


# -- leases ----------------------------------------------------------------------------------
def test_fences_are_a_sequence_of_each_project(make_store: StoreFactory) -> None:
    """A grant's fence counts its own project's admissions only: a job's record tells its project
    nothing of how many jobs others ran in between. A job admitted again still gets a new, larger
    fence, so the stale holder is refused."""
    store = make_store()
    for n, project in enumerate(["a", "b", "b", "b", "a"]):
        store.add_pending(job(f"{project}{n}", project=project))
    fences = {}
    while (grant := store.admit_next(1_010.0).grant) is not None:
        fences[grant.job_id] = grant.fence
        assert store.release(grant.job_id, grant.fence)
    assert sorted(f for j, f in fences.items() if j.startswith("a")) == [1, 2]
    assert sorted(f for j, f in fences.items() if j.startswith("b")) == [1, 2, 3]
    store.add_pending(job("a9", project="a"))
    stale = store.admit_next(1_020.0).grant
    assert stale is not None and store.requeue("a9", stale.fence)  # back in line, admitted again
    fresh = store.admit_next(1_021.0).grant
    assert fresh is not None and fresh.job_id == "a9" and fresh.fence == stale.fence + 1
    assert not store.renew("a9", stale.fence, 1_022.0) and not store.release("a9", stale.fence)
    assert store.release("a9", fresh.fence)


def test_release_and_renew_check_the_fence(make_store: StoreFactory) -> None:
    store = make_store()
    store.add_pending(job("j0"))
    grant = store.admit_next(1_010.0).grant
    assert grant is not None and grant.lease_expires_at == pytest.approx(1_040.0)
    assert store.lease_valid("j0", grant.fence)
    assert not store.renew("j0", grant.fence + 1, 1_020.0)
    assert store.renew("j0", grant.fence, 1_020.0)
    assert store.next_expiry() == pytest.approx(1_050.0)
    assert not store.release("j0", grant.fence - 1)
    assert store.release("j0", grant.fence)
    assert not store.release("j0", grant.fence)  # a duplicate release frees nothing twice
    assert not store.lease_valid("j0", grant.fence)
    assert store.snapshot().in_flight == 0 and store.snapshot().reserved_kv_tokens == 0


def test_a_lease_names_the_project_it_was_granted_to(make_store: StoreFactory) -> None:
    store = make_store()
    store.add_pending(PendingItem("b/j0", "b", 500, 400, enqueued_at=1_000.0))
    assert store.lease_project("b/j0") is None  # pending: no lease yet
    grant = store.admit_next(1_010.0).grant
    assert grant is not None and store.lease_project("b/j0") == "b"
    assert store.release("b/j0", grant.fence)
    assert store.lease_project("b/j0") is None


def test_expired_lease_goes_back_to_its_place(make_store: StoreFactory) -> None:
    store = make_store(limits(max_num_seqs=1))
    for i in range(3):
        store.add_pending(job(f"j{i}"))
    first = store.admit_next(1_010.0).grant
    assert first is not None and first.job_id == "j0"
    assert not store.renew("j0", first.fence, 1_041.0)  # too late: the lease is lost
    assert store.reap_expired(1_041.0) == ["j0"]
    again = store.admit_next(1_041.0).grant
    assert again is not None and again.job_id == "j0" and again.fence > first.fence
    assert not store.release("j0", first.fence)  # the old holder's fence is dead
    assert store.snapshot().in_flight == 1
    assert store.release("j0", again.fence)


def test_claim_drops_a_second_delivery(make_store: StoreFactory) -> None:
    store = make_store()
    store.add_pending(job("j0"))
    grant = store.admit_next(1_010.0).grant
    assert grant is not None and grant.lease_expires_at == pytest.approx(1_040.0)
    assert not store.claim("j0", grant.fence + 1, "worker-a", 1_012.0)  # wrong fence
    assert store.claim("j0", grant.fence, "worker-a", 1_012.0)
    assert store.next_expiry() == pytest.approx(1_042.0)  # the claim renewed the lease
    assert not store.claim("j0", grant.fence, "worker-b", 1_013.0)  # the duplicate delivery
    assert store.next_expiry() == pytest.approx(1_042.0)  # ... changed nothing
    assert store.claim("j0", grant.fence, "worker-a", 1_014.0)  # the same owner again
    assert store.renew("j0", grant.fence, 1_020.0)  # renew checks the fence only, as before
    assert store.next_expiry() == pytest.approx(1_050.0)
    assert not store.claim("j0", grant.fence, "worker-a", 1_051.0)  # expired
    assert store.reap_expired(1_051.0) == ["j0"]
    again = store.admit_next(1_051.0).grant
    assert again is not None and again.fence > grant.fence
    assert not store.claim("j0", grant.fence, "worker-a", 1_052.0)  # the old fence is dead
    assert store.claim("j0", again.fence, "worker-b", 1_052.0)  # a new lease, a new owner
    assert store.release("j0", again.fence)
    assert not store.claim("j0", again.fence, "worker-b", 1_053.0)  # no lease any more


def test_requeue_gives_the_lease_back_at_once(make_store: StoreFactory) -> None:
    store = make_store(limits(max_num_seqs=1))
    for i in range(3):
        store.add_pending(job(f"j{i}"))
    first = store.admit_next(1_010.0).grant
    assert first is not None and first.job_id == "j0"
    assert not store.requeue("j0", first.fence + 1)
    assert store.requeue("j0", first.fence)
    assert store.snapshot().in_flight == 0 and store.lease_fences() == {}
    assert not store.requeue("j0", first.fence)  # nothing to give back twice
    again = store.admit_next(1_010.0).grant  # back at its original place: first in line
    assert again is not None and again.job_id == "j0" and again.fence > first.fence
    assert store.pending_ids() == {"j1", "j2"}


def test_a_grant_whose_message_was_lost_is_given_back_only_while_unclaimed(make_store: StoreFactory) -> None:
    """What the dispatcher does at the broker's return (fleet/worker/lostgrants.py): the leases no
    worker claimed, granted before the return, are listed; giving one back with ``unclaimed_only``
    puts the job back at its place; a claimed lease is never given back that way."""
    store = make_store()
    for i in range(3):
        store.add_pending(job(f"j{i}"))
    grants = [store.admit_next(1_010.0).grant for _ in range(2)]
    late = store.admit_next(1_020.0).grant
    assert all(grants) and late is not None
    assert store.claim("j1", grants[1].fence, "worker-1", 1_011.0)
    assert store.unclaimed_leases(admitted_before=1_015.0) == {"j0": grants[0].fence}
    assert not store.requeue("j1", grants[1].fence, unclaimed_only=True)  # claimed: kept
    assert store.requeue("j0", grants[0].fence, unclaimed_only=True)
    assert set(store.lease_fences()) == {"j1", "j2"} and store.pending_ids() == {"j0"}
    assert store.snapshot().in_flight == 2 and store.snapshot().claimed == 1


def test_deadlines_expire_pending_jobs_only(make_store: StoreFactory) -> None:
    store = make_store(limits(max_num_seqs=1))
    store.add_pending(job("j0", deadline=1_020.0))  # admitted first: in flight, not touched
    store.add_pending(job("j1", deadline=1_030.0))
    store.add_pending(job("j2", deadline=1_020.0))
    store.add_pending(job("j3"))
    store.add_pending(job("j4", deadline=1_025.0))
    grant = store.admit_next(1_010.0).grant
    assert grant is not None and grant.job_id == "j0"
    assert store.next_deadline() == pytest.approx(1_020.0)  # j2's (j0 left the deadlines)
    assert store.expire_deadlines(1_019.0) == []
    assert store.expire_deadlines(1_020.0) == ["j2"]  # deadline <= now
    assert store.pending_ids() == {"j1", "j3", "j4"}
    assert store.lease_fences() == {"j0": grant.fence}
    assert store.cancel_pending("j4")  # a cancelled job's deadline goes with it
    assert store.next_deadline() == pytest.approx(1_030.0)
    assert store.expire_deadlines(1_035.0) == ["j1"]
    assert store.next_deadline() is None
    assert store.snapshot().pending == {"a": {"batch": 1}}
    assert store.snapshot().in_flight == 1


def test_deadline_comes_back_with_an_expired_lease(make_store: StoreFactory) -> None:
    store = make_store()
    store.add_pending(job("j0", deadline=1_100.0))
    grant = store.admit_next(1_010.0).grant
    assert grant is not None and store.next_deadline() is None
    assert store.reap_expired(1_041.0) == ["j0"]
    assert store.next_deadline() == pytest.approx(1_100.0)
    assert store.expire_deadlines(1_100.0) == ["j0"]
    assert store.pending_ids() == set() and store.admit_next(1_100.0).hold_reason == "empty"


def test_resubmit_without_deadline_clears_it(make_store: StoreFactory) -> None:
    store = make_store()
    store.add_pending(job("j0", deadline=1_050.0))
    grant = store.admit_next(1_010.0).grant
    assert grant is not None and store.release("j0", grant.fence)
    store.add_pending(job("j0"))  # submitted again after its lease ended, this time without one
    assert store.next_deadline() is None
    assert store.expire_deadlines(1_060.0) == []
    assert store.pending_ids() == {"j0"}


def test_cancel_and_duplicate_submit(make_store: StoreFactory) -> None:
    store = make_store()
    store.add_pending(job("j0"))
    store.add_pending(job("j0"))
    store.add_pending(job("j1"))
    assert store.snapshot().pending == {"a": {"batch": 2}}
    assert store.cancel_pending("j0")
    assert not store.cancel_pending("j0")
    assert admit_ids(store, 1_010.0) == ["j1"]
    assert not store.cancel_pending("j1")  # in flight, not pending
    assert store.admit_next(1_010.0).hold_reason == "empty"


def test_submit_and_release_wake_a_dispatcher(make_store: StoreFactory) -> None:
    store = make_store()
    assert not store.wait_for_wake(0.01)
    store.add_pending(job("j0"))
    assert store.wait_for_wake(0.01)
    grant = store.admit_next(1_010.0).grant
    assert not store.wait_for_wake(0.01)
    store.release("j0", grant.fence)
    assert store.wait_for_wake(0.01)


def test_backend_gate(make_store: StoreFactory) -> None:
    clock = FakeClock(1_000.0)
    config = StoreConfig(limits=BASE.limits, gate=True, scrape_stale_s=5.0)
    store = make_store(config, clock)
    store.add_pending(job("j0"))
    assert store.admit_next(1_000.0).hold_reason == "backend_stale"
    store.record_backend(1_000.0, "waiting", {"waiting": "2.0"})
    assert store.admit_next(1_001.0).hold_reason == "backend_waiting"
    assert store.backend()["waiting"] == "2.0"
    store.record_backend(1_001.0, "", {})
    assert store.admit_next(1_007.0).hold_reason == "backend_stale"
    assert admit_ids(store, 1_002.0) == ["j0"]
    assert store.snapshot().holds["backend_stale"] == 2


def test_interactive_and_priority_order(make_store: StoreFactory) -> None:
    store = make_store(limits(max_num_seqs=10))
    store.add_pending(job("b1"))
    store.add_pending(job("b2", priority=1))
    store.add_pending(job("i3", band="interactive"))
    assert admit_ids(store, 1_010.0) == ["i3", "b2", "b1"]


def test_an_aged_short_job_behind_a_fresh_long_one_keeps_its_aging_lift(make_store: StoreFactory) -> None:
    """Batch puts a project's fresh long prompt before its short job that has waited past
    ``aging_s``: the project's tier comes from the oldest of the two, so it competes with another
    project's interactive work by fair share (its long prompt goes first, on its lower start tag),
    instead of waiting in tier 1 for as long as fresh long prompts keep coming."""
    store = make_store(limits(max_num_seqs=10))
    store.add_pending(job("s0"))  # enqueued at 1,000: 70 s old at 1,070
    store.add_pending(job("l65", prompt=12_000, new=0))
    store.add_pending(ijob("i66", project="b"))
    store.add_pending(job("x1", project="b"))  # b's finish tag moves ahead once i66 goes
    assert admit_ids(store, 1_070.0)[:2] == ["l65", "i66"]


def test_blocking_wait_stays_under_the_socket_timeout(redis_url: str, key_prefix: str) -> None:
    assert max_block_s(redis.Redis.from_url(redis_url)) == 4.0  # redis-py 8 default: 5 s
    assert max_block_s(redis.Redis.from_url(redis_url, socket_timeout=None)) == 4.0
    short = redis.Redis.from_url(redis_url, socket_timeout=0.5)
    assert max_block_s(short) == pytest.approx(0.4)
    store = RedisStore(short, Keys(key_prefix), BASE)
    try:
        assert not store.wait_for_wake(60.0)  # would raise TimeoutError if it blocked 60 s
    finally:
        short.close()


# -- random sequences ------------------------------------------------------------------------
MACHINE = StoreConfig(
    limits=Limits(
        max_num_seqs=4,
        kv_budget_tokens=40_000,
        block_tokens=1000,
        long_prompt_tokens=10_000,
        max_long=1,
        prefill_tokens_per_s=20_000.0,
        prefill_burst_tokens=40_000,
        hol_bypass_s=5.0,
    ),
    lease_ttl_s=30.0,
    aging_s=60.0,
    gate=False,
)


class StoreMachine(RuleBasedStateMachine):
    """Model of what must hold whatever happens; the store is the system under test."""

    factory: Callable[[FakeClock], MemoryStore | RedisStore]
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.store = self.factory(self.clock)
        self.limits = self.store.config.limits
        self.submitted: dict[str, PendingItem] = {}
        self.done: set[str] = set()
        self.live: dict[str, int] = {}  # job -> fence, as the model believes
        self.owners: dict[tuple[str, int], str] = {}  # (job, fence) -> first claimant
        self.waiting: dict[str, float] = {}  # continuations -> their not-before time
        self.count = 0

    @rule(
        project=st.sampled_from(["a", "b", "c"]),
        prompt=st.sampled_from([300, 2_500, 9_000, 12_000]),
        new=st.integers(0, 4_000),
        band=st.sampled_from(["batch", "interactive"]),
        deadline_in_s=st.sampled_from([None, None, 1.0, 10.0, 60.0]),
    )
    def submit(
        self, project: str, prompt: int, new: int, band: str, deadline_in_s: float | None
    ) -> None:
        self.count += 1
        deadline = None if deadline_in_s is None else self.clock.now + deadline_in_s
        item = PendingItem(
            f"j{self.count}", project, prompt, new, band=band, deadline=deadline  # type: ignore[arg-type]
        )
        self.submitted[item.job_id] = item
        self.store.add_pending(item)

    @rule(target=leases)
    def admit(self):
        grant = self.store.admit_next(self.clock.now).grant
        if grant is None:
            return multiple()
        assert grant.job_id not in self.live, "admitted twice at once"
        self.live[grant.job_id] = grant.fence
        return (grant.job_id, grant.fence)

    @rule(lease=consumes(leases))
    def release(self, lease) -> None:
        job_id, fence = lease
        ok = self.store.release(job_id, fence)
        assert ok == (self.live.get(job_id) == fence)
        if ok:
            del self.live[job_id]
            self.done.add(job_id)

    @rule(lease=leases)
    def stale_release_or_renew(self, lease) -> None:
        job_id, fence = lease
        if self.live.get(job_id) != fence:
            assert not self.store.release(job_id, fence)
            assert not self.store.renew(job_id, fence, self.clock.now)

    @rule(lease=leases, owner=st.sampled_from(["w1", "w2"]))
    def claim(self, lease, owner: str) -> None:
        job_id, fence = lease
        live = self.live.get(job_id) == fence
        ok = self.store.claim(job_id, fence, owner, self.clock.now)
        if not live:
            assert not ok
        elif self.owners.setdefault((job_id, fence), owner) == owner:
            assert ok
        else:
            assert not ok, "a second owner claimed the same lease"

    @rule(lease=consumes(leases))
    def requeue(self, lease) -> None:
        job_id, fence = lease
        ok = self.store.requeue(job_id, fence)
        assert ok == (self.live.get(job_id) == fence)
        if ok:
            del self.live[job_id]

    @rule(lease=leases)
    def give_back_a_lost_grant(self, lease) -> None:
        """The broker's return: an unclaimed lease is given back, a claimed one is kept."""
        job_id, fence = lease
        live = self.live.get(job_id) == fence
        unclaimed = self.store.unclaimed_leases(admitted_before=self.clock.now + 1)
        assert (unclaimed.get(job_id) == fence) == (live and (job_id, fence) not in self.owners)
        ok = self.store.requeue(job_id, fence, unclaimed_only=True)
        assert ok == (unclaimed.get(job_id) == fence)
        if ok:
            del self.live[job_id]

    @rule()
    def expire_deadlines(self) -> None:
        now = self.clock.now
        for job_id in self.store.expire_deadlines(now):
            assert job_id not in self.live and job_id not in self.done
            deadline = self.submitted[job_id].deadline
            assert deadline is not None and deadline <= now
            self.done.add(job_id)
        for job_id in self.store.pending_ids():
            deadline = self.submitted[job_id].deadline
            assert deadline is None or deadline > now

    @rule(lease=leases)
    def renew(self, lease) -> None:
        job_id, fence = lease
        if self.live.get(job_id) == fence:
            assert self.store.renew(job_id, fence, self.clock.now)

    @rule(lease=consumes(leases), extra=st.sampled_from([-500, 4_000]),
          backoff_s=st.sampled_from([0.0, 4.0]))
    def readmit(self, lease, extra: int, backoff_s: float) -> None:
        """Another model turn with a new plan: back in line at once, or after a backoff."""
        job_id, fence = lease
        item = self.submitted[job_id]
        new = max(0, item.max_new_tokens + extra)
        now = self.clock.now
        ok = self.store.readmit(job_id, fence, new, now + backoff_s, now)
        assert ok == (self.live.get(job_id) == fence)
        if ok:
            del self.live[job_id]
            self.submitted[job_id] = replace(item, max_new_tokens=new)
            if backoff_s:
                self.waiting[job_id] = now + backoff_s

    @rule(seconds=st.sampled_from([0.5, 5.0, 31.0]))
    def time_passes(self, seconds: float) -> None:
        """Workers that did not renew are crashed: their leases expire and are reaped."""
        self.clock.now += seconds
        for job_id in self.store.reap_expired(self.clock.now):
            assert job_id in self.live
            del self.live[job_id]
        due = {j for j, not_before in self.waiting.items() if not_before <= self.clock.now}
        assert set(self.store.promote_due(self.clock.now)) == due
        for job_id in due:
            del self.waiting[job_id]

    @rule(index=st.integers(0, 50))
    def cancel(self, index: int) -> None:
        job_id = f"j{index}"
        pending = job_id in self.store.pending_ids() or job_id in self.waiting
        assert self.store.cancel_pending(job_id) == pending
        if pending:
            self.waiting.pop(job_id, None)
            self.done.add(job_id)

    @invariant()
    def limits_hold_and_counters_match(self) -> None:
        snap = self.store.snapshot()
        fences = self.store.lease_fences()
        assert fences == self.live
        items = [self.submitted[j] for j in fences]
        kv = sum(
            kv_tokens(i.prompt_tokens, i.max_new_tokens, self.limits.block_tokens) for i in items
        )
        longs = sum(i.prompt_tokens > self.limits.long_prompt_tokens for i in items)
        interactive = sum(i.band == "interactive" for i in items)
        assert (snap.in_flight, snap.reserved_kv_tokens, snap.long_in_flight, snap.interactive_in_flight) == (
            len(items),
            kv,
            longs,
            interactive,
        )
        assert snap.in_flight <= self.limits.max_num_seqs
        assert snap.long_in_flight <= self.limits.max_long
        assert kv <= self.limits.kv_budget_tokens or len(items) == 1

    @invariant()
    def no_job_lost(self) -> None:
        pending = self.store.pending_ids()
        assert not pending & set(self.live)
        assert not pending & set(self.waiting) and not set(self.live) & set(self.waiting)
        assert pending | set(self.live) | set(self.waiting) | self.done == set(self.submitted)
        assert not pending & self.done
        assert self.store.next_not_before() == min(self.waiting.values(), default=None)


def _machine(factory) -> type[StoreMachine]:
    return type("Machine", (StoreMachine,), {"factory": staticmethod(factory)})


def test_random_sequences_memory() -> None:
    machine = _machine(lambda clock: MemoryStore(MACHINE, clock=clock))
    run_state_machine_as_test(
        machine, settings=settings(max_examples=60, stateful_step_count=40, deadline=None)
    )


def test_random_sequences_redis(key_prefix: str) -> None:
    client = redis.Redis.from_url(TEST_REDIS_URL)
    runs = iter(range(10**6))

    def factory(clock: FakeClock) -> RedisStore:
        prefix = f"{key_prefix}{next(runs)}:"
        return RedisStore(client, Keys(prefix), MACHINE, clock=clock)

    try:
        run_state_machine_as_test(
            _machine(factory),
            settings=settings(
                max_examples=25,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        delete_prefix(client, key_prefix)
        client.close()


def test_a_drained_system_forgives_an_earlier_lead(make_store: StoreFactory) -> None:
    """Project a ran alone with big jobs; everything drained; then a and b both queue: b must
    not get everything while a's old lead is paid back (a gets its turn within the first few)."""
    store = make_store(limits(max_num_seqs=1))
    now = 1_100.0
    for i in range(5):
        store.add_pending(job(f"big{i}", "a", prompt=9_000, new=1_000))
        grant = store.admit_next(now).grant
        assert grant is not None and store.release(grant.job_id, grant.fence)
    for i in range(6):
        store.add_pending(job(f"a{i}", "a", enqueued_at=1_200.0 + i))
        store.add_pending(job(f"b{i}", "b", enqueued_at=1_200.0 + i))
    order = []
    for _ in range(4):
        grant = store.admit_next(now).grant
        assert grant is not None
        order.append(grant.project)
        store.release(grant.job_id, grant.fence)
    assert order.count("a") >= 1 and order.count("b") >= 1


class TwoDispatchers:
    """Two RedisStore instances, each with its own connection, over one key prefix: admission
    rounds alternate between them as two dispatcher processes' would; everything else goes to
    the first (workers and producers talk to the same shared state either way)."""

    def __init__(self, first: RedisStore, second: RedisStore) -> None:
        self._stores = (first, second)
        self._turn = 0

    def admit_next(self, now: float):
        self._turn ^= 1
        return self._stores[self._turn].admit_next(now)

    def __getattr__(self, name: str):
        return getattr(self._stores[0], name)


def test_random_sequences_redis_two_dispatchers(key_prefix: str) -> None:
    clients = [redis.Redis.from_url(TEST_REDIS_URL) for _ in range(2)]
    runs = iter(range(10**6))

    def factory(clock: FakeClock) -> TwoDispatchers:
        keys = Keys(f"{key_prefix}{next(runs)}:")
        return TwoDispatchers(*(RedisStore(c, keys, MACHINE, clock=clock) for c in clients))

    try:
        run_state_machine_as_test(
            _machine(factory),
            settings=settings(max_examples=20, stateful_step_count=30, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow]),
        )
    finally:
        delete_prefix(clients[0], key_prefix)
        for client in clients:
            client.close()


def test_a_job_in_flight_is_not_added_again(make_store: StoreFactory) -> None:
    """A resubmission of a leased job is ignored: when the lease is later reaped, the job comes
    back with its own place in line and no deadline it never had (the differential test found the
    Redis store taking the facts of a resubmission cancelled meanwhile)."""
    clock = FakeClock(990.0)
    store = make_store(clock=clock)
    store.add_pending(job("j0", enqueued_at=990.0))
    grant = store.admit_next(1_000.0).grant
    assert grant is not None and grant.job_id == "j0"
    store.add_pending(job("j0", enqueued_at=995.0, deadline=1_100.0))
    assert store.snapshot().pending == {}
    assert store.cancel_pending("j0") is False
    reaped_at = 1_000.0 + BASE.lease_ttl_s + 1
    assert store.reap_expired(reaped_at) == ["j0"]
    assert store.next_deadline() is None
    again = store.admit_next(reaped_at).grant
    assert again is not None and again.job_id == "j0"
    assert again.waited_s == pytest.approx(reaped_at - 990.0)


@pytest.mark.parametrize(("partial", "long_partial", "expected"), [(1, 3, 1), (4, 3, 3), (2, 3, 2), (4, 1, 1)])
def test_long_prefills_per_window_follow_the_servers_flags(partial: int, long_partial: int, expected: int) -> None:
    """vLLM prefills one prompt at a time unless --max-num-partial-prefills > 1; then at most
    --max-long-partial-prefills long ones (and never more than the partial prefills)."""
    from fleet.core.config import Settings

    settings = Settings(backend={"max_num_partial_prefills": partial, "max_long_partial_prefills": long_partial})
    assert Limits.from_settings(settings).long_prefills == expected


def test_a_deadline_is_reported_before_its_job_leaves_the_line(make_store: StoreFactory) -> None:
    """The dispatcher reports a due job (its E_DEADLINE envelope) before the store drops it.
    Before, the job left the line first: a report that failed, or a dispatcher that died between
    the two steps, left the job with no final result for good."""
    store = make_store()
    for job_id in ("j0", "j1"):
        store.add_pending(job(job_id, deadline=1_020.0))
    reported: list[str] = []
    failures = {"j0"}

    def on_expired(job_id: str) -> None:
        if job_id in failures:
            failures.discard(job_id)
            raise RuntimeError("the report failed")
        reported.append(job_id)

    assert expire_deadlines(store, 1_030.0, on_expired) == ["j1"]
    assert store.pending_ids() == {"j0"}  # kept in line: the next round reports it again
    assert expire_deadlines(store, 1_031.0, on_expired) == ["j0"]
    assert reported == ["j1", "j0"] and store.pending_ids() == set()

    store.add_pending(job("j2", deadline=1_040.0))

    def dies_after_reporting(job_id: str) -> None:
        reported.append(job_id)
        raise SystemExit  # the dispatcher dies right after the envelope went out

    with pytest.raises(SystemExit):
        expire_deadlines(store, 1_050.0, dies_after_reporting)
    assert store.pending_ids() == {"j2"}  # still in line: the next dispatcher drops it
    assert store.due_deadlines(1_050.0) == ["j2"]
    assert expire_deadlines(store, 1_050.0, None) == ["j2"]
