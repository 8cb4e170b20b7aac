"""The dispatcher process loop on a real Redis: event-driven wakes, metrics, ``fleet queues``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import redis
from rich.console import Console

from fleet.config import Settings
from fleet.dispatcher import make_store, queues_table, run_dispatcher, wait_timeout_s
from schedulers.store import AdmitResult, Grant, PendingItem


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


def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Wait for a condition another thread brings about (a generous bound, not a timing claim)."""
    event = threading.Event()
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        event.wait(0.01)
    return True


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
    # Both the idle wait and the lease TTL are an hour: only an event can wake the dispatcher.
    settings = settings_for(
        key_prefix, max_wait_s=3600.0, lease_ttl_s=3600.0, metrics_port=free_port()
    )
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
    assert recorder.wait_for(2)  # only the release's wake can have done this (max wait 1 h)
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
