"""Every Redis client of the fleet's own code is made here (``redis_client``), so how the fleet
reaches its broker - a URL today, Sentinel or a cluster later - changes in one place. Celery's own
connection (kombu) is configured in fleet/worker/app.py from the same ``broker_url``.

``broker_unavailable`` turns a connection failure into ``BrokerUnavailable``
(E_BROKER_UNAVAILABLE) with one line naming the broker (password masked), which is what producers
and every CLI command show instead of a traceback.
"""

from __future__ import annotations

from typing import Any

import redis

from fleet.core.config import mask_url
from fleet.core.errors import BrokerUnavailable

UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)


def redis_client(url: str, **options: Any) -> redis.Redis:
    """A client for ``url`` (redis-py options as given: timeouts, retry, keepalive...)."""
    return redis.Redis.from_url(url, **options)


def broker_unavailable(url: str, exc: BaseException) -> BrokerUnavailable:
    return BrokerUnavailable(f"the broker at {mask_url(url)} does not answer ({type(exc).__name__}); "
                             "is Redis running, and is broker_url (FLEET_BROKER_URL) right?")
