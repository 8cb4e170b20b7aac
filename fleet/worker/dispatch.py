"""What a ``fleet dispatcher`` process runs: the admission loop (schedulers/dispatcher.py) wired to
the outside world.

- ``send``: a grant becomes a ``fleet.infer`` task carrying job id and fence. The message
  expires with the lease it carries: by then the job is pending again, so stale messages do not
  pile up while inference workers are down.
- ``on_expired``: a job whose deadline passed while it waited for admission gets its final
  E_DEADLINE envelope here, without ever taking a slot.
- the prep watchdog (fleet/prep/watchdog.py) runs beside the loop, sending again the prep messages
  of jobs whose prep worker died before handing them over.
- ``stop`` ends both; ``fleet dispatcher`` sets it on SIGINT, SIGTERM and SIGHUP, so a supervisor
  (systemd, honcho, ``fleet up``) stops a dispatcher cleanly within ``admission.max_wait_s``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import redis
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.core.codes import Code
from fleet.core.config import Settings
from fleet.core.keys import Keys
from fleet.core.models import Envelope
from fleet.core.results import ResultStore
from fleet.prep.watchdog import run_prep_watchdog
from fleet.worker.app import INFER_TASK, PREP_TASK, create_app, prep_backlog, shown
from schedulers.dispatcher import run_dispatcher
from schedulers.store.base import Grant


def serve_dispatcher(settings: Settings, stop: threading.Event | None = None) -> None:
    stop = stop or threading.Event()
    celery = create_app(settings)
    client = redis.Redis.from_url(settings.broker_url)
    results = ResultStore(client, Keys(settings.key_prefix), settings)

    def send(grant: Grant) -> None:
        celery.send_task(INFER_TASK, kwargs={"job_id": grant.job_id, "project": grant.project,
                                             "fence": grant.fence},
                         expires=datetime.fromtimestamp(grant.lease_expires_at, tz=UTC),
                         **shown(grant.project, grant.job_id))

    def on_expired(job_id: str) -> None:
        project = results.job_record(job_id).get("project", "")
        results.publish(Envelope.failure(job_id, project, Code.E_DEADLINE,
                                         "the deadline passed while waiting for admission"))

    def resend_prep(signed: dict[str, Any]) -> None:
        celery.send_task(PREP_TASK, kwargs={"project": signed["project"],
                                            "job_id": signed["job"]["id"], "signed": signed},
                         **shown(signed["project"], signed["job"]["id"]))

    threading.Thread(target=run_prep_watchdog, name="prep-watchdog", daemon=True,
                     args=(settings, results, resend_prep, stop)).start()
    run_dispatcher(settings, client, send, stop=stop, on_expired=on_expired,
                   shared_metrics=[PrepBacklogCollector(settings, client)])


class PrepBacklogCollector(Collector):
    """``fleet_prep_queued{project}``: prep messages waiting in the broker, read on each scrape
    (a job waits there before the dispatcher store knows it; see ``fleet_dispatch_pending``)."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self._settings = settings
        self._client = client

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("fleet_prep_queued", "Prep messages waiting in the broker",
                                   labels=["project"])
        for project, count in sorted(prep_backlog(self._settings, self._client).items()):
            family.add_metric([project], count)
        yield family
