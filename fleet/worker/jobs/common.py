"""What the fleet's tasks share: a job's event sink, its cancel request, ending it with a failure,
a worker's owner name, ending a job that holds no lease, and the saved turn a job may run.

Ending a job that holds no lease (in line, or waiting between turns: a cancel while prep hands it
over, ``fleet.cancel``, a cancel between turns, a tool result its next turn can never be sent
with): its final envelope is published FIRST, then its item is taken out of the dispatcher store
(``end_unleased``). A worker dying in between leaves an item whose job is final: the dispatcher
admits it and ``fleet.infer`` finds the result, releases the slot and drops it. The other order
would leave a job "pending" with no item and no envelope, which nothing ever ends (no lease to
expire; the prep watchdog looks only at jobs not handed over). A job admitted just before it was
ended finds its result at its claim, or, running already, its lease keeper sees the result (as it
sees a cancel) and stops; publishing is first-wins, so the job keeps exactly one envelope.

Failure cases: ``current_turn`` raises AuthError for a saved turn the workers did not seal or
that is not the job's current one (fleet/core/seal.py); Redis errors go up to the task.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from typing import Any

from fleet.core.codes import Code
from fleet.core.errors import AuthError
from fleet.core.events import EventSink
from fleet.core.keys import split_ref
from fleet.core.models import Envelope
from fleet.core.seal import cancel_valid, check_turn
from fleet.infer.turns import TurnRecord
from fleet.worker.runtime import Runtime


def event_sink(rt: Runtime, ref: str) -> EventSink:
    return EventSink(rt.redis, rt.keys, ref, rt.settings.events_ttl_s)


def cancel_requested(rt: Runtime, ref: str) -> bool:
    """A cancel request signed by the job's own project exists (anything else is ignored)."""
    project, job_id = split_ref(ref)
    return cancel_valid(rt.settings, project, job_id, rt.redis.get(rt.keys.cancel(ref)))


def fail(rt: Runtime, job_id: str, project: str, code: Code, message: str, **extra: Any) -> str:
    rt.results.publish(Envelope.failure(job_id, project, code, message, **extra))
    return code.value


def new_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def end_unleased(rt: Runtime, ref: str, code: Code, message: str, **extra: Any) -> str:
    """End a job that holds no lease (in line, waiting between turns, or not handed over yet):
    its final envelope FIRST, then its item out of the dispatcher store (module docstring). A
    worker dying in between leaves an item whose job is final, which the inference task releases
    and drops; the other order would leave a job with neither, which nothing ever ends."""
    project, job_id = split_ref(ref)
    fail(rt, job_id, project, code, message, **extra)
    rt.store.cancel_pending(ref)
    return code.value


def current_turn(rt: Runtime, ref: str, record: dict[str, str]) -> TurnRecord | None:
    """The saved turn to run (None: the first); AuthError unless the workers sealed it AND it is
    the job's current turn. The producer may write its job hash, so the seal alone would let it
    put an earlier turn back (or delete it) and reset every counter the turn carries; the number
    of the turn that may run is in the dispatcher store, which only the fleet writes (``readmit``
    records it). A saved turn one ahead of the store's is the turn of a worker that died (or lost
    Redis) between saving it and ``readmit``: the reaped job resumes from it."""
    turn_json = check_turn(rt.settings, ref, record)
    turn: TurnRecord | None = None if turn_json is None else json.loads(turn_json)
    number = 0 if turn is None else turn.get("number")
    expected = rt.store.turn_of(ref)
    if number not in (expected, expected + 1):
        raise AuthError(f"the saved turn ({number}) is not the job's current turn ({expected}): "
                        f"an earlier turn put back")
    return turn
