"""Continuations through the REAL fleet (Celery worker and dispatcher processes, ``fleet sim``,
Redis), cap 1: a job whose attempt failed waits for its backoff in the store, not in a worker,
so the one slot serves the next job meanwhile; a cancel reaches it while it waits.

The backoff is drawn from U(0, 600 s) (full jitter, retry.backoff_base_s = backoff_max_s = 600):
the job waits far longer than the next job needs (the chance that it is drawn below the ~1 s
the test needs is about 0.2%).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from fleet.core.codes import Code
from tests.support.fleet_harness import FleetProbe, Harness, make_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

SIM_ARGS = ["--think-min-tokens", "50", "--think-max-tokens", "100",
            "--answer-min-tokens", "10", "--answer-max-tokens", "20"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    config = make_config(tmp_path_factory.mktemp("fleet-continuations"),
                         backend={"max_num_seqs": 1}, admission={"lease_ttl_s": 4},
                         retry={"backoff_base_s": 600.0, "backoff_max_s": 600.0})
    with Harness(config, sim_speed=100, sim_args=SIM_ARGS) as harness:
        yield harness


@pytest.fixture
def probe(fleet: Harness) -> FleetProbe:
    return FleetProbe(fleet)


def ask(project: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"project": project, "messages": [{"role": "user", "content": text}], **extra}


def test_a_backoff_holds_no_slot_and_a_waiting_continuation_can_be_cancelled(
        fleet: Harness, probe: FleetProbe) -> None:
    client = fleet.client
    failing = client.submit(ask("reports", "Sum the invoices. [sim:http500/1] [sim:think=50]"))
    wait_until(lambda: probe.store().continuations() == {"reports": {"deferred": 1}}, 60,
               "the failed job to wait for its backoff in the store")
    assert probe.state(failing) == "pending" and probe.snapshot().in_flight == 0
    other = client.submit(ask("reports", "Count the pages. [sim:think=50]"))
    done = client.result(other, timeout=60)  # the one slot is free: the next job runs now
    assert done is not None and done.code == Code.OK
    assert client.results.get(client.ref(failing)) is None  # still waiting, not failed
    assert len(probe.sim_requests(failing)) == 1
    client.cancel(failing)
    cancelled = client.result(failing, timeout=30)
    assert cancelled is not None and cancelled.code == Code.E_CANCELLED, cancelled
    # the envelope goes out first, then the item leaves the store (fleet/worker/tasks.py)
    wait_until(lambda: probe.store().continuations() == {}, 30, "the cancelled item to leave")
    assert probe.envelope_counts()[failing] == 1
