"""A grant whose ``fleet.infer`` message the broker lost is given back at the broker's return, not
when its lease expires (fleet/worker/lostgrants.py): a REAL fleet on a Redis of the test's own.

Two jobs are prepared and admitted while no inference worker runs (the worker gate off, so the
dispatcher grants and sends); one's inference message is deleted from the queue list, as a
SIGKILL with AOF ``everysec`` can leave it (lease kept, message gone), and the broker restarts. The
lost job's lease is given back and it is granted again, with a new fence, far below its lease's
120 s; the job whose message stayed is not touched (same fence, same message). Then an inference
worker starts and each job ends with exactly one envelope.

Fails when nothing looks for lost grants on the broker's return (the lost job waits for its
lease to expire), or when the look cannot see a message in the queue (the kept job is given back).
"""

from __future__ import annotations

import os

import pytest

from fleet.worker.queues import INFER_QUEUE, INFER_TASK, infer_grants_in_broker, stored_task_kwargs
from tests.support.fleet_harness import FleetProbe, Harness, RestartableRedis, make_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

SIM_ARGS = ["--answer-min-tokens", "5", "--answer-max-tokens", "10"]
LEASE_S = 120.0  # what the lost job would wait without the look
WITHIN_S = 60.0


def submit(fleet: Harness, job_id: str) -> str:
    return fleet.client.submit({"project": "assistant", "id": job_id,
                                "messages": [{"role": "user", "content": f"hello {job_id}"}]})


def grants(fleet: Harness) -> dict[str, int]:
    """Job ref -> fence of every inference message in the broker."""
    return dict(infer_grants_in_broker(fleet.settings, fleet.client.redis))


def delete_message(fleet: Harness, ref: str) -> None:
    """Remove the job's inference message from the queue list, as a lost AOF second would."""
    queue = f"{fleet.settings.key_prefix}q:{INFER_QUEUE}"
    mine = [raw for raw in fleet.client.redis.lrange(queue, 0, -1)
            if [kwargs["ref"] for kwargs in stored_task_kwargs([raw], INFER_TASK)] == [ref]]
    assert len(mine) == 1, "the job's inference message is not in its queue"
    assert fleet.client.redis.lrem(queue, 1, mine[0]) == 1


def given_back(fleet: Harness) -> str:
    return "\n".join(line for line in fleet.fleet._tails["dispatcher-0"]
                     if "without the inference messages" in line)


def test_a_grant_whose_message_was_lost_is_given_back_on_the_brokers_return(
        tmp_path, broker: RestartableRedis) -> None:
    config = make_config(tmp_path, broker_url=broker.url,
                         admission={"worker_gate": False, "lease_ttl_s": LEASE_S})
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, workers=0) as fleet:
        probe = FleetProbe(fleet)
        fleet.fleet.spawn("prep-0", ["worker", "--role", "prep", "--concurrency", "4",
                                     "--hostname", f"prep-{os.getpid()}@%h", "--log-level", "WARNING"])
        lost_id, kept_id = submit(fleet, "lost"), submit(fleet, "kept")
        lost, kept = fleet.client.ref(lost_id), fleet.client.ref(kept_id)
        wait_until(lambda: {lost, kept} <= set(grants(fleet)), WITHIN_S, "both jobs granted")
        first = grants(fleet)
        delete_message(fleet, lost)
        broker.stop()  # a clean stop: the deletion is on disk, the lease is kept
        fleet.client.redis.connection_pool.disconnect()
        broker.start()
        wait_until(lambda: grants(fleet).get(lost, 0) > first[lost], WITHIN_S, "the lost job granted again")
        assert "assistant/lost" in given_back(fleet) and "assistant/kept" not in given_back(fleet)
        assert grants(fleet)[kept] == first[kept]
        fleet.fleet.spawn("worker-0", ["worker", "--role", "infer", "--concurrency", "4",
                                       "--hostname", f"infer-{os.getpid()}@%h", "--log-level", "WARNING"])
        for job_id in (lost_id, kept_id):
            wait_until(lambda j=job_id: fleet.client.results.final(fleet.client.ref(j)),
                       WITHIN_S, f"job {job_id} final")
        counts = probe.envelope_counts()
        assert (counts[lost_id], counts[kept_id]) == (1, 1)
