"""A prep message the broker lost comes back in seconds, not after ``prep_unclaimed_s``
(fleet/prep/recover.py): a REAL fleet on a Redis of the test's own. Two jobs are submitted while
no worker runs; one's message is deleted from its queue list, as a SIGKILL with AOF ``everysec``
can leave it (record ``submitted``, message gone), and the broker restarts. The lost job is sent
again and ends well within seconds of the broker's return, far below ``prep_unclaimed_s``; the job
whose message stayed in its queue is not sent again; each ends with exactly one envelope.

Fails when the dispatcher's watchdog does not look for lost messages on the broker's return (the
lost job waits ``prep_unclaimed_s``), or when it cannot see a message in its queue (the kept job
is named among the lost)."""

from __future__ import annotations

import os

import pytest

from tests.support.fleet_harness import FleetProbe, Harness, RestartableRedis, make_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

SIM_ARGS = ["--answer-min-tokens", "5", "--answer-max-tokens", "10"]
RECOVERED_WITHIN_S = 60  # a safety net: prep_unclaimed_s is 600


def submit(fleet: Harness, job_id: str) -> str:
    return fleet.client.submit({"project": "assistant", "id": job_id,
                                "messages": [{"role": "user", "content": f"hello {job_id}"}]})


def messages(fleet: Harness, job_id: str) -> list[bytes]:
    """The job's prep messages waiting in its queue list."""
    queue = f"{fleet.settings.key_prefix}q:fleet.assistant"
    return [raw for raw in fleet.client.redis.lrange(queue, 0, -1) if f"job={job_id}\"".encode() in raw]


def delete_message(fleet: Harness, job_id: str) -> None:
    """Remove the job's prep message from its queue list, as a lost AOF second would."""
    mine = messages(fleet, job_id)
    assert len(mine) == 1, "the job's prep message is not in its queue"
    assert fleet.client.redis.lrem(f"{fleet.settings.key_prefix}q:fleet.assistant", 1, mine[0]) == 1


def lost_named(fleet: Harness) -> str:
    return "\n".join(line for line in fleet.fleet._tails["dispatcher-0"]
                     if "without the prep messages" in line)


def test_a_lost_prep_message_is_sent_again_on_the_brokers_return(
        tmp_path, broker: RestartableRedis) -> None:
    config = make_config(tmp_path, broker_url=broker.url)
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, workers=0) as fleet:
        probe = FleetProbe(fleet)
        lost, kept = submit(fleet, "lost"), submit(fleet, "kept")
        delete_message(fleet, lost)
        broker.stop()  # a clean stop: the deletion is on disk, the records are kept
        fleet.client.redis.connection_pool.disconnect()
        broker.start()
        wait_until(lambda: messages(fleet, lost), RECOVERED_WITHIN_S, "the lost job sent again")
        assert "assistant/lost" in lost_named(fleet) and "assistant/kept" not in lost_named(fleet)
        assert len(messages(fleet, kept)) == 1
        fleet.fleet.spawn("worker-0", ["worker", "--concurrency", "4",
                                       "--hostname", f"return-{os.getpid()}@%h", "--log-level", "WARNING"])
        for job_id in (lost, kept):
            wait_until(lambda j=job_id: fleet.client.results.final(fleet.client.ref(j)),
                       RECOVERED_WITHIN_S, f"job {job_id} final")
        counts = probe.envelope_counts()
        assert (counts[lost], counts[kept]) == (1, 1)
