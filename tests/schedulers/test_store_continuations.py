"""Continuations in the admission store (``readmit``, ``promote_due``), both stores.

A job that needs another model turn gives its lease up at once and comes back at its original
place in line (ahead of its project's newer work), with its new plan's size, after its
not-before time; a waiting continuation holds no slot and can be cancelled.
"""

from __future__ import annotations

import redis

from fleet.core.keys import Keys
from schedulers.policy.limits import kv_tokens
from schedulers.store.redis_store import RedisStore
from tests.support.store_cases import BASE, FakeClock, StoreFactory, admit_ids, job, limits, make_store

__all__ = ["make_store"]  # the parametrised fixture, memory and Redis


def test_readmit_frees_the_slot_and_keeps_the_place(make_store: StoreFactory) -> None:
    store = make_store(limits(max_num_seqs=1))
    store.add_pending(job("j0"))
    first = store.admit_next(1_010.0).grant
    assert first is not None
    store.add_pending(job("j5"))  # newer work of the same project
    assert not store.readmit("j0", first.fence + 1, 800, 0.0, 1_011.0)  # stale fence
    assert store.readmit("j0", first.fence, 800, 0.0, 1_011.0)
    assert store.snapshot().in_flight == 0 and store.lease_fences() == {}
    assert store.continuations() == {"a": {"pending": 1}}
    again = store.admit_next(1_012.0).grant
    assert again is not None and again.job_id == "j0" and again.fence > first.fence
    assert again.kv_tokens == kv_tokens(500, 800, BASE.limits.block_tokens)  # the new plan
    assert not store.readmit("j0", first.fence, 800, 0.0, 1_013.0)  # the old fence is dead


def test_a_backoff_waits_outside_the_queue_without_a_slot(make_store: StoreFactory) -> None:
    clock = FakeClock(1_010.0)
    store = make_store(limits(max_num_seqs=1), clock)
    store.add_pending(job("j0"))
    store.add_pending(job("j1"))
    grant = store.admit_next(1_010.0).grant
    assert grant is not None and grant.job_id == "j0"
    assert store.readmit("j0", grant.fence, 400, 1_020.0, 1_011.0)
    assert store.next_not_before() == 1_020.0
    assert store.continuations() == {"a": {"deferred": 1}}
    assert store.promote_due(1_019.0) == []
    assert admit_ids(store, 1_012.0) == ["j1"]  # the slot went to the next job at once
    assert store.snapshot().in_flight == 1
    assert store.promote_due(1_020.0) == ["j0"]
    assert store.next_not_before() is None and store.pending_ids() == {"j0"}


def test_a_waiting_continuation_can_be_cancelled(make_store: StoreFactory) -> None:
    store = make_store(limits())
    store.add_pending(job("j0", deadline=1_100.0))
    grant = store.admit_next(1_010.0).grant
    assert grant is not None
    assert store.readmit("j0", grant.fence, 400, 1_050.0, 1_011.0)
    assert store.cancel_pending("j0")
    assert not store.cancel_pending("j0")
    assert store.promote_due(1_060.0) == [] and store.pending_ids() == set()
    assert store.continuations() == {}


def test_a_promoted_continuation_gets_its_deadline_back(make_store: StoreFactory) -> None:
    store = make_store(limits())
    store.add_pending(job("j0", deadline=1_100.0))
    grant = store.admit_next(1_010.0).grant
    assert grant is not None
    assert store.readmit("j0", grant.fence, 400, 1_050.0, 1_011.0)
    assert store.next_deadline() is None  # waiting: no deadline entry
    assert store.promote_due(1_050.0) == ["j0"]
    assert store.next_deadline() == 1_100.0
    assert store.expire_deadlines(1_100.0) == ["j0"]


def test_a_job_submitted_again_after_its_release_is_no_continuation(make_store: StoreFactory) -> None:
    store = make_store(limits())
    store.add_pending(job("j0"))
    grant = store.admit_next(1_010.0).grant
    assert grant is not None and store.readmit("j0", grant.fence, 400, 0.0, 1_011.0)
    again = store.admit_next(1_012.0).grant
    assert again is not None and store.release("j0", again.fence)
    store.add_pending(job("j0"))  # the same id submitted anew: new work, not a waiting turn
    assert store.continuations() == {}
    assert store.pending_ids() == {"j0"}


def test_a_release_takes_the_job_out_of_the_continuations_set(
    key_prefix: str, redis_client: redis.Redis
) -> None:
    """The set is a hint list for ``fleet queues``; without this it grew by every continuation
    ever made until someone ran ``fleet queues``."""
    store = RedisStore(redis_client, Keys(key_prefix), limits())
    members = f"{Keys(key_prefix).dispatch}continuations"
    store.add_pending(job("j0"))
    grant = store.admit_next(1_010.0).grant
    assert grant is not None and store.readmit("j0", grant.fence, 400, 0.0, 1_011.0)
    assert redis_client.smembers(members) == {b"j0"}
    again = store.admit_next(1_012.0).grant
    assert again is not None and store.release("j0", again.fence)
    assert redis_client.smembers(members) == set()


def test_the_next_turns_prompt_grows_the_item_and_the_store_names_the_turn(
        make_store: StoreFactory) -> None:
    """A tool round's conversation and results are prompt the next turn sends: admission counts
    them (prompt, KV, size, and the uncached tokens the long-prefill rule and the prefill bucket
    charge); the store keeps the number of the turn it put in line (before, only max_new and KV
    changed on readmit)."""
    store = make_store(limits(max_num_seqs=1))
    store.add_pending(job("j0", uncached_tokens=200))
    grant = store.admit_next(1_010.0).grant
    assert grant is not None and store.turn_of("j0") == 0
    assert store.readmit("j0", grant.fence, 400, 1_050.0, 1_011.0, prompt_tokens=2_500, turn=1)
    assert store.turn_of("j0") == 1
    assert store.grow("j0", 12_000)  # a large tool result came in while the job waits
    assert not store.grow("j0", 11_000)  # an earlier report, out of order: never smaller
    assert store.promote_due(1_050.0) == ["j0"]
    assert not store.grow("j0", 13_000)  # in line again: a late result is not counted
    again = store.admit_next(1_051.0).grant
    assert again is not None and again.prompt_tokens == 12_000 and again.long
    assert again.kv_tokens == kv_tokens(12_000, 400, BASE.limits.block_tokens)
    assert store.turn_of("j0") == 1 and store.snapshot().long_in_flight == 1


def test_a_prompt_past_the_kv_budget_grows_and_is_admitted_alone(make_store: StoreFactory) -> None:
    """As a new job of that size would be (``test_job_bigger_than_the_budget_goes_alone``).
    Before, ``grow`` refused it and the tool worker ended the job E_PROMPT_TOO_LONG."""
    store = make_store(limits(max_num_seqs=4, kv_budget_tokens=20_000))
    store.add_pending(job("j0"))
    grant = store.admit_next(1_010.0).grant
    assert grant is not None
    assert store.readmit("j0", grant.fence, 400, 1_050.0, 1_011.0, prompt_tokens=2_500, turn=1)
    assert store.grow("j0", 30_000)
    assert not store.grow("j0", 12_000)  # never smaller
    store.add_pending(job("j1"))
    other = store.admit_next(1_012.0).grant
    assert other is not None and other.job_id == "j1"
    assert store.promote_due(1_050.0) == ["j0"]
    assert store.admit_next(1_051.0).hold_reason == "kv"  # j1 is in flight
    assert store.release("j1", other.fence)
    again = store.admit_next(1_052.0).grant
    assert again is not None and again.job_id == "j0" and again.prompt_tokens == 30_000
    assert again.kv_tokens == kv_tokens(30_000, 400, BASE.limits.block_tokens) > 20_000
