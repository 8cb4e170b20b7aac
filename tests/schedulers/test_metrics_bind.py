"""Where the dispatchers' and workers' /metrics listen: loopback unless ``metrics_host`` says
otherwise (their figures name every project and need no key)."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, Counter

from fleet.core.config import load_settings
from fleet.local.embedded import free_port
from schedulers.metrics import serve_registry


def test_metrics_listen_on_loopback_by_default_and_on_metrics_host_when_set() -> None:
    registry = CollectorRegistry()
    Counter("fleet_probe", "a figure", ["project"], registry=registry).labels("alpha").inc()
    for host, expected in ((load_settings(env={}).metrics_host, "127.0.0.1"),
                           (load_settings(env={"FLEET_METRICS_HOST": "0.0.0.0"}).metrics_host, "0.0.0.0")):
        port = free_port()
        server = serve_registry(registry, port, "dispatcher", host)
        assert server is not None
        try:
            assert server.server_address[0] == expected
            assert 'project="alpha"' in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        finally:
            server.shutdown()
            server.server_close()
