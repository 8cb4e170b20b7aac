"""What one model turn hands the next, typed: the retry kinds, the saved turn and its tool rounds.

``RetryKind``   how a turn that needs another goes on (``Continuation.how``, the ``retry`` and
                ``continuation`` events): a ``StrEnum``, so it is written as the same string
                as before ("carry", "budget", ...)
``Turn``        the state one turn hands the next (fleet/infer/attempts.py): saved sealed in the
                job record as JSON (fleet/worker/jobs/infer.py), in ``TurnRecord``'s form and key
                order; ``record()`` and ``from_record()`` convert, and a record read back is
                written back byte for byte (tests/test_turn_records.py)
``ToolRound``   one round of tool calls (fleet/infer/tools.py) as the turn and the envelope keep
                it, with its ``ToolCall`` entries and their ``ToolResult``
``ToolTask``    what the inference worker sends for one valid call (a ``fleet.tool`` task)

The records are plain dicts (TypedDicts) because they are stored and shown as JSON as they are:
the envelope's ``tool_rounds`` is the same list. Keys a record gains later in its life are
``NotRequired``: a call's ``result`` once its round finished, a round's ``duration_s`` then and
``sends`` once it was sent again, a result's ``tokens`` once it was counted.

Failure cases: ``Turn.from_record`` raises KeyError for a record missing a field (it ignores
keys it does not know); the inference turn reading it ends the job E_INTERNAL. Fields added to
``TurnRecord`` after records were stored (``ADDED_LATER``) read as their default when missing, so
a job saved by the release before goes on after an upgrade, and they are written only when they
differ from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, NotRequired, TypedDict

from fleet.infer.budget import Plan


class RetryKind(StrEnum):
    CARRY = "carry"  # retry with a carry-over note of the attempt's conclusions (a loop)
    BUDGET = "budget"  # retry with a grown thinking budget (forced end, empty or invalid)
    RESERVE = "reserve"  # retry with a grown content reserve (an empty answer)
    REASK = "reask"  # ask again with the validation error (an invalid answer)
    BACKOFF = "backoff"  # a retryable upstream error: back in line after a backoff
    OUTAGE = "outage"  # the backend is down: back in line behind its gate, not a retry
    TOOL = "tool"  # a tool round: back in line once its tools have run


class ToolResult(TypedDict, total=False):
    ok: bool
    content: str  # ok: what the tool returned, as the model reads it
    error: str  # not ok: why
    timed_out: bool
    started_at: float
    duration_s: float
    tokens: int  # its size in the next turn's prompt, once counted


class ToolCall(TypedDict):
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it
    error: str | None  # why the call was not run (the check); None: it was run
    result: NotRequired[ToolResult | None]  # once the round finished; None: not run


class ToolRound(TypedDict):
    number: int
    calls: list[ToolCall]
    started_at: float
    timeout_s: float
    sends: NotRequired[int]  # sent again: how many times its tasks were sent
    duration_s: NotRequired[float]  # once finished: its results are in the conversation


class ToolTask(TypedDict):
    id: str
    name: str
    queue: str
    timeout_s: float  # Celery's soft time limit
    time_limit_s: float  # the hard one


class TurnRecord(TypedDict):
    """A ``Turn`` as saved (JSON) and handed over (``Continuation.turn``), in this key order."""

    number: int
    plan: dict[str, Any]  # a Plan's fields (fleet/infer/budget.py)
    carry_note: str | None
    reask_note: str | None
    conclusions: list[str]
    retries: int
    reasks: int
    outages: int
    cuts: NotRequired[int]  # written only when not 0, so a record reads back as it was before
    heat: int
    warnings: list[str]
    conversation: list[dict[str, Any]]
    tool_rounds: list[ToolRound]
    invalid_rounds: int
    tools_off: bool
    kept: NotRequired[dict[str, Any]]  # a cut reasoning to continue (fleet/infer/resume.py Kept)


# Fields added after records were stored, with the value that reads as "none so far": a record
# without one reads as that value, and the value is not written (the record stays as it was).
ADDED_LATER: dict[str, Any] = {"cuts": 0}

# The fields a turn carries over as they are (``number`` and ``plan`` are the turn's own; ``kept``
# is written only when there is one).
CARRIED = tuple(name for name in TurnRecord.__annotations__ if name not in ("number", "plan", "kept"))


@dataclass
class Turn:
    """What a turn starts from: its number, its plan and what the turns before it carried."""

    number: int  # 0 the first, then one more per continuation (the store keeps it, ``readmit``)
    plan: Plan
    carry_note: str | None  # the carry-over note for the next attempt (fleet/infer/carryover.py)
    reask_note: str | None  # the re-ask note with the rejected answer
    conclusions: list[str]  # of every attempt so far
    retries: int  # counted against retry.max_attempts
    reasks: int  # against retry.reask_invalid
    outages: int  # against retry.max_outage_returns
    cuts: int  # outage returns whose request reached the backend: against retry.max_cut_returns
    heat: int  # answer-level failures so far: the temperature's step
    warnings: list[str]
    conversation: list[dict[str, Any]]  # messages after the job's own: the tool rounds'
    tool_rounds: list[ToolRound]
    invalid_rounds: int  # rounds with invalid calls (at most tool_invalid_max)
    tools_off: bool  # an untrusted tool result came in: no tools any more
    kept: dict[str, Any] | None = None  # the cut reasoning the next attempt continues

    @classmethod
    def from_record(cls, record: TurnRecord) -> Turn:
        """The turn a record names; other keys are ignored, a missing one is a KeyError."""
        carried: dict[str, Any] = {
            name: record.get(name, ADDED_LATER[name]) if name in ADDED_LATER
            else record[name] for name in CARRIED}  # type: ignore[literal-required]
        return cls(number=record["number"], plan=Plan(**record["plan"]), kept=record.get("kept"),
                   **carried)

    def record(self) -> TurnRecord:
        fields = asdict(self)
        if fields["plan"]["limit"] is None:  # no client limit: written as before there was one
            del fields["plan"]["limit"]
        if fields["kept"] is None:
            del fields["kept"]
        for name, default in ADDED_LATER.items():
            if fields[name] == default:
                del fields[name]
        return TurnRecord(**fields)  # type: ignore[typeddict-item]
