"""The backend a turn streams to is the one its lease was granted on (the claim answers it), not
the one its task names: a task naming another backend (a dispatcher with other ``[[backends]]``,
or a message written by anyone but a dispatcher) sends nothing; its lease expires and the job is
admitted again and runs. A task naming a backend the worker does not have claims nothing. One
process with the real pieces (Redis store, records, ``fleet sim``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from fleet.core.codes import Code
from fleet.worker.jobs.infer import run_turn
from fleet.worker.runtime import Runtime
from tests.support.worker_runtime import LEASE_TTL_S, admit, envelope, runtime, submit


@pytest.fixture
def two(sim: str, key_prefix: str, redis_client: redis.Redis) -> Iterator[Runtime]:
    """Backends "a" and "b", both the one simulator."""
    yield from runtime(sim, key_prefix, backends=["a", "b"])


def test_a_task_naming_another_backend_than_its_lease_runs_nothing(two: Runtime) -> None:
    rt = two
    ref = submit(rt, "Sum the invoices.")
    fence = admit(rt, ref, time.time())  # on "a": both are idle, ties go in settings order
    assert rt.store.snapshot().backends["a"].in_flight == 1
    assert run_turn(rt, ref, "reports", fence, "b").outcome == "unknown-backend"
    assert rt.results.job_record(ref).get("state") != "running"  # never sent
    assert envelope(rt, ref) is None
    assert rt.store.lease_fences() == {ref: fence}  # claimed, never renewed: it expires
    assert rt.store.snapshot().claimed == 1
    assert rt.store.reap_expired(time.time() + LEASE_TTL_S + 1) == [ref]
    again = admit(rt, ref, time.time() + LEASE_TTL_S + 1)
    turn = run_turn(rt, ref, "reports", again, "")  # '' names none: the lease's backend
    assert turn.outcome == "OK"
    ended = envelope(rt, ref)
    assert ended is not None and ended.code == Code.OK and ended.backend == "a"


def test_a_task_naming_an_unknown_backend_leaves_the_lease_to_the_right_delivery(two: Runtime) -> None:
    """A copy of the grant naming a backend this worker does not have claims nothing: the
    delivery naming the lease's backend still runs the job at once (it is not a duplicate)."""
    rt = two
    ref = submit(rt, "Sum the invoices.")
    fence = admit(rt, ref, time.time())
    assert run_turn(rt, ref, "reports", fence, "elsewhere").outcome == "unknown-backend"
    assert rt.store.snapshot().claimed == 0
    assert run_turn(rt, ref, "reports", fence, "a").outcome == "OK"
    ended = envelope(rt, ref)
    assert ended is not None and ended.code == Code.OK and ended.backend == "a"
