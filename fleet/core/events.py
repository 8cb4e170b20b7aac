"""Per-job live events: a Redis Stream ``{p}events:{<id>}`` that ``fleet tail`` and
``Client.result`` read with blocking XREAD (nobody sleep-polls).

Event types: ``queued``, ``rejected``, ``prepared``, ``admitted``, ``attempt``, ``reasoning``,
``content``, ``retry``, ``final``. Each entry has the fields ``type``, ``ts`` and ``data`` (JSON).
Reasoning and content deltas are coalesced by the caller (a few per second), so a job streaming
30,000 tokens writes hundreds of entries, not tens of thousands; the stream is also capped.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis

from fleet.core.keys import Keys
from fleet.core.outagelog import BROKER_LOST, OutageLog

EVENTS_MAXLEN = 5000
log = logging.getLogger(__name__)
_OUTAGE = OutageLog(log, "live events", "live events dropped")


class EventSink:
    """Appends events for one job; every stream gets a TTL so nothing lingers."""

    def __init__(self, client: redis.Redis, keys: Keys, ref: str, ttl_s: int) -> None:
        self._client: Any = client
        self._key = keys.events(ref)
        self._ttl_s = ttl_s
        self.dropped = 0

    def emit(self, kind: str, **data: Any) -> None:
        """Best effort: live events are for watching, so a Redis error here is logged and
        dropped rather than allowed to end a healthy stream (results never go through here). A
        broker outage is logged once when it starts and once when it ends, with the count of
        events dropped meanwhile (fleet/core/outagelog.py), not once per event."""
        fields = {"type": kind, "ts": f"{time.time():.6f}", "data": json.dumps(data, default=str)}
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.xadd(self._key, fields, maxlen=EVENTS_MAXLEN, approximate=True)
            pipe.expire(self._key, self._ttl_s)
            pipe.execute()
        except BROKER_LOST as exc:  # an outage: one line when it starts, one when it ends
            self.dropped += 1
            _OUTAGE.failed(exc)
        except redis.RedisError as exc:
            self.dropped += 1
            log.warning("event %s for %s dropped: %s", kind, self._key, exc)
        else:
            _OUTAGE.answered()


def decode_event(entry_id: bytes | str, fields: dict[Any, Any]) -> dict[str, Any]:
    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    plain = {text(k): text(v) for k, v in fields.items()}
    return {
        "id": text(entry_id),
        "type": plain.get("type", ""),
        "ts": float(plain.get("ts", 0) or 0),
        "data": json.loads(plain.get("data", "{}")),
    }
