"""The persistence contract: what a Redis restart or memory pressure can cost, checked at start.

Everything the fleet knows lives in Redis: Celery's queues, job records, the dispatcher store,
results. Two settings of the broker's Redis decide what survives (docs/operations.md has the
measured loss per configuration):

- ``appendonly``: without the append-only file a restart keeps only the last RDB snapshot (if
  any), so queued jobs and results since then vanish without an envelope. With ``appendonly yes``
  and ``appendfsync everysec`` a ``kill -9`` of Redis loses nothing acknowledged (the file is
  written before the reply; the kernel keeps it), a crash of the machine up to the last second;
- ``maxmemory-policy``: anything but ``noeviction`` lets Redis delete keys under memory pressure -
  a job record, a lease or a queued message gone without a trace. With ``noeviction`` a full Redis
  refuses writes instead, which the fleet reports and retries.

``check_broker`` (workers and dispatchers call it before taking work, ``fleet worker`` /
``fleet dispatcher``) reads both through INFO (allowed to the fleet's service ACL users) and,
when either is unsafe, logs a WARNING (``[redis] on_unsafe = "warn"``) or raises BrokerUnsafe
(``"refuse"``). A broker the parent process started itself (``fleet up``, ``fleet demo``, tests:
fleet/core/exposure.py) is throwaway by design and exempt.
"""

from __future__ import annotations

import logging
from typing import Any

from fleet.core.config import Settings
from fleet.core.errors import BrokerUnsafe
from fleet.core.redisconn import mask_url

log = logging.getLogger(__name__)


def unsafe_settings(client: Any) -> dict[str, str]:
    """{setting: its value} for each of the two settings that is unsafe (``appendonly``,
    ``maxmemory-policy``); {} when Redis keeps an append-only file and never evicts. Read through
    INFO, so ``fleet_broker_unsafe`` (schedulers/metrics.py) sees what ``check_broker`` sees."""
    unsafe = {}
    if not int(client.info("persistence").get("aof_enabled", 0)):
        unsafe["appendonly"] = "no"
    policy = str(client.info("memory").get("maxmemory_policy", "noeviction"))
    if policy != "noeviction":
        unsafe["maxmemory-policy"] = policy
    return unsafe


def broker_risks(client: Any) -> list[str]:
    """What this Redis may lose, in words; [] when it keeps an append-only file and never evicts."""
    risks = []
    unsafe = unsafe_settings(client)
    if "appendonly" in unsafe:
        risks.append("appendonly is off (a restart loses queued jobs and results)")
    if "maxmemory-policy" in unsafe:
        policy = unsafe["maxmemory-policy"]
        risks.append(f"maxmemory-policy is {policy} (keys are evicted: jobs vanish silently); "
                     "set noeviction")
    return risks


def check_broker(settings: Settings, client: Any, *, role: str, local_broker: bool) -> list[str]:
    """Warn about or refuse an unsafe broker (module docstring); returns the risks found."""
    risks = broker_risks(client)
    if not risks or local_broker:
        return risks
    text = (f"the broker at {mask_url(settings.broker_url)}: {'; '.join(risks)} "
            "(docs/operations.md)")
    if settings.redis.on_unsafe == "refuse":
        raise BrokerUnsafe(f"{role} refuses to start: {text}")
    log.warning("%s: %s", role, text)
    return risks
