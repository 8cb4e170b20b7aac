"""The test Redis and the corpora.

``FLEET_TEST_REDIS_URL`` points the suite at a Redis of your choosing (a database you can spare;
the suite touches only keys under its own random prefixes and deletes them). Without it, the suite
starts its own private redis-server on a free loopback port for the session and stops it at the
end, so it never writes into whatever happens to answer on the default port.

Under pytest-xdist (``PYTEST_XDIST_WORKER`` set: ``gw0``, ``gw1``, ...) each worker is a session of
its own (its own private redis-server, its own ``tmp_path`` folders), and the ports the test
process picks (``free_port``: redis-servers, the simulator, gateways, metrics) come from a block
of loopback ports of that worker's own, below the kernel's ephemeral range, so two workers never
pick the same one and neither picks a port the kernel hands out for ``bind(0)`` or a connection."""

from __future__ import annotations

import itertools
import os
import socket
import sys

import pytest
import redis

import fleet.local.embedded as embedded
from fleet.local.embedded import start_redis

XDIST_PORTS_FROM = 20_000  # up to the ephemeral range's usual start (32768): 12,000 ports
XDIST_PORTS_PER_WORKER = 1_500


def _worker_ports(worker: str) -> itertools.cycle[int]:
    number = int(worker.removeprefix("gw"))
    first = XDIST_PORTS_FROM + number * XDIST_PORTS_PER_WORKER
    if first + XDIST_PORTS_PER_WORKER > 32_768:
        raise RuntimeError(f"no block of test ports for xdist worker {worker}")
    return itertools.cycle(range(first, first + XDIST_PORTS_PER_WORKER))


def _use_worker_ports(worker: str) -> None:
    """``free_port`` of this process (in fleet.local.embedded and wherever it was imported by
    name) takes the next port of the worker's block that nothing listens on or is bound to."""
    ports, original = _worker_ports(worker), embedded.free_port

    def free_port() -> int:
        for _ in range(XDIST_PORTS_PER_WORKER):
            port = next(ports)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
        raise RuntimeError(f"no free port left in the block of xdist worker {worker}")

    for module in list(sys.modules.values()):
        if getattr(module, "free_port", None) is original:
            module.free_port = free_port  # type: ignore[attr-defined]


if os.environ.get("PYTEST_XDIST_WORKER"):
    _use_worker_ports(os.environ["PYTEST_XDIST_WORKER"])


def _test_redis_url() -> str:
    configured = os.environ.get("FLEET_TEST_REDIS_URL")
    if configured:
        return configured
    return start_redis().url  # stopped (and its folder removed) when the session exits


TEST_REDIS_URL = _test_redis_url()
SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared"))


def corpus_file(*parts: str) -> str | None:
    """A file of the corpora kept beside the repository (``../shared/corpora``), or None when absent.

    Developers may not have the corpora, so their tests skip; CI always has them, so there (``CI``
    set) a missing corpus fails the test instead of skipping it silently."""
    path = os.path.join(SHARED, "corpora", *parts)
    if os.path.exists(path):
        return path
    if os.environ.get("CI"):
        pytest.fail(f"corpus absent in CI: {path}")
    return None


def delete_prefix(client: redis.Redis, prefix: str) -> None:
    batch = []
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            client.delete(*batch)
            batch.clear()
    if batch:
        client.delete(*batch)
