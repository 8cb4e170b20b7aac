"""A message a worker gives back returns to the list it was taken from, never through kombu's
binding sets, which a project's producer can write for its own queues (fleet/worker/transport.py):
real worker processes on the fleet's ACL users, the producer on its own user (a private
redis-server with the default user off).

Before, a message given back after a worker died went through its exchange's binding set onto
every queue the producer had added there (another project's queue, fleet.infer), where other
workers took it."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import threading
import uuid
from collections.abc import Iterator

import pytest
import redis

from fleet.client import Client
from fleet.local.processes import LocalFleet
from fleet.worker.queues import INFER_QUEUE, collect_queue, project_queue
from tests.support.acl_broker import A, AclBroker, B, broker
from tests.support.waiting import wait_until

__all__ = ["broker"]

pytestmark = pytest.mark.slow


def spawn_worker(fleet: LocalFleet, broker: AclBroker, name: str, **env: str) -> None:
    """A worker of the collect role (every project's collect queues, nothing else: A's queue and
    fleet.infer keep whatever lands there) on the worker's user."""
    projects = json.dumps({n: p.model_dump(mode="json") for n, p in broker.settings.projects.items()})
    fleet.spawn(name, ["worker", "--role", "collect", "--concurrency", "2", "--log-level", "WARNING",
                       "--hostname", f"{name}-{uuid.uuid4().hex[:6]}@%h"],
                {"FLEET_BROKER_URL": broker.url("fleet-worker"), "FLEET_PROJECTS": projects, **env})


@pytest.fixture(scope="module")
def fleet(broker: AclBroker) -> Iterator[LocalFleet]:
    fleet = LocalFleet(broker.settings, workers=0, dispatchers=0, sim_speed=50.0)
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.close()


def queued(broker: AclBroker, queue: str) -> int:
    operator = broker.client("fleet-operator")
    try:
        return int(operator.llen(f"{broker.settings.key_prefix}q:{queue}"))
    finally:
        operator.close()


class HoldingServer:
    """A TCP server on loopback that accepts connections and never answers: a URL source that a
    prep task waits on for as long as its read timeout."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def test_a_given_back_message_returns_only_to_its_own_queue(broker: AclBroker, fleet: LocalFleet) -> None:
    """B adds members naming A's queue and fleet.infer to the binding set of its collect queue's
    exchange; a worker dies while preparing B's collect job; a new worker gives the message back
    when it starts (the visibility timeout has passed): it lands on B's collect queue only."""
    q = f"{broker.settings.key_prefix}q:"
    producer, operator = broker.client(f"fleet-producer-{B}"), broker.client("fleet-operator")
    server = HoldingServer()
    try:
        for target in (project_queue(A), INFER_QUEUE):
            producer.sadd(f"{q}_kombu.binding.{collect_queue(B)}",
                          f"{collect_queue(B)}\x06\x16\x06\x16{target}")
        collect_env = {"FLEET_COLLECT_ALLOW_HOSTS": '["127.0.0.1"]'}
        spawn_worker(fleet, broker, "holder", FLEET_COLLECT_READ_TIMEOUT_S="600", **collect_env)
        with Client(broker.settings_for(f"fleet-producer-{B}", B)) as client:
            job_id = client.submit({"project": B, "messages": [{"role": "user", "content": "Sum up."}],
                                    "sources": [{"type": "url", "url": f"http://127.0.0.1:{server.port}/doc"}]})
        wait_until(lambda: server.accepted, 60, "the holder's prep fetching the source")
        tag = held_tag(operator, q, job_id)
        holder = next(p for n, p in fleet.children if n == "holder")
        os.killpg(holder.pid, signal.SIGKILL)  # dies holding the message, unacknowledged
        holder.wait(timeout=10)
        spawn_worker(fleet, broker, "restorer", FLEET_VISIBILITY_TIMEOUT_S="1", **collect_env)
        # given back (the unacked entry moved to a list), taken again and acknowledged as a
        # duplicate of the prep the holder still claims, or fetching again
        wait_until(lambda: (not operator.hexists(f"{q}unacked", tag) or len(server.accepted) > 1)
                   and operator.llen(f"{q}{collect_queue(B)}") == 0, 60, "the message given back and taken")
        assert queued(broker, project_queue(A)) == 0
        assert queued(broker, INFER_QUEUE) == 0
    finally:
        server.close()
        producer.close()
        operator.close()


def held_tag(operator: redis.Redis, q: str, job_id: str) -> str:
    """The delivery tag of the unacknowledged message of ``job_id``."""
    for tag, value in operator.hgetall(f"{q}unacked").items():
        if job_id.encode() in base64.b64decode(json.loads(value)[0]["body"]):
            return tag.decode()
    raise AssertionError(f"no unacknowledged message of job {job_id}")
