"""Inference workers announce themselves, so a dispatcher admits only while someone will run the job.

Without it a fleet whose inference workers are all gone (crashed, stopped, stuck reconnecting)
keeps admitting: each grant becomes a ``fleet.infer`` message nobody takes, its lease expires,
the job is admitted again, and so on every ``lease_ttl_s`` while the queue grows.

Key (fleet/core/keys.py): ``{p}{d}:workers``, a zset of Celery node names, score = when the entry
lapses. A worker that consumes ``fleet.infer`` writes its entry once it is ready and every
``HEARTBEAT_S`` after (lapsing after ``HEARTBEAT_TTL_S``: a worker killed with SIGKILL is gone
from the count within that), and removes it when it shuts down. A beat that fails (Redis down)
is logged once per change; the next one after Redis is back writes the entry again, so a Redis
restarted without persistence learns its workers within ``HEARTBEAT_S``.

The dispatcher side (``WorkerGate``, wired in fleet/worker/dispatch.py): a round starts only when
at least one entry is live, else the round ends with the hold reason ``no_workers`` (one WARNING
when the state changes, one INFO when it lifts). ``admission.worker_gate = false`` turns it off
for a fleet whose only door is the gateway (its requests stream in the gateway process).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_ready, worker_shutdown

from fleet.core.keys import Keys

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
HEARTBEAT_TTL_S = 15.0


def beat(client: Any, keys: Keys, name: str, now: float) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.zadd(keys.infer_workers, {name: now + HEARTBEAT_TTL_S})
    pipe.zremrangebyscore(keys.infer_workers, "-inf", now)
    pipe.execute()


def live_workers(client: Any, keys: Keys, now: float) -> int:
    return int(client.zcount(keys.infer_workers, now, "+inf"))


class Heartbeat:
    """The beating thread of one inference worker."""

    def __init__(self, client: Any, keys: Keys, name: str) -> None:
        self.client, self.keys, self.name = client, keys, name
        self.stop = threading.Event()
        self._failing = False

    def run(self) -> None:
        while True:
            try:
                beat(self.client, self.keys, self.name, time.time())
                if self._failing:
                    log.info("heartbeat of %s written again", self.name)
                self._failing = False
            except redis.RedisError as exc:
                if not self._failing:
                    log.warning("heartbeat of %s not written (%r); again every %.0f s",
                                self.name, exc, HEARTBEAT_S)
                self._failing = True
            if self.stop.wait(HEARTBEAT_S):
                return

    def leave(self) -> None:
        self.stop.set()
        with contextlib.suppress(redis.RedisError):  # else the entry lapses on its own
            self.client.zrem(self.keys.infer_workers, self.name)


def beat_when_ready(app: Celery, client: Any, keys: Keys, queue: str) -> None:
    """Start a Heartbeat once a worker of ``app`` that consumes ``queue`` is ready; stop it (and
    remove the entry) when that worker shuts down."""
    beating: list[Heartbeat] = []

    def on_ready(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        if queue not in app.amqp.queues.consume_from:  # type: ignore[union-attr]
            return
        heartbeat = Heartbeat(client, keys, sender.hostname)
        beating.append(heartbeat)
        threading.Thread(target=heartbeat.run, name="heartbeat", daemon=True).start()

    def on_shutdown(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            for heartbeat in beating:
                heartbeat.leave()

    worker_ready.connect(on_ready, weak=False)
    worker_shutdown.connect(on_shutdown, weak=False)


class WorkerGate:
    """A dispatcher's check before each round: "" while an inference worker is live, else
    ``no_workers``. Logs the changes only."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self.client, self.keys = client, keys
        self._held: bool | None = None

    def __call__(self) -> str:
        held = live_workers(self.client, self.keys, time.time()) == 0
        if held != self._held:
            if held:
                log.warning("no live inference worker consumes fleet.infer: admissions held")
            elif self._held is not None:
                log.info("an inference worker is live again: admissions resume")
            self._held = held
        return "no_workers" if held else ""
