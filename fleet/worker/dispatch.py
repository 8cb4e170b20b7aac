"""What a ``fleet dispatcher`` process runs: the admission loop (schedulers/dispatcher.py) wired to
the outside world.

- ``send``: a grant becomes a ``fleet.infer`` task carrying the job's ref and fence. The message
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
from datetime import UTC, datetime
from typing import Any

import redis

from fleet.core.codes import Code
from fleet.core.config import Settings
from fleet.core.keys import Keys, split_ref
from fleet.core.models import Envelope
from fleet.core.results import ResultStore
from fleet.prep.watchdog import run_prep_watchdog
from fleet.worker.app import INFER_TASK, PREP_TASK, create_app
from schedulers.dispatcher import run_dispatcher
from schedulers.store.base import Grant


def serve_dispatcher(settings: Settings, stop: threading.Event | None = None) -> None:
    stop = stop or threading.Event()
    celery = create_app(settings)
    client = redis.Redis.from_url(settings.broker_url)
    results = ResultStore(client, Keys(settings.key_prefix), settings)

    def send(grant: Grant) -> None:
        celery.send_task(INFER_TASK, kwargs={"ref": grant.job_id, "project": grant.project,
                                             "fence": grant.fence},
                         expires=datetime.fromtimestamp(grant.lease_expires_at, tz=UTC))

    def on_expired(ref: str) -> None:
        project, job_id = split_ref(ref)
        results.publish(Envelope.failure(job_id, project, Code.E_DEADLINE,
                                         "the deadline passed while waiting for admission"))

    def resend_prep(signed: dict[str, Any]) -> None:
        celery.send_task(PREP_TASK, kwargs={"project": signed["project"],
                                            "job_id": signed["job"]["id"], "signed": signed})

    threading.Thread(target=run_prep_watchdog, name="prep-watchdog", daemon=True,
                     args=(settings, results, resend_prep, stop)).start()
    run_dispatcher(settings, client, send, stop=stop, on_expired=on_expired)
