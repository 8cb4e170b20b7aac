"""Quotas per API key for the queue jobs the gateway submits for a key (``/v1/tasks``, a
``/v1/batches`` line; docs/usage.md, "Quotas per API key"). A gateway chat request reserves its
key's quota in the gateway (schedulers/store/keyquota.py); a job a key submitted reserves it
here, in the inference worker, at each turn's claim, before anything is sent to vLLM, with the
same atomic script (KEYQUOTA) on the same keys, so a key's chat requests, tasks and batch lines
share its windows and together never pass them.

Flow (fleet/worker/jobs/infer.py ``_run``): the job's record names a key under the workers' seal
(``tagged_key``; written with the record by the gateway, fleet/client.py ``submit``'s
``record``) whose project has ``key_quotas`` for it ->
  reserve the turn's worst case (its plan's prompt and output limit, the key's cost formula)
  under ``<ref>#<fence>`` ->
    reserved: the turn runs; each attempt's usage adds to what it spent, and the reservation is
              settled with that once the turn ends (SETTLE: the rest refunded, overage added)
    held, ``over = "wait"`` (the key's): the grant is given back at once (``readmit``, its
              place in line kept) not before the held window's end (plus up to a second, so a
              key's held jobs do not all come back at once); nothing was sent
    held, ``over = "refuse"``, a window that resets after the job's deadline, or a turn no
              window could ever hold: the job ends E_QUOTA_EXCEEDED naming the key's limit and
              when its window resets

Failure cases: a turn that raises is settled with what its attempts spent so far; a worker
dying or shut down mid-turn leaves its reservation standing (the window keeps the
worst case; the reaped turn reserves again under its new fence); a Redis error on reserving
goes up to the task like any Redis error at a turn's start (the job goes back in line); one on
settling is logged and leaves the worst case. Trust: the key label comes only from a sealed tag,
so a producer writing its own job hash can neither move its jobs onto one of its project's keys
(spending that key's quota) nor off the key they were submitted for.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis

from fleet.core.codes import Code
from fleet.core.keys import split_ref
from fleet.core.models import Envelope
from fleet.core.seal import tagged_key
from fleet.core.usage import TurnUsage
from fleet.infer.budget import Plan
from schedulers.policy.quota import Quota
from schedulers.store.base import quota_of
from schedulers.store.keyquota import KeyQuotas

if TYPE_CHECKING:
    from fleet.worker.runtime import Runtime

log = logging.getLogger(__name__)


class KeyQuotaHeld(Exception):
    """The turn waits for its key's window: give the grant back, not before ``not_before``."""

    def __init__(self, not_before: float, why: str) -> None:
        super().__init__(why)
        self.not_before = not_before
        self.max_tokens, self.turn = 0, 0  # the held turn's: its admission size and number


@dataclass
class KeyTicket:
    """A turn's reservation against its key's quota, and what its attempts spent."""

    quota: Quota
    project: str
    ref: str  # the reservation's name: <job ref>#<fence>
    prompt_tokens: int  # the plan's: an attempt cut before its first token still counts it
    spent: list[int] = field(default_factory=list)

    def add(self, usage: TurnUsage) -> None:
        self.spent.append(self.quota.spent(max(usage.prompt_tokens, self.prompt_tokens), usage.cached_tokens,
                                           usage.reasoning_tokens + usage.answer_tokens))


def reserve(rt: Runtime, ref: str, fence: int, record: dict[str, str], plan: Plan,
            deadline: float | None = None) -> KeyTicket | Envelope | None:
    """The turn's reservation (None: no key quota binds the job), or the E_QUOTA_EXCEEDED envelope
    the job ends with; KeyQuotaHeld when it waits (module docstring)."""
    project, job_id = split_ref(ref)
    label = tagged_key(rt.settings, ref, record)
    limits = None if label is None else rt.settings.projects[project].key_quotas.get(label)
    if label is None or limits is None:
        return None
    quota = quota_of(limits)
    cost = quota.reserve(plan.prompt_tokens, plan.max_tokens)
    if quota.never_fits(cost):
        return Envelope.failure(job_id, project, Code.E_QUOTA_EXCEEDED,
                                f"quota of API key {label}: this turn may cost {cost:,} (prompt and output "
                                f"limit), more than the key's smallest token quota ({quota.smallest_tokens:,})")
    ticket = KeyTicket(quota, project, f"{ref}#{fence}", plan.prompt_tokens)
    now = time.time()
    held = KeyQuotas(rt.redis, rt.keys).reserve(project, label, quota, ticket.ref, plan.prompt_tokens,
                                                plan.max_tokens, now)
    if held is None:
        return ticket
    name, limit, retry_s = held
    why = f"quota of API key {label}: {name} {limit:,} reached; its window resets in {math.ceil(retry_s)} s"
    # spread over a second: the key's held jobs do not all come back at the same instant (each
    # would take a grant only to be held again)
    resets = now + retry_s + 0.05
    if limits.over == "wait" and (deadline is None or resets < deadline):
        spread = random.random() if deadline is None else min(random.random(), max(0.0, deadline - resets) / 2)
        raise KeyQuotaHeld(resets + spread, why)
    if limits.over == "wait":
        why += ", after the job's deadline"
    return Envelope.failure(job_id, project, Code.E_QUOTA_EXCEEDED, why)


def settle(rt: Runtime, ticket: KeyTicket | None) -> None:
    """The turn's reservation meets what its attempts spent (0 when none ran)."""
    if ticket is None:
        return
    try:
        KeyQuotas(rt.redis, rt.keys).settle(ticket.project, ticket.ref, sum(ticket.spent))
    except redis.RedisError as exc:
        log.warning("key quota: the reservation of %s not settled (%r); it stands", ticket.ref, exc)
