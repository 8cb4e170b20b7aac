"""The fair-share policy on 10,000+ synthetic jobs, without a network.

A discrete-event simulation drives the in-memory store (the same pure policy and limits the Redis
store runs): a backend with ``cap`` slots, each job holding its slot for a time proportional to
its token cost, a fake clock. Shares are measured over the period in which every project still
has a backlog.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import pytest

from schedulers.policy.fairshare import FairSnapshot, Head, ProjectView, jain_index, order, pending_score
from schedulers.policy.limits import Limits
from schedulers.store.base import PendingItem, StoreConfig
from schedulers.store.memory_store import MemoryStore

OPEN = Limits(
    max_num_seqs=32,
    kv_budget_tokens=10**12,
    long_prompt_tokens=10**9,
    prefill_tokens_per_s=1e12,
    prefill_burst_tokens=10**12,
)


@dataclass
class Sim:
    store: MemoryStore
    now: float = 0.0
    running: list[tuple[float, str, int]] = field(default_factory=list)
    admitted: list[tuple[float, str, str, int]] = field(
        default_factory=list
    )  # t, project, id, cost
    tokens_per_s: float = 2_000.0

    def step(self, costs: dict[str, int]) -> bool:
        """Admit what fits, then advance to the next completion. False when idle."""
        while (grant := self.store.admit_next(self.now).grant) is not None:
            cost = costs[grant.job_id]
            self.admitted.append((self.now, grant.project, grant.job_id, cost))
            heapq.heappush(
                self.running, (self.now + cost / self.tokens_per_s, grant.job_id, grant.fence)
            )
        if not self.running:
            return False
        self.now, job_id, fence = heapq.heappop(self.running)
        assert self.store.release(job_id, fence)
        return True


def make_sim(weights: dict[str, float], limits: Limits = OPEN) -> Sim:
    sim_holder: list[Sim] = []
    store = MemoryStore(
        StoreConfig(limits=limits, weights=weights, aging_s=60.0, gate=False),
        clock=lambda: sim_holder[0].now,
    )
    sim_holder.append(Sim(store))
    return sim_holder[0]


def backlog(sim: Sim, counts: dict[str, int], seed: int) -> dict[str, int]:
    """Random jobs; each project has its own size scale, so counting requests would be unfair."""
    rng = random.Random(seed)
    costs = {}
    for scale, (project, count) in enumerate(counts.items(), start=1):
        for i in range(count):
            prompt, new = rng.randint(200, 2_000) * scale, rng.randint(100, 1_000) * scale
            job_id = f"{project}-{i:05d}"
            costs[job_id] = prompt + new
            sim.store.add_pending(PendingItem(job_id, project, prompt, new, enqueued_at=i * 1e-6))
    return costs


def shares_while_backlogged(sim: Sim, counts: dict[str, int]) -> dict[str, float]:
    """Token shares up to the moment the first project runs out of pending jobs."""
    seen = {p: 0 for p in counts}
    tokens = {p: 0 for p in counts}
    for _t, project, _job, cost in sim.admitted:
        seen[project] += 1
        if seen[project] == counts[project]:
            break
        tokens[project] += cost
    total = sum(tokens.values())
    return {p: tokens[p] / total for p in counts}


def run(sim: Sim, costs: dict[str, int]) -> None:
    while sim.step(costs):
        pass


def test_token_shares_follow_weights_on_12500_jobs() -> None:
    weights = {"assistant": 3, "reports": 2, "translate": 2, "triage": 1, "research": 1}
    counts = {p: 2_500 for p in weights}
    sim = make_sim(weights)
    costs = backlog(sim, counts, seed=1)
    run(sim, costs)
    assert len(sim.admitted) == 12_500  # every job admitted, none twice
    assert len({job for _, _, job, _ in sim.admitted}) == 12_500
    shares = shares_while_backlogged(sim, counts)
    total_weight = sum(weights.values())
    for project, weight in weights.items():
        assert shares[project] == pytest.approx(weight / total_weight, rel=0.05), project
    assert jain_index([shares[p] / weights[p] for p in weights]) >= 0.98


def test_a_heavy_project_does_not_crowd_out_small_ones() -> None:
    weights = {"big": 1, "s1": 1, "s2": 1, "s3": 1, "s4": 1}
    counts = {"big": 10_000, "s1": 1_000, "s2": 1_000, "s3": 1_000, "s4": 1_000}
    sim = make_sim(weights)
    costs = backlog(sim, counts, seed=2)
    run(sim, costs)
    shares = shares_while_backlogged(sim, counts)
    for project in weights:
        assert shares[project] == pytest.approx(0.2, rel=0.05), project
    assert jain_index(list(shares.values())) >= 0.98
    # Work-conserving: once the small projects are done, "big" gets the whole backend.
    small_done = max(t for t, p, _, _ in sim.admitted if p != "big")
    tail = [p for t, p, _, _ in sim.admitted if t > small_done]
    assert tail and set(tail) == {"big"}


def test_idle_project_cannot_hoard_credit() -> None:
    """A project that was idle comes back at the current virtual time, not with a burst."""
    weights = {"a": 1, "b": 1}
    sim = make_sim(weights, Limits(**{**OPEN.__dict__, "max_num_seqs": 1}))
    costs = backlog(sim, {"a": 200}, seed=3)
    for _ in range(100):
        sim.step(costs)
    rng = random.Random(4)
    for i in range(100):
        job_id = f"b-{i:05d}"
        prompt, new = rng.randint(200, 8_000), rng.randint(100, 4_000)
        costs[job_id] = prompt + new
        sim.store.add_pending(PendingItem(job_id, "b", prompt, new, enqueued_at=sim.now))
    start = len(sim.admitted)
    for _ in range(60):
        sim.step(costs)
    window = sim.admitted[start : start + 60]
    b_tokens = sum(cost for _, p, _, cost in window if p == "b")
    share = b_tokens / sum(cost for *_, cost in window)
    assert 0.35 <= share <= 0.65  # equal weights share from the start; no burst of b's credit


def head(job_id: str, project: str, band: str = "batch", enq: float = 0.0, prio: int = 0, **kw):
    return Head(
        job_id,
        project,
        band,
        kw.get("prompt", 100),
        100,
        enq,
        pending_score(enq, prio, 60.0),
        kw.get("long", False),
    )


def test_interactive_goes_first_and_aged_batch_competes() -> None:
    views = (
        ProjectView("a", 1.0, 0.0, (head("a1", "a", enq=100.0),)),
        ProjectView("b", 1.0, 50.0, (head("b1", "b", band="interactive", enq=130.0),)),
    )
    fresh = order(FairSnapshot(views, 0.0, now=130.0), aging_s=60.0)
    assert [h.job_id for h in fresh] == ["b1", "a1"]  # interactive above batch
    aged = order(FairSnapshot(views, 0.0, now=161.0), aging_s=60.0)
    assert [h.job_id for h in aged] == ["a1", "b1"]  # a1 waited 61 s: by virtual time now


def test_priority_ages_within_a_band() -> None:
    old_low = head("low", "a", enq=0.0, prio=0)
    new_high = head("high", "a", enq=30.0, prio=1)
    later_high = head("later", "a", enq=90.0, prio=1)
    assert [h.job_id for h in sorted([old_low, new_high], key=lambda h: h.score)] == ["high", "low"]
    assert [h.job_id for h in sorted([old_low, later_high], key=lambda h: h.score)] == [
        "low",
        "later",
    ]


def test_long_head_offers_a_short_fallback() -> None:
    views = (
        ProjectView("a", 1.0, 0.0, (head("long", "a", long=True), head("short", "a", enq=5.0))),
    )
    assert [h.job_id for h in order(FairSnapshot(views, 0.0, 1.0), 60.0)] == ["long", "short"]


def test_batch_is_not_starved_by_a_stream_of_interactive_jobs() -> None:
    weights = {"chat": 1, "batch": 1}
    sim = make_sim(weights, Limits(**{**OPEN.__dict__, "max_num_seqs": 2}))
    costs = {"b-0": 2_000}
    sim.store.add_pending(PendingItem("b-0", "batch", 1_000, 1_000, enqueued_at=0.0))
    n = 0
    while all(job != "b-0" for _, _, job, _ in sim.admitted):
        for _ in range(3):  # more interactive work than the backend can take
            n += 1
            costs[f"c-{n}"] = 2_000
            sim.store.add_pending(
                PendingItem(f"c-{n}", "chat", 1_000, 1_000, band="interactive", enqueued_at=sim.now)
            )
        assert sim.step(costs)
        assert sim.now < 120.0, "batch job starved"
    admitted_at = next(t for t, _, job, _ in sim.admitted if job == "b-0")
    assert admitted_at >= 60.0  # interactive went first until the batch job had aged


def test_the_fluid_bound_of_the_fairness_bench() -> None:
    """``fleet bench``'s reference for a small project's wait: exact weighted fair share gives a
    project of equal weight half the backend while a big one stays backlogged."""
    from fleet.bench.fleet.fairness import fluid_wait

    small, big = [1.0] * 10, [1.0] * 100
    with_big = fluid_wait({"small": small, "big": big}, {"small": 1, "big": 1}, "small", 0.5)
    alone = fluid_wait({"small": small}, {"small": 1}, "small", 0.5)
    assert (with_big, alone) == (10.0, 5.0)
    weighted = {"heavy": [1.0] * 30, "small": small}
    assert fluid_wait(weighted, {"heavy": 3, "small": 1}, "small", 0.5) == 15 + 5
    drained = {"heavy": [1.0] * 6, "small": small}  # heavy is done after 6: small alone from then on
    assert fluid_wait(drained, {"heavy": 3, "small": 1}, "small", 0.99) == 6 + 9
