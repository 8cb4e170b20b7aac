"""What a client may hold open in one gateway process before it has shown any key.

Every connection is counted from the moment it is accepted (``ConnectionGuard``), per process
and per client address, and answered at once and closed when it is over either cap:

- over ``gateway.max_connections_per_address``: 429 ``E_BUSY`` with ``Retry-After: 1``;
- over ``gateway.max_connections`` (the whole process): 503 ``E_BUSY`` with ``Retry-After: 1``;
- request headers not complete ``gateway.header_timeout_s`` after the connection opened (or
  after the first byte of a later request on a kept-alive connection): 408 ``E_INPUT_INVALID``;
- the rest of a request body still arriving after the answer went out (a client that trickles
  the body of a refused request): closed after the same time, since nobody reads it.

Refusing is one short write and a close, so a flood costs the gateway no more than the accepts,
and the accept loop keeps draining the listen queue: a client over a cap gets an answer instead
of a hang. The process's open-file limit is raised at start to what the caps need
(``limits_for``); where the hard limit is lower the process cap is lowered to fit, with one
warning, so the accept loop never meets EMFILE. Should it still (the limit lowered from outside,
another part of the process holding files), asyncio's "out of system resource" report is counted
like the rest instead of logged with a traceback every second.

Nothing of this is logged per connection: each kind of closing is logged the first time, then as
one summary per ``gateway.connection_log_interval_s`` ("closed N connections ... in the last
60 s, most from <address> (M)"), and counted in ``fleet_gateway_connections_closed_total``.
The uvicorn protocol that applies all this is fleet/gateway/guarded.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections import Counter
from dataclasses import dataclass
from typing import Any

from fleet.core.codes import Code
from fleet.core.config import GatewaySettings
from fleet.gateway.metrics import GatewayMetrics
from fleet.gateway.wire import error_body

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1
# Files the process keeps beside its clients' connections: its Redis pools, log, epoll, the
# interpreter's own; the backend's connections (one per stream thread) and the I/O threads' are
# added from the settings (``limits_for``).
BASE_FILES = 64
ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's own message


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    max_per_address: int  # 0: no per-address cap
    header_timeout_s: float
    log_interval_s: float


def _answer(status: int, reason: str, code: Code, message: str, retry: bool) -> bytes:
    """A complete HTTP/1.1 answer that closes the connection, written before any request was read."""
    error = error_body(code, message, status=status)
    if status == 408:
        error["error"]["type"] = "TimeoutError"
    body = json.dumps(error).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close"]
    if retry:
        head.append(f"retry-after: {RETRY_AFTER_S}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _Tally:
    """One kind of closing, logged the first time and then at most once per interval."""

    def __init__(self, what: str, interval_s: float) -> None:
        self.what, self.interval_s = what, interval_s
        self.by_address: Counter[str] = Counter()
        self._timer: asyncio.TimerHandle | None = None

    def note(self, address: str) -> None:
        self.by_address[address] += 1
        if self._timer is None:
            self._flush()

    def _flush(self) -> None:
        if not self.by_address:
            self._timer = None  # a quiet interval: the next one is logged at once again
            return
        total = sum(self.by_address.values())
        top, most = self.by_address.most_common(1)[0]
        log.warning("closed %d connection%s %s in the last %g s, most from %s (%d)", total,
                    "" if total == 1 else "s", self.what, self.interval_s, top, most)
        self.by_address.clear()
        self._timer = asyncio.get_running_loop().call_later(self.interval_s, self._flush)


class ConnectionGuard:
    """The counts of one gateway process's open connections, and what it answers past its caps."""

    def __init__(self, limits: ConnectionLimits, metrics: GatewayMetrics | None = None) -> None:
        self.limits = limits
        self.metrics = metrics
        self.open = 0
        self.by_address: Counter[str] = Counter()
        interval = limits.log_interval_s
        self._tallies = {
            "address": _Tally(f"over gateway.max_connections_per_address ({limits.max_per_address})",
                              interval),
            "process": _Tally(f"over gateway.max_connections ({limits.max_connections})", interval),
            "header_timeout": _Tally(f"without complete request headers within "
                                     f"gateway.header_timeout_s ({limits.header_timeout_s:g} s)",
                                     interval),
            "body_timeout": _Tally(f"still sending an unread request body "
                                   f"{limits.header_timeout_s:g} s after the answer", interval),
            "accept_failed": _Tally("unaccepted: the process is out of file descriptors", interval),
        }
        limit = limits.max_per_address
        self.over_address = _answer(429, "Too Many Requests", Code.E_BUSY,
                                    f"this address holds {limit} open connections to the gateway "
                                    f"(gateway.max_connections_per_address); close some first", True)
        self.over_process = _answer(503, "Service Unavailable", Code.E_BUSY,
                                    f"the gateway holds its {limits.max_connections} open connections "
                                    f"(gateway.max_connections); try again shortly", True)
        self.header_timeout = _answer(408, "Request Timeout", Code.E_INPUT_INVALID,
                                      f"the request headers were not complete within "
                                      f"{limits.header_timeout_s:g} s (gateway.header_timeout_s)", False)

    def admit(self, address: str) -> bytes | None:
        """Count a new connection from ``address``; past a cap, the answer to close it with instead."""
        limits = self.limits
        if self.open >= limits.max_connections:
            self.closed("process", address)
            return self.over_process
        if limits.max_per_address and self.by_address[address] >= limits.max_per_address:
            self.closed("address", address)
            return self.over_address
        self.open += 1
        self.by_address[address] += 1
        self._gauge()
        return None

    def release(self, address: str) -> None:
        self.open -= 1
        self.by_address[address] -= 1
        if not self.by_address[address]:
            del self.by_address[address]
        self._gauge()

    def closed(self, reason: str, address: str) -> None:
        self._tallies[reason].note(address)
        if self.metrics is not None:
            self.metrics.connections_closed.labels(reason).inc()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.connections_open.set(self.open)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Count asyncio's "out of system resource" accept failures instead of logging each one
        with a traceback (asyncio retries the accept a second later by itself)."""
        def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if context.get("message") == ACCEPT_FAILED:
                self.closed("accept_failed", "unknown")
            else:
                loop.default_exception_handler(context)
        loop.set_exception_handler(handler)


def limits_for(gateway: GatewaySettings, reserve: int) -> ConnectionLimits:
    """The limits in force: the settings', with the process cap lowered where the open-file limit
    cannot hold it beside the listen backlog (accepted in one burst before any is counted) and
    ``reserve`` files of the process's own. The soft limit is first raised towards the need."""
    need = gateway.max_connections + gateway.listen_backlog + BASE_FILES + reserve
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    cap = gateway.max_connections
    if soft != resource.RLIM_INFINITY and soft < need:
        cap = max(1, soft - gateway.listen_backlog - BASE_FILES - reserve)
        log.warning("gateway.max_connections %d lowered to %d: the process may open %d files "
                    "(ulimit -n; hard limit %s) and keeps %d for its listen backlog and its own "
                    "connections", gateway.max_connections, cap, soft, hard,
                    need - gateway.max_connections)
    per_address = min(gateway.max_connections_per_address, cap)
    return ConnectionLimits(cap, per_address, gateway.header_timeout_s,
                            gateway.connection_log_interval_s)
