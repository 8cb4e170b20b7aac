"""A job that holds no lease (in line, or waiting between turns) is ended by a worker in two
steps: its final envelope is published and its item taken out of the dispatcher store. A worker
dying between the two must never leave a job that nothing ends. In one process with the real
pieces (Redis store, job records, ``fleet sim``); the death is a BaseException raised by
whichever of the two steps comes second, so the test holds for either order:

- publish first (the order the tasks use): the job is final, its item is left; the dispatcher
  admits it, the inference task finds the result, releases the slot and drops it;
- the other order would leave the job "pending" with no item and no envelope: no dispatcher,
  lease or prep watchdog ever looks at it again.

Each of the four paths: cancelled while prep handed it over, cancelled while queued, cancelled
between turns, and a tool result that makes the next turn impossible to send.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fleet.core.codes import Code
from fleet.core.models import Envelope
from fleet.core.seal import sign_cancel
from fleet.worker.jobs.cancel import cancel_job
from fleet.worker.jobs.infer import infer_job
from fleet.worker.jobs.tool import tool_job
from fleet.worker.runtime import Runtime
from tests.support.waiting import wait_until
from tests.support.worker_runtime import BIG_RESULT, Sent, admit, envelope, submit, submit_asking

LATER = 3600.0  # past every backoff and tool round timeout


class Died(BaseException):
    """The worker process dying (kill -9, OOM): nothing after this point runs."""


@pytest.fixture
def dies_between(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Runtime], None]]:
    """``dies_between(runtime)``: of the runtime's next publish and cancel_pending, the first
    runs, the second dies before doing anything (``monkeypatch.undo()`` revives the worker)."""

    def arm(runtime: Runtime) -> None:
        done: list[str] = []

        def dying(name: str, step: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                if done:
                    raise Died
                done.append(name)
                return step(*args, **kwargs)
            return run

        monkeypatch.setattr(runtime.results, "publish", dying("publish", runtime.results.publish))
        monkeypatch.setattr(runtime.store, "cancel_pending",
                            dying("cancel_pending", runtime.store.cancel_pending))

    yield arm


def request_cancel(runtime: Runtime, ref: str) -> None:
    project, job_id = ref.split("/", 1)
    runtime.redis.set(runtime.keys.cancel(ref),
                      sign_cancel(project, job_id, runtime.settings.projects[project].secret))


def assert_ended_once_and_nothing_held(runtime: Runtime, ref: str, code: Code) -> None:
    """The job has its one envelope; whatever item is left is admitted and dropped at once, and
    no slot or lease stays held."""
    final = envelope(runtime, ref)
    assert final is not None and final.code == code
    runtime.store.promote_due(time.time() + LATER)
    if ref in runtime.store.pending_ids():  # left by the death: admitted, found final, dropped
        assert infer_job(runtime, ref, ref.split("/")[0], admit(runtime, ref, time.time())) == "already-final"
    assert ref not in runtime.store.pending_ids() and runtime.store.next_not_before() is None
    assert runtime.store.snapshot().in_flight == 0 and runtime.store.lease_fences() == {}
    project = ref.split("/")[0]
    published = [fields for _, fields in runtime.redis.xrange(runtime.keys.results(project))
                 if ref.split("/", 1)[1].encode() in b"".join(fields.values())]
    assert len(published) == 1
    assert envelope(runtime, ref) == final


def test_a_job_cancelled_while_prep_handed_it_over(
        rt: Runtime, dies_between: Callable[[Runtime], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    add_pending, handed_over = rt.store.add_pending, []

    def cancelled_meanwhile(item: Any) -> None:
        add_pending(item)
        request_cancel(rt, item.job_id)
        handed_over.append(item.job_id)

    monkeypatch.setattr(rt.store, "add_pending", cancelled_meanwhile)
    dies_between(rt)
    with pytest.raises(Died):
        submit(rt, "Sum the invoices.")
    monkeypatch.undo()
    assert_ended_once_and_nothing_held(rt, handed_over[0], Code.E_CANCELLED)


def test_a_job_cancelled_while_queued(rt: Runtime, dies_between: Callable[[Runtime], None],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ref = submit(rt, "Sum the invoices.")
    request_cancel(rt, ref)
    dies_between(rt)
    with pytest.raises(Died):
        cancel_job(rt, *ref.split("/", 1))
    monkeypatch.undo()
    assert_ended_once_and_nothing_held(rt, ref, Code.E_CANCELLED)


def test_a_job_cancelled_between_turns(rt: Runtime, dies_between: Callable[[Runtime], None],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ref = submit(rt, "Sum the invoices. [sim:http500/1] [sim:think=50]")
    readmit = rt.store.readmit

    def cancelled_during_the_turn(*args: Any, **kwargs: Any) -> bool:
        request_cancel(rt, ref)
        return readmit(*args, **kwargs)

    monkeypatch.setattr(rt.store, "readmit", cancelled_during_the_turn)
    dies_between(rt)
    with pytest.raises(Died):
        infer_job(rt, ref, "reports", admit(rt, ref, time.time()))
    monkeypatch.undo()
    assert_ended_once_and_nothing_held(rt, ref, Code.E_CANCELLED)


def test_a_job_whose_next_turn_can_never_be_sent(
        tool_rt: Runtime, dies_between: Callable[[Runtime], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    rt, sent = tool_rt, Sent()
    rt.send_task = sent
    ref = submit_asking(rt, "Find the March invoice. [sim:tool=search_docs/1] [sim:parallel=2]")
    assert infer_job(rt, ref, "reports", admit(rt, ref, time.time())) == "continued"
    first, second = sent.tasks
    dies_between(rt)
    with pytest.raises(Died):
        tool_job(rt, {"tests.search_docs": lambda **kw: BIG_RESULT}, ref, 1, first["call_id"])
    monkeypatch.undo()
    assert tool_job(rt, {"tests.search_docs": lambda **kw: BIG_RESULT}, ref, 1,
                    second["call_id"]) == "stale"
    assert_ended_once_and_nothing_held(rt, ref, Code.E_PROMPT_TOO_LONG)


def test_a_job_admitted_while_it_was_ended_stops_and_gives_its_slot_up(rt: Runtime) -> None:
    """The race publishing first leaves: the dispatcher admitted the job just before a worker
    ended it. Its turn stops (the lease keeper watches for a final result as for a cancel),
    publishes nothing more and releases the lease; before, it ran on until the stream ended."""
    ref = submit(rt, "Sum the invoices. [sim:stall=100000] [sim:think=50]")
    fence = admit(rt, ref, time.time())
    outcome: list[str] = []
    turn = threading.Thread(target=lambda: outcome.append(infer_job(rt, ref, "reports", fence)))
    turn.start()
    wait_until(lambda: rt.results.job_record(ref).get("state") == "running", 60,
               "the admitted turn to start running")
    project, job_id = ref.split("/", 1)
    ended = Envelope.failure(job_id, project, Code.E_PROMPT_TOO_LONG, "ended while waiting")
    assert rt.results.publish(ended)
    turn.join(timeout=60)
    assert outcome == ["already-final"]
    assert envelope(rt, ref) == ended
    assert rt.store.snapshot().in_flight == 0 and rt.store.lease_fences() == {}
