"""uvicorn's h11 protocol under the gateway's connection limits (fleet/gateway/connections.py).

uvicorn bounds none of this itself: its h11 and httptools protocols arm a timer only once a
response went out (``timeout_keep_alive``, the idle time between requests), and every byte that
arrives cancels it, so a connection that never finishes its headers, or trickles a body nobody
reads, is held for as long as its client likes; ``limit_concurrency`` answers 503 only once a
complete request arrived, and logs a line for each. This subclass counts the connection when it
is made (refusing it there, past a cap, before reading anything) and keeps a request timer:

- armed when the connection opens, and again when the first bytes of a later request arrive on
  a kept-alive connection; cancelled once the request's headers are complete (the route reads
  the body, and checks the key before it does);
- armed also when a response went out while the request's body is still arriving: the rest of
  it is read by nobody, and uvicorn's keep-alive timer restarts with each byte;
- when it fires, a connection still waiting for headers is answered 408 and closed, one still
  sending an unread body just closed.

The h11 protocol is used whatever else is installed (uvicorn's "auto" picks httptools when it
is): the timer reads h11's connection state.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from fleet.gateway.connections import ConnectionGuard


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, bound to ``guard``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})


class GuardedH11Protocol(H11Protocol):
    guard: ConnectionGuard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._address = ""
        self._counted = False
        self._request_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        self._address = str(peer[0]) if isinstance(peer, tuple) else "local"
        refusal = self.guard.admit(self._address)
        if refusal is not None:
            # Never handed to uvicorn: one write and a close, nothing read or parsed.
            self.transport = transport
            transport.write(refusal)
            transport.close()
            return
        self._counted = True
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._counted:
            return
        self._counted = False
        self._disarm()
        self.guard.release(self._address)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return
        super().data_received(data)
        if self._waiting_for_client():
            if self._request_timer is None:
                self._arm()
        else:
            self._disarm()

    def _waiting_for_client(self) -> bool:
        """Headers not complete yet, or a body still coming after its answer went out."""
        conn = self.conn
        if conn.their_state is h11.IDLE and conn.our_state is h11.IDLE:
            return True
        return conn.their_state is h11.SEND_BODY and conn.our_state in (h11.DONE, h11.MUST_CLOSE)

    def _arm(self) -> None:
        self._disarm()
        self._request_timer = self.loop.call_later(self.guard.limits.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _expired(self) -> None:
        self._request_timer = None
        if self.transport.is_closing() or not self._waiting_for_client():
            return
        if self.conn.our_state is h11.IDLE:
            self.guard.closed("header_timeout", self._address)
            self.transport.write(self.guard.header_timeout)
        else:
            self.guard.closed("body_timeout", self._address)
        self.transport.close()
