"""``fleet queues``: pending work per project and band, and the limits in use.

Per project: jobs waiting in the dispatcher store for admission (interactive, batch) and prep
messages still waiting in the broker (``prep queue``). Flower's broker page sees only the latter:
a prepared job waits in the dispatcher store, which is no Celery queue. Continuations (jobs
between two model turns, fleet/infer/attempts.py) apart from new work: ``continuing`` are back in
line (counted in their band too), ``waiting`` wait outside it for a backoff or their tools."""

from __future__ import annotations

import time

import redis
from rich.table import Table

from fleet.core.config import Settings
from fleet.core.keys import Keys
from fleet.worker.heartbeat import live_worker_names, shown_workers
from fleet.worker.queues import prep_backlog
from schedulers.store import make_store
from schedulers.store.base import BackendSnapshot, StoreSnapshot
from schedulers.store.redis_store import RedisStore


def quota_cell(store: RedisStore, project: str, now: float) -> str:
    """A project's quota as its current windows hold it ("-": none): tokens and requests this
    minute, tokens today and this month, turns in flight, each against its limit."""
    quota = store.config.quota(project)
    if quota is None:
        return "-"
    used = store.quota_usage(project, now)
    parts = [(used.tokens_minute, quota.tokens_per_minute, "t/min"),
             (used.requests_minute, quota.requests_per_minute, "req/min"),
             (used.tokens_day, quota.tokens_per_day, "t/day"),
             (used.tokens_month, quota.tokens_per_month, "t/month"),
             (used.in_flight, quota.max_in_flight, "in flight")]
    return " · ".join(f"{value:,}/{limit:,} {unit}" for value, limit, unit in parts if limit)


def quota_holds(client: redis.Redis, settings: Settings) -> dict[str, int]:
    """Admission calls that passed a project's work over for its quota (stats' quota_held:<p>)."""
    stats: dict[bytes | str, bytes | str] = client.hgetall(Keys(settings.key_prefix).dispatch + "stats")  # type: ignore[assignment]
    found = {}
    for key, value in stats.items():
        name = key.decode() if isinstance(key, bytes) else key
        if name.startswith("quota_held:"):
            found[name.removeprefix("quota_held:")] = int(value)
    return found


def queues_table(settings: Settings, client: redis.Redis) -> Table:
    """What ``fleet queues`` prints: pending per project and band, then the limits in use."""
    store = make_store(settings, client)
    snap = store.snapshot()
    limits = store.config.limits
    table = Table(title="Dispatcher queues")
    backlog = prep_backlog(settings, client)
    continuing = store.continuations()
    deferred = store.deferred_counts()
    quota_held, now = quota_holds(client, settings), time.time()
    columns = ["project", "weight", "interactive", "batch", "continuing", "waiting", "prep queue"]
    if store.config.quotas:
        columns += ["quota", "quota holds"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("project", "quota") else "right")
    for project in sorted(set(snap.pending) | set(settings.projects) | set(continuing) | set(deferred)):
        bands = snap.pending.get(project, {})
        weight = store.config.weight(project)
        cont = continuing.get(project, {})
        cells = [
            project, f"{weight:g}", str(bands.get("interactive", 0)), str(bands.get("batch", 0)),
            # waiting: every job deferred until a not-before time (a continuation's backoff, a
            # repeat of a job running now, a turn its API key's quota holds)
            str(cont.get("pending", 0)), str(deferred.get(project, 0)),
            str(backlog.get(project, "-")),
        ]
        if store.config.quotas:
            cells += [quota_cell(store, project, now), str(quota_held.get(project, 0))]
        table.add_row(*cells)
    backend = store.backend()
    gate = backend.get("hold") or ("open" if backend else "no scrape yet")
    names = live_worker_names(client, Keys(settings.key_prefix))
    held = settings.admission.worker_gate and not names
    holds = ", ".join(f"{reason}={count}" for reason, count in sorted(snap.holds.items())) or "-"
    if len(store.config.backends) > 1:
        table.caption = "\n".join((
            *(backend_line(store, snap, entry.name) for entry in store.config.backends),
            f"in flight {snap.in_flight} in all, interactive {snap.interactive_in_flight}",
            f"admissions {snap.admissions}",
            f"holds {holds}",
            f"live inference workers {shown_workers(names)}"
            + (" (admissions held: no_workers)" if held else ""),
        ))
        return table
    table.caption = "\n".join(
        (
            f"in flight {snap.in_flight}/{limits.max_num_seqs}, "
            f"long {snap.long_in_flight}/{limits.max_long}, interactive {snap.interactive_in_flight}",
            f"KV {snap.reserved_kv_tokens:,}/{limits.kv_budget_tokens:,}",
            f"admissions {snap.admissions}",
            f"holds {holds}",
            f"backend gate: {gate}",
            f"live inference workers {shown_workers(names)}"
            + (" (admissions held: no_workers)" if held else ""),
            f"running {backend.get('running', '?')}, waiting {backend.get('waiting', '?')}",
        )
    )
    return table


def backend_line(store: RedisStore, snap: StoreSnapshot, name: str) -> str:
    """One backend's line: its leases against its limits, its gate and its server's figures."""
    limits = store.config.backends[store.config.backend_index(name)].limits
    counts = snap.backends.get(name, BackendSnapshot())
    scrape = store.backend(name)
    gate = scrape.get("hold") or ("open" if scrape else "no scrape yet")
    if "scraped_at" in scrape and time.time() - float(scrape["scraped_at"]) > store.config.scrape_stale_s:
        gate = "stale (no scrape recorded lately: admissions held)"
    queries, hits = float(scrape.get("prefix_cache_queries") or 0), float(scrape.get("prefix_cache_hits") or 0)
    hit_rate = f", prefix cache hits {hits / queries:.0%}" if queries else ""
    return (f"backend {name}: in flight {counts.in_flight}/{limits.max_num_seqs}, "
            f"long {counts.long_in_flight}/{limits.max_long}, "
            f"KV {counts.reserved_kv_tokens:,}/{limits.kv_budget_tokens:,}, gate: {gate}, "
            f"running {scrape.get('running', '?')}, waiting {scrape.get('waiting', '?')}{hit_rate}")
