"""What a ``fleet dispatcher`` process runs: the admission loop (schedulers/dispatcher.py) wired to
the outside world.

- ``send``: a grant becomes a ``fleet.infer`` task carrying the job's ref and fence. The message
  expires with the lease it carries: by then the job is pending again, so stale messages do not
  pile up while inference workers are down. A gateway request (job hash ``origin=gateway``)
  streams inside the gateway process that holds it, so its grant is pushed onto that gateway's
  ``{p}gwgrants:<gateway>`` list instead (``hand_to_gateway``; fleet/gateway/admission.py), but
  only when the record carries the workers' seal over origin and gateway (fleet/core/seal.py):
  a producer may write its own job hash, and one that sets ``origin=gateway`` on its prepared
  job sends it to the inference workers all the same, which end it E_AUTH (the seal no longer
  verifies). Dispatchers therefore hold ``security.worker_secret`` too.
- ``on_expired``: a job whose deadline passed while it waited for admission gets its final
  E_DEADLINE envelope here, without ever taking a slot.
- at start, ``end_never_fitting``: a waiting job its project's quota (as these settings have it)
  can never admit ends E_QUOTA_EXCEEDED.
- the prep watchdog (fleet/prep/watchdog.py) runs beside the loop, sending again the prep messages
  of jobs whose prep worker died before handing them over; when it sees the broker come back it
  also gives back the grants whose inference message the broker lost (fleet/worker/lostgrants.py).
- ``gate``: queued jobs are held ("no_workers") while no inference worker's heartbeat is live
  (fleet/worker/heartbeat.py; ``admission.worker_gate``); gateway requests are still admitted
  (they stream in the gateway), their grants pushed to the gateway by ``send``.
- ``stop`` ends both; ``fleet dispatcher`` sets it on SIGINT, SIGTERM and SIGHUP, so a supervisor
  (systemd, honcho, ``fleet up``) stops a dispatcher cleanly within ``admission.max_wait_s``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import redis
from celery import Celery
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.core.codes import Code
from fleet.core.config import Settings
from fleet.core.keys import Keys, split_ref
from fleet.core.models import Envelope
from fleet.core.redisconn import redis_client
from fleet.core.results import ResultStore
from fleet.core.seal import sealed_gateway
from fleet.prep.recover import run_prep_watchdog
from fleet.worker.app import create_app
from fleet.worker.heartbeat import WorkerGate, live_workers
from fleet.worker.lostgrants import give_back_lost_grants
from fleet.worker.queues import (
    INFER_TASK,
    PREP_TASK,
    infer_grants_in_broker,
    prep_backlog,
    prep_kind,
    prep_refs_in_broker,
    shown,
)
from schedulers.dispatcher import run_dispatcher
from schedulers.store import make_store
from schedulers.store.base import AdmissionStore, Grant

log = logging.getLogger(__name__)


def serve_dispatcher(settings: Settings, stop: threading.Event | None = None) -> None:
    stop = stop or threading.Event()
    celery = create_app(settings)
    client = redis_client(settings)
    results = ResultStore(client, Keys(settings.key_prefix), settings)
    send = make_send(settings, client, celery)


    def on_expired(ref: str) -> None:
        project, job_id = split_ref(ref)
        results.publish(Envelope.failure(job_id, project, Code.E_DEADLINE,
                                         "the deadline passed while waiting for admission"))

    def resend_prep(signed: dict[str, Any]) -> None:
        celery.send_task(PREP_TASK, kwargs={"project": signed["project"],
                                            "job_id": signed["job"]["id"], "signed": signed},
                         **shown(signed["project"], signed["job"]["id"], prep_kind(signed)))

    store = make_store(settings, client)

    def give_back(returned_at: float) -> None:
        give_back_lost_grants(store, client, settings,
                              lambda: infer_grants_in_broker(settings, client), returned_at)

    threading.Thread(target=run_prep_watchdog, name="prep-watchdog", daemon=True,
                     args=(settings, results, resend_prep, stop,
                           lambda: prep_refs_in_broker(settings, client), give_back)).start()
    gate = WorkerGate(client, Keys(settings.key_prefix)) if settings.admission.worker_gate else None
    try:
        end_never_fitting(store, results)
    except redis.RedisError as exc:  # the next start sweeps again; the loop rides the outage out
        log.warning("quota sweep at start skipped (%r)", exc)
    run_dispatcher(settings, client, send, stop=stop, on_expired=on_expired,
                   shared_metrics=[PrepBacklogCollector(settings, client), LiveWorkersCollector(client, settings)],
                   gate=gate)


def end_never_fitting(store: AdmissionStore, results: ResultStore) -> list[str]:
    """End every waiting job that its project's quota can never admit (its worst case above the
    smallest token limit: a quota lowered, by a restart with new settings, below jobs already in
    line), E_QUOTA_EXCEEDED, envelope first, then out of the store (fleet/worker/jobs/common.py
    ``end_unleased``'s order). Without it such a job would head its project's queue for ever
    (admission passes it over, and only heads are candidates), holding every job behind it.
    Returns the refs ended. One HSCAN of the items per project with a quota: at start only."""
    ended = []
    for project in store.config.quotas:
        quota = store.config.quota(project)
        if quota is None:
            continue
        for ref, prompt_tokens, max_new in store.waiting_items(project):
            cost = quota.reserve(prompt_tokens, max_new)
            # a gateway request is the gateway's to answer (it times out as held); a job granted
            # since the scan (another dispatcher, on the old quota) runs
            if (not quota.never_fits(cost) or results.job_record(ref).get("origin") == "gateway"
                    or store.lease_project(ref) is not None):
                continue
            _, job_id = split_ref(ref)
            results.publish(Envelope.failure(
                job_id, project, Code.E_QUOTA_EXCEEDED,
                f"quota: this turn may cost {cost:,} (prompt {prompt_tokens:,} and output limit), more than the "
                f"project's smallest token quota ({quota.smallest_tokens:,}) since the quota was lowered"))
            if not store.cancel_pending(ref):  # granted meanwhile: its claim finds the result and stops
                log.warning("quota: job=%s was granted while the start sweep ended it", ref)
            log.warning("quota: job=%s ended E_QUOTA_EXCEEDED at start: it can never fit the quota", ref)
            ended.append(ref)
    return ended


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


class LiveWorkersCollector(Collector):
    """``fleet_inference_workers``: inference worker processes whose heartbeat is live
    (fleet/worker/heartbeat.py), the count the ``no_workers`` gate reads; read on each scrape."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self._client = client
        self._keys = Keys(settings.key_prefix)

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("fleet_inference_workers",
                                "Inference worker processes with a live heartbeat",
                                value=live_workers(self._client, self._keys))


def make_send(settings: Settings, client: redis.Redis, celery: Celery) -> Callable[[Grant], None]:
    """Where a grant goes: to the gateway that holds the request, else to an inference worker.
    The gateway runs an admission round with the same function (fleet/gateway/admission.py)."""
    several = len(settings.backends) > 1

    def send(grant: Grant) -> None:
        if hand_to_gateway(client, settings, grant):
            return
        kwargs: dict[str, Any] = {"ref": grant.job_id, "project": grant.project, "fence": grant.fence}
        if several:  # one backend: the message a worker of before several backends reads
            kwargs["backend"] = grant.backend
        celery.send_task(INFER_TASK, kwargs=kwargs,
                         expires=datetime.fromtimestamp(grant.lease_expires_at, tz=UTC),
                         **shown(grant.project, split_ref(grant.job_id)[1], "turn"))

    return send


GATEWAY_ORIGIN = b"gateway"


def hand_to_gateway(client: redis.Redis, settings: Settings, grant: Grant) -> bool:
    """Push a gateway request's grant to the gateway process that waits for it; False for any
    other job, and for a record that claims a gateway without the workers' seal.

    The list expires with the lease: if that gateway died, nothing is left behind, and the lease
    expires the same way a dead worker's does."""
    keys = Keys(settings.key_prefix)
    if client.hget(keys.job(grant.job_id), "origin") != GATEWAY_ORIGIN:
        return False  # one small read for a queued job: its prepared job is not fetched
    gateway = sealed_gateway(client, settings, grant.job_id)
    if gateway is None:
        log.warning("job %s claims origin=gateway without the workers' seal: sent to the "
                    "inference workers, which refuse it", grant.job_id)
        return False
    key = keys.gateway_grants(gateway)
    ttl_s = settings.admission.lease_ttl_s
    payload = json.dumps({"job_id": grant.job_id, "fence": grant.fence, "backend": grant.backend,
                          "lease_expires_at": grant.lease_expires_at, "waited_s": grant.waited_s})
    pipe = client.pipeline(transaction=False)
    pipe.lpush(key, payload)
    pipe.expire(key, max(1, int(ttl_s)))
    pipe.execute()
    return True
