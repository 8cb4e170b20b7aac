"""Bounded work through the REAL fleet (prep and inference worker, dispatcher, ``fleet sim``, Redis).

The workers run with small size caps while the test's producer keeps the defaults, so the
messages reach prep and prep alone refuses them. The answer-pattern test gives the job a schema
whose ``const`` (which the simulator writes as the answer) is a string Python's ``re`` would take
minutes to match against ``^(a|aa)*$``, with a 10 s lease (room for a busy 2-core machine, far
short of the stall): a stalled worker would lose the lease and run the job again, so one request
per attempt and the other jobs' results show it did not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from fleet.client import Client
from fleet.core.codes import Code
from fleet.core.config import LimitsSettings
from fleet.core.keys import job_ref
from tests.support.fleet_harness import FleetProbe, Harness, make_config

pytestmark = pytest.mark.slow

HOSTILE = "^(a|aa)*$"
HOSTILE_TEXT = "a" * 40 + "b"
WORKER_LIMITS = {"max_message_bytes": 20_000, "max_messages": 3}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    config = make_config(tmp_path_factory.mktemp("fleet-bounded"), limits=WORKER_LIMITS,
                         admission={"lease_ttl_s": 10}, retry={"reask_invalid": 1})
    with Harness(config, sim_speed=100) as harness:
        yield harness


@pytest.fixture(scope="module")
def producer(fleet: Harness) -> Iterator[Client]:
    with Client(fleet.settings.model_copy(update={"limits": LimitsSettings()})) as client:
        yield client


def ask(text: str, **extra: object) -> dict[str, object]:
    return {"project": "reports", "messages": [{"role": "user", "content": text}], **extra}


def test_an_oversized_message_ends_input_invalid_unread(fleet: Harness, producer: Client) -> None:
    job_id = producer.submit(ask("x" * 50_000))
    envelope = producer.result(job_id, timeout=60)
    assert envelope is not None and envelope.code == Code.E_INPUT_INVALID, envelope
    assert "limits.max_message_bytes is 20000" in envelope.message
    record = producer.results.job_record(job_ref("reports", job_id))
    # never verified (its nonce was not claimed) nor parsed (prep wrote nothing to the record)
    nonce = json.loads(record["signed"])["nonce"]
    assert not producer.redis.exists(producer.keys.nonce("reports", nonce))
    assert record["state"] == "submitted" and "job" not in record


def test_prep_refuses_a_job_over_a_count_cap(fleet: Harness, producer: Client) -> None:
    job_id = producer.submit({"project": "reports",
                              "messages": [{"role": "user", "content": str(n)} for n in range(4)]})
    envelope = producer.result(job_id, timeout=60)
    assert envelope is not None and envelope.code == Code.E_INPUT_INVALID, envelope
    assert "the job has 4 messages; limits.max_messages is 3" in envelope.message


def test_a_hostile_pattern_does_not_stall_the_worker(fleet: Harness) -> None:
    probe = FleetProbe(fleet)
    schema = {"const": HOSTILE_TEXT, "pattern": HOSTILE}
    hostile = fleet.client.submit(ask("Write the string.", response_schema=schema))
    others = [fleet.client.submit(ask(f"Summarise item {n}.")) for n in range(4)]
    envelope = fleet.client.result(hostile, timeout=120)
    assert envelope is not None and envelope.code == Code.E_OUTPUT_INVALID, envelope
    assert f"does not match {HOSTILE!r}" in envelope.message
    # one request per recorded attempt (the first, the re-ask, and on a busy machine perhaps a
    # retry after a timeout): the lease was never lost, no attempt ran twice
    numbers = [attempt.number for attempt in envelope.attempts]
    assert len(numbers) >= 2 and numbers == list(range(1, len(numbers) + 1)), envelope.attempts
    sent = [body["request_id"] for body in probe.sim_requests(hostile)]
    assert sent == [f"{hostile}-{n}" for n in numbers], (sent, envelope.attempts)
    for job_id in others:
        done = fleet.client.result(job_id, timeout=120)
        assert done is not None and done.ok, done  # OK, or OK_THINKING_FORCED on a long draw
        assert len(probe.sim_requests(job_id)) == len(done.attempts), done.attempts
