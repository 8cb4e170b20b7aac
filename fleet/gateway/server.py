"""Running the gateway: ``fleet gateway`` builds the ``Gateway`` from the settings in force, serves
it with uvicorn, and turns SIGHUP into a reload of the API keys and project defaults (SIGINT and
SIGTERM stop uvicorn gracefully: open streams end, their leases are released)."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import uvicorn

from fleet.core.config import Settings, config_path, load_settings
from fleet.gateway.app import Gateway, create_app
from fleet.gateway.auth import LiveSettings

log = logging.getLogger(__name__)


def serve_gateway(settings: Settings, host: str | None = None, port: int | None = None,
                  path: Path | None = None) -> None:
    path = path if path is not None else config_path()
    live = LiveSettings(settings, path, load_settings)
    signal.signal(signal.SIGHUP, lambda *_: live.request_reload())
    gateway = Gateway(live)
    host = host or settings.gateway.host
    port = port if port is not None else settings.gateway.port
    log.info("gateway on http://%s:%d, backend %s, %d API keys", host, port, settings.backend.url,
             len(live.keys))
    config = uvicorn.Config(create_app(gateway), host=host, port=port, access_log=False,
                            log_level="warning", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()
