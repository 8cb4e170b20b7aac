"""Inference workers announce themselves, so a dispatcher admits only while someone will run the job.

Without it a fleet whose inference workers are all gone (crashed, stopped, stuck reconnecting)
keeps admitting: each grant becomes a ``fleet.infer`` message nobody takes, its lease expires,
the job is admitted again, and so on every ``lease_ttl_s`` while the queue grows.

Key (fleet/core/keys.py): ``{p}{d}:workers``, a zset of worker instances, score = when the entry
lapses. An instance id is ``<Celery node name>#<pid>-<nonce>`` (``instance_id``): unique per
worker process even when two workers share a node name (two hosts with one ``--hostname``, a
restarted worker whose old entry has not lapsed), so one worker's exit never removes or renews
another's entry; ``live_worker_names`` gives the node names back for ``fleet queues``.

Clock: only Redis's. ``beat.lua`` stamps the lapse as Redis ``TIME`` + ``HEARTBEAT_TTL_S`` and
``live.lua`` compares with Redis ``TIME``, so a worker or dispatcher host whose clock is off (by
15 s or by an hour) neither keeps a dead fleet looking alive nor a live one looking dead.

A worker that consumes ``fleet.infer`` writes its entry once it is ready and every
``HEARTBEAT_S`` after, and removes it as soon as its shutdown starts (Celery's
``worker_shutdown``, sent when a warm or cold shutdown begins, before the running streams end):
from then on it takes no new task, so the gate closes at once when the last worker stops
cleanly. A worker killed with SIGKILL (or whose host dies) cannot remove its entry: that one
lapses ``HEARTBEAT_TTL_S`` after its last beat, and admissions go on until then. A beat that fails
(Redis down) is logged once per change; the next one after Redis is back writes the entry
again, so a Redis restarted without persistence learns its workers within ``HEARTBEAT_S``.

The dispatcher side (``WorkerGate``, wired in fleet/worker/dispatch.py): a full round runs only
when at least one entry is live, else the round admits gateway requests only (they need no
inference worker; schedulers/dispatcher.py) and ends with the hold reason ``no_workers`` (one
WARNING when the state changes, one INFO when it lifts). ``admission.worker_gate = false`` turns it off
for a fleet whose only door is the gateway (its requests stream in the gateway process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from collections import Counter
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_ready, worker_shutdown

from fleet.core.keys import Keys
from fleet.core.lua import shared

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
HEARTBEAT_TTL_S = 6.0  # three beats: one slow or lost beat never lapses a live worker
_SCRIPTS = ("beat", "live")


def instance_id(node: str) -> str:
    """A worker process's own entry: its node name, pid and a nonce of this start."""
    return f"{node}#{os.getpid()}-{secrets.token_hex(4)}"


def node_of(instance: str) -> str:
    return instance.rpartition("#")[0] or instance


def beat(client: Any, keys: Keys, instance: str) -> None:
    shared(client, __package__, _SCRIPTS)["beat"](keys=[keys.infer_workers], args=[instance, HEARTBEAT_TTL_S])


def live_instances(client: Any, keys: Keys) -> list[str]:
    found = shared(client, __package__, _SCRIPTS)["live"](keys=[keys.infer_workers])
    return [i.decode() if isinstance(i, bytes) else str(i) for i in found]


def live_workers(client: Any, keys: Keys) -> int:
    return len(live_instances(client, keys))


def live_worker_names(client: Any, keys: Keys) -> list[str]:
    """The node names of the live instances, sorted (a name twice: two processes share it)."""
    return sorted(node_of(instance) for instance in live_instances(client, keys))


def shown_workers(names: list[str]) -> str:
    """How ``fleet queues`` and ``fleet top`` show them: the count, then the node names, a name
    that several processes share counted (``2: infer@a x2``)."""
    counts = Counter(names)
    shown = ", ".join(name if n == 1 else f"{name} x{n}" for name, n in sorted(counts.items()))
    return f"{len(names)}: {shown}" if names else "0"


class Heartbeat:
    """The beating thread of one inference worker process."""

    def __init__(self, client: Any, keys: Keys, node: str) -> None:
        self.client, self.keys, self.node = client, keys, node
        self.instance = instance_id(node)
        self.stop = threading.Event()
        self._lock = threading.Lock()  # a beat in flight never lands after ``leave``'s removal
        self._failing = False

    def run(self) -> None:
        while True:
            with self._lock:
                if self.stop.is_set():
                    return
                self._beat_once()
            if self.stop.wait(HEARTBEAT_S):
                return

    def _beat_once(self) -> None:
        try:
            beat(self.client, self.keys, self.instance)
            if self._failing:
                log.info("heartbeat of %s written again", self.instance)
            self._failing = False
        except redis.RedisError as exc:
            if not self._failing:
                log.warning("heartbeat of %s not written (%r); again every %.0f s",
                            self.instance, exc, HEARTBEAT_S)
            self._failing = True

    def leave(self) -> None:
        """Stop beating and remove the entry; a beat stuck on an unreachable Redis is not waited
        for past ``HEARTBEAT_S`` (the shutdown goes on, the entry lapses on its own)."""
        self.stop.set()
        if not self._lock.acquire(timeout=HEARTBEAT_S):
            return
        try:
            with contextlib.suppress(redis.RedisError):  # else the entry lapses on its own
                self.client.zrem(self.keys.infer_workers, self.instance)
        finally:
            self._lock.release()


def beat_when_ready(app: Celery, client: Any, keys: Keys, queue: str) -> None:
    """Start a Heartbeat once a worker of ``app`` that consumes ``queue`` is ready; stop it (and
    remove the entry) as soon as that worker's shutdown starts."""
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
        held = live_workers(self.client, self.keys) == 0
        if held != self._held:
            if held:
                log.warning("no live inference worker consumes fleet.infer: queued jobs held "
                            "(gateway requests are still admitted)")
            elif self._held is not None:
                log.info("an inference worker is live again: admissions resume")
            self._held = held
        return "no_workers" if held else ""
