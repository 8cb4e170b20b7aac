"""After the broker came back: grants whose ``fleet.infer`` message it lost are given back at once,
not when their lease expires.

A dispatcher grants a lease and sends a ``fleet.infer`` message; a worker claims the lease when the
message reaches it. Redis with AOF ``everysec`` killed in between may keep the lease (the
dispatcher store) and lose the message: nobody would ever claim that lease, which then holds its
slot until it expires (``admission.lease_ttl_s``) and only then puts the job back in line.

``give_back_lost_grants`` runs when the prep watchdog sees the broker come back
(fleet/prep/recover.py ``BrokerReturns``): it takes the leases no worker has claimed that were
granted before that moment, and gives back (``requeue(unclaimed_only=True)``: the job keeps its
place, the next grant has a new fence) each one whose message is in no queue and no unacked entry,
read twice ``settle_s`` apart. A worker that did get the message keeps it: its claim makes the
lease claimed, which the give-back refuses in the same atomic step.

Failure cases: a message in flight between a worker's pop and kombu's unacked entry (a few
milliseconds) in both reads, or sent late by a slow dispatcher, makes a lease look lost: the
give-back frees it, the worker's claim then fails on its stale fence and it drops the message, and
the job is admitted again from its place: one more grant, nothing lost or doubled. A gateway
request's grant goes to its gateway's list, not the broker (fleet/worker/dispatch.py
``hand_to_gateway``): such leases are left to their expiry, which the gateway request's own
deadline bounds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from fleet.core.config import Settings
from fleet.core.seal import sealed_gateway
from schedulers.store.base import AdmissionStore

log = logging.getLogger(__name__)

SETTLE_S = 1.0  # between the two reads of the broker


def give_back_lost_grants(store: AdmissionStore, client: redis.Redis, settings: Settings,
                          in_broker: Callable[[], set[tuple[str, int]]], returned_at: float,
                          settle_s: float = SETTLE_S, sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """Give back the unclaimed leases granted before ``returned_at`` whose message is nowhere in
    the broker (module docstring); returns their job refs."""
    unclaimed = store.unclaimed_leases(admitted_before=returned_at)
    unclaimed = {ref: fence for ref, fence in unclaimed.items() if not _gateway_request(client, settings, ref)}
    if not unclaimed:
        return []
    missing = set(unclaimed.items()) - in_broker()
    if missing:
        sleep(settle_s)
        missing -= in_broker()
    lost = sorted(ref for ref, fence in missing if store.requeue(ref, fence, unclaimed_only=True))
    if lost:
        log.warning("the broker came back without the inference messages of %d granted jobs; "
                    "their leases are given back and they go again from their place: %s",
                    len(lost), ", ".join(lost[:20]))
    return lost


def _gateway_request(client: redis.Redis, settings: Settings, ref: str) -> bool:
    """A gateway request by its sealed record, as the dispatcher's ``send`` decides where its
    grant goes."""
    return sealed_gateway(client, settings, ref) is not None
