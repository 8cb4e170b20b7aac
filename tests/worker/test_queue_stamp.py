"""A task runs only for a message taken from a queue it belongs on (fleet/worker/transport.py
stamps the queue on delivery, fleet/worker/tasks.py checks it), on a private redis-server with
the fleet's ACL users, a real worker process on its own user and the simulator.

A producer may push raw messages onto its own project queue, writing every field of them itself
(routing key and delivery_info included). Before, the worker ran any task it had registered
whatever queue it came from: a ``fleet.infer`` message naming another project's job (with the
fence of its current grant) ran that job's turn, and a ``fleet.prep`` message claiming another
project wrote a ``rejected`` event into that project's job."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Consumer

from fleet.client import Client
from fleet.core.codes import Code
from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.keys import Keys, job_ref
from fleet.local.processes import LocalFleet
from fleet.worker.app import create_app
from fleet.worker.queues import INFER_QUEUE, INFER_TASK, PREP_TASK, project_queue, shown
from fleet.worker.transport import QUEUE_STAMP, stamp_queue
from schedulers.store import make_store
from tests.support.acl_broker import A, AclBroker, B, broker
from tests.support.waiting import wait_until

__all__ = ["broker"]


@pytest.fixture(scope="module")
def worker(broker: AclBroker) -> Iterator[LocalFleet]:
    """One worker process on the worker's user (every queue), no dispatcher: the tests grant
    leases themselves, so that nothing but the pushed message can run a job."""
    fleet = LocalFleet(broker.settings, workers=0, dispatchers=0, sim_speed=50.0)
    fleet.start()
    projects = json.dumps({name: p.model_dump(mode="json") for name, p in broker.settings.projects.items()})
    try:
        fleet.spawn("worker", ["worker", "--concurrency", "2", "--log-level", "WARNING",
                               "--hostname", f"stamp-{uuid.uuid4().hex[:6]}@%h"],
                    {"FLEET_BROKER_URL": broker.url("fleet-worker"), "FLEET_PROJECTS": projects})
        yield fleet
    finally:
        fleet.close()


def raw_message(task: str, kwargs: dict[str, Any], posing_as: str) -> tuple[str, str]:
    """A Celery message as a producer can write it by hand: (its delivery tag, its JSON). It
    claims to come from ``posing_as`` in every field the sender writes, the transport's own
    stamp included."""
    task_id, tag = str(uuid.uuid4()), str(uuid.uuid4())
    body = json.dumps([[], kwargs, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
    message = {
        "body": base64.b64encode(body.encode()).decode(),
        "content-encoding": "utf-8", "content-type": "application/json",
        "headers": {"lang": "py", "task": task, "id": task_id, "root_id": task_id,
                    "parent_id": None, "group": None, "retries": 0, "eta": None, "expires": None,
                    "timelimit": [None, None], "argsrepr": "()", "kwargsrepr": "{}"},
        "properties": {"correlation_id": task_id, "reply_to": "", "delivery_mode": 2,
                       "priority": 0, "body_encoding": "base64", "delivery_tag": tag,
                       "delivery_info": {"exchange": posing_as, "routing_key": posing_as,
                                         QUEUE_STAMP: posing_as}},
    }
    return tag, json.dumps(message)


def push_and_wait_taken(broker: AclBroker, task: str, kwargs: dict[str, Any], posing_as: str) -> None:
    """LPUSH the message onto B's own queue as B's producer, then wait until the worker took it
    and acknowledged it (gone from the queue and from kombu's unacked hash)."""
    queues = f"{broker.settings.key_prefix}q:"
    tag, message = raw_message(task, kwargs, posing_as)
    producer = broker.client(f"fleet-producer-{B}")
    operator = broker.client("fleet-operator")
    try:
        producer.lpush(f"{queues}{project_queue(B)}", message)
        wait_until(lambda: operator.llen(f"{queues}{project_queue(B)}") == 0
                   and not operator.hexists(f"{queues}unacked", tag), 60, "the pushed message acknowledged")
    finally:
        producer.close()
        operator.close()


def submitted(broker: AclBroker, content: str) -> str:
    with Client(broker.settings_for(f"fleet-producer-{A}", A)) as client:
        return client.submit({"project": A, "messages": [{"role": "user", "content": content}]})


def in_line(operator: redis.Redis, broker: AclBroker, ref: str) -> bool:
    return operator.hget(Keys(broker.settings.key_prefix).job(ref), "state") == b"pending"


def events(broker: AclBroker, ref: str) -> list[str]:
    operator = redis.Redis.from_url(broker.settings.broker_url)
    try:
        return [fields[b"type"].decode()
                for _, fields in operator.xrange(Keys(broker.settings.key_prefix).events(ref))]
    finally:
        operator.close()


def test_an_infer_message_pushed_onto_a_project_queue_runs_nothing(broker: AclBroker,
                                                                   worker: LocalFleet) -> None:
    job_id = submitted(broker, "Hello. [sim:think=30] [sim:answer=10]")
    ref = job_ref(A, job_id)
    operator = redis.Redis.from_url(broker.settings.broker_url)
    store = make_store(broker.settings, operator)
    wait_until(lambda: in_line(operator, broker, ref), 60, "A's job prepared and in line")
    store.record_backend(time.time(), "", {})  # a backend with room, as a fresh scrape says
    grant = store.admit_next(time.time()).grant  # as a dispatcher would, sending nothing yet
    assert grant is not None and grant.job_id == ref
    # B sends the grant's fleet.infer itself, from its own queue, posing as fleet.infer
    push_and_wait_taken(broker, INFER_TASK, {"ref": ref, "project": A, "fence": grant.fence},
                        posing_as=INFER_QUEUE)
    assert "admitted" not in events(broker, ref), "a message on B's queue ran A's job"
    assert store.lease_valid(ref, grant.fence)  # still the grant's, unclaimed
    # the grant's own message (the dispatcher's path) runs it, once
    create_app(broker.settings).send_task(
        INFER_TASK, kwargs={"ref": ref, "project": A, "fence": grant.fence}, **shown(A, job_id, "turn"))
    with Client(broker.settings_for(f"fleet-producer-{A}", A)) as client:
        envelope = client.result(job_id, timeout=120)
    assert envelope is not None and envelope.code == Code.OK, envelope
    results = operator.xrange(Keys(broker.settings.key_prefix).results(A))
    assert sum(json.loads(f[b"envelope"])["job_id"] == job_id for _, f in results) == 1
    assert events(broker, ref).count("admitted") == 1
    operator.close()


def test_a_prep_message_claiming_another_project_writes_nothing_there(broker: AclBroker,
                                                                     worker: LocalFleet) -> None:
    job_id = submitted(broker, "Mine. [sim:stall=1000000]")
    ref = job_ref(A, job_id)
    operator = redis.Redis.from_url(broker.settings.broker_url)
    wait_until(lambda: in_line(operator, broker, ref), 60, "A's job prepared and in line")
    before = events(broker, ref)
    push_and_wait_taken(broker, PREP_TASK, {"project": A, "job_id": job_id, "signed": {"forged": 1}},
                        posing_as=project_queue(A))
    assert events(broker, ref) == before, "a message on B's queue wrote into A's job events"
    assert operator.get(Keys(broker.settings.key_prefix).result(ref)) is None
    operator.close()


def test_a_message_given_back_by_a_lost_channel_returns_to_the_queue_it_came_from(
        redis_url: str, key_prefix: str, redis_client: redis.Redis) -> None:
    """kombu keeps a message's exchange and routing key in its unacked hash and gives the message
    back by them when its channel goes: after the stamp they are the queue it was popped from,
    not the ones its sender wrote, and the next pop stamps it again."""
    settings = load_settings(EXAMPLE_CONFIG, env={}).model_copy(
        update={"broker_url": redis_url, "key_prefix": key_prefix})
    app = create_app(settings)
    queues = f"{key_prefix}q:"
    mine, theirs = app.amqp.queues[project_queue(B)], app.amqp.queues[INFER_QUEUE]
    taken: list[Any] = []
    with app.connection_for_read() as connection:
        channel = connection.channel()
        theirs.bind(channel).declare()  # the queue the sender names exists, bound as in a fleet
        consumer = Consumer(channel, queues=[mine], accept=["json"],
                            callbacks=[lambda _body, message: taken.append(message)])
        consumer.consume()
        _, message = raw_message(INFER_TASK, {"ref": f"{A}/x", "project": A, "fence": 1},
                                 posing_as=INFER_QUEUE)
        redis_client.lpush(f"{queues}{project_queue(B)}", message)
        connection.drain_events(timeout=10)
        assert [m.delivery_info[QUEUE_STAMP] for m in taken] == [project_queue(B)]
        assert taken[0].delivery_info["routing_key"] == project_queue(B)
        channel.close()  # unacknowledged: kombu gives it back (QoS.restore_unacked)
    assert redis_client.llen(f"{queues}{INFER_QUEUE}") == 0
    assert redis_client.llen(f"{queues}{project_queue(B)}") == 1


def test_the_stamp_replaces_what_the_sender_wrote() -> None:
    _, text = raw_message(INFER_TASK, {}, posing_as=INFER_QUEUE)
    message = json.loads(text)
    stamp_queue(message, project_queue(B))
    assert message["properties"]["delivery_info"] == {
        "exchange": project_queue(B), "routing_key": project_queue(B), QUEUE_STAMP: project_queue(B)}
    unstamped: dict[str, Any] = {"properties": {"delivery_tag": "t"}}
    stamp_queue(unstamped, INFER_QUEUE)
    assert unstamped["properties"]["delivery_info"][QUEUE_STAMP] == INFER_QUEUE
