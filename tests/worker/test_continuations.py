"""Between two model turns, in one process with the real pieces (Redis store, job records,
``fleet sim``): the inference task's turn -> save -> readmit path, and what happens when it is
cut short. Driving the task functions directly (not through Celery) puts a crash or a Redis
error exactly between saving the next turn and the readmit, which no timing could hit.

- a retry's turn is saved sealed in the job record, the lease is given up (no slot held), and the
  job is pending again with the new plan's size;
- the worker dies (or Redis fails) after saving the turn, before the readmit: the lease expires,
  the reaper puts the job back, and the next delivery resumes from the saved turn (attempt 2,
  same plan) and ends OK: nothing lost, no attempt repeated;
- a saved turn that does not carry the workers' seal runs nothing (E_AUTH).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis

from fleet.core.codes import Code
from fleet.worker.jobs.infer import infer_job
from fleet.worker.runtime import Runtime
from tests.support.worker_runtime import LEASE_TTL_S, admit, envelope, submit


def test_a_retry_gives_the_slot_up_and_the_next_turn_runs_from_the_saved_turn(rt: Runtime) -> None:
    ref = submit(rt, "Sum the invoices. [sim:http500/1] [sim:think=50]")
    fence = admit(rt, ref, time.time())
    assert infer_job(rt, ref, "reports", fence) == "continued"
    record = rt.results.job_record(ref)
    assert record["state"] == "pending" and json.loads(record["turn"])["retries"] == 1
    assert rt.store.snapshot().in_flight == 0 and rt.store.lease_fences() == {}
    assert ref in rt.store.pending_ids() and envelope(rt, ref) is None
    assert rt.store.continuations() == {"reports": {"pending": 1}}
    assert infer_job(rt, ref, "reports", admit(rt, ref, time.time())) == "OK"
    final = envelope(rt, ref)
    assert final is not None and [a.code for a in final.attempts] == [Code.E_UPSTREAM_ERROR, Code.OK]
    submitted_at = json.loads(rt.results.job_record(ref)["job"])["submitted_at"]
    # queued until the FIRST admission, not the last turn's
    assert final.timings.queued_s == round(final.attempts[0].started_at - submitted_at, 4)


@pytest.mark.parametrize("how", ["worker dies", "redis error"])
def test_cut_between_saving_the_turn_and_readmit_loses_nothing(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    ref = submit(rt, "Sum the invoices. [sim:http500/1] [sim:think=50]")
    fence = admit(rt, ref, time.time())

    class Died(BaseException):  # a process dying: nothing after this point runs
        pass

    def cut(*_args: Any, **_kwargs: Any) -> bool:
        if how == "worker dies":
            raise Died
        raise redis.ConnectionError("simulated blip")

    monkeypatch.setattr(rt.store, "readmit", cut)
    if how == "worker dies":
        with pytest.raises(Died):
            infer_job(rt, ref, "reports", fence)
    else:
        assert infer_job(rt, ref, "reports", fence) == "readmit-failed"
    monkeypatch.undo()
    # The turn is saved, the lease still held: nothing runs, nothing is published.
    assert "turn" in rt.results.job_record(ref) and envelope(rt, ref) is None
    assert rt.store.lease_fences() == {ref: fence}
    assert rt.store.reap_expired(time.time() + LEASE_TTL_S + 1) == [ref]
    again = admit(rt, ref, time.time() + LEASE_TTL_S + 1)
    assert again > fence
    assert infer_job(rt, ref, "reports", again) == "OK"
    final = envelope(rt, ref)
    assert final is not None
    assert [a.number for a in final.attempts] == [1, 2]  # resumed: attempt 1 is not run again
    assert [a.code for a in final.attempts] == [Code.E_UPSTREAM_ERROR, Code.OK]


def test_a_saved_turn_without_the_workers_seal_runs_nothing(rt: Runtime) -> None:
    ref = submit(rt, "Sum the invoices. [sim:http500/1] [sim:think=50]")
    assert infer_job(rt, ref, "reports", admit(rt, ref, time.time())) == "continued"
    turn = json.loads(rt.results.job_record(ref)["turn"])
    turn["plan"]["max_tokens"] = 10**6  # a producer writing its own turn state
    rt.results.record(ref, turn=json.dumps(turn))
    assert infer_job(rt, ref, "reports", admit(rt, ref, time.time())) == "E_AUTH"


@pytest.mark.parametrize("replay", ["an earlier turn", "no turn at all"])
def test_a_replayed_turn_runs_nothing_and_resets_no_counter(rt: Runtime, replay: str) -> None:
    """The producer may write its own job hash: putting back an earlier sealed turn (or deleting
    the turn, the first turn's state) would reset the retry and tool counters. The store, which
    only the fleet writes, names the turn that may run."""
    ref = submit(rt, "Sum the invoices. [sim:http500/2] [sim:think=50]")
    first = rt.results.job_record(ref)
    assert infer_job(rt, ref, "reports", admit(rt, ref, time.time())) == "continued"
    earlier = rt.results.job_record(ref)
    assert json.loads(earlier["turn"])["number"] == 1 and rt.store.turn_of(ref) == 1
    assert infer_job(rt, ref, "reports", admit(rt, ref, time.time())) == "continued"
    assert json.loads(rt.results.job_record(ref)["turn"])["retries"] == 2
    assert rt.store.turn_of(ref) == 2
    if replay == "an earlier turn":
        rt.results.record(ref, turn=earlier["turn"], turn_seal=earlier["turn_seal"])
    else:
        assert "turn" not in first
        rt.redis.hdel(rt.keys.job(ref), "turn", "turn_seal")
    assert infer_job(rt, ref, "reports", admit(rt, ref, time.time())) == "E_AUTH"
    final = envelope(rt, ref)
    assert final is not None and final.code == Code.E_AUTH and "turn" in final.message
    assert len(carryover_attempts(rt, ref)) == 2  # nothing more was sent


def carryover_attempts(rt: Runtime, ref: str) -> list[dict[str, Any]]:
    from fleet.infer.carryover import load_attempts

    return load_attempts(rt.redis, rt.keys, ref)
