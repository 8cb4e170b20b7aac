"""The dispatcher's Prometheus registry: the shared store's figures, final result codes and this
process's own queue-wait histogram, served by prometheus_client on ``admission.metrics_port``."""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterable

import redis
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.core.keys import Keys
from schedulers.store.base import AdmissionStore, Grant

log = logging.getLogger(__name__)

WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


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


def serve_metrics(metrics: DispatcherMetrics, port: int):  # type: ignore[no-untyped-def]
    """Serve ``/metrics`` on ``port`` (0 = off); returns the server, or None.

    A busy port (another dispatcher on this host has it) is a WARNING and this dispatcher runs
    on without its own endpoint: the figures read from the shared store and the result codes are
    the same from every dispatcher, so the one that holds the port serves them for all; only this
    process's queue-wait histogram goes unserved. Give each dispatcher its own port to scrape that.
    """
    if not port:
        return None
    try:
        server, _thread = start_http_server(port, registry=metrics.registry)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        log.warning("metrics port %d is in use (another dispatcher on this host?); this dispatcher "
                    "serves no /metrics and goes on admitting", port)
        return None
    log.info("dispatcher metrics on :%d/metrics", port)
    return server
