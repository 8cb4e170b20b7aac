"""The dispatcher process loop on a real Redis: event-driven wakes, metrics, ``fleet queues``,
deadlines of pending jobs, continuations (promoted when due, also while held), failed sends, and
surviving Redis errors."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import httpx
import kombu.exceptions
import pytest
import redis
from pydantic import ValidationError
from rich.console import Console

from fleet.cli.queues import queues_table
from fleet.core.config import Settings, load_settings
from fleet.core.errors import ConfigError
from schedulers.backoff import Backoff
from schedulers.dispatcher import run_dispatcher, wait_timeout_s
from schedulers.store import make_store
from schedulers.store.base import AdmitResult, Grant, PendingItem
from tests.support.waiting import wait_until


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def settings_for(prefix: str, **admission) -> Settings:
    return Settings(
        key_prefix=prefix,
        backend={"max_num_seqs": 1},
        admission={"backend_gate": False, "metrics_port": 0, **admission},
        projects={"a": {"weight": 2, "secret": "secret-a-123"}, "b": {"secret": "secret-b-123"}},
    )


class Recorder:
    """The ``send`` callback: records grants in order and signals each one."""

    def __init__(self) -> None:
        self.grants: list[Grant] = []
        self.log: list[str] = []
        self.cond = threading.Condition()

    def __call__(self, grant: Grant) -> None:
        with self.cond:
            self.grants.append(grant)
            self.log.append(f"grant {grant.job_id}")
            self.cond.notify_all()

    def wait_for(self, count: int, timeout_s: float = 20.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.grants) >= count, timeout_s)


@pytest.fixture
def running(
    key_prefix: str, redis_url: str, redis_client: redis.Redis
) -> Iterator[tuple[Settings, Recorder, threading.Event]]:
    # The lease TTL is an hour, so no expiry wakes the dispatcher; its idle wait (at most 4 s)
    # may, but an idle round finds nothing new to admit.
    settings = settings_for(key_prefix, max_wait_s=4.0, lease_ttl_s=3600.0, metrics_port=free_port())
    recorder, stop = Recorder(), threading.Event()
    client = redis.Redis.from_url(redis_url)
    thread = threading.Thread(target=run_dispatcher, args=(settings, client, recorder, stop))
    thread.start()
    yield settings, recorder, stop
    stop.set()
    make_store(settings, redis_client).wake()
    thread.join(timeout=10)
    client.close()
    assert not thread.is_alive()


def test_release_wakes_a_blocked_dispatcher(running, redis_client: redis.Redis) -> None:
    settings, recorder, _stop = running
    store = make_store(settings, redis_client)
    store.add_pending(PendingItem("j1", "a", 100, 100))
    assert recorder.wait_for(1)
    store.add_pending(PendingItem("j2", "a", 100, 100))
    # The dispatcher saw j2 and held it (cap 1): it is now blocked on the wake list.
    assert wait_until(lambda: store.snapshot().holds.get("seqs", 0) >= 1)
    assert recorder.grants[1:] == []
    first = recorder.grants[0]
    with recorder.cond:
        recorder.log.append("release j1")
    assert store.release("j1", first.fence)
    assert recorder.wait_for(2)
    assert recorder.log == ["grant j1", "release j1", "grant j2"]
    assert recorder.grants[1].fence > first.fence


def test_metrics_endpoint(running, redis_client: redis.Redis) -> None:
    settings, recorder, _stop = running
    store = make_store(settings, redis_client)
    # j2 goes first whether or not the dispatcher saw the others yet (interactive first).
    store.add_pending(PendingItem("j2", "b", 100, 100, band="interactive"))
    store.add_pending(PendingItem("j1", "a", 3000, 1000))
    store.add_pending(PendingItem("j3", "a", 100, 100))
    assert recorder.wait_for(1)
    assert wait_until(lambda: store.snapshot().holds.get("seqs", 0) >= 1)  # j1, j3 were seen
    url = f"http://127.0.0.1:{settings.admission.metrics_port}/metrics"
    text = httpx.get(url, timeout=10).text
    granted = recorder.grants[0]
    assert granted.job_id == "j2"
    assert 'fleet_dispatch_pending{band="batch",project="a"} 2.0' in text
    assert "fleet_dispatch_in_flight 1.0" in text
    assert "fleet_dispatch_interactive_in_flight 1.0" in text  # j2 is interactive
    assert f"fleet_dispatch_reserved_kv_tokens {granted.kv_tokens:.1f}" in text
    assert "fleet_dispatch_admissions_total 1.0" in text
    assert 'fleet_dispatch_holds_total{reason="seqs"}' in text
    assert 'fleet_dispatch_queue_wait_seconds_count{project="b"} 1.0' in text


def test_queues_table(key_prefix: str, redis_client: redis.Redis) -> None:
    settings = settings_for(key_prefix)
    store = make_store(settings, redis_client)
    store.add_pending(PendingItem("j1", "a", 100, 100))
    store.add_pending(PendingItem("j2", "a", 100, 100, band="interactive"))
    store.add_pending(PendingItem("j3", "zeta", 100, 100))
    console = Console(record=True, width=200)
    console.print(queues_table(settings, redis_client))
    text = console.export_text()
    lines = text.splitlines()
    row_a = next(line for line in lines if line.strip().startswith("│ a"))
    assert [cell.strip() for cell in row_a.split("│")[1:5]] == ["a", "2", "1", "1"]
    assert any("zeta" in line for line in lines)
    assert "in flight 0/1, long 0/3" in text


def test_queues_table_shows_continuations_apart(key_prefix: str, redis_client: redis.Redis) -> None:
    settings = settings_for(key_prefix)
    store = make_store(settings, redis_client)
    for job_id in ("j1", "j2", "j3"):
        store.add_pending(PendingItem(job_id, "a", 100, 100))
    store.config = replace(store.config, limits=replace(store.config.limits, max_num_seqs=3),
                           gate=False)
    grants = [store.admit_next(time.time()).grant for _ in range(2)]
    assert all(grants)
    first, second = (g for g in grants if g is not None)
    assert store.readmit(first.job_id, first.fence, 100, 0.0, time.time())  # back in line
    assert store.readmit(second.job_id, second.fence, 100, time.time() + 600, time.time())  # backoff
    console = Console(record=True, width=200)
    console.print(queues_table(settings, redis_client))
    lines = console.export_text().splitlines()
    header = next(line for line in lines if "continuing" in line)
    assert [c.strip() for c in header.split("┃")[1:7]] == [
        "project", "weight", "interactive", "batch", "continuing", "waiting"]
    row_a = next(line for line in lines if line.strip().startswith("│ a"))
    assert [cell.strip() for cell in row_a.split("│")[1:7]] == ["a", "2", "0", "2", "1", "1"]


def test_wait_timeout_follows_the_next_event(key_prefix: str, redis_client: redis.Redis) -> None:
    settings = settings_for(key_prefix)
    store = make_store(settings, redis_client)
    assert wait_timeout_s(store, AdmitResult(None, "empty"), 0.0, 1.0) == 1.0
    assert wait_timeout_s(store, AdmitResult(None, "bucket", 0.25), 0.0, 1.0) == 0.25
    store.add_pending(PendingItem("j1", "a", 100, 100))
    grant = store.admit_next(100.0).grant
    assert grant is not None
    timeout = wait_timeout_s(store, AdmitResult(None, "seqs"), 100.0, 3600.0)
    assert timeout == pytest.approx(settings.admission.lease_ttl_s)
    store.add_pending(PendingItem("j2", "a", 100, 100, deadline=102.5))  # before the expiry
    assert wait_timeout_s(store, AdmitResult(None, "seqs"), 100.0, 3600.0) == pytest.approx(2.5)
    assert wait_timeout_s(store, AdmitResult(None, "send_failed"), 200.0, 1.0) == 0.001


def test_max_wait_stays_under_the_socket_timeout(key_prefix: str) -> None:
    with pytest.raises(ValidationError):
        settings_for(key_prefix, max_wait_s=5.0)
    with pytest.raises(ConfigError):
        load_settings(env={}, admission={"max_wait_s": 30.0})
    assert settings_for(key_prefix, max_wait_s=4.0).admission.max_wait_s == 4.0


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    backoff = Backoff(0.5, 5.0)
    assert [backoff.next_s() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    backoff.reset()
    assert backoff.next_s() == 0.5


class Dispatcher:
    """``run_dispatcher`` in a thread with a fast back-off; stops and joins on ``close``."""

    def __init__(self, settings: Settings, client: redis.Redis, send, **kw) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=run_dispatcher,
            args=(settings, client, send, self.stop),
            kwargs={"backoff": Backoff(0.01, 0.05), **kw},
        )
        self.thread.start()

    def close(self, store) -> None:
        self.stop.set()
        store.wake()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


class FlakyRedis(redis.Redis):
    """A real client whose next ``failures`` commands raise ``error`` (a Redis blip)."""

    failures = 0
    error: type[redis.RedisError] = redis.ConnectionError

    def execute_command(self, *args, **options):  # type: ignore[no-untyped-def]
        if self.failures > 0:
            self.failures -= 1
            raise self.error(f"injected failure of {args[0]}")
        return super().execute_command(*args, **options)


@pytest.mark.parametrize("error", [redis.ConnectionError, redis.TimeoutError, redis.ResponseError])
def test_dispatcher_survives_redis_errors(
    error, key_prefix: str, redis_url: str, redis_client: redis.Redis, caplog
) -> None:
    settings = settings_for(key_prefix, lease_ttl_s=3600.0)
    store = make_store(settings, redis_client)
    store.add_pending(PendingItem("j1", "a", 100, 100))
    flaky = FlakyRedis.from_url(redis_url)
    flaky.failures, flaky.error = 5, error
    recorder = Recorder()
    caplog.set_level("WARNING", logger="schedulers.dispatcher")
    dispatcher = Dispatcher(settings, flaky, recorder)
    try:
        assert recorder.wait_for(1)  # admitted after the blip
        assert flaky.failures == 0 and dispatcher.thread.is_alive()
        blips = [r for r in caplog.records if "redis error" in r.getMessage()]
        assert len(blips) == 5 and error.__name__ in blips[0].getMessage()
        store.add_pending(PendingItem("j2", "b", 100, 100))  # and goes on working
        assert store.release("j1", recorder.grants[0].fence)
        assert recorder.wait_for(2) and recorder.grants[1].job_id == "j2"
    finally:
        dispatcher.close(store)
        flaky.close()


@pytest.mark.parametrize(
    "error", [kombu.exceptions.OperationalError("broker down"), ConnectionRefusedError(), KeyError()]
)
def test_failed_send_puts_the_job_back_at_once(
    error, key_prefix: str, redis_url: str, redis_client: redis.Redis
) -> None:
    settings = settings_for(key_prefix, lease_ttl_s=3600.0)  # no waiting out a lease here
    store = make_store(settings, redis_client)
    store.add_pending(PendingItem("j1", "a", 100, 100))
    store.add_pending(PendingItem("j2", "a", 100, 100, enqueued_at=time.time() + 1))
    attempts: list[Grant] = []
    recorder = Recorder()

    def send(grant: Grant) -> None:
        attempts.append(grant)
        if len(attempts) <= 2:
            raise error
        recorder(grant)

    client = redis.Redis.from_url(redis_url)
    dispatcher = Dispatcher(settings, client, send)
    try:
        assert recorder.wait_for(1)
        # Both failed sends were of j1, which kept its place ahead of j2 (cap 1).
        assert [g.job_id for g in attempts] == ["j1", "j1", "j1"]
        assert attempts[0].fence < attempts[1].fence < attempts[2].fence
        assert store.lease_fences() == {"j1": attempts[2].fence}
        assert store.pending_ids() == {"j2"}
    finally:
        dispatcher.close(store)
        client.close()


def test_pending_deadline_is_expired_and_reported(
    key_prefix: str, redis_url: str, redis_client: redis.Redis
) -> None:
    settings = settings_for(key_prefix, lease_ttl_s=3600.0, max_wait_s=4.0)
    store = make_store(settings, redis_client)
    store.add_pending(PendingItem("j1", "a", 100, 100, deadline=time.time() - 1))
    expired: list[str] = []
    reported = threading.Event()

    def on_expired(job_id: str) -> None:
        expired.append(job_id)
        reported.set()

    client = redis.Redis.from_url(redis_url)
    recorder = Recorder()
    dispatcher = Dispatcher(settings, client, recorder, on_expired=on_expired)
    try:
        assert reported.wait(20)  # reported first, then out of the line
        assert wait_until(lambda: store.pending_ids() == set())
        assert expired == ["j1"]
        store.add_pending(PendingItem("j2", "a", 100, 100))
        assert recorder.wait_for(1)  # cap 1: j2 holds the slot now
        # j3 waits behind j2 with a deadline a moment away: it passes while j3 is pending.
        reported.clear()
        store.add_pending(PendingItem("j3", "a", 100, 100, deadline=time.time() + 0.2))
        assert reported.wait(20)
        assert wait_until(lambda: store.pending_ids() == set())
        assert expired == ["j1", "j3"]
        assert [g.job_id for g in recorder.grants] == ["j2"]
        assert store.lease_fences().keys() == {"j2"}
    finally:
        dispatcher.close(store)
        client.close()


def test_a_failed_send_requeues_the_unsent_grants_of_its_call(
    key_prefix: str, redis_url: str, redis_client: redis.Redis
) -> None:
    """One ADMIT call grants several jobs; when the second send fails, it and every grant of the
    call not sent yet go back in line at once, and the job sent before keeps its lease."""
    settings = settings_for(key_prefix, lease_ttl_s=3600.0)
    settings = settings.with_backend(max_num_seqs=4)
    store = make_store(settings, redis_client)
    store.add_pending_many(PendingItem(f"j{n}", "a", 100, 100, enqueued_at=1e9 + n) for n in range(4))
    sent: list[Grant] = []
    failed = threading.Event()

    def send(grant: Grant) -> None:
        if len(sent) == 1 and not failed.is_set():
            failed.set()
            raise redis.ConnectionError("broker down")
        sent.append(grant)

    client = redis.Redis.from_url(redis_url)
    dispatcher = Dispatcher(settings, client, send)
    try:
        assert wait_until(lambda: len(sent) == 4)
        assert [g.job_id for g in sent] == ["j0", "j1", "j2", "j3"]  # back at their places
        assert store.lease_fences() == {g.job_id: g.fence for g in sent}
        assert store.snapshot().in_flight == 4 and store.pending_ids() == set()
    finally:
        dispatcher.close(store)
        client.close()


def test_an_unrenewed_lease_is_reaped_while_other_wakes_keep_coming(
    key_prefix: str, redis_url: str, redis_client: redis.Redis
) -> None:
    """Rounds woken early skip the reap; the lease's expiry still bounds the wait, so a dead
    worker's job comes back however many submits wake the dispatcher meanwhile."""
    settings = settings_for(key_prefix, lease_ttl_s=1.0, max_wait_s=4.0)
    store = make_store(settings, redis_client)
    store.add_pending(PendingItem("j1", "a", 100, 100))
    recorder = Recorder()
    client = redis.Redis.from_url(redis_url)
    dispatcher = Dispatcher(settings, client, recorder)
    try:
        assert recorder.wait_for(1)
        n = 0
        while len(recorder.grants) < 2 and n < 400:  # cap 1: only j1's expiry frees the slot
            n += 1
            store.add_pending(PendingItem(f"w{n}", "a", 100, 100, enqueued_at=time.time() + 3600))
            threading.Event().wait(0.05)
        assert [g.job_id for g in recorder.grants[:2]] == ["j1", "j1"]
        assert recorder.grants[1].fence > recorder.grants[0].fence
    finally:
        dispatcher.close(store)
        client.close()


def test_a_held_round_still_promotes_a_due_continuation(
    key_prefix: str, redis_url: str, redis_client: redis.Redis
) -> None:
    """While the worker gate holds, a continuation whose backoff ended joins its queue (before,
    it stayed in ``deferred`` and the wait, ending at its past not-before time, spun at 1 ms)."""
    settings = settings_for(key_prefix, max_wait_s=4.0, lease_ttl_s=3600.0)
    store = make_store(settings, redis_client)
    store.add_pending(PendingItem("j1", "a", 100, 100))
    grant = store.admit_next(time.time()).grant
    assert grant is not None
    assert store.readmit("j1", grant.fence, 100, time.time() + 0.3, time.time())
    assert store.continuations() == {"a": {"deferred": 1}}
    recorder = Recorder()
    client = redis.Redis.from_url(redis_url)
    dispatcher = Dispatcher(settings, client, recorder, gate=lambda: "no_workers")
    try:
        assert wait_until(lambda: store.continuations() == {"a": {"pending": 1}})
        assert store.next_not_before() is None and recorder.grants == []
    finally:
        dispatcher.close(store)
        client.close()


def test_a_backoff_ends_in_a_grant_while_other_wakes_keep_coming(
    key_prefix: str, redis_url: str, redis_client: redis.Redis
) -> None:
    """Rounds woken early skip the promotion as they skip the reap; the continuation's not-before
    time still bounds the wait, so it is admitted again however many wakes come meanwhile."""
    settings = settings_for(key_prefix, lease_ttl_s=3600.0, max_wait_s=4.0)
    store = make_store(settings, redis_client)
    store.add_pending(PendingItem("j1", "a", 100, 100))
    recorder = Recorder()
    client = redis.Redis.from_url(redis_url)
    dispatcher = Dispatcher(settings, client, recorder)
    try:
        assert recorder.wait_for(1)
        first = recorder.grants[0]
        assert store.readmit("j1", first.fence, 100, time.time() + 1.0, time.time())
        n = 0
        while len(recorder.grants) < 2 and n < 400:  # every wake well inside max_wait_s
            n += 1
            store.wake()
            threading.Event().wait(0.05)
        assert [g.job_id for g in recorder.grants] == ["j1", "j1"]
        assert recorder.grants[1].fence > first.fence
    finally:
        dispatcher.close(store)
        client.close()


def test_a_no_workers_hold_is_counted_and_shown_in_fleet_queues(
    key_prefix: str, redis_url: str, redis_client: redis.Redis
) -> None:
    """The worker gate's hold is counted with the store's own holds (before, it showed in the
    dispatcher's log only), and ``fleet queues`` says no inference worker is live."""
    settings = settings_for(key_prefix, max_wait_s=0.05)
    store = make_store(settings, redis_client)
    store.add_pending(PendingItem("j1", "a", 100, 100))
    recorder = Recorder()
    client = redis.Redis.from_url(redis_url)
    dispatcher = Dispatcher(settings, client, recorder, gate=lambda: "no_workers")
    try:
        assert wait_until(lambda: store.snapshot().holds.get("no_workers", 0) >= 2)
        assert recorder.grants == []
    finally:
        dispatcher.close(store)
        client.close()
    console = Console(record=True, width=200)
    console.print(queues_table(settings, redis_client))
    text = console.export_text()
    assert "no_workers=" in text
    assert "live inference workers 0 (admissions held: no_workers)" in text
