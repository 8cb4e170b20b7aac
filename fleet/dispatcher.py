"""The dispatcher process: admits pending jobs into the backend, one atomic decision at a time.

Loop (``run_dispatcher``):
  1. reap expired leases (their jobs go back in line at their original place);
  2. drop pending jobs whose deadline passed (``expire_deadlines``) and hand each id to
     ``on_expired`` (the caller publishes E_DEADLINE);
  3. ``admit_next`` while it grants, calling ``send(grant)`` for each (the caller enqueues the
     inference task with the job id and the fence);
  4. block on the wake list (BLPOP) until a submit, a release, an expiry or a lifted backend hold
     pushes to it, or until the next time-based event: lease expiry, pending deadline, bucket
     refill, spacing, or ``admission.max_wait_s`` at most (<= 4 s, below redis-py's socket
     timeout). Nothing sleep-polls; a freed slot is refilled as soon as the release's wake
     reaches a dispatcher.

Beside it, a thread scrapes the backend (fleet/scrape.py) when ``admission.backend_gate`` is on,
and prometheus_client serves ``/metrics`` on ``admission.metrics_port`` (0 = off). Any number of
dispatchers may run against one Redis: the store's Lua script is the only place that decides.

Failure cases:
- ``send`` raises (broker down): the lease is given back at once with ``requeue`` (the job
  returns to its place in line), the round ends and the dispatcher backs off before the next.
  If even the requeue fails, the lease expires after ``lease_ttl_s`` and the job is admitted
  again: nothing is lost and no capacity leaks.
- Redis unreachable or slow (ConnectionError, TimeoutError, any RedisError) in reap, expiry,
  admission or the wait: one log line, a back-off (0.5 s doubling to 5 s, reset after a good
  round) on the stop event, and the loop goes on. The dispatcher never exits on a Redis blip.
- ``on_expired`` raises: logged; the job has already left the line (its E_DEADLINE is lost).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import kombu.exceptions
import redis
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from rich.table import Table

from fleet.config import Settings
from fleet.keys import Keys
from fleet.scrape import make_http, run_scraper
from schedulers.redis_store import RedisStore
from schedulers.store import AdmissionStore, AdmitResult, Grant, StoreConfig

log = logging.getLogger(__name__)

SEND_ERRORS = (kombu.exceptions.OperationalError, redis.RedisError, OSError)
WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


def make_store(settings: Settings, client: redis.Redis) -> RedisStore:
    """The fleet's Redis store; its waits stay under ``client``'s socket timeout (see there)."""
    return RedisStore(client, Keys(settings.key_prefix), StoreConfig.from_settings(settings))


class Backoff:
    """Waits after a failed round: ``first_s``, doubling up to ``max_s``; ``reset`` on success."""

    def __init__(self, first_s: float = 0.5, max_s: float = 5.0) -> None:
        self.first_s, self.max_s = first_s, max_s
        self._next_s = first_s

    def next_s(self) -> float:
        wait_s = self._next_s
        self._next_s = min(self.max_s, wait_s * 2)
        return wait_s

    def reset(self) -> None:
        self._next_s = self.first_s


class StoreCollector(Collector):
    """Reads the shared store on every Prometheus scrape: the figures of the whole fleet."""

    def __init__(self, store: AdmissionStore) -> None:
        self._store = store

    def collect(self) -> Iterable[Metric]:
        snap = self._store.snapshot()
        pending = GaugeMetricFamily(
            "fleet_dispatch_pending", "Jobs waiting for admission", labels=["project", "band"]
        )
        for project, bands in sorted(snap.pending.items()):
            for band, count in sorted(bands.items()):
                pending.add_metric([project, band], count)
        yield pending
        yield GaugeMetricFamily("fleet_dispatch_in_flight", "Live leases", value=snap.in_flight)
        yield GaugeMetricFamily(
            "fleet_dispatch_reserved_kv_tokens",
            "KV tokens reserved by live leases (whole blocks)",
            value=snap.reserved_kv_tokens,
        )
        yield GaugeMetricFamily(
            "fleet_dispatch_long_in_flight",
            "Live leases with a long prompt",
            value=snap.long_in_flight,
        )
        yield CounterMetricFamily(
            "fleet_dispatch_admissions", "Jobs admitted", value=snap.admissions
        )
        holds = CounterMetricFamily(
            "fleet_dispatch_holds", "Admission rounds that admitted nothing", labels=["reason"]
        )
        for reason, count in sorted(snap.holds.items()):
            holds.add_metric([reason], count)
        yield holds


class ResultCodeCollector(Collector):
    """Final results by project and code, counted atomically when each envelope is published
    (fleet/results.py) in ``{p}stats:codes``; read on every scrape."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._client = client
        self._key = keys.code_counts

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "fleet_results", "Final envelopes by project and message code", labels=["project", "code"]
        )
        for field, count in sorted(self._client.hgetall(self._key).items()):
            text = field.decode() if isinstance(field, bytes) else str(field)
            project, _, code = text.partition("|")
            family.add_metric([project, code], int(count))
        yield family


class DispatcherMetrics:
    """This process's registry: the store's shared figures, the fleet's result codes and this
    dispatcher's own queue-wait histogram."""

    def __init__(self, store: AdmissionStore, results: Collector | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(store))
        if results is not None:
            self.registry.register(results)
        self.queue_wait = Histogram(
            "fleet_dispatch_queue_wait_seconds",
            "Time from submission to admission",
            ["project"],
            buckets=WAIT_BUCKETS_S,
            registry=self.registry,
        )

    def admitted(self, grant: Grant) -> None:
        self.queue_wait.labels(grant.project).observe(grant.waited_s)


def admit_all(
    store: AdmissionStore,
    send: Callable[[Grant], None],
    now: float,
    metrics: DispatcherMetrics | None = None,
) -> AdmitResult:
    """Admit while the store grants; returns the round's final (holding) result, or
    ``AdmitResult(None, "send_failed")`` after a grant that could not be sent (it is requeued)."""
    while True:
        result = store.admit_next(now)
        grant = result.grant
        if grant is None:
            return result
        log.info(
            "admitted %s project=%s fence=%d prompt=%d kv=%d long=%s waited=%.3fs",
            grant.job_id,
            grant.project,
            grant.fence,
            grant.prompt_tokens,
            grant.kv_tokens,
            grant.long,
            grant.waited_s,
        )
        if metrics is not None:
            metrics.admitted(grant)
        try:
            send(grant)
        except SEND_ERRORS as exc:
            log.warning("sending %s failed (%r); back in line", grant.job_id, exc)
            return _requeue(store, grant)
        except Exception:  # a bug in send: same handling, with the traceback
            log.exception("sending %s failed; back in line", grant.job_id)
            return _requeue(store, grant)


def _requeue(store: AdmissionStore, grant: Grant) -> AdmitResult:
    """Give a grant's lease back at once. If Redis is down too, the RedisError reaches the loop,
    and the lease simply expires after its TTL."""
    store.requeue(grant.job_id, grant.fence)
    return AdmitResult(None, "send_failed")


def wait_timeout_s(store: AdmissionStore, result: AdmitResult, now: float, max_s: float) -> float:
    """How long to block on the wake list: until the next time-based event, at most ``max_s``."""
    timeout_s = max_s
    if result.hold_reason == "conflict":
        return 0.0
    if result.retry_in_s is not None:
        timeout_s = min(timeout_s, result.retry_in_s)
    for event_at in (store.next_expiry(), store.next_deadline()):
        if event_at is not None:
            timeout_s = min(timeout_s, event_at - now)
    return max(timeout_s, 0.001)


def expire_deadlines(
    store: AdmissionStore, now: float, on_expired: Callable[[str], None] | None
) -> list[str]:
    """Drop pending jobs past their deadline and report each to ``on_expired``."""
    expired = store.expire_deadlines(now)
    for job_id in expired:
        log.info("deadline passed while pending: %s", job_id)
        if on_expired is None:
            continue
        try:
            on_expired(job_id)
        except Exception:  # one failed report must not stop the others or the loop
            log.exception("reporting the expired deadline of %s failed", job_id)
    return expired


def dispatch_round(
    store: AdmissionStore,
    send: Callable[[Grant], None],
    clock: Callable[[], float],
    metrics: DispatcherMetrics | None = None,
    on_expired: Callable[[str], None] | None = None,
) -> AdmitResult:
    """One pass of the loop before its wait: reap, expire deadlines, admit."""
    store.reap_expired(clock())
    expire_deadlines(store, clock(), on_expired)
    return admit_all(store, send, clock(), metrics)


def run_dispatcher(
    settings: Settings,
    client: redis.Redis,
    send: Callable[[Grant], None],
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.time,
    on_expired: Callable[[str], None] | None = None,
    backoff: Backoff | None = None,
) -> None:
    """Run until ``stop`` is set (it is checked after every wake; ``store.wake()`` hurries it).

    ``on_expired(job_id)`` is called for each pending job dropped because its deadline passed;
    ``backoff`` paces the retries after a Redis error or a failed send (module docstring).
    """
    stop = stop or threading.Event()
    backoff = backoff or Backoff()
    store = make_store(settings, client)
    metrics = DispatcherMetrics(store, ResultCodeCollector(client, Keys(settings.key_prefix)))
    admission = settings.admission
    server = _serve_metrics(metrics, admission.metrics_port)
    scraper_stop = threading.Event()
    scraper = _start_scraper(settings, store, scraper_stop, clock)
    log.info(
        "dispatcher running: cap=%d, prefix=%s", settings.backend.max_num_seqs, settings.key_prefix
    )
    try:
        while not stop.is_set():
            try:
                result = dispatch_round(store, send, clock, metrics, on_expired)
                if result.hold_reason == "send_failed":
                    stop.wait(backoff.next_s())
                    continue
                store.wait_for_wake(wait_timeout_s(store, result, clock(), admission.max_wait_s))
                backoff.reset()
            except redis.RedisError as exc:
                pause_s = backoff.next_s()
                log.warning("redis error in the dispatcher loop (%r); again in %.1fs", exc, pause_s)
                stop.wait(pause_s)
    finally:
        scraper_stop.set()
        if scraper is not None:
            scraper.join(timeout=5)
        if server is not None:
            server.shutdown()
        log.info("dispatcher stopped")


def _serve_metrics(metrics: DispatcherMetrics, port: int):  # type: ignore[no-untyped-def]
    if not port:
        return None
    server, _thread = start_http_server(port, registry=metrics.registry)
    log.info("dispatcher metrics on :%d/metrics", port)
    return server


def _start_scraper(
    settings: Settings, store: AdmissionStore, stop: threading.Event, clock: Callable[[], float]
) -> threading.Thread | None:
    if not settings.admission.backend_gate:
        return None

    def scrape() -> None:
        with make_http(settings) as http:
            run_scraper(settings, store, http, stop, clock)

    thread = threading.Thread(target=scrape, name="backend-scraper", daemon=True)
    thread.start()
    return thread


def queues_table(settings: Settings, client: redis.Redis) -> Table:
    """What ``fleet queues`` prints: pending per project and band, then the limits in use."""
    store = make_store(settings, client)
    snap = store.snapshot()
    limits = store.config.limits
    table = Table(title="Dispatcher queues")
    for column in ("project", "weight", "interactive", "batch"):
        table.add_column(column, justify="left" if column == "project" else "right")
    for project in sorted(set(snap.pending) | set(settings.projects)):
        bands = snap.pending.get(project, {})
        weight = store.config.weight(project)
        table.add_row(
            project, f"{weight:g}", str(bands.get("interactive", 0)), str(bands.get("batch", 0))
        )
    backend = store.backend()
    gate = backend.get("hold") or ("open" if backend else "no scrape yet")
    holds = ", ".join(f"{reason}={count}" for reason, count in sorted(snap.holds.items())) or "-"
    table.caption = "\n".join(
        (
            f"in flight {snap.in_flight}/{limits.max_num_seqs}, "
            f"long {snap.long_in_flight}/{limits.max_long}",
            f"KV {snap.reserved_kv_tokens:,}/{limits.kv_budget_tokens:,}",
            f"admissions {snap.admissions}",
            f"holds {holds}",
            f"backend gate: {gate}",
            f"running {backend.get('running', '?')}, waiting {backend.get('waiting', '?')}",
        )
    )
    return table
