"""kombu's Redis transport, with the one failure that made a worker exit on a Redis restart removed.

What happens in kombu 5.x when the broker goes away under a running worker: the consumer sees a
ConnectionError and closes its connection to start again; closing a channel gives its unacked
messages back (``QoS.restore_unacked_once`` -> ``restore_unacked``), which needs a Redis client.
By then the connection's transport has been detached (``transport.client`` is None), so building
that client raises ``AttributeError: 'NoneType' object has no attribute 'hostname'`` from
``Channel._connparams`` - not a connection error, so Celery calls it unrecoverable and the worker
exits for good. With the broker down, a working client would fail the same way anyway.

The same detached transport breaks the acknowledgement of a task that finishes after the
reconnect, on the channel it came from (``QoS.ack`` -> ``pipe_or_acquire``: ``AttributeError:
'NoneType' object has no attribute 'client'``), again fatal. A ConnectionError there is only
logged by kombu (CRITICAL, with a traceback).

``QoS.restore_unacked``, ``ack`` and ``reject`` here let those calls fail with one WARNING
instead, which names the cause in words (``lost_cause``: "its connection was already detached"
for kombu's AttributeError, the error's type for a connection error), never the raw
AttributeError text, which reads like a bug of the fleet. Nothing is lost: the
messages stay in kombu's unacked hash in Redis (``append`` wrote them there on delivery), and the
tags a lost channel could not give back are remembered: the next channel (the reconnect) moves
them back to their queues (``Channel._restore_lost``), instead of leaving them to the broker's
visibility timeout (hours) - a prep message a worker had reserved but not started would otherwise
wait for the prep watchdog's ``prep_unclaimed_s``. A copy of a task still running (or one whose
job already went on: an inference job's lease expired and it was admitted again) is dropped by
its prep claim or its fence.

Used for ``redis://``, ``rediss://`` and ``sentinel://`` broker URLs (``broker_transport``,
fleet/worker/app.py).
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)

RESTORE_ERRORS = (AttributeError, *kombu_redis.get_redis_error_classes()[0],
                  *kombu_redis.get_redis_error_classes()[1])


# Delivery tags whose messages a lost channel could not give back (restore_unacked failed).
_UNRESTORED: set[str] = set()


class QoS(kombu_redis.QoS):
    def ack(self, delivery_tag: Any) -> None:
        try:
            super().ack(delivery_tag)
        except RESTORE_ERRORS as exc:
            _unacked("acknowledged", exc)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        try:
            super().reject(delivery_tag, requeue=requeue)
        except RESTORE_ERRORS as exc:
            _unacked("rejected", exc)

    def restore_unacked(self, client: Any = None) -> None:
        try:
            super().restore_unacked(client)
        except RESTORE_ERRORS as exc:
            delivered: Any = self._delivered
            log.warning("broker lost: %d unacknowledged messages stay in the broker's unacked set "
                        "(%s); given back once the broker answers again", len(delivered), lost_cause(exc))
            _UNRESTORED.update(delivered)
            delivered.clear()


def lost_cause(exc: BaseException) -> str:
    """Why a channel could not reach the broker, in words (module docstring)."""
    if isinstance(exc, AttributeError):
        return "its connection was already detached by the reconnect"
    return type(exc).__name__


def _unacked(what: str, exc: BaseException) -> None:
    log.warning("broker lost: a finished task's message could not be %s (%s); it stays in the "
                "broker's unacked set and a late redelivery is dropped as a duplicate", what,
                lost_cause(exc))


class Channel(kombu_redis.Channel):
    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._restore_lost()

    def _restore_lost(self) -> None:
        """Give back the messages a lost channel could not (module docstring): the new channel of
        a reconnect moves them from the unacked set to their queues; a tag already gone is a
        no-op. A copy of a task that is still running is dropped by its claim or fence."""
        tags = list(_UNRESTORED)
        if not tags:
            return
        try:
            with self.conn_or_acquire() as client:
                for tag in tags:
                    self.qos.restore_by_tag(tag, client=client)
                    _UNRESTORED.discard(tag)
        except RESTORE_ERRORS as exc:
            log.warning("giving back messages of a lost channel failed (%s); the next channel tries "
                        "again", lost_cause(exc))
            return
        log.info("gave back %d messages a lost broker connection held", len(tags))


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """The same, for ``sentinel://`` broker URLs: a failover is a broker loss too."""


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


TRANSPORT = f"{__name__}:Transport"
SENTINEL_TRANSPORT = f"{__name__}:SentinelTransport"
