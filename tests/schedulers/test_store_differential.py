"""The in-memory twin and the Redis store (Lua) agree: one random operation sequence, both stores.

A hypothesis state machine draws a small configuration (few sequences, a small KV budget, one or
two long prompts at a time, one or two long prefills per quiet window, drains that pay or not
(``short_job_s``), a tight prefill bucket,
spacing, project weights, the backend gate on or off) and jobs with and without prep's
uncached-token estimate, then feeds the same submits, resubmits, admissions (one at a time and
several per call), claims, renewals, releases, requeues (of any lease, or of unclaimed ones only),
readmits (continuations, with and without a not-before time), promotions, hurries, cancels,
deadline expiries, backend verdicts and clock steps (which reap unrenewed leases) to a
``MemoryStore`` and a ``RedisStore`` sharing one fake clock. Every
answer must be equal - grants (job, fence, project, sizes, expiry, wait), hold reasons and their
retry times, booleans, reaped, expired and promoted ids - and after every step so must the
snapshots (pending per project and band, in flight, reserved KV, long and interactive in flight,
claimed leases, admissions, holds, and each backend's counters), the live leases, the pending
ids, the next deadline, expiry and not-before time, and the continuations waiting per project;
and Redis's counters must be the sums over the live leases (``recount`` finds nothing to put
right).

A second run of the same machine draws only configurations with quiet long prefills on and room
for long prompts (``quiet_configs``), so that its admissions reach the window, the drain (paying
or not) and the protection of interactive work, rather than stopping at the KV budget.

Both draw one to three backends (gpu-a, gpu-b, small), each with limits of its own (the others'
block size and long threshold may differ from gpu-a's), and each job an eligibility mask that
makes sense for them: with three, "small" serves another model (mask 4) and gpu-a and gpu-b the
same one (either: 3, or one of them: 1, 2); with two, either or one; now and then a mask naming
a backend the config does not have. Backend verdicts are drawn per backend, and the snapshots
compared include each backend's counters. Each job may carry a prefix-cache hint (a backend of
its mask or not, or none), and each config a routing policy (fleet with tight or loose imbalance
thresholds, least loaded, round robin), so the two ``pick``s are compared on every grant; and
each backend a ``charge_per_token`` (1, a quarter, three times), so the finish tags differ by
where a job ran. Each config may give one or two projects a quota (tokens per minute or day,
requests per minute, an in-flight cap, cheaper cached or dearer output tokens), and a worker may
settle its grant's turn with what it spent: the quota holds, reservations and refunds, and each
project's usage in the current windows must agree too.

The order of ``reap_expired``'s ids is not part of the contract (the caller only logs them), so
they are compared as sorted lists. Resubmissions happen at any time, in flight too.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import redis
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from fleet.core.keys import Keys
from schedulers.policy.limits import Limits
from schedulers.policy.locality import Locality
from schedulers.policy.placement import Routing
from schedulers.policy.quota import Quota
from schedulers.store.base import BackendLimits, PendingItem, StoreConfig
from schedulers.store.memory_store import MemoryStore
from schedulers.store.redis_store import RedisStore
from tests.support.store_cases import FakeClock
from tests.support.testenv import TEST_REDIS_URL, delete_prefix

PROJECTS = ("a", "b", "c")
LONG_PROMPT_TOKENS = 10_000
# Around the long threshold, and one prompt bigger than some drawn KV budgets and buckets.
PROMPTS = (300, 2_500, 9_000, LONG_PROMPT_TOKENS, LONG_PROMPT_TOKENS + 1, 12_000, 25_000)

small_limits = st.builds(
    Limits,
    max_num_seqs=st.integers(1, 4),
    kv_budget_tokens=st.sampled_from([8_000, 20_000, 40_000]),
    block_tokens=st.just(1000),
    long_prompt_tokens=st.just(LONG_PROMPT_TOKENS),
    max_long=st.integers(1, 2),
    prefill_tokens_per_s=st.sampled_from([4_000.0, 30_000.0, 1e9]),
    prefill_burst_tokens=st.sampled_from([12_000, 40_000, 10**9]),
    min_spacing_s=st.sampled_from([0.0, 0.0, 0.7]),
    hol_bypass_s=st.sampled_from([0.0, 3.0, 10.0]),
    long_prefill_tokens_per_s=st.sampled_from([0.0, 0.0, 5_000.0]),
    short_beside_long=st.integers(0, 1),
    long_prefills=st.integers(1, 2),
    short_job_s=st.sampled_from([0.0, 0.0, 2.0, 60.0]),
    # the prefix cache's room (locality): none, a few jobs' worth, many
    cache_tokens=st.sampled_from([0, 6_000, 30_000]),
    # the first_token routing's prefill rate: none (the fleet rule), slow, fast
    queue_tokens_per_s=st.sampled_from([0.0, 2_000.0, 20_000.0]),
)
NAMES = ("gpu-a", "gpu-b", "small")
# Backends beside the first: another block size and long threshold now and then (the queues are
# split by the first's threshold; each backend's KV and long cap count its own).
more_limits = st.builds(
    lambda limits, block, threshold: replace(limits, block_tokens=block, long_prompt_tokens=threshold),
    small_limits, st.sampled_from([1000, 1000, 500]), st.sampled_from([LONG_PROMPT_TOKENS, 8_000, 20_000]))


def with_backends(first: Limits, more: list[Limits], charges: tuple[float, ...] = (1.0, 1.0, 1.0),
                  **fields: Any) -> StoreConfig:
    """A config of ``first`` and ``more`` (gpu-a, gpu-b, small, in that order), each backend's
    tokens charged to fair share at ``charges``."""
    return StoreConfig.with_backends(
        [BackendLimits(name, limits, charge)
         for name, limits, charge in zip(NAMES, [first, *more], charges, strict=False)], **fields)


def masks_for(count: int) -> tuple[int, ...]:
    """Eligibility masks of a fleet of ``count`` backends (module docstring)."""
    return {1: (1,), 2: (3, 3, 1, 2), 3: (3, 3, 1, 2, 4)}[count]


quota_specs = st.builds(
    Quota, tokens_per_minute=st.sampled_from([0, 8_000, 30_000]), requests_per_minute=st.sampled_from([0, 0, 2]),
    tokens_per_day=st.sampled_from([0, 0, 50_000]), max_in_flight=st.sampled_from([0, 0, 1, 2]),
    cost_cached=st.sampled_from([1.0, 0.5]), cost_output=st.sampled_from([1.0, 2.0]))
quota_maps = st.one_of(st.just({}), st.dictionaries(st.sampled_from(PROJECTS), quota_specs, min_size=1, max_size=2))
routings = st.builds(
    Routing, policy=st.sampled_from(["fleet", "fleet", "first_token", "first_token", "least_loaded", "round_robin"]),
    balance_abs_seqs=st.sampled_from([0, 1, 4]), balance_rel=st.sampled_from([1.0, 1.5]))
# which of a queue's first jobs goes (schedulers/policy/locality.py): mostly off in ``configs``
localities = st.builds(Locality, lookahead=st.sampled_from([1, 1, 2, 4]), max_wait_s=st.sampled_from([0.0, 0.0, 20.0]))
configs = st.builds(
    with_backends,
    first=small_limits,
    more=st.lists(more_limits, max_size=2),
    lease_ttl_s=st.just(30.0),
    aging_s=st.sampled_from([10.0, 60.0]),
    weights=st.dictionaries(st.sampled_from(PROJECTS), st.sampled_from([0.5, 1.0, 3.0])),
    gate=st.sampled_from([False, False, True]),
    scrape_stale_s=st.just(5.0),
    routing=routings,
    charges=st.tuples(*[st.sampled_from([1.0, 1.0, 0.25, 3.0])] * 3),
    quotas=quota_maps,
    locality=localities,
)
# Quiet long prefills in play all along: room for long prompts (KV, bucket), so that admissions
# reach the window, the drain (paying or not) and the bands' protection instead of stopping at kv.
quiet_configs = st.builds(
    with_backends,
    more=st.lists(st.builds(
        lambda limits, threshold: replace(limits, long_prompt_tokens=threshold),
        st.builds(Limits, max_num_seqs=st.integers(1, 4), kv_budget_tokens=st.just(200_000),
                  block_tokens=st.sampled_from([1000, 500]), max_long=st.integers(1, 2),
                  prefill_tokens_per_s=st.just(1e9), prefill_burst_tokens=st.just(10**9),
                  hol_bypass_s=st.sampled_from([0.0, 3.0, 10.0]),
                  long_prefill_tokens_per_s=st.sampled_from([0.0, 5_000.0]),
                  short_beside_long=st.integers(0, 1), long_prefills=st.integers(1, 2),
                  short_job_s=st.sampled_from([0.0, 2.0, 60.0])),
        st.sampled_from([LONG_PROMPT_TOKENS, 8_000])), max_size=2),
    first=st.builds(
        Limits,
        max_num_seqs=st.integers(2, 4),
        kv_budget_tokens=st.just(200_000),
        block_tokens=st.just(1000),
        long_prompt_tokens=st.just(LONG_PROMPT_TOKENS),
        max_long=st.integers(1, 2),
        prefill_tokens_per_s=st.just(1e9),
        prefill_burst_tokens=st.just(10**9),
        hol_bypass_s=st.sampled_from([0.0, 3.0, 10.0]),
        long_prefill_tokens_per_s=st.just(5_000.0),
        short_beside_long=st.integers(0, 1),
        long_prefills=st.integers(1, 2),
        short_job_s=st.sampled_from([0.0, 2.0, 60.0]),
    ),
    lease_ttl_s=st.just(30.0),
    aging_s=st.sampled_from([10.0, 60.0]),
    gate=st.just(False),
    routing=routings,
    quotas=quota_maps,
)
jobs = st.fixed_dictionaries(
    {
        "project": st.sampled_from(PROJECTS),
        "band": st.sampled_from(["interactive", "batch"]),
        "prompt_tokens": st.sampled_from(PROMPTS),
        "max_new_tokens": st.integers(0, 6_000),
        "priority": st.integers(0, 2),
        "age_s": st.sampled_from([None, 0.0, 15.0, 90.0]),
        "deadline_in_s": st.sampled_from([None, None, None, 0.0, 1.0, 20.0, 60.0]),
        # prep's prefix-cache estimate: none (the whole prompt), mostly cached, around the long
        # threshold, more than the prompt (clamped)
        "uncached_tokens": st.sampled_from([None, 0, 800, LONG_PROMPT_TOKENS + 1, 30_000]),
        # the job's eligibility class: masks_for(backends)[cls], or 29: a backend not configured
        "cls": st.integers(0, 29),
        # the backend prep expects to hold its cached prefix: none, one of up to three (in its
        # mask or not)
        "hint": st.sampled_from([None, 0, 1, 1, 2]),
        # a job waiting for an identical job's answer joins deferred: not in line before then
        "wait_s": st.sampled_from([None, None, None, 0.0, 5.0, 30.0]),
    }
)

lease_ops = st.one_of(
    st.tuples(st.just("claim"), st.sampled_from(["w1", "w2"])),
    st.tuples(st.just("renew")),
    st.tuples(st.just("release")),
    st.tuples(st.just("requeue"), st.booleans()),  # unclaimed only, or any
    # max_new_tokens, not-before, and the mask of its grown prompt (None: unchanged, else an
    # index into masks_for)
    st.tuples(st.just("readmit"), st.sampled_from([400, 3_000]), st.sampled_from([0.0, 0.0, 4.0, 20.0]),
              st.sampled_from([None, None, 0, 1, 4])),
    st.tuples(st.just("settle"), st.sampled_from([0, 700, 10**6])),  # what the turn spent
)
other_ops = st.one_of(
    st.tuples(st.just("resubmit"), st.sampled_from([None, 5.0])),
    st.tuples(st.just("cancel")),
    st.tuples(st.just("expire")),
    st.tuples(st.just("promote")),
    st.tuples(st.just("hurry")),
    st.tuples(st.just("verdict"), st.sampled_from([0.0, 0.0, 6.0]), st.sampled_from(["", "", "waiting", "kv_usage"]),
              st.sampled_from(["0.0", "1.0", "3.0"]), st.integers(0, 2)),
)


class Differential(RuleBasedStateMachine):
    """Both stores are the system under test; each is the other's model."""

    client: redis.Redis
    prefix: str
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.submitted: list[PendingItem] = []
        self.memory: MemoryStore
        self.redis: RedisStore
        self.keys: Keys

    @initialize(config=configs)
    def start(self, config: StoreConfig) -> None:
        # Not a drawn value: hypothesis replays drawn uuids, and every run needs fresh keys.
        self.keys = Keys(f"{self.prefix}{uuid.uuid4().hex[:12]}:")
        self.memory = MemoryStore(config, clock=self.clock)
        self.redis = RedisStore(self.client, self.keys, config, clock=self.clock)
        self.names = [b.name for b in config.backends]
        self.masks = masks_for(len(self.names))
        event(f"backends: {len(self.names)}")
        for name in self.names:
            self.both("record_backend", self.clock.now, "", {}, name)

    def teardown(self) -> None:
        if hasattr(self, "keys"):
            delete_prefix(self.client, self.keys.prefix)

    def both(self, call: str, *args: Any, **kwargs: Any) -> Any:
        mine, theirs = (getattr(store, call)(*args, **kwargs) for store in (self.memory, self.redis))
        assert mine == theirs, f"{call}{args}{kwargs}: memory {mine!r} != redis {theirs!r}"
        return mine

    # -- submit / cancel ---------------------------------------------------------------------
    @rule(jobs=st.lists(jobs, min_size=1, max_size=3))
    def submit(self, jobs: list[dict[str, Any]]) -> None:
        """New jobs; ``age_s`` None leaves ``enqueued_at`` to the store (its clock)."""
        now = self.clock.now
        for spec in jobs:
            fields = dict(spec)
            age_s, deadline_in_s, cls = fields.pop("age_s"), fields.pop("deadline_in_s"), fields.pop("cls")
            wait_s = fields.pop("wait_s")
            item = PendingItem(
                f"j{len(self.submitted)}", **fields,
                not_before=None if wait_s is None else now + wait_s,
                enqueued_at=0.0 if age_s is None else now - age_s,
                deadline=None if deadline_in_s is None else now + deadline_in_s,
                eligible=1 << len(self.names) if cls == 29 else self.masks[cls % len(self.masks)],
            )
            self.submitted.append(item)
            self.both("add_pending", item)

    def _routed(self, grant: Any) -> None:
        """Count how a grant was routed, so a run shows that hints were followed and passed."""
        item = next(i for i in reversed(self.submitted) if i.job_id == grant.job_id)
        if item.hint is not None and bin(item.eligible).count("1") > 1:
            followed = self.names.index(grant.backend or self.names[0]) == item.hint
            event(f"routed: hint {'followed' if followed else 'passed'}")

    @rule(target=leases, rounds=st.integers(1, 3))
    def admit(self, rounds: int) -> Any:
        """Admission rounds at one instant, as a dispatcher loops until it is told to hold."""
        grants = []
        for _ in range(rounds):
            result = self.both("admit_next", self.clock.now)
            event(f"admit: {result.hold_reason or 'grant'}")
            if result.grant is None:
                break
            self._routed(result.grant)
            grants.append((result.grant.job_id, result.grant.fence))
        return multiple(*grants)

    @rule(target=leases, max_grants=st.integers(1, 5))
    def admit_many(self, max_grants: int) -> Any:
        """Several grants decided by one call (one ADMIT script on Redis), as the dispatcher asks."""
        results = self.both("admit_many", self.clock.now, max_grants)
        assert len(results) <= max_grants + 1
        event(f"admit_many: {len(results)} results")
        for r in results:
            if r.grant is not None:
                self._routed(r.grant)
        return multiple(*[(r.grant.job_id, r.grant.fence) for r in results if r.grant is not None])

    @rule(lease=leases, op=lease_ops)
    def worker(self, lease: tuple[str, int], op: tuple[Any, ...]) -> None:
        """What a worker does with a grant; leases stay in the bundle, so a later call may
        carry a dead fence (a late or duplicate worker)."""
        name, *extra = op
        now = self.clock.now
        args = {"claim": (*extra, now), "renew": (now,), "requeue": tuple(extra)}.get(name, ())
        if name == "readmit":  # max_new_tokens, a not-before time (now: straight back in line)
            mask = None if extra[2] is None else self.masks[extra[2] % len(self.masks)]
            self.both(name, *lease, extra[0], now + extra[1], now, eligible=mask)
            return
        if name == "settle":
            self.both(name, *lease, *extra)
            return
        self.both(name, *lease, *args)

    @rule(op=other_ops, index=st.integers(0, 30))
    def other(self, op: tuple[Any, ...], index: int) -> None:
        """Producers and the dispatcher's housekeeping: resubmit a job (ignored while pending or
        in flight, queued again after it left), cancel one (index past the end: a job the
        stores never saw), expire deadlines, record a backend verdict."""
        name, *extra = op
        if name == "resubmit" and self.submitted:
            item = self.submitted[index % len(self.submitted)]
            deadline = None if extra[0] is None else self.clock.now + extra[0]
            self.both("add_pending", replace(item, deadline=deadline))
        elif name == "cancel":
            self.both("cancel_pending", f"j{index % (len(self.submitted) + 1)}")
        elif name == "expire":
            self.both("expire_deadlines", self.clock.now)
        elif name == "promote":
            mine, theirs = self.memory.promote_due(self.clock.now), self.redis.promote_due(self.clock.now)
            assert sorted(mine) == sorted(theirs), f"promoted: memory {mine} != redis {theirs}"
        elif name == "hurry":
            self.both("hurry", f"j{index % (len(self.submitted) + 1)}", self.clock.now)
        elif name == "verdict":
            figures = {"waiting": "0", "outside": extra[2]}  # outside clients hold sequences
            name = self.names[extra[3] % len(self.names)]
            self.both("record_backend", self.clock.now - extra[0], extra[1], figures, name)
            assert self.memory.backend(name) == self.redis.backend(name)

    @rule(seconds=st.sampled_from([0.3, 0.7, 5.0, 12.0, 31.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds
        now = self.clock.now
        mine, theirs = self.memory.reap_expired(now), self.redis.reap_expired(now)
        assert sorted(mine) == sorted(theirs), f"reaped: memory {mine} != redis {theirs}"

    # -- after every step --------------------------------------------------------------------
    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "keys"):
            return
        for call in ("snapshot", "lease_fences", "pending_ids", "next_deadline", "next_expiry",
                     "next_not_before", "continuations", "deferred_counts"):
            self.both(call)
        for project in PROJECTS:
            self.both("quota_usage", project, self.clock.now)
            mine, theirs = (sorted(store.waiting_items(project)) for store in (self.memory, self.redis))
            assert mine == theirs, f"waiting_items({project}): memory {mine} != redis {theirs}"
        assert self.redis.recount() == {}  # each backend's counters are the sums over its leases
        assert self.pacing(self.memory) == self.pacing(self.redis)

    def pacing(self, store: MemoryStore | RedisStore) -> list[tuple[Any, ...]]:
        """Each backend's pacing state as the store last wrote it: the prefill bucket's level and
        window, and where they are read, the locality ``filled`` count and first_token's
        ``queue_until`` (rounded: the Redis store writes them as decimal text)."""
        config = store.config
        out = []
        for b in range(len(self.names)):
            if isinstance(store, MemoryStore):
                s = store._states[b]
                got = [s.bucket_tokens, s.prefill_until, s.filled, s.queue_until]
            else:  # (every backend's filled count lives in backend 0's hash)
                bucket, until, queue = self.client.hmget(store._states[b], "bucket", "prefill_until", "queue_until")
                filled = self.client.hget(store._states[0], f"filled:{b}" if b else "filled")
                got = [None if bucket is None else float(bucket), *(float(v or 0) for v in (until, filled, queue))]
            if not config.locality.on:
                got[2] = None
            if config.routing.policy != "first_token":
                got[3] = None
            out.append(tuple(None if v is None else round(v, 6) for v in got))
        return out


class QuietDifferential(Differential):
    """The same machine on ``quiet_configs``."""

    @initialize(config=quiet_configs)
    def start(self, config: StoreConfig) -> None:
        Differential.start(self, config)


class BackendsDifferential(Differential):
    """The same machine on ``configs`` of two or three backends only."""

    @initialize(config=configs.filter(lambda config: len(config.backends) > 1))
    def start(self, config: StoreConfig) -> None:
        Differential.start(self, config)


class LocalityDifferential(Differential):
    """The same machine with locality on in every config (a look-ahead of 2 to 4, with and without
    the wait bound), on one to three backends."""

    @initialize(config=configs, locality=st.builds(Locality, lookahead=st.integers(2, 4),
                                                    max_wait_s=st.sampled_from([0.0, 20.0])),
                cache=st.sampled_from([1_000, 3_000, 6_000]))
    def start(self, config: StoreConfig, locality: Locality, cache: int) -> None:  # type: ignore[override]
        """A small cache room on every backend, so that estimates go stale within a run."""
        more = tuple(replace(b, limits=replace(b.limits, cache_tokens=cache)) for b in config.more_backends)
        Differential.start(self, replace(config, locality=locality, more_backends=more,
                                         limits=replace(config.limits, cache_tokens=cache)))

    @rule(project=st.sampled_from(PROJECTS), band=st.sampled_from(["interactive", "batch"]),
          prompt=st.sampled_from([2_500, 9_000]), cls=st.integers(0, 4), hint=st.sampled_from([None, 0, 1]),
          uncached=st.lists(st.sampled_from([None, 0, 800, 2_500]), min_size=2, max_size=4))
    def submit_line(self, project: str, band: str, prompt: int, cls: int, hint: int | None,
                    uncached: list[int | None]) -> None:
        """Jobs of one queue that differ in what is cached: what locality chooses between."""
        for tokens in uncached:
            item = PendingItem(f"j{len(self.submitted)}", project, prompt, 500, band=band, uncached_tokens=tokens,
                               eligible=self.masks[cls % len(self.masks)], hint=hint)
            self.submitted.append(item)
            self.both("add_pending", item)


class FirstTokenDifferential(Differential):
    """The same machine on two or three backends under the ``first_token`` routing, every backend
    with a prefill rate (placement.first_token_s: the queue of prefills it was sent)."""

    @initialize(config=configs.filter(lambda config: len(config.backends) > 1),
                rate=st.sampled_from([1_000.0, 5_000.0]), balance=st.sampled_from([0, 4]))
    def start(self, config: StoreConfig, rate: float, balance: int) -> None:  # type: ignore[override]
        more = tuple(replace(b, limits=replace(b.limits, queue_tokens_per_s=rate * (i + 2)))
                     for i, b in enumerate(config.more_backends))
        Differential.start(self, replace(config, more_backends=more,
                                         limits=replace(config.limits, queue_tokens_per_s=rate),
                                         routing=Routing("first_token", balance_abs_seqs=balance)))


def test_memory_and_redis_stores_agree(key_prefix: str) -> None:
    _agree(Differential, key_prefix)


def test_memory_and_redis_stores_agree_on_quiet_long_prefills(key_prefix: str) -> None:
    """Quiet windows, drains that pay or not, interactive and batch work side by side."""
    _agree(QuietDifferential, key_prefix)


def test_memory_and_redis_stores_agree_across_backends(key_prefix: str) -> None:
    """Two or three backends, one of another model: placement, per-backend limits and gates."""
    _agree(BackendsDifferential, key_prefix)


def test_memory_and_redis_stores_agree_with_locality(key_prefix: str) -> None:
    """Each queue offering the most cached of its first jobs still expected in the cache."""
    _agree(LocalityDifferential, key_prefix)


def test_memory_and_redis_stores_agree_on_first_token_routing(key_prefix: str) -> None:
    """Each candidate on the backend expected to give its first token soonest."""
    _agree(FirstTokenDifferential, key_prefix)


def _agree(base: type[Differential], key_prefix: str) -> None:
    client = redis.Redis.from_url(TEST_REDIS_URL)
    machine = type("Machine", (base,), {"client": client, "prefix": key_prefix})
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=40,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        delete_prefix(client, key_prefix)
        client.close()
