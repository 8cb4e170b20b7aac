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

The queue a message was taken from is stamped into it on delivery, as
``delivery_info['fleet_queue']`` (``Channel.basic_consume``): the list BRPOP popped it from,
overwriting whatever the sender wrote there. Everything else in a message (its routing key and
the rest of ``delivery_info``) is written by its sender, and a producer may push raw messages
onto its own project queue; the tasks check the stamp (fleet/worker/tasks.py, ``arrived_on`` in
fleet/worker/queues.py).
The exchange and routing key are overwritten with the queue's own too: kombu keeps them
with the message in its unacked hash, and a lost channel (or the visibility timeout) gives the
message back by them, so it goes back to the list it was popped from (not to a queue its sender
named) and is stamped again when it is popped from there.

Binding sets are never read (``Channel._lookup``): kombu routes a published or given-back
message through the set ``_kombu.binding.<exchange>``, and a project's producer may write the
sets of its own queues' exchanges (it declares its queues when it sends). Every fleet queue has
an exchange of its own named like it (fleet/worker/app.py), so a message for exchange X with
routing key X goes to the list X and nowhere else, whatever members that set holds. Before, a
producer that added members naming ``fleet.infer`` and another project's queue to its own set
had each of its messages a worker gave back copied onto those queues (and a prep message the
dispatcher's watchdog resent as well).

Used for ``redis://``, ``rediss://`` and ``sentinel://`` broker URLs (``broker_transport``,
fleet/worker/app.py), and registered as kombu's transport for those schemes in every process
that imports this module (``TRANSPORT_ALIASES``): on a broker loss kombu's failover switches the
connection to the next URL of the broker list and takes the transport named by that URL's
scheme, which would otherwise be kombu's own - without the stamp (every task then refused) and
without the fixes above.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)

RESTORE_ERRORS = (AttributeError, *kombu_redis.get_redis_error_classes()[0],
                  *kombu_redis.get_redis_error_classes()[1])


# The key of a message's delivery_info the transport writes on delivery (module docstring).
QUEUE_STAMP = "fleet_queue"

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

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        """kombu's, with each message stamped with ``queue`` (the list it was popped from) before
        kombu makes it a Message and keeps it in its unacked hash (module docstring)."""
        consumer_tag = super().basic_consume(queue, *args, **kwargs)
        deliver = self.connection._callbacks[queue]

        def stamped(raw_message: Any) -> Any:
            stamp_queue(raw_message, queue)
            return deliver(raw_message)

        self.connection._callbacks[queue] = stamped
        return consumer_tag

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        """The list a message for ``exchange`` goes to: a fleet queue's exchange routes to that
        queue only, never through its binding set (module docstring); any other exchange (Celery's
        own: the control reply exchange, events) as kombu routes it."""
        if exchange and exchange == routing_key:
            return [exchange]
        return list(super()._lookup(exchange, routing_key, default))

    def _get(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        """kombu's (``basic_get``), stamped like a consumed message (module docstring)."""
        message = super()._get(queue, *args, **kwargs)
        stamp_queue(message, queue)
        return message

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


def stamp_queue(raw_message: Any, queue: str) -> None:
    """Write ``queue`` into the message's delivery_info, over anything the sender put there, and
    make its exchange and routing key the queue's own (the way back after a lost channel). A
    message without a properties mapping is left as it is: kombu cannot make a Message of it."""
    properties = raw_message.get("properties") if isinstance(raw_message, dict) else None
    if not isinstance(properties, dict):
        return
    info = properties.get("delivery_info")
    if not isinstance(info, dict):
        info = properties["delivery_info"] = {}
    # Each fleet queue has an exchange of its own, bound by its name (fleet/worker/app.py): the
    # unacked hash keeps these two, and a lost channel gives the message back by them.
    info.update({QUEUE_STAMP: queue, "exchange": queue, "routing_key": queue})


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """The same, for ``sentinel://`` broker URLs: a failover is a broker loss too."""


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


TRANSPORT = f"{__name__}:Transport"
SENTINEL_TRANSPORT = f"{__name__}:SentinelTransport"

# kombu resolves a scheme when a connection first uses it (then keeps the class): the modules that
# make connections import this one first (module docstring).
TRANSPORT_ALIASES.update({"redis": TRANSPORT, "rediss": TRANSPORT, "sentinel": SENTINEL_TRANSPORT})
