"""Admission across several backends (docs/backends.md, sections 4 to 6), on the in-memory twin and
on Redis (Lua): every limit held per backend, a job only a full backend can take holding up
nobody, a lease freeing only its own backend's counters however it ends, the gate per backend,
the head-of-line reservation per backend, and the keys of a one-backend fleet unchanged.

Backends here are "gpu-a" (0), "gpu-b" (1) and "small" (2); a job's ``eligible`` is the bit mask
of the backends it may run on (1: gpu-a, 2: gpu-b, 3: either, 4: small).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import redis

from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.keys import Keys
from schedulers.policy.limits import Limits, kv_tokens
from schedulers.policy.placement import Routing
from schedulers.store.base import BackendLimits, BackendSnapshot, PendingItem, StoreConfig
from schedulers.store.records import Item, Lease
from schedulers.store.redis_store import RedisStore
from tests.support.store_cases import BASE, FakeClock, StoreFactory, admit_ids, job, make_store

__all__ = ["make_store"]  # the parametrised fixture, memory and Redis

NOW = 1_010.0


def backends(*caps: int, **changes: object) -> StoreConfig:
    """A config of len(caps) backends (gpu-a, gpu-b, small), each BASE's limits with that
    max_num_seqs; ``changes``: ``<index>_<field>`` of one backend's limits."""
    names = ("gpu-a", "gpu-b", "small")
    entries = []
    for index, cap in enumerate(caps):
        mine = {k.split("_", 1)[1]: v for k, v in changes.items() if k.startswith(f"b{index}_")}
        entries.append(BackendLimits(names[index], replace(BASE.limits, max_num_seqs=cap, **mine)))
    return StoreConfig.with_backends(entries, lease_ttl_s=30.0, aging_s=60.0, gate=False)


def on(store, name: str) -> BackendSnapshot:
    return store.snapshot().backends[name]


def granted(store, now: float = NOW) -> list[tuple[str, str]]:
    """(job, backend) of every grant until a hold."""
    out = []
    while (result := store.admit_next(now)).grant:
        out.append((result.grant.job_id, result.grant.backend))
    return out


# -- caps per backend -------------------------------------------------------------------------
@pytest.mark.parametrize("caps", [(2, 3), (2, 3, 1)], ids=["2 backends", "3 backends"])
def test_each_backend_holds_its_own_sequence_cap(make_store: StoreFactory, caps: tuple[int, ...]) -> None:
    store = make_store(backends(*caps))
    every = (1 << len(caps)) - 1
    for i in range(10):
        store.add_pending(job(f"j{i}", project="abc"[i % 3], eligible=every))
    grants = granted(store)
    assert len(grants) == sum(caps)
    assert store.admit_next(NOW).hold_reason == "seqs"
    snap = store.snapshot()
    assert {name: b.in_flight for name, b in snap.backends.items()} == dict(
        zip(("gpu-a", "gpu-b", "small"), caps, strict=False))
    assert snap.in_flight == sum(caps)
    assert snap.reserved_kv_tokens == sum(b.reserved_kv_tokens for b in snap.backends.values())


def test_the_least_loaded_backend_gets_the_job_ties_in_settings_order(make_store: StoreFactory) -> None:
    """gpu-a seats 2, gpu-b 4: a half-full gpu-a counts as loaded as a half-full gpu-b."""
    store = make_store(backends(2, 4))
    for i in range(6):
        store.add_pending(job(f"j{i}", eligible=3))
    assert granted(store) == [("j0", "gpu-a"), ("j1", "gpu-b"), ("j2", "gpu-b"), ("j3", "gpu-a"),
                              ("j4", "gpu-b"), ("j5", "gpu-b")]


def test_kv_long_and_block_size_are_each_backends_own(make_store: StoreFactory) -> None:
    """gpu-b has 500-token blocks, a 6,000-token long threshold and room for one long prompt;
    a job's KV reservation and long flag are those of the backend it runs on."""
    store = make_store(backends(4, 4, b1_block_tokens=500, b1_long_prompt_tokens=6_000, b1_max_long=1,
                                b0_kv_budget_tokens=3_000))
    store.add_pending(job("a0", prompt=2_001, new=0, eligible=1))  # gpu-a: 3 blocks of 1,000
    store.add_pending(job("b1", prompt=2_001, new=0, eligible=2))  # gpu-b: 5 blocks of 500
    store.add_pending(job("b2", prompt=7_000, new=0, eligible=2))  # long on gpu-b
    store.add_pending(job("b3", prompt=7_000, new=0, eligible=2))  # the second long one waits
    store.add_pending(job("a4", prompt=500, new=0, eligible=1))  # gpu-a's KV budget is full
    results = store.admit_many(NOW, 8)
    grants = {r.grant.job_id: r.grant for r in results if r.grant}
    assert sorted(grants) == ["a0", "b1", "b2"]
    assert (grants["a0"].kv_tokens, grants["a0"].backend) == (3_000, "gpu-a")
    assert (grants["b1"].kv_tokens, grants["b1"].long) == (2_500, False)
    assert (grants["b2"].kv_tokens, grants["b2"].long) == (kv_tokens(7_000, 0, 500), True)
    # b3, first in line now, is held by gpu-b's long cap (and a4 behind it by gpu-a's KV budget)
    assert results[-1].hold_reason == "long"
    assert store.pending_ids() == {"b3", "a4"}
    assert store.cancel_pending("b3")
    assert store.admit_next(NOW).hold_reason == "kv"
    assert on(store, "gpu-a") == BackendSnapshot(1, 3_000, 0, 0, 0)
    assert on(store, "gpu-b") == BackendSnapshot(2, 2_500 + 7_000, 1, 0, 0)


# -- a full backend blocks nobody else --------------------------------------------------------
@pytest.mark.parametrize("caps", [(1, 3), (1, 3, 2)], ids=["2 backends", "3 backends"])
def test_a_job_only_a_full_backend_can_take_holds_up_no_one(make_store: StoreFactory,
                                                            caps: tuple[int, ...]) -> None:
    """gpu-a is full: project a's next job, only for gpu-a, waits first in line, and both the
    same project's job for gpu-b behind it and project b's (behind it in fair order: b was
    served before) go."""
    store = make_store(backends(*caps))
    store.add_pending(job("z0", project="z", eligible=1))
    store.add_pending(job("b0", project="b", eligible=2))
    assert sorted(granted(store)) == [("b0", "gpu-b"), ("z0", "gpu-a")]
    assert store.release("b0", store.lease_fences()["b0"])
    store.add_pending(job("a1", eligible=1))  # first in line, only gpu-a
    store.add_pending(job("a2", eligible=2))
    store.add_pending(job("b3", project="b", eligible=2))
    results = store.admit_many(NOW, 8)
    assert [(r.grant.job_id, r.grant.backend) for r in results if r.grant] == [("a2", "gpu-b"), ("b3", "gpu-b")]
    assert results[-1].hold_reason == "seqs"  # a1's, on gpu-a
    assert store.pending_ids() == {"a1"}


def test_a_reservation_drains_only_the_backend_it_is_on(make_store: StoreFactory) -> None:
    """A big job first in line, blocked by gpu-a's KV budget for hol_bypass_s, keeps gpu-a for
    itself (short jobs stop passing it there) while gpu-b goes on admitting."""
    store = make_store(backends(4, 4, b0_kv_budget_tokens=5_000, b1_kv_budget_tokens=5_000))
    store.add_pending(job("s0", project="b", prompt=1_500, new=0, eligible=1))
    assert granted(store, 1_000.0) == [("s0", "gpu-a")]
    store.add_pending(job("big", prompt=4_000, new=0, eligible=1, enqueued_at=990.0))
    store.add_pending(job("s1", project="b", prompt=500, new=0, eligible=1))
    store.add_pending(job("t1", project="c", prompt=500, new=0, eligible=2))
    assert granted(store, 1_000.0) == [("t1", "gpu-b"), ("s1", "gpu-a")]  # within the window
    store.add_pending(job("s2", project="b", prompt=500, new=0, eligible=1))
    store.add_pending(job("t2", project="c", prompt=500, new=0, eligible=2))
    assert granted(store, 1_006.0) == [("t2", "gpu-b")]  # gpu-a reserved for big: s2 waits
    assert store.admit_next(1_006.0).hold_reason == "kv"
    for name in ("s0", "s1"):
        assert store.release(name, store.lease_fences()[name])
    assert granted(store, 1_006.0) == [("big", "gpu-a"), ("s2", "gpu-a")]


def test_a_mask_naming_no_configured_backend_holds_up_no_one(make_store: StoreFactory) -> None:
    store = make_store(backends(2, 2))
    store.add_pending(job("x0", eligible=4))  # a third backend this config does not have
    store.add_pending(job("b1", project="b"))
    assert granted(store) == [("b1", "gpu-a")]
    assert store.admit_next(NOW).hold_reason == "no_backend"
    with pytest.raises(ValueError, match="names no backend"):
        store.add_pending(job("z", eligible=0))


# -- routing: the prefix-cache hint, the imbalance thresholds, the baselines --------------------
def test_a_job_goes_to_its_hint_backend_while_the_load_is_near(make_store: StoreFactory) -> None:
    """gpu-b holds the prefix of h*: they go there although gpu-a is as idle, until gpu-b has more
    than balance_abs_seqs (2) sequences beyond gpu-a at a load above 1.5x its: then load wins."""
    config = replace(backends(8, 8), routing=Routing(balance_abs_seqs=2, balance_rel=1.5))
    store = make_store(config)
    for i in range(5):
        store.add_pending(job(f"h{i}", eligible=3, hint=1, uncached_tokens=0))
    assert granted(store) == [("h0", "gpu-b"), ("h1", "gpu-b"), ("h2", "gpu-b"),
                              ("h3", "gpu-a"), ("h4", "gpu-b")]


def test_a_hint_outside_the_usable_backends_falls_back_to_the_least_loaded(make_store: StoreFactory) -> None:
    store = make_store(backends(1, 4))
    store.add_pending(job("x0", eligible=1))  # fills gpu-a
    store.add_pending(job("h1", project="b", eligible=3, hint=0, uncached_tokens=0))
    store.add_pending(job("h2", project="c", eligible=2, hint=0))  # the hint is not in its mask
    assert granted(store) == [("x0", "gpu-a"), ("h1", "gpu-b"), ("h2", "gpu-b")]


def test_uncached_tokens_count_on_the_hint_backend_only(make_store: StoreFactory) -> None:
    """Both prefill buckets (6,000 tokens) are left at 2,000 by a 4,000-token prompt each. A
    9,000-token prompt cached on gpu-b (1,000 uncached) fits gpu-b's; on gpu-a its whole prompt
    counts (up to the burst), which the bucket refuses, though least_loaded would pick gpu-a."""
    config = backends(4, 4, b0_prefill_burst_tokens=6_000, b1_prefill_burst_tokens=6_000,
                      b0_prefill_tokens_per_s=1.0, b1_prefill_tokens_per_s=1.0)
    store = make_store(replace(config, routing=Routing(policy="least_loaded")))
    store.add_pending(job("p0", prompt=4_000, new=0, eligible=1))
    store.add_pending(job("p1", project="b", prompt=4_000, new=0, eligible=2))
    assert granted(store) == [("p0", "gpu-a"), ("p1", "gpu-b")]
    store.add_pending(job("c2", prompt=9_000, eligible=3, hint=1, uncached_tokens=1_000))
    assert granted(store) == [("c2", "gpu-b")]
    store.add_pending(job("c3", prompt=9_000, eligible=1, hint=1, uncached_tokens=1_000))
    result = store.admit_next(NOW)
    assert result.grant is None and result.hold_reason == "bucket"


@pytest.mark.parametrize(("policy", "expected"), [("fleet", "gpu-a"), ("first_token", "gpu-b")])
def test_first_token_weighs_the_cached_prefix_against_the_prefills_before_it(
        make_store: StoreFactory, policy: str, expected: str) -> None:
    """Both servers prefill 1,000 tokens/s. gpu-a was just sent a 9,000-token report (its prefill
    runs until NOW + 9 s). A 9,000-token prompt cached on gpu-a but for 2,000 tokens would get its
    first token there in 9 + 2 = 11 s, on gpu-b in 9 s: first_token sends it to gpu-b, the fleet
    rule to its hint."""
    config = backends(4, 4, b0_queue_tokens_per_s=1_000.0, b1_queue_tokens_per_s=1_000.0)
    store = make_store(replace(config, routing=Routing(policy=policy)))
    store.add_pending(job("r0", prompt=9_000, new=0, eligible=1, uncached_tokens=9_000))
    assert granted(store) == [("r0", "gpu-a")]
    store.add_pending(job("c1", project="b", prompt=9_000, eligible=3, hint=0, uncached_tokens=2_000))
    assert granted(store) == [("c1", expected)]


def test_first_token_keeps_a_job_on_its_cached_prefix_when_that_is_sooner(make_store: StoreFactory) -> None:
    config = backends(4, 4, b0_queue_tokens_per_s=1_000.0, b1_queue_tokens_per_s=1_000.0)
    store = make_store(replace(config, routing=Routing(policy="first_token")))
    store.add_pending(job("r0", prompt=3_000, new=0, eligible=1, uncached_tokens=3_000))  # gpu-a busy 3 s
    assert granted(store) == [("r0", "gpu-a")]
    store.add_pending(job("c1", project="b", prompt=9_000, eligible=3, hint=0, uncached_tokens=1_000))
    assert granted(store) == [("c1", "gpu-a")]  # 3 + 1 s there against 9 s on gpu-b


def test_least_loaded_ignores_the_hint(make_store: StoreFactory) -> None:
    store = make_store(replace(backends(4, 4), routing=Routing(policy="least_loaded")))
    for i in range(3):
        store.add_pending(job(f"h{i}", eligible=3, hint=1, uncached_tokens=0))
    assert granted(store) == [("h0", "gpu-a"), ("h1", "gpu-b"), ("h2", "gpu-a")]


def test_round_robin_takes_the_next_usable_backend(make_store: StoreFactory) -> None:
    store = make_store(replace(backends(4, 1, 4), routing=Routing(policy="round_robin")))
    for i in range(6):
        store.add_pending(job(f"r{i}", project="abc"[i % 3], eligible=7, hint=2))
    assert granted(store) == [("r0", "gpu-a"), ("r1", "gpu-b"), ("r2", "small"),
                              ("r3", "gpu-a"), ("r4", "small"), ("r5", "gpu-a")]


def test_a_hint_is_kept_in_the_record_and_through_a_continuation(redis_client: redis.Redis,
                                                                 key_prefix: str) -> None:
    store = RedisStore(redis_client, Keys(key_prefix), backends(4, 4))
    store.add_pending(job("h0", eligible=3, hint=1, uncached_tokens=200))
    store.add_pending(job("n1", project="b", eligible=3))
    raw = {k.decode(): Item.unpack(v.decode()) for k, v in redis_client.hgetall(key_prefix + "{d}:items").items()}
    assert (raw["h0"].elig, raw["h0"].hint, raw["n1"].hint) == ("3", "1", None)
    grants = granted(store)
    assert ("h0", "gpu-b") in grants
    fence = store.lease_fences()["h0"]
    assert store.readmit("h0", fence, 300, NOW, NOW)
    again = Item.unpack(redis_client.hget(key_prefix + "{d}:items", "h0").decode())
    assert (again.elig, again.hint) == ("3", "1")


# -- a lease frees its own backend only ---------------------------------------------------------
def _one_on_each(store) -> dict[str, int]:
    store.add_pending(job("a0", prompt=12_000, new=0, eligible=1, band="interactive"))
    store.add_pending(job("b1", project="b", prompt=700, new=300, eligible=2))
    assert sorted(granted(store)) == [("a0", "gpu-a"), ("b1", "gpu-b")]
    return store.lease_fences()


@pytest.mark.parametrize("end", ["release", "requeue", "readmit", "reap"])
@pytest.mark.parametrize("caps", [(4, 4), (4, 4, 4)], ids=["2 backends", "3 backends"])
def test_a_lease_frees_only_its_own_backends_counters(make_store: StoreFactory, end: str,
                                                      caps: tuple[int, ...]) -> None:
    clock = FakeClock(NOW)
    store = make_store(backends(*caps), clock)
    fences = _one_on_each(store)
    assert store.claim("a0", fences["a0"], "w1", NOW) and store.claim("b1", fences["b1"], "w2", NOW)
    a_before = on(store, "gpu-a")
    assert a_before == BackendSnapshot(1, 12_000, 1, 1, 1)
    assert on(store, "gpu-b") == BackendSnapshot(1, 1_000, 0, 0, 1)
    if end == "release":
        assert store.release("b1", fences["b1"])
    elif end == "requeue":
        assert store.requeue("b1", fences["b1"])
    elif end == "readmit":
        assert store.readmit("b1", fences["b1"], 300, NOW, NOW)
    else:
        assert store.renew("a0", fences["a0"], NOW + 20)
        assert store.reap_expired(NOW + 31) == ["b1"]
    assert on(store, "gpu-b") == BackendSnapshot()
    assert on(store, "gpu-a") == a_before
    if len(caps) == 3:
        assert on(store, "small") == BackendSnapshot()
    if end != "release":  # back in line, for gpu-b again
        assert granted(store, NOW + 31) == [("b1", "gpu-b")]


def test_a_claim_answers_the_backend_its_lease_was_granted_on(make_store: StoreFactory) -> None:
    """The worker and the gateway stream to what the claim answers, not to what a task names."""
    store = make_store(backends(1, 1, 1))
    for i, mask in enumerate((4, 2, 1)):
        store.add_pending(job(f"j{i}", project="abc"[i], eligible=mask))
    assert sorted(granted(store)) == [("j0", "small"), ("j1", "gpu-b"), ("j2", "gpu-a")]
    fences = store.lease_fences()
    assert store.claim_on("j0", fences["j0"] + 1, "w1", NOW) is None  # a stale fence
    assert [store.claim_on(f"j{i}", fences[f"j{i}"], "w1", NOW) for i in range(3)] == ["small", "gpu-b", "gpu-a"]
    assert store.claim_on("j1", fences["j1"], "w1", NOW + 1) == "gpu-b"  # the same owner again
    assert store.claim_on("j1", fences["j1"], "w2", NOW + 1) is None  # a duplicate delivery
    assert {name: b.claimed for name, b in store.snapshot().backends.items()} == {"gpu-a": 1, "gpu-b": 1, "small": 1}


# -- the gate per backend ---------------------------------------------------------------------
def test_a_stale_backend_is_passed_over_and_used_again_once_fresh(make_store: StoreFactory) -> None:
    clock = FakeClock(NOW)
    store = make_store(replace(backends(2, 2, 2), gate=True, scrape_stale_s=5.0), clock)
    store.record_backend(NOW, "", {})  # gpu-a
    store.record_backend(NOW, "waiting", {}, "small")
    store.record_backend(NOW - 6, "", {"outside": "1"}, "gpu-b")  # stale
    store.add_pending(job("b0", eligible=2))  # only gpu-b
    store.add_pending(job("e1", project="b", eligible=3))
    store.add_pending(job("s2", project="c", eligible=4))
    assert granted(store) == [("e1", "gpu-a")]
    assert store.admit_next(NOW).hold_reason == "backend_stale"  # b0 first in line, on gpu-b
    assert store.backend("gpu-b")["outside"] == "1" and store.backend()["hold"] == ""
    store.record_backend(NOW, "", {"outside": "1"}, "gpu-b")  # fresh, outside clients hold one
    assert granted(store) == [("b0", "gpu-b")]
    store.record_backend(NOW, "", {}, "small")
    assert granted(store) == [("s2", "small")]
    store.add_pending(job("b3", eligible=2))
    assert store.admit_next(NOW).hold_reason == "outside"
    with pytest.raises(KeyError):
        store.record_backend(NOW, "", {}, "gpu-z")


# -- continuations keep their class ----------------------------------------------------------------
def test_a_continuation_goes_back_to_its_own_class(make_store: StoreFactory) -> None:
    clock = FakeClock(NOW)
    store = make_store(backends(2, 2), clock)
    store.add_pending(job("j0", eligible=2))
    fence = store.admit_next(NOW).grant.fence
    assert store.readmit("j0", fence, 500, NOW + 5, NOW, prompt_tokens=700, turn=2)
    assert store.continuations() == {"a": {"deferred": 1}}
    assert store.promote_due(NOW + 5) == ["j0"]
    store.add_pending(job("j1", eligible=1))
    again = store.admit_many(NOW + 5, 4)
    assert [(r.grant.job_id, r.grant.backend) for r in again if r.grant] == [("j0", "gpu-b"), ("j1", "gpu-a")]
    assert store.turn_of("j0") == 2


@pytest.mark.parametrize("how", ["readmit", "readmit later", "grow"])
def test_a_grown_continuation_moves_to_the_class_it_fits_now(make_store: StoreFactory, how: str) -> None:
    """gpu-a is full (j9); j0 ran on gpu-b and its next prompt fits only gpu-a now (its new mask,
    1): it waits for gpu-a, and j1 (either) takes gpu-b."""
    clock = FakeClock(NOW)
    store = make_store(backends(1, 2), clock)
    store.add_pending(job("j0", eligible=2))
    assert granted(store) == [("j0", "gpu-b")]
    fence = store.lease_fences()["j0"]
    store.add_pending(job("j9", project="c", eligible=1))
    assert granted(store) == [("j9", "gpu-a")]
    if how == "readmit":
        assert store.readmit("j0", fence, 500, NOW, NOW, prompt_tokens=900, turn=2, eligible=1)
    else:
        assert store.readmit("j0", fence, 500, NOW + 5, NOW, prompt_tokens=700, turn=2)
        if how == "grow":
            assert store.grow("j0", 900, eligible=1)
            assert not store.grow("j0", 800, eligible=3)  # never smaller, the mask stays
        else:
            store.grow("j0", 900)
            assert not store.readmit("j0", fence, 500, NOW, NOW, eligible=1)  # its lease is gone
        assert store.promote_due(NOW + 5) == ["j0"]
    store.add_pending(job("j1", project="b", eligible=3))
    if how == "readmit later":  # grown without a new mask: still gpu-b's, beside j1
        assert sorted(granted(store, NOW + 5)) == [("j0", "gpu-b"), ("j1", "gpu-b")]
    else:
        assert granted(store, NOW + 5) == [("j1", "gpu-b")]
        assert store.release("j9", store.lease_fences()["j9"])
        assert granted(store, NOW + 5) == [("j0", "gpu-a")]


def test_a_continuation_is_hinted_to_the_backend_it_ran_on(make_store: StoreFactory) -> None:
    """j1 ran on gpu-b (gpu-a was busy); readmitted, its next turn goes back to gpu-b, where its
    prompt is cached, though gpu-a is as idle and first in order."""
    clock = FakeClock(NOW)
    store = make_store(backends(4, 4), clock)
    store.add_pending(job("x0", eligible=1))
    store.add_pending(job("j1", project="b", eligible=3))
    assert granted(store) == [("x0", "gpu-a"), ("j1", "gpu-b")]
    fences = store.lease_fences()
    assert store.release("x0", fences["x0"])
    assert store.readmit("j1", fences["j1"], 500, NOW, NOW, prompt_tokens=900, turn=2)
    assert granted(store) == [("j1", "gpu-b")]


def test_promote_leaves_a_continuation_whose_class_changed_since_it_was_read(
        redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GROW moves a waiting continuation to another class between promote_due's read of its item
    and the script: the script leaves it waiting (it is in no queue of the class it was read in),
    and the next call puts it in the queue of its new class."""
    clock = FakeClock(NOW)
    store = RedisStore(redis_client, Keys(key_prefix), backends(2, 2), clock=clock)
    store.add_pending(job("j0", eligible=3))
    [(_, where_it_ran)] = granted(store)
    assert store.readmit("j0", store.lease_fences()["j0"], 500, NOW + 5, NOW, prompt_tokens=700, turn=2)
    read_before = store._where(["j0"])
    assert store.grow("j0", 900, eligible=2)
    monkeypatch.setattr(store, "_where", lambda ids: read_before)
    assert store.promote_due(NOW + 5) == []
    assert store.continuations() == {"a": {"deferred": 1}}
    monkeypatch.undo()
    assert store.promote_due(NOW + 5) == ["j0"]
    assert granted(store, NOW + 5) == [("j0", "gpu-b")]
    assert where_it_ran == "gpu-a"


@pytest.mark.parametrize(("charge", "a_first"), [(1.0, 3), (0.25, 4)])
def test_a_backends_charge_per_token_counts_in_fair_share(make_store: StoreFactory, charge: float,
                                                          a_first: int) -> None:
    """Project a runs on "small" only, b on gpu-a only, jobs of one size. With "small" charging
    a token as one, fair share alternates them (3 of the first 5 grants are a's); charging a
    quarter, a's jobs cost a quarter of its share: four of a's for one of b's."""
    entries = [BackendLimits("gpu-a", replace(BASE.limits, max_num_seqs=8)),
               BackendLimits("small", replace(BASE.limits, max_num_seqs=8), charge_per_token=charge)]
    store = make_store(StoreConfig.with_backends(entries, lease_ttl_s=30.0, aging_s=60.0, gate=False))
    for i in range(8):
        store.add_pending(job(f"a{i}", project="a", eligible=2))
        store.add_pending(job(f"b{i}", project="b", eligible=1))
    order = [job_id for job_id, _backend in granted(store)]
    assert sum(1 for job_id in order[:5] if job_id.startswith("a")) == a_first, order


# -- Redis: keys, records, recount, gateway ---------------------------------------------------------
def _redis(redis_client: redis.Redis, key_prefix: str, config: StoreConfig, clock: FakeClock | None = None
           ) -> tuple[RedisStore, str]:
    store = RedisStore(redis_client, Keys(key_prefix), config, clock=clock or FakeClock(NOW))
    return store, Keys(key_prefix).dispatch


def test_one_backend_keeps_its_keys_and_records(redis_client: redis.Redis, key_prefix: str) -> None:
    store, d = _redis(redis_client, key_prefix, BASE)
    store.add_pending(job("j0"))
    store.add_pending(job("j1"))
    grant = store.admit_next(NOW).grant
    assert grant is not None and grant.backend == "default"
    assert store.claim(grant.job_id, grant.fence, "w1", NOW)
    keys = {k.decode().removeprefix(d) for k in redis_client.scan_iter(match=f"{d}*")}
    assert keys == {"items", "pending:a:batch:short", "projects", "state", "vtime", "wake", "leases", "lease",
                    "fences", "stats"}
    raw_item = redis_client.hget(d + "items", "j1").decode()
    assert len(raw_item.split(" ")) == 14 and Item.unpack(raw_item).elig == "1"  # no elig written
    raw_lease = redis_client.hget(d + "lease", "j0").decode()
    assert raw_lease.endswith(" a w1") and Lease.unpack(raw_lease).backend == "0"  # no backend written
    assert redis_client.smembers(d + "projects") == {b"a"}


def test_several_backends_keys_and_records(redis_client: redis.Redis, key_prefix: str) -> None:
    store, d = _redis(redis_client, key_prefix, replace(backends(2, 2), gate=True))
    store.record_backend(NOW, "", {})
    store.record_backend(NOW, "", {}, "gpu-b")
    store.add_pending(job("j0", eligible=2))
    store.add_pending(job("j1", eligible=3))
    assert redis_client.smembers(d + "projects") == {b"a:2", b"a:3"}
    assert redis_client.zrange(d + "pending:a:batch:short:2", 0, -1) == [b"j0"]
    assert Item.unpack(redis_client.hget(d + "items", "j1").decode()).where == ("a", "batch", "short", "3")
    assert granted(store) == [("j0", "gpu-b"), ("j1", "gpu-a")]
    assert Lease.unpack(redis_client.hget(d + "lease", "j0").decode()).backend == "1"
    assert store.claim("j0", store.lease_fences()["j0"], "w1", NOW)
    assert redis_client.hget(d + "bstate:gpu-b", "claimed") == b"1"
    assert redis_client.hget(d + "state", "claimed") in (None, b"0")
    assert redis_client.hget(d + "backend:gpu-b", "hold") == b""
    assert store.cancel_pending("nothing") is False
    store.add_pending(job("j2", eligible=2))
    assert store.cancel_pending("j2") and store.pending_ids() == set()


def test_recount_puts_each_backends_counters_right(redis_client: redis.Redis, key_prefix: str) -> None:
    store, d = _redis(redis_client, key_prefix, backends(4, 4, 4))
    store.add_pending(job("a0", prompt=12_000, eligible=1))
    store.add_pending(job("c1", project="c", prompt=12_000, eligible=4, band="interactive"))
    assert len(granted(store)) == 2
    assert store.recount() == {}
    redis_client.hincrby(d + "bstate:small", "long", 1)
    redis_client.hincrby(d + "bstate:gpu-b", "in_flight", 2)
    redis_client.hincrby(d + "state", "kv", -1)
    assert store.recount() == {"small:long": (2, 1), "gpu-b:in_flight": (2, 0), "kv": (12_999, 13_000)}
    assert on(store, "small") == BackendSnapshot(1, 13_000, 1, 1, 0)
    assert store.recount() == {}


def test_a_gateway_request_is_granted_and_claimed_on_its_backend(redis_client: redis.Redis,
                                                                 key_prefix: str) -> None:
    store, d = _redis(redis_client, key_prefix, backends(1, 2))
    store.add_pending(job("q0", eligible=3))
    assert granted(store) == [("q0", "gpu-a")]
    request = PendingItem("g1", "g", 100, 100, band="interactive", deadline=NOW + 30, eligible=3)
    results, fence = store.enter_gateway(request, "gateway-1", NOW, False, 8)
    assert fence and [(r.grant.job_id, r.grant.backend) for r in results if r.grant] == [("g1", "gpu-b")]
    assert redis_client.hget(d + "bstate:gpu-b", "claimed") == b"1"
    assert on(store, "gpu-b").claimed == 1 and on(store, "gpu-a").claimed == 0


def test_from_settings_lists_every_backend_in_order() -> None:
    settings = load_settings(EXAMPLE_CONFIG, env={})
    first = settings.backend
    second = first.model_copy(update={"name": "gpu-b", "max_num_seqs": 7, "block_tokens": 512})
    several = settings.model_copy(update={"backends": [first, second]})  # past the refusal at load
    config = StoreConfig.from_settings(several)
    assert [b.name for b in config.backends] == [first.name, "gpu-b"]
    assert config.limits == Limits.from_settings(settings) == config.backends[0].limits
    assert (config.backends[1].limits.max_num_seqs, config.backends[1].limits.block_tokens) == (7, 512)
    one = StoreConfig.from_settings(settings)
    assert one.more_backends == () and one.backend_name == first.name
    assert replace(config, limits=replace(config.limits, max_num_seqs=1)).backends[1] == config.backends[1]
    with pytest.raises(ValueError, match="unique"):
        StoreConfig.with_backends([BackendLimits("x", Limits()), BackendLimits("x", Limits())])


def test_admit_ids_helper_still_sees_one_backend(make_store: StoreFactory) -> None:
    """The one-backend config of the other store tests: grants name backend 0, "default"."""
    store = make_store()
    store.add_pending(job("j0"))
    assert admit_ids(store, NOW) == ["j0"]
    assert list(store.snapshot().backends) == ["default"]


def test_backends_may_be_appended_but_not_reordered_while_jobs_hold_positions(
        redis_client: redis.Redis, key_prefix: str) -> None:
    """A job's eligibility bits and a lease's backend are positions in the backends' order: the
    store refuses another order while anything is in line or in flight, takes an appended
    backend at any time and any order once drained."""
    from schedulers.store.redis_store import BackendOrderChanged

    def store(config: StoreConfig) -> RedisStore:
        return RedisStore(redis_client, Keys(key_prefix), config, clock=FakeClock())

    two = store(backends(2, 2))
    two.register_backends()
    two.add_pending(job("j1", eligible=0b10))
    store(backends(2, 2, 2)).register_backends()  # small appended: fine
    names = ["gpu-b", "gpu-a"]
    swapped = StoreConfig.with_backends([BackendLimits(n, BASE.limits) for n in names], gate=False)
    with pytest.raises(BackendOrderChanged, match="gpu-a, gpu-b, small in this order"):
        store(swapped).register_backends()
    assert two.cancel_pending("j1")
    store(swapped).register_backends()  # drained: any order
    assert redis_client.get(f"{Keys(key_prefix).dispatch}backends") == b'["gpu-b", "gpu-a"]'
