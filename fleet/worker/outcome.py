"""What a fleet task shows when it ends: the line Celery's task events, its log and Flower carry.

A task's return value is one line, ``"<outcome> job=<id> ..."``; Celery puts its repr into the
``task-succeeded`` event (Flower's Result column, searchable there). An inference turn adds what
an operator asks of it, never a job's text:

  OK job=X turn=0 attempts=1 tokens=120+812 backend=local@127.0.0.1:8100
        a final envelope: the turn's number (0 the first), the job's model attempts so far,
        tokens prompt+completion, the backend (model @ host:port; no credentials)
  continued job=X turn=0 next=carry cause=E_THINK_LOOP
        the turn handed the job on (``Continuation``): how the next turn goes on and why

A job that ended with a code that is not ``OK*`` raises ``JobEnded`` whose text is the code, the
job, the code's one-line meaning (docs/codes.md; never the envelope's own message, which may quote
the answer) and the same figures. Its repr is that text, so Flower's Exception column and the
``task-failed`` event read ``E_THINK_LOOP job=X: The reasoning looped ...``, not a class name.

``ended_event`` is what a fleet task's Request does to its closing event (``ShownRequest``,
fleet/worker/queues.py): a handed-on turn is sent as ``task-continued`` instead of
``task-succeeded`` (Celery's event state, and so Flower, shows an unknown ``task-*`` event as a
state of that name: CONTINUED, not a green SUCCESS); a ``JobEnded`` failure carries its line as
the traceback (there is no Python fault to show) and as the result, which Flower's search reads
(it does not search exceptions), so ``E_THINK_LOOP`` in its search box finds the job. A model
turn's closing event also names the turn (args ``turn 2``; ``turn`` until then: the worker
learns the number only once the turn runs).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from fleet.core.codes import Code
from fleet.core.config import Settings
from fleet.core.models import Envelope

CONTINUED = ("continued", "tools-unsent")  # outcomes of a turn that handed its job on
CONTINUED_EVENT = "task-continued"
CLOSING_EVENTS = ("task-succeeded", "task-failed")
TURN_NUMBER = re.compile(r" turn=(\d+)\b")
ID_CHARS = 80  # of a job id as a task shows it: the sender's value, cut there (as queues.SHOWN_CHARS)


def printable(text: str) -> str:
    """``text`` with every unprintable character escaped (a newline as ``\\n``): one log line,
    whatever a sender put in a field that reaches it."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class JobEnded(Exception):
    """A task's job ended with a non-OK final envelope; the text starts with the code and is
    also its repr (what Celery's events and Flower show as the exception)."""

    def __repr__(self) -> str:
        return printable(str(self))


def backend_label(settings: Settings) -> str:
    """``model@host:port`` of the backend: never the URL's user, password or path."""
    parts = urlsplit(settings.backend.url)
    host = parts.hostname or "?"
    return f"{settings.backend.model}@{host}" + (f":{parts.port}" if parts.port else "")


def ended_detail(envelope: Envelope, turn: int, backend: str) -> str:
    usage = envelope.usage
    return (f"turn={turn} attempts={len(envelope.attempts)} "
            f"tokens={usage.prompt_tokens}+{usage.completion_tokens} backend={backend}")


def continued_detail(turn: int, how: str, cause: Code) -> str:
    return f"turn={turn} next={how} cause={cause.value}"


def task_outcome(outcome: str, job_id: str, detail: str = "") -> str:
    """A task's return value, ``"<outcome> job=<id> <detail>"``; raises ``JobEnded`` when
    ``outcome`` is a non-OK code (its text: code, job, the code's meaning, detail)."""
    tail = f" {detail}" if detail else ""
    job_id = printable(job_id[:ID_CHARS])
    if outcome in Code._value2member_map_ and not Code(outcome).ok:
        raise JobEnded(f"{outcome} job={job_id}: {Code(outcome).info.meaning}{tail}")
    return f"{outcome} job={job_id}{tail}"


def handed_on(result: Any) -> bool:
    """Whether a ``task-succeeded`` event's result (the repr of the return value) is a turn
    that handed its job on."""
    text = result.strip("'\"") if isinstance(result, str) else ""
    return text.split(" ", 1)[0] in CONTINUED


def ended_event(kind: str, fields: dict[str, Any], ended: str | None,
                shown_as: str = "") -> tuple[str, dict[str, Any]]:
    """The closing event as a fleet task sends it (module docstring); ``ended`` is the
    ``JobEnded`` line of a failed task, None otherwise. A model turn (``shown_as`` "turn") that
    names its number closes with it as its args, ``turn 2``: which turn of its job it was."""
    if kind in CLOSING_EVENTS and shown_as == "turn":
        number = TURN_NUMBER.search(str(ended or fields.get("result") or ""))
        if number is not None:
            fields = {**fields, "args": f"turn {number.group(1)}"}
    if kind == "task-succeeded" and handed_on(fields.get("result")):
        return CONTINUED_EVENT, fields
    if kind == "task-failed" and ended is not None:
        return kind, {**fields, "exception": ended, "traceback": ended, "result": ended}
    return kind, fields
