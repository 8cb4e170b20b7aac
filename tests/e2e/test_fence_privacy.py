"""A project learns nothing of other projects' work from its fencing tokens (issue 22): real
dispatcher and inference workers on their own ACL users, ``fleet sim`` as backend, each producer
on its own user (a private redis-server with the default user off).

The one fence a producer can see is the ``fence`` field the inference worker writes into the job
record when it starts the job (``<p>job:{<project>/<id>}``, a key of the producer's own: its user
reads the whole hash). Events, status, the envelope and the results stream carry none; the
dispatcher's ``fences`` hash is out of the producer's reach. Fences used to be one sequence for
all projects, so A's next job's fence told A how many jobs other projects had been admitted
meanwhile; they are now a sequence of each project (schedulers/store/lua/admit.lua)."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from fleet import Client
from fleet.core.keys import Keys, job_ref
from fleet.local.processes import LocalFleet
from tests.support.acl_broker import A, AclBroker, B, broker

__all__ = ["broker"]

pytestmark = pytest.mark.slow

HELLO = {"role": "user", "content": "Hello. [sim:answer=5]"}


@pytest.fixture(scope="module")
def fleet(broker: AclBroker) -> Iterator[LocalFleet]:
    fleet = LocalFleet(broker.settings, workers=0, dispatchers=0, sim_speed=50.0)
    fleet.start()
    projects = json.dumps({n: p.model_dump(mode="json") for n, p in broker.settings.projects.items()})
    try:
        fleet.spawn("dispatcher", ["dispatcher", "--log-level", "WARNING"],
                    {"FLEET_BROKER_URL": broker.url("fleet-dispatcher"),
                     "FLEET_ADMISSION_METRICS_PORT": "0", "FLEET_PROJECTS": projects})
        fleet.spawn("worker", ["worker", "--concurrency", "4", "--log-level", "WARNING",
                               "--hostname", f"fence-{uuid.uuid4().hex[:6]}@%h"],
                    {"FLEET_BROKER_URL": broker.url("fleet-worker"), "FLEET_PROJECTS": projects})
        yield fleet
    finally:
        fleet.close()


def run_jobs(client: Client, project: str, n: int) -> list[str]:
    """Submit n jobs of the project and wait for each to end OK; their ids."""
    ids = [client.submit({"project": project, "messages": [HELLO]}) for _ in range(n)]
    for job_id in ids:
        envelope = client.result(job_id, timeout=120)
        assert envelope is not None and envelope.ok, envelope
    return ids


def fences(value: Any) -> list[int]:
    """Every number under a key that names a fence, anywhere in value (JSON strings opened);
    ``fence_tag`` is the random tag of a job's prompt markers, not a counter."""
    found: list[int] = []
    if isinstance(value, dict):
        for key, inner in value.items():
            if "fence" in str(key).lower() and key != "fence_tag":
                found.append(int(inner))
            found += fences(inner)
    elif isinstance(value, list):
        for inner in value:
            found += fences(inner)
    elif isinstance(value, str) and value[:1] in "{[":
        with contextlib.suppress(ValueError):
            found += fences(json.loads(value))
    return found


def seen_by_producer(client: Client, raw: redis.Redis, keys: Keys, job_id: str) -> dict[str, Any]:
    """Everything the project's own user reads about one of its jobs."""
    ref = job_ref(A, job_id)
    record = {k.decode(): v.decode() for k, v in raw.hgetall(keys.job(ref)).items()}
    return {"record": record, "status": client.status(job_id),
            "events": list(client.events(job_id, follow=False)),
            "envelope": json.loads(raw.get(keys.result(ref)))}


def test_a_project_cannot_count_other_projects_jobs_by_its_fences(
        broker: AclBroker, fleet: LocalFleet) -> None:
    keys = Keys(broker.settings.key_prefix)
    with (Client(broker.settings_for(f"fleet-producer-{A}", A)) as a,
          Client(broker.settings_for(f"fleet-producer-{B}", B)) as b):
        first = run_jobs(a, A, 3)
        run_jobs(b, B, 10)
        then = run_jobs(a, A, 3)
        raw = broker.client(f"fleet-producer-{A}")
        try:
            seen = {job_id: seen_by_producer(a, raw, keys, job_id) for job_id in first + then}
            stream = raw.xrevrange(keys.results(A))
            with pytest.raises(redis.exceptions.NoPermissionError):
                raw.hgetall(f"{keys.dispatch}fences")
        finally:
            raw.close()
    # where a producer sees a fence at all: its job records, nowhere else
    for job_id, views in seen.items():
        assert len(fences(views["record"])) == 1, (job_id, views["record"])
        assert [fences(views[k]) for k in ("status", "events", "envelope")] == [[], [], []], views
    assert len(stream) == 6
    assert fences([{k.decode(): v.decode() for k, v in fields.items()} for _, fields in stream]) == []
    # A's own sequence, untouched by B's ten admissions in between (one counter: 14, 15, 16)
    assert sorted(f for job_id in first for f in fences(seen[job_id]["record"])) == [1, 2, 3]
    assert sorted(f for job_id in then for f in fences(seen[job_id]["record"])) == [4, 5, 6]
