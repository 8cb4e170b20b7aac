"""The usage ledger: what each project spent, per API key, model and UTC hour (docs/usage.md).

One hash per project and hour, ``{p}usage:{<project>}:h:<YYYYMMDDHH>`` (fleet/core/keys.py), with
a field per ``<key>|<model>|<metric>`` counted by HINCRBY: ``requests`` (model turns sent),
``prompt_tokens``, ``cached_tokens`` (vLLM's ``prompt_tokens_details.cached_tokens``),
``reasoning_tokens``, ``answer_tokens`` (completion minus reasoning), ``cut_turns`` (turns whose
stream ended without vLLM's usage chunk: counted from what the fleet saw), ``loop_cuts`` and
``crashed_turns`` and ``crashed_tokens`` (turns whose worker died mid-stream, below), ``loop_cuts``
and ``loop_cut_tokens`` (turns ending E_THINK_LOOP and the completion tokens they spent),
``tool_rounds`` (turns that ended in tool calls), ``code:<CODE>`` (turns by message code).
``<key>`` is ``queue`` for a queue job (it has no API key) and ``sha256:<8 hex>`` (the start of
the key's digest, as in ``projects.<name>.api_keys``) for a gateway request, and for a task or
batch line the gateway submitted for a key (its sealed tag, fleet/core/seal.py ``key_tag``).

Who writes: the inference worker at the end of each model turn (fleet/infer/attempts.py, in the
pipeline that records the attempt), the gateway at the end of each request's attempts
(fleet/gateway/chat.py). Both run ``usage.lua``: SET NX of the turn's marker
``{p}usage:{<project>}:t:<job id>:<fence>:<turn>`` and the increments in one script, so a count
resent (a redis-py retry after a lost reply) counts nothing. A redelivered job runs under a new
fence: its turn is a new request to vLLM and counts as one. The hour is the writer's clock at
the turn's end.

A worker killed mid-stream cannot count its turn: while the turn streams, its lease keeper
records the progress at each renewal (``checkpoint``: ``{p}usage:{<project>}:open:<job id>``:
fence, turn, tokens so far), the turn's own count removes the entry, and the job's next
turn, under another fence, counts an entry it finds as a crashed turn (``settle``), under that
turn's own marker, so once.

Failure cases: the inference worker's count rides in the attempt's pipeline (a Redis error there
sends the job back in line, the turn counted when it runs again); the gateway's is logged and
its turns go uncounted; what streamed after a dead turn's last renewal is not counted, nor a
dead turn whose job ends without another turn; see docs/usage.md.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis

from fleet.core.config import UsageSettings
from fleet.core.keys import Keys
from fleet.core.lua import Scripts

log = logging.getLogger(__name__)

QUEUE_KEY = "queue"
HOUR_S = 3600
METRICS = ("requests", "prompt_tokens", "cached_tokens", "reasoning_tokens", "answer_tokens",
           "cut_turns", "crashed_turns", "crashed_tokens", "loop_cuts", "loop_cut_tokens",
           "tool_rounds", "cache_hits")
LOOP_CODE = "E_THINK_LOOP"
# A turn whose worker died mid-stream ends with no code of its own: it counts under the code of a
# stream that ended without its end, as the fleet names it when it sees one.
CRASHED_CODE = "E_STREAM_DROPPED"
PROGRESS_FIELDS = ("fence", "turn", "key", "model", "prompt_tokens", "reasoning_tokens",
                   "answer_tokens", "ended_at")


def key_label(key_digest: str) -> str:
    """How a gateway API key is named in the ledger: the start of its SHA-256 digest."""
    return f"sha256:{key_digest[:8]}"


def hour_of(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y%m%d%H")


def hour_start(hour: str) -> int:
    return int(datetime.strptime(hour, "%Y%m%d%H").replace(tzinfo=UTC).timestamp())


@dataclass(frozen=True)
class TurnUsage:
    """One model turn's figures, as the ledger counts them."""

    project: str
    job_id: str
    fence: int
    turn: int  # the attempt's number within its job
    code: str
    key: str = QUEUE_KEY
    model: str = "local"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    answer_tokens: int = 0
    cut: bool = False  # no usage chunk from vLLM: the fleet's own figures
    crashed: bool = False  # its worker died mid-stream: counted from its last progress entry
    tool_round: bool = False
    ended_at: float = 0.0
    # a gateway request answered from the project's exact-repeat cache: no model request, counted
    # as ``cache_hits`` only (fleet/core/repeatcache.py)
    cache_hit: bool = False

    def fields(self) -> dict[str, int]:
        if self.cache_hit:
            return {f"{self.key}|{self.model.replace('|', '_')}|cache_hits": 1}
        loop = self.code == LOOP_CODE
        spent = self.reasoning_tokens + self.answer_tokens
        values = {
            "requests": 1, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "reasoning_tokens": self.reasoning_tokens, "answer_tokens": self.answer_tokens,
            "cut_turns": int(self.cut), "crashed_turns": int(self.crashed),
            "crashed_tokens": spent if self.crashed else 0, "loop_cuts": int(loop),
            "loop_cut_tokens": spent if loop else 0,
            "tool_rounds": int(self.tool_round), f"code:{self.code}": 1,
        }
        prefix = f"{self.key}|{self.model.replace('|', '_')}|"
        return {prefix + name: value for name, value in values.items() if value > 0}


@dataclass(frozen=True)
class HourCounts:
    """One (hour, key, model) cell of a project's ledger."""

    start: int  # unix seconds, the hour's start (UTC)
    key: str
    model: str
    counts: dict[str, int]


class UsageLedger:
    def __init__(self, client: redis.Redis, keys: Keys, settings: UsageSettings,
                 on_count: Callable[[TurnUsage], None] | None = None) -> None:
        self._client, self._keys, self._settings = client, keys, settings
        self._script = Scripts(client, "fleet.core", ("usage",))["usage"]
        self.on_count = on_count  # once per turn this process counted (Prometheus)

    def add(self, turn: TurnUsage, pipe: Any) -> None:
        """Queue the turn's count on ``pipe``; give its reply to ``counted`` after execute."""
        ended = turn.ended_at or time.time()
        keys = [self._keys.usage_hour(turn.project, hour_of(ended)),
                self._keys.usage_turn(turn.project, turn.job_id, turn.fence, turn.turn),
                self._keys.usage_open(turn.project, turn.job_id)]
        args: list[Any] = [self._settings.retention_days * 86_400, self._settings.turn_marker_s,
                           turn.fence]
        for name, value in turn.fields().items():
            args += [name, value]
        self._script(keys=keys, args=args, client=pipe)

    def counted(self, turn: TurnUsage, reply: object) -> bool:
        """Whether ``reply`` (the script's) counted the turn now; fires ``on_count`` if so."""
        fresh = reply == 1
        if fresh and self.on_count is not None:
            self.on_count(turn)
        return fresh

    def count(self, turns: Iterable[TurnUsage]) -> int:
        """Count turns now, in one round trip; how many were new. A Redis error is logged and
        leaves them uncounted (module docstring)."""
        turns = list(turns)
        if not turns:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for turn in turns:
            self.add(turn, pipe)
        try:
            replies = pipe.execute()
        except redis.RedisError as exc:
            log.warning("usage of %d turns of project=%s not counted: %r", len(turns),
                        turns[0].project, exc)
            return 0
        return sum(self.counted(turn, reply) for turn, reply in zip(turns, replies, strict=True))

    def checkpoint(self, turn: TurnUsage, client: redis.Redis | None = None) -> None:
        """Record a streaming turn's progress so far (``turn``: what it would count now), for
        ``settle`` to count if its worker dies before the turn ends."""
        entry = {name: getattr(turn, name) for name in PROGRESS_FIELDS}
        (client or self._client).set(self._keys.usage_open(turn.project, turn.job_id),
                                     json.dumps(entry), ex=self._settings.turn_marker_s)

    def settle(self, project: str, job_id: str, fence: int) -> bool:
        """At the start of a job's turn under ``fence``: a progress entry of another fence is a
        turn whose worker died mid-stream; count it (``crashed``) from that entry, once."""
        key = self._keys.usage_open(project, job_id)
        raw = self._client.get(key)
        if raw is None:
            return False
        try:
            entry = json.loads(raw)
            if entry["fence"] == fence:
                return False  # this very grant's (a worker that died before it is ours cannot be)
            turn = TurnUsage(project=project, job_id=job_id, code=CRASHED_CODE, cut=True,
                             crashed=True, **{name: entry[name] for name in PROGRESS_FIELDS})
        except (ValueError, TypeError, KeyError):
            log.warning("usage: unreadable progress entry of job=%s/%s dropped", project, job_id)
            self._client.delete(key)
            return False
        return self.count([turn]) == 1

    def read(self, project: str, start: float, end: float) -> list[HourCounts]:
        """The project's cells of the hours overlapping [start, end), oldest first; the range is
        clipped to the retention (older hours are gone) and to the next hour (none is later)."""
        now = time.time()
        oldest, newest = now - self._settings.retention_days * 86_400, now + HOUR_S
        first, last = int(max(start, oldest)) // HOUR_S, int(min(end, newest) - 1) // HOUR_S
        hours = [hour_of(h * HOUR_S) for h in range(first, last + 1)]
        pipe = self._client.pipeline(transaction=False)
        for hour in hours:
            pipe.hgetall(self._keys.usage_hour(project, hour))
        cells: list[HourCounts] = []
        for hour, found in zip(hours, pipe.execute() if hours else [], strict=True):
            cells += _cells(hour_start(hour), found)
        return cells


def _cells(start: int, found: dict[bytes, bytes]) -> list[HourCounts]:
    by_pair: dict[tuple[str, str], dict[str, int]] = {}
    for raw_field, raw_value in found.items():
        key, _, rest = raw_field.decode().partition("|")
        model, _, metric = rest.partition("|")
        by_pair.setdefault((key, model), {})[metric] = int(raw_value)
    return [HourCounts(start, key, model, counts) for (key, model), counts in sorted(by_pair.items())]

