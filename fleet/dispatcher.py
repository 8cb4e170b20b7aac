"""The dispatcher process: admits pending jobs into the backend, one atomic decision at a time.

Loop (``run_dispatcher``):
  1. reap expired leases (their jobs go back in line at their original place);
  2. ``admit_next`` while it grants, calling ``send(grant)`` for each (the caller enqueues the
     inference task with the job id and the fence);
  3. block on the wake list (BLPOP) until a submit, a release, an expiry or a lifted backend hold
     pushes to it, or until the next time-based event: lease expiry, bucket refill, spacing, or
     ``admission.max_wait_s`` at most. Nothing sleep-polls; a freed slot is refilled as soon as
     the release's wake reaches a dispatcher.

Beside it, a thread scrapes the backend (fleet/scrape.py) when ``admission.backend_gate`` is on,
and prometheus_client serves ``/metrics`` on ``admission.metrics_port`` (0 = off). Any number of
dispatchers may run against one Redis: the store's Lua script is the only place that decides.

If ``send`` raises (broker down), the lease stays and expires after ``lease_ttl_s``; the job is
then admitted again. Nothing is lost and no capacity leaks, it only costs one lease TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

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

WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


def make_store(settings: Settings, client: redis.Redis) -> RedisStore:
    return RedisStore(client, Keys(settings.key_prefix), StoreConfig.from_settings(settings))


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
    """Admit while the store grants; returns the round's final (holding) result."""
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
        except Exception:  # the lease expires and the job is admitted again (module docstring)
            log.exception(
                "sending %s failed; it is re-admitted when its lease expires", grant.job_id
            )


def wait_timeout_s(store: AdmissionStore, result: AdmitResult, now: float, max_s: float) -> float:
    """How long to block on the wake list: until the next time-based event, at most ``max_s``."""
    timeout_s = max_s
    if result.hold_reason == "conflict":
        return 0.0
    if result.retry_in_s is not None:
        timeout_s = min(timeout_s, result.retry_in_s)
    expiry = store.next_expiry()
    if expiry is not None:
        timeout_s = min(timeout_s, expiry - now)
    return max(timeout_s, 0.001)


def run_dispatcher(
    settings: Settings,
    client: redis.Redis,
    send: Callable[[Grant], None],
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.time,
) -> None:
    """Run until ``stop`` is set (it is checked after every wake; ``store.wake()`` hurries it)."""
    stop = stop or threading.Event()
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
            store.reap_expired(clock())
            result = admit_all(store, send, clock(), metrics)
            store.wait_for_wake(wait_timeout_s(store, result, clock(), admission.max_wait_s))
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
