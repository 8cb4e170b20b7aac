"""The gateway's half of admission on the real Redis store: the dispatcher's ``hand_to_gateway``
routes a gateway job's grant to the gateway that waits for it, and a grant nobody waits for any
more is released at once instead of holding a slot until its lease expires."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.asyncio import Redis as AsyncRedis

from fleet.core.config import Settings
from fleet.core.keys import Keys
from fleet.core.results import ResultStore
from fleet.core.seal import sealed
from fleet.gateway.admission import Admission
from fleet.worker.app import create_app
from fleet.worker.dispatch import hand_to_gateway, make_send
from fleet.worker.heartbeat import WorkerGate, beat, instance_id
from schedulers.dispatcher import run_dispatcher
from schedulers.store import make_store
from schedulers.store.base import PendingItem


def settings_for(prefix: str, broker_url: str) -> Settings:
    return Settings(broker_url=broker_url, key_prefix=prefix, backend={"max_num_seqs": 2},
                    admission={"backend_gate": False, "metrics_port": 0, "lease_ttl_s": 3600},
                    projects={"a": {"secret": "secret-a-123"}},
                    security={"worker_secret": "test-workers-key-0123456789"})


async def _off_loop(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kwargs)


def run_gateway_side(redis_url: str, key_prefix: str, body: Callable[..., Any],
                     admits: bool = False) -> Any:
    """``body(admission, store, client, keys)`` beside a running listener; with ``admits`` the
    gateway runs its own admission round at enqueue, as ``fleet gateway`` does."""
    settings = settings_for(key_prefix, redis_url)
    client = redis.Redis.from_url(redis_url)
    store = make_store(settings, client)
    keys = Keys(key_prefix)
    send = make_send(settings, client, create_app(settings)) if admits else None

    async def main() -> Any:
        aredis = AsyncRedis.from_url(redis_url)
        admission = Admission(store, ResultStore(client, keys, settings), aredis, keys, _off_loop, send)
        listener = asyncio.create_task(admission.listen())
        try:
            return await body(admission, store, client, keys)
        finally:
            listener.cancel()
            await aredis.aclose()

    try:
        return asyncio.run(main())
    finally:
        client.close()


def dispatch_once(store: Any, client: redis.Redis, settings: Settings) -> int:
    """What a dispatcher's round does with one pending job: admit it and send its grant."""
    grant = store.admit_next(time.time()).grant
    assert grant is not None
    assert hand_to_gateway(client, settings, grant)
    return grant.fence


def test_a_grant_reaches_the_request_that_waits_for_it(redis_url: str, key_prefix: str) -> None:
    async def body(admission: Admission, store: Any, client: redis.Redis, keys: Keys) -> None:
        enqueued_at = await admission.enqueue("j1", "a", "interactive", 100, 500, 30)
        assert await admission.next_grant("j1", 0.01) is None
        fence = await asyncio.to_thread(dispatch_once, store, client,
                                        admission.results.settings)
        grant = await admission.next_grant("j1", 30)
        assert grant is not None and grant["fence"] == fence
        ticket = await admission.claim("j1", "a", grant, enqueued_at)
        assert store.snapshot().in_flight == 1
        await admission.release(ticket)
        assert store.snapshot().in_flight == 0

    run_gateway_side(redis_url, key_prefix, body)


def test_a_grant_after_the_request_left_is_released_at_once(redis_url: str, key_prefix: str) -> None:
    async def body(admission: Admission, store: Any, client: redis.Redis, keys: Keys) -> None:
        await admission.enqueue("j2", "a", "interactive", 100, 500, 30)
        admission.forget("j2")  # the request gave up just before the dispatcher admitted it
        await asyncio.to_thread(dispatch_once, store, client,
                                        admission.results.settings)
        assert store.snapshot().admissions == 1  # admitted; its lease would last an hour
        for _ in range(3000):  # the listener's release, not the lease expiring an hour later
            if store.snapshot().in_flight == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the orphaned grant still holds its slot")

    run_gateway_side(redis_url, key_prefix, body)


def test_with_room_the_gateway_admits_its_request_without_a_dispatcher(
    redis_url: str, key_prefix: str,
) -> None:
    async def body(admission: Admission, store: Any, client: redis.Redis, keys: Keys) -> None:
        enqueued_at = await admission.enqueue("j3", "a", "interactive", 100, 500, 30)
        grant = await admission.next_grant("j3", 30)
        assert grant is not None
        ticket = await admission.claim("j3", "a", grant, enqueued_at)
        assert store.snapshot().in_flight == 1
        await admission.release(ticket)

    run_gateway_side(redis_url, key_prefix, body, admits=True)


def test_queue_jobs_are_not_handed_to_a_gateway(redis_url: str, key_prefix: str) -> None:
    settings = settings_for(key_prefix, redis_url)
    client = redis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    store = make_store(settings, client)
    ResultStore(client, keys, settings).record("q1", project="a", state="pending")
    store.add_pending(PendingItem("q1", "a", 100, 500))
    grant = store.admit_next(time.time()).grant
    assert grant is not None
    assert hand_to_gateway(client, settings, grant) is False
    assert list(client.scan_iter(match=f"{key_prefix}gwgrants:*")) == []
    client.close()


def test_a_record_edited_to_claim_a_gateway_is_not_handed_to_it(redis_url: str, key_prefix: str
                                                               ) -> None:
    """A producer may write its own job hash: ``origin=gateway`` without the workers' seal over
    it diverts nothing (the job goes to the inference workers, which refuse the record)."""
    settings = settings_for(key_prefix, redis_url)
    client = redis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    store = make_store(settings, client)
    results = ResultStore(client, keys, settings)
    results.record("a/q2", state="pending", **sealed(settings, "a/q2", project="a", kind="infer",
                                                     job="{}", plan="{}", fence_tag="t"))
    client.hset(keys.job("a/q2"), mapping={"origin": "gateway", "gateway": "0123456789abcdef"})
    results.record("a/g1", state="pending", **sealed(settings, "a/g1", project="a", kind="infer",
                                                     origin="gateway", gateway="feedfacecafe0001"))
    client.hset(keys.job("a/g1"), "gateway", "0123456789abcdef")  # another gateway's list
    for ref in ("a/q2", "a/g1"):
        store.add_pending(PendingItem(ref, "a", 100, 500))
        grant = store.admit_next(time.time()).grant
        assert grant is not None and grant.job_id == ref
        assert hand_to_gateway(client, settings, grant) is False
    assert list(client.scan_iter(match=f"{key_prefix}gwgrants:*")) == []
    client.close()


def _queued_and_gateway_round(redis_url: str, key_prefix: str, live_worker: bool) -> set[str]:
    """A queued job waits first in line; then a gateway request runs its own admission round.
    Returns the jobs still pending afterwards (the gateway request must have been admitted)."""
    settings = settings_for(key_prefix, redis_url)
    client = redis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    store = make_store(settings, client)
    if live_worker:
        beat(client, keys, instance_id("infer@host"))
    ResultStore(client, keys, settings).record("a/q1", project="a", state="pending")
    store.add_pending(PendingItem("a/q1", "a", 100, 500))
    client.close()

    async def body(admission: Admission, store: Any, client: redis.Redis, keys: Keys) -> set[str]:
        enqueued_at = await admission.enqueue("a/g1", "a", "interactive", 100, 500, 30)
        grant = await admission.next_grant("a/g1", 5)
        assert grant is not None, "the gateway's own request goes on without inference workers"
        ticket = await admission.claim("a/g1", "a", grant, enqueued_at)
        pending = store.pending_ids()
        await admission.release(ticket)
        return pending

    return run_gateway_side(redis_url, key_prefix, body, admits=True)


def test_the_gateway_round_admits_no_queued_job_while_no_inference_worker_is_live(
    redis_url: str, key_prefix: str,
) -> None:
    """The worker gate holds queued jobs in the gateway's round too (before, the round admitted
    them and sent them to inference workers nobody ran; their leases expired, again and again);
    the gateway's own request, which needs no inference worker, is admitted past them."""
    assert _queued_and_gateway_round(redis_url, key_prefix, live_worker=False) == {"a/q1"}


def test_the_gateway_round_admits_queued_jobs_while_an_inference_worker_is_live(
    redis_url: str, key_prefix: str,
) -> None:
    assert _queued_and_gateway_round(redis_url, key_prefix, live_worker=True) == set()


def test_the_gateway_call_learns_unseen_projects_and_survives_a_script_flush(
    redis_url: str, key_prefix: str,
) -> None:
    """A fresh store names only the request's project; ADMIT refuses to decide while another
    project waits unnamed, so the call learns it and decides again (fair share sees both). A Redis
    that lost its scripts (a restart) gets the script loaded again, and the record is still
    written once before the script runs."""
    settings = settings_for(key_prefix, redis_url)
    client = redis.Redis.from_url(redis_url)
    make_store(settings, client).add_pending(PendingItem("b/q1", "b", 100, 500))
    store = make_store(settings, client)  # another process: has seen no project yet
    client.script_flush()
    now = time.time()
    results, fence = store.enter_gateway(
        PendingItem("a/g1", "a", 100, 500, deadline=now + 30), "gateway-1", now, False, 8,
        lambda pipe: pipe.hset(f"{key_prefix}probe", "recorded", "1"))
    granted = {r.grant.job_id for r in results if r.grant is not None}
    assert fence and granted == {"a/g1", "b/q1"}
    assert client.hget(f"{key_prefix}probe", "recorded") == b"1"
    assert store.snapshot().in_flight == 2
    client.close()


def test_the_gateway_round_admits_its_request_queued_behind_its_own_projects_job_while_no_worker_is_live(
    redis_url: str, key_prefix: str,
) -> None:
    """The request waits in the same queue (project, band, size) behind a queued job, so it is not
    the head of its queue. Before, the gated round saw queue heads only: the queued job was passed
    over and the request never became a candidate, so on an idle fleet it waited until 429."""
    settings = settings_for(key_prefix, redis_url)
    client = redis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    store = make_store(settings, client)
    ResultStore(client, keys, settings).record("a/q1", project="a", state="pending")
    store.add_pending(PendingItem("a/q1", "a", 100, 500, band="interactive"))
    client.close()

    async def body(admission: Admission, store: Any, client: redis.Redis, keys: Keys
                   ) -> tuple[set[str], int]:
        enqueued_at = await admission.enqueue("a/g1", "a", "interactive", 100, 500, 30)
        grant = await admission.next_grant("a/g1", 5)
        assert grant is not None, "the gateway request waited behind its own project's queued job"
        ticket = await admission.claim("a/g1", "a", grant, enqueued_at)
        pending, in_flight = store.pending_ids(), store.snapshot().in_flight
        await admission.release(ticket)
        return pending, in_flight

    assert run_gateway_side(redis_url, key_prefix, body, admits=True) == ({"a/q1"}, 1)


def test_the_gated_round_takes_gateway_requests_in_queue_order_under_the_cap(
    redis_url: str, key_prefix: str,
) -> None:
    """Three gateway requests wait behind a queued job in one queue while no inference worker is
    live: the round grants them in line order up to the sequence cap (2) and no further; the
    queued job keeps its place."""
    settings = settings_for(key_prefix, redis_url)
    client = redis.Redis.from_url(redis_url)
    store = make_store(settings, client)
    ResultStore(client, Keys(key_prefix), settings).record("a/q1", project="a", state="pending")
    store.add_pending(PendingItem("a/q1", "a", 100, 500, band="interactive"))
    now = time.time()
    granted: list[str] = []
    for ref in ("a/g1", "a/g2", "a/g3"):
        item = PendingItem(ref, "a", 100, 500, band="interactive", deadline=now + 30)
        results, _ = store.enter_gateway(item, "gateway-1", now, True, 0 if ref != "a/g3" else 8)
        granted += [r.grant.job_id for r in results if r.grant is not None]
    assert granted == ["a/g1", "a/g2"]
    assert store.pending_ids() == {"a/q1", "a/g3"}
    assert store.snapshot().in_flight == 2
    client.close()


def test_the_worker_gate_reads_heartbeats_by_redis_clock_not_the_gateway_hosts(
    redis_url: str, key_prefix: str,
) -> None:
    """Heartbeats are stamped by Redis's clock. Before, the gateway compared them with its own
    host's clock: a host 30 s behind counted a worker that lapsed 10 s ago as live and granted a
    queued job into fleet.infer, which nobody reads."""
    settings = settings_for(key_prefix, redis_url)
    client = redis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    store = make_store(settings, client)
    redis_now = float(client.time()[0])
    client.zadd(keys.infer_workers, {instance_id("infer@gone"): redis_now - 10})
    ResultStore(client, keys, settings).record("a/q1", project="a", state="pending")
    store.add_pending(PendingItem("a/q1", "a", 100, 500))
    host_now = redis_now - 30
    results, fence = store.enter_gateway(
        PendingItem("a/g1", "a", 100, 500, band="interactive", deadline=host_now + 30),
        "gateway-1", host_now, True, 8)
    assert fence and [r.grant.job_id for r in results if r.grant is not None] == ["a/g1"]
    assert store.pending_ids() == {"a/q1"}
    client.close()


def test_a_gateway_host_whose_clock_runs_ahead_never_prunes_anothers_waiting_requests(
    redis_url: str, key_prefix: str,
) -> None:
    """The gateway set's entries live by Redis's clock. Before, each call pruned them by its own
    host's clock: a host 40 s ahead dropped another gateway's live request from the set, and while
    no inference worker was live that request was never admitted again (429 on an idle fleet)."""
    settings = settings_for(key_prefix, redis_url)
    client = redis.Redis.from_url(redis_url)
    store = make_store(settings, client)
    now_b = time.time()
    store.enter_gateway(PendingItem("b/g1", "b", 100, 500, band="interactive", deadline=now_b + 30),
                        "gateway-b", now_b, True, 0)  # in line, no round
    now_a = now_b + 40
    results, _fence = store.enter_gateway(
        PendingItem("a/g1", "a", 100, 500, band="interactive", deadline=now_a + 30),
        "gateway-a", now_a, True, 8)
    assert {r.grant.job_id for r in results if r.grant is not None} == {"a/g1", "b/g1"}
    client.close()


def test_a_freed_slot_goes_to_a_waiting_gateway_request_while_no_inference_worker_is_live(
    redis_url: str, key_prefix: str,
) -> None:
    """The cap (2) is full of gateway leases, a third gateway request waits behind a queued job and
    no inference worker is live. One lease is released: a running dispatcher admits the waiting
    request (only gateway requests: the queued job stays in line). Before, the worker gate made
    the dispatchers hold every round, so the request was admitted only by the next gateway
    request's round, or waited until its 429."""
    settings = settings_for(key_prefix, redis_url)
    client = redis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    ResultStore(client, keys, settings).record("a/q1", project="a", state="pending")
    make_store(settings, client).add_pending(PendingItem("a/q1", "a", 100, 500, band="interactive"))

    async def body(admission: Admission, store: Any, _client: redis.Redis, _keys: Keys) -> None:
        tickets = []
        for ref in ("a/g1", "a/g2"):
            enqueued_at = await admission.enqueue(ref, "a", "interactive", 100, 500, 30)
            grant = await admission.next_grant(ref, 5)
            assert grant is not None
            tickets.append(await admission.claim(ref, "a", grant, enqueued_at))
        enqueued_at = await admission.enqueue("a/g3", "a", "interactive", 100, 500, 30)
        assert store.pending_ids() == {"a/q1", "a/g3"}  # the fleet is full
        stop = threading.Event()
        dispatcher = threading.Thread(
            target=run_dispatcher,
            args=(settings, client, make_send(settings, client, create_app(settings)), stop),
            kwargs={"gate": WorkerGate(client, keys)})
        dispatcher.start()
        try:
            await admission.release(tickets[0])
            grant = await admission.next_grant("a/g3", 20)
            assert grant is not None, "the freed slot was not given to the waiting gateway request"
            tickets.append(await admission.claim("a/g3", "a", grant, enqueued_at))
            assert store.pending_ids() == {"a/q1"}
            assert store.snapshot().in_flight == 2
        finally:
            stop.set()
            store.wake()
            await asyncio.to_thread(dispatcher.join, 10)
        assert not dispatcher.is_alive()
        for ticket in tickets[1:]:
            await admission.release(ticket)

    try:
        run_gateway_side(redis_url, key_prefix, body, admits=True)
    finally:
        client.close()
