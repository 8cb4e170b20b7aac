"""The dispatcher's Prometheus registry: the shared store's figures, final result codes and this
process's own queue-wait histogram, served by prometheus_client on ``admission.metrics_port``.

Fleet-wide families (``StoreCollector``, ``ResultCodeCollector``) are read from Redis and are the
same from every dispatcher; were each dispatcher to export them, a ``sum()`` over instances would
count them once per dispatcher. So only the *metrics leader* exports them: the dispatcher holding a
short Redis lock (``{p}metrics:leader``, redis-py's ``Lock``: SET NX PX, extended by its owner), renewed
from the dispatcher loop. The others export only their own families, and every dispatcher exports
``fleet_metrics_leader`` (1 on the leader) so a dashboard can tell which one speaks for the fleet.
A dispatcher that serves no /metrics (port 0, or busy) never competes for the lock.
If the leader dies, another takes the lock within ``LEADER_TTL_S``; a scrape in that gap sees no
fleet-wide figures from anyone (a gap in the graph, never a double count).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import Callable, Iterable

import redis
import redis.exceptions
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.core.keys import Keys
from fleet.core.persistence import unsafe_settings
from schedulers.store.base import AdmissionStore, BackendSnapshot, Grant, StoreSnapshot

log = logging.getLogger(__name__)

WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
LEADER_TTL_S = 15.0
LEADER_RENEW_S = 5.0  # a third of the TTL: two renewals may fail before the lock lapses


class MetricsLeader:
    """Holds, or tries to take, the lock that makes this dispatcher the one exporting the fleet-wide
    families. ``renew`` is called from the dispatcher loop; it contacts Redis at most every
    ``LEADER_RENEW_S``; a Redis error drops leadership and is raised to the loop, which logs it and
    backs off as for any other Redis error."""

    def __init__(self, client: redis.Redis, key: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = client.lock(key, timeout=LEADER_TTL_S, thread_local=False)
        self._clock = clock
        self._next_at = -float("inf")
        self.held = False

    def renew(self) -> bool:
        now = self._clock()
        if now < self._next_at:
            return self.held
        self._next_at = now + LEADER_RENEW_S
        was = self.held
        try:
            if self.held:
                self._lock.reacquire()
            else:
                self.held = bool(self._lock.acquire(blocking=False))
        except redis.exceptions.LockError:  # another dispatcher took it after our lock lapsed
            self.held = False
        except redis.RedisError:
            self.held = False  # unknown: export nothing shared rather than risk a double count
            raise
        if self.held != was:
            log.info("metrics leader: %s", "this dispatcher exports the fleet-wide figures" if self.held
                     else "another dispatcher exports the fleet-wide figures")
        return self.held

    def release(self) -> None:
        if self.held:
            # expired or unreachable: the TTL frees it
            with contextlib.suppress(redis.exceptions.LockError, redis.RedisError):
                self._lock.release()
            self.held = False


class LeaderOnly(Collector):
    """Yields ``inner``'s families only while ``leader`` holds the lock."""

    def __init__(self, inner: Collector, leader: MetricsLeader) -> None:
        self._inner = inner
        self._leader = leader

    def collect(self) -> Iterable[Metric]:
        if self._leader.held:
            yield from self._inner.collect()


class LeaderGauge(Collector):
    def __init__(self, leader: MetricsLeader) -> None:
        self._leader = leader

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("fleet_metrics_leader",
                                "1 if this dispatcher exports the fleet-wide figures",
                                value=1 if self._leader.held else 0)


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
        yield GaugeMetricFamily("fleet_dispatch_cap", "Most leases at once (backend.max_num_seqs)",
                                value=self._store.config.limits.max_num_seqs)
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
        yield GaugeMetricFamily(
            "fleet_dispatch_interactive_in_flight",
            "Live leases of interactive-band jobs (while any lives, long prefills get quiet windows)",
            value=snap.interactive_in_flight,
        )
        yield CounterMetricFamily(
            "fleet_dispatch_admissions", "Jobs admitted", value=snap.admissions
        )
        yield from self._per_backend(snap)
        yield from self._backend()
        oldest = GaugeMetricFamily(
            "fleet_dispatch_oldest_pending_seconds",
            "Age of the longest-waiting job at the head of a project's queues (since it was queued)",
            labels=["project"],
        )
        now = time.time()
        for project, enqueued_at in sorted(self._store.oldest_pending().items()):
            oldest.add_metric([project], max(0.0, now - enqueued_at))
        yield oldest
        holds = CounterMetricFamily(
            "fleet_dispatch_holds", "Admission rounds that admitted nothing", labels=["reason"]
        )
        for reason, count in sorted(snap.holds.items()):
            holds.add_metric([reason], count)
        yield holds
        yield from self._quotas(snap, now)

    def _quotas(self, snap: StoreSnapshot, now: float) -> Iterable[Metric]:
        """Each project's quota windows against its limits (schedulers/policy/quota.py), and the
        admission calls its quota held it; nothing for a fleet without quotas."""
        config = self._store.config
        if not config.quotas:
            return
        used = GaugeMetricFamily("fleet_quota_used", "What the project's turns hold in the current quota "
                                 "window (cost units; requests; turns in flight)", labels=["project", "window"])
        limit = GaugeMetricFamily("fleet_quota_limit", "The project's quota for the window",
                                  labels=["project", "window"])
        held = CounterMetricFamily("fleet_quota_held", "Admission calls that passed the project's work "
                                   "over for its quota", labels=["project"])
        for project in sorted(config.quotas):
            quota = config.quota(project)
            if quota is None:
                continue
            usage = self._store.quota_usage(project, now)
            for window, value, cap in (("tokens_minute", usage.tokens_minute, quota.tokens_per_minute),
                                       ("requests_minute", usage.requests_minute, quota.requests_per_minute),
                                       ("tokens_day", usage.tokens_day, quota.tokens_per_day),
                                       ("tokens_month", usage.tokens_month, quota.tokens_per_month),
                                       ("in_flight", usage.in_flight, quota.max_in_flight)):
                if cap:
                    used.add_metric([project, window], value)
                    limit.add_metric([project, window], cap)
            held.add_metric([project], snap.quota_held.get(project, 0))
        yield from (used, limit, held)

    def _per_backend(self, snap: StoreSnapshot) -> Iterable[Metric]:
        """Each backend's own lease counters and limits, labelled with its configured name (a
        bounded set: never a request's input)."""
        labels = ["backend"]
        in_flight = GaugeMetricFamily("fleet_dispatch_backend_in_flight", "Live leases on the backend",
                                      labels=labels)
        cap = GaugeMetricFamily("fleet_dispatch_backend_cap", "Most leases at once on the backend "
                                "(its max_num_seqs)", labels=labels)
        kv = GaugeMetricFamily("fleet_dispatch_backend_reserved_kv_tokens",
                               "KV tokens reserved by the backend's live leases (whole blocks)", labels=labels)
        long = GaugeMetricFamily("fleet_dispatch_backend_long_in_flight",
                                 "Live leases with a long prompt on the backend", labels=labels)
        for backend in self._store.config.backends:
            counts = snap.backends.get(backend.name, BackendSnapshot())
            in_flight.add_metric([backend.name], counts.in_flight)
            cap.add_metric([backend.name], backend.limits.max_num_seqs)
            kv.add_metric([backend.name], counts.reserved_kv_tokens)
            long.add_metric([backend.name], counts.long_in_flight)
        yield from (in_flight, cap, kv, long)

    def _backend(self) -> Iterable[Metric]:
        """Each backend as the dispatchers' scrapers last saw it (schedulers/scrape.py), labelled
        with its name. A backend no scrape was recorded for yet (never reached since the store's
        keys began) is down and held (the gate holds it: no verdict is a stale one), so its
        alerts fire as for one that went away; it has no age series until its first scrape."""
        labels = ["backend"]
        up = GaugeMetricFamily("fleet_backend_up", "1 if the backend's /health answered 200 at the last scrape",
                               labels=labels)
        age_family = GaugeMetricFamily("fleet_backend_scrape_age_seconds",
                                       "Seconds since a dispatcher last scraped the backend", labels=labels)
        held = GaugeMetricFamily("fleet_backend_held",
                                 "1 while the backend gate holds admissions (a hold or a stale scrape)",
                                 labels=labels)
        outside_family = GaugeMetricFamily(
            "fleet_backend_outside_sequences",
            "Sequences running at the backend that are not the fleet's (last scrape)", labels=labels)
        hit_rate = GaugeMetricFamily(
            "fleet_backend_prefix_cache_hit_rate",
            "The backend's own prefix cache hits / queries in tokens since it started (last scrape; 0: none yet)",
            labels=labels)
        for entry in self._store.config.backends:
            backend = self._store.backend(entry.name)
            if "scraped_at" in backend:
                age = max(0.0, time.time() - float(backend["scraped_at"]))
                up.add_metric([entry.name], 1 if backend.get("healthy") == "1" else 0)
                age_family.add_metric([entry.name], age)
                stale = age > self._store.config.scrape_stale_s
                held.add_metric([entry.name], 1 if backend.get("hold") or stale else 0)
            else:
                up.add_metric([entry.name], 0)
                held.add_metric([entry.name], 1)
            if backend.get("outside") is not None:
                outside_family.add_metric([entry.name], float(backend["outside"]))
            queries, hits = backend.get("prefix_cache_queries"), backend.get("prefix_cache_hits")
            if queries is not None and hits is not None:  # the server exports its counters
                hit_rate.add_metric([entry.name], float(hits) / float(queries) if float(queries) > 0 else 0.0)
        yield from (up, age_family, held, outside_family, hit_rate)


class ResultCodeCollector(Collector):
    """Final results by project and code, counted atomically when each envelope is published
    (fleet/core/results.py) in ``{p}stats:codes``; read on every scrape."""

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


class BrokerPersistenceCollector(Collector):
    """``fleet_broker_unsafe{setting}``: 1 while the broker's ``appendonly`` or
    ``maxmemory-policy`` is one that loses jobs (fleet/core/persistence.py), read through INFO on
    each scrape; both series are always there (0 = safe)."""

    SETTINGS = ("appendonly", "maxmemory-policy")

    def __init__(self, client: redis.Redis) -> None:
        self._client = client

    def collect(self) -> Iterable[Metric]:
        unsafe = unsafe_settings(self._client)
        family = GaugeMetricFamily("fleet_broker_unsafe",
                                   "1 if this broker setting can lose jobs (appendonly off, an evicting policy)",
                                   labels=["setting"])
        for setting in self.SETTINGS:
            family.add_metric([setting], 1 if setting in unsafe else 0)
        yield family


class DispatcherMetrics:
    """This process's registry: the store's shared figures, the fleet's result codes and any other
    fleet-wide ``shared`` collectors (only while ``leader`` holds the lock, or always without a
    leader) and this dispatcher's own queue-wait histogram."""

    def __init__(self, store: AdmissionStore, results: Collector | None = None,
                 leader: MetricsLeader | None = None, shared: Iterable[Collector] = ()) -> None:
        self.registry = CollectorRegistry()
        shared = [StoreCollector(store), *([results] if results is not None else []), *shared]
        for collector in shared:
            self.registry.register(collector if leader is None else LeaderOnly(collector, leader))
        if leader is not None:
            self.registry.register(LeaderGauge(leader))
        self.queue_wait = Histogram(
            "fleet_dispatch_queue_wait_seconds",
            "Time from submission to admission",
            ["project"],
            buckets=WAIT_BUCKETS_S,
            registry=self.registry,
        )

    def admitted(self, grant: Grant) -> None:
        self.queue_wait.labels(grant.project).observe(grant.waited_s)


def serve_metrics(metrics: DispatcherMetrics, port: int, host: str = "127.0.0.1"):  # type: ignore[no-untyped-def]
    """Serve ``/metrics`` on ``port`` (0 = off); returns the server, or None.

    A busy port (another dispatcher on this host has it) is a WARNING and this dispatcher runs
    on without its own endpoint, so its own queue-wait histogram goes unserved, and so do the
    fleet-wide figures while it is the metrics leader. Give each dispatcher its own port.
    """
    return serve_registry(metrics.registry, port, "dispatcher", host)


def serve_registry(registry: CollectorRegistry, port: int, who: str,  # type: ignore[no-untyped-def]
                   host: str = "127.0.0.1"):
    """Serve ``registry`` on ``host``:``port`` (0 = off; the ``metrics_host`` setting, loopback by
    default: the figures name every project and need no key) for process kind ``who``; a busy
    port is a WARNING and None (the process goes on without /metrics), any other failure raises."""
    if not port:
        return None
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        log.warning("metrics port %d is in use (another %s on this host?); this %s serves no "
                    "/metrics and goes on working", port, who, who)
        return None
    log.info("%s metrics on %s:%d/metrics", who, host, port)
    return server
