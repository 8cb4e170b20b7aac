"""The dispatcher store: where pending jobs wait and every admission is decided atomically.

- ``base``: the interface (``AdmissionStore``) and its value types;
- ``memory_store``: the in-memory twin, calling the pure policy directly (tests, simulations);
- ``redis_store``: the fleet's store, the same rules in Lua scripts (``lua/``).
- ``records``: the Redis store's packed item and lease records, read by name.

``make_store`` is all a producer needs: it imports redis and the store, nothing of the dispatcher's
loop, metrics or CLI.
"""

from __future__ import annotations

import redis

from fleet.core.config import Settings
from fleet.core.keys import Keys
from schedulers.store.base import StoreConfig
from schedulers.store.redis_store import RedisStore


def make_store(settings: Settings, client: redis.Redis) -> RedisStore:
    """The fleet's Redis store; its waits stay under ``client``'s socket timeout (see there)."""
    return RedisStore(client, Keys(settings.key_prefix), StoreConfig.from_settings(settings))
