"""A project's producer reaches nothing through Celery's own machinery: real
worker processes on the fleet's ACL users, the producer on its own user (a private redis-server
with the default user off).

A producer may push raw messages onto its own queues. Before, a worker ran Celery's built-in
tasks and honoured any callbacks a message carried, publishing them with the worker's rights
onto any queue they named (one message nesting callbacks put hundreds of messages on another
project's queue and on fleet.infer; a ``celery.chord_unlock`` retried itself for good)
(fleet/worker/screen.py). Given-back messages and binding sets: tests/e2e/test_binding_sets.py."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from fleet.core.codes import Code
from fleet.local.processes import LocalFleet
from fleet.worker.queues import INFER_QUEUE, PREP_TASK, collect_queue, project_queue
from tests.support.acl_broker import A, AclBroker, B, broker
from tests.support.waiting import wait_until

__all__ = ["broker"]

pytestmark = pytest.mark.slow


def spawn_worker(fleet: LocalFleet, broker: AclBroker, name: str, **env: str) -> None:
    """A worker of the collect role (it consumes every project's collect queue, nothing else: the
    queues the callbacks name stay as they were left) on the worker's user."""
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


@pytest.fixture(scope="module")
def collector(fleet: LocalFleet, broker: AclBroker) -> LocalFleet:
    spawn_worker(fleet, broker, "collector")
    return fleet


def sig(task: str, queue: str, **options: Any) -> dict[str, Any]:
    """A Celery signature as a message carries it, routed by its own options."""
    return {"task": task, "args": [], "kwargs": {}, "options": {"queue": queue, **options},
            "subtask_type": None, "immutable": True}


def raw_message(task: str, kwargs: dict[str, Any], embed: dict[str, Any] | None = None,
                headers: dict[str, Any] | None = None) -> tuple[str, str, str]:
    """(task id, delivery tag, JSON) of a Celery message written by hand."""
    task_id, tag = str(uuid.uuid4()), str(uuid.uuid4())
    body = [[], kwargs, {"callbacks": None, "errbacks": None, "chain": None, "chord": None,
                         **(embed or {})}]
    message = {
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8", "content-type": "application/json",
        "headers": {"lang": "py", "task": task, "id": task_id, "root_id": task_id,
                    "parent_id": None, "group": None, "retries": 0, "eta": None, "expires": None,
                    "timelimit": [None, None], "argsrepr": "()", "kwargsrepr": "{}",
                    **(headers or {})},
        "properties": {"correlation_id": task_id, "reply_to": "", "delivery_mode": 2,
                       "priority": 0, "body_encoding": "base64", "delivery_tag": tag,
                       "delivery_info": {"exchange": "", "routing_key": collect_queue(B)}},
    }
    return task_id, tag, json.dumps(message)


def pushed_and_taken(broker: AclBroker, task: str, kwargs: dict[str, Any],
                     embed: dict[str, Any] | None = None, headers: dict[str, Any] | None = None) -> str:
    """LPUSH the message onto B's collect queue as B's producer, wait until the worker took it,
    refused it and acknowledged it (whatever it then published is in the broker by then); its
    task id. Every message these tests push is one the screen refuses."""
    q = f"{broker.settings.key_prefix}q:"
    task_id, tag, message = raw_message(task, kwargs, embed, headers)
    producer, operator = broker.client(f"fleet-producer-{B}"), broker.client("fleet-operator")
    try:
        producer.lpush(f"{q}{collect_queue(B)}", message)
        # the refusal first: a message just popped is in neither the list nor the unacked
        # hash until kombu records it, which looks like acknowledged
        wait_until(lambda: refusals(broker, task_id) and not operator.hexists(f"{q}unacked", tag)
                   and message.encode() not in operator.lrange(f"{q}{collect_queue(B)}", 0, -1),
                   60, "the pushed message taken, refused and acknowledged")
    finally:
        producer.close()
        operator.close()
    return task_id


def queued(broker: AclBroker, queue: str) -> int:
    operator = broker.client("fleet-operator")
    try:
        return int(operator.llen(f"{broker.settings.key_prefix}q:{queue}"))
    finally:
        operator.close()


def refusals(broker: AclBroker, task_id: str) -> list[dict[str, str]]:
    operator = broker.client("fleet-operator")
    try:
        entries = operator.xrange(f"{broker.settings.key_prefix}rejections")
    finally:
        operator.close()
    found = [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]
    return [f for f in found if f.get("job_id") == task_id]


def refused(broker: AclBroker, task_id: str) -> dict[str, str]:
    """The one refusal of ``task_id``: the screen acknowledges the message and writes the refusal
    in either order, so an acknowledged message's entry may be a moment behind it."""
    wait_until(lambda: refusals(broker, task_id), 30, f"the refusal of {task_id}")
    [entry] = refusals(broker, task_id)
    assert entry["code"] == Code.E_MESSAGE_REFUSED.value
    assert entry["queue"] == collect_queue(B) and entry["project"] == B
    return entry


def test_a_builtin_task_nesting_callbacks_puts_nothing_on_other_queues(
        broker: AclBroker, collector: LocalFleet) -> None:
    inner = [sig("celery.accumulate", project_queue(A)) for _ in range(20)]
    outer = [sig("celery.accumulate", queue, link=inner)
             for queue in [project_queue(A), INFER_QUEUE] * 25]
    task_id = pushed_and_taken(broker, "celery.accumulate", {}, embed={"callbacks": outer})
    assert queued(broker, project_queue(A)) == 0
    assert queued(broker, INFER_QUEUE) == 0
    assert "not a fleet task" in refused(broker, task_id)["reason"]


def test_chord_unlock_is_refused_and_never_retried(broker: AclBroker, collector: LocalFleet) -> None:
    task_id = pushed_and_taken(broker, "celery.chord_unlock", {
        "group_id": "g", "callback": sig("celery.accumulate", project_queue(A)),
        "result": [[["x", None], None]], "max_retries": None, "interval": 1})
    operator = broker.client("fleet-operator")
    q = f"{broker.settings.key_prefix}q:"
    try:
        held = list(operator.hvals(f"{q}unacked")) + operator.lrange(f"{q}{collect_queue(B)}", 0, -1)
    finally:
        operator.close()
    assert not [m for m in held if b"celery.chord_unlock" in m], "a retry of chord_unlock is in the broker"
    refused(broker, task_id)


@pytest.mark.parametrize("where", ["embed", "headers"])
def test_callbacks_on_a_fleet_task_are_dropped_with_it(broker: AclBroker, collector: LocalFleet,
                                                       where: str) -> None:
    """A fleet.prep message (refused at prep: its signature is forged, so errbacks would run)
    carrying callbacks and errbacks naming A's queue, in the body's embed or smuggled in as
    headers (Celery copies every header into the task's request)."""
    canvas = {"callbacks": [sig(PREP_TASK, project_queue(A))],
              "errbacks": [sig(PREP_TASK, project_queue(A))]}
    kwargs = {"project": B, "job_id": uuid.uuid4().hex[:12], "signed": {"forged": True}}
    task_id = pushed_and_taken(broker, PREP_TASK, kwargs, **{"embed" if where == "embed" else "headers": canvas})
    assert queued(broker, project_queue(A)) == 0
    refused(broker, task_id)
