"""Running the gateway: ``fleet gateway`` builds the ``Gateway`` from the settings in force, serves
it with uvicorn, and turns SIGHUP into a reload of the API keys and project defaults (SIGINT and
SIGTERM stop uvicorn gracefully: open streams end, their leases are released).

uvicorn serves through fleet/gateway/guarded.py's protocol, under the connection limits of
fleet/gateway/connections.py (a header timeout, caps per process and per client address); the
process's open-file limit is raised at start to what those caps need, or the process cap is
lowered with a warning where it cannot be. uvicorn's own ``limit_concurrency`` stays off: it
refuses only once a complete request arrived, and logs a line for each.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from pathlib import Path

import uvicorn

from fleet.core.config import Settings, config_path, load_settings
from fleet.gateway.app import IO_THREADS, Gateway, create_app
from fleet.gateway.auth import LiveSettings
from fleet.gateway.connections import ConnectionGuard, limits_for
from fleet.gateway.guarded import guarded_protocol

log = logging.getLogger(__name__)


class _GuardedServer(uvicorn.Server):
    """uvicorn's server with the guard's accept-failure counting on its event loop."""

    def __init__(self, config: uvicorn.Config, guard: ConnectionGuard) -> None:
        super().__init__(config)
        self.guard = guard

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.guard.install(asyncio.get_running_loop())
        await super().startup(sockets)


def own_files(settings: Settings) -> int:
    """Files the process holds beside its clients': a connection per I/O and batch thread and per
    stream thread (fleet/gateway/app.py)."""
    return IO_THREADS + settings.gateway.batch_threads + 2 * settings.backend.max_num_seqs


def serve_gateway(settings: Settings, host: str | None = None, port: int | None = None,
                  path: Path | None = None) -> None:
    path = path if path is not None else config_path()
    live = LiveSettings(settings, path, load_settings)
    signal.signal(signal.SIGHUP, lambda *_: live.request_reload())
    gateway = Gateway(live)
    host = host or settings.gateway.host
    port = port if port is not None else settings.gateway.port
    limits = limits_for(settings.gateway, own_files(settings))
    guard = ConnectionGuard(limits, gateway.metrics)
    log.info("gateway on http://%s:%d, backend %s, %d API keys, at most %d connections (%s per "
             "address)", host, port, settings.backend.url, len(live.keys), limits.max_connections,
             limits.max_per_address or "no cap")
    config = uvicorn.Config(create_app(gateway), host=host, port=port, access_log=False,
                            log_level="warning", timeout_graceful_shutdown=5,
                            http=guarded_protocol(guard), backlog=settings.gateway.listen_backlog,
                            timeout_keep_alive=settings.gateway.idle_timeout_s)
    _GuardedServer(config, guard).run()
