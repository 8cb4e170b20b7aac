"""``fleet queues``: pending work per project and band, and the limits in use.

Per project: jobs waiting in the dispatcher store for admission (interactive, batch) and prep
messages still waiting in the broker (``prep queue``). Flower's broker page sees only the latter:
a prepared job waits in the dispatcher store, which is no Celery queue. Continuations (jobs
between two model turns, fleet/infer/attempts.py) apart from new work: ``continuing`` are back in
line (counted in their band too), ``waiting`` wait outside it for a backoff or their tools."""

from __future__ import annotations

import redis
from rich.table import Table

from fleet.core.config import Settings
from fleet.core.keys import Keys
from fleet.worker.heartbeat import live_worker_names, shown_workers
from fleet.worker.queues import prep_backlog
from schedulers.store import make_store


def queues_table(settings: Settings, client: redis.Redis) -> Table:
    """What ``fleet queues`` prints: pending per project and band, then the limits in use."""
    store = make_store(settings, client)
    snap = store.snapshot()
    limits = store.config.limits
    table = Table(title="Dispatcher queues")
    backlog = prep_backlog(settings, client)
    continuing = store.continuations()
    for column in ("project", "weight", "interactive", "batch", "continuing", "waiting",
                   "prep queue"):
        table.add_column(column, justify="left" if column == "project" else "right")
    for project in sorted(set(snap.pending) | set(settings.projects) | set(continuing)):
        bands = snap.pending.get(project, {})
        weight = store.config.weight(project)
        cont = continuing.get(project, {})
        table.add_row(
            project, f"{weight:g}", str(bands.get("interactive", 0)), str(bands.get("batch", 0)),
            str(cont.get("pending", 0)), str(cont.get("deferred", 0)),
            str(backlog.get(project, "-")),
        )
    backend = store.backend()
    gate = backend.get("hold") or ("open" if backend else "no scrape yet")
    names = live_worker_names(client, Keys(settings.key_prefix))
    held = settings.admission.worker_gate and not names
    holds = ", ".join(f"{reason}={count}" for reason, count in sorted(snap.holds.items())) or "-"
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

