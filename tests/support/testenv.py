"""The test Redis and the corpora.

``FLEET_TEST_REDIS_URL`` points the suite at a Redis of your choosing (a database you can spare;
the suite touches only keys under its own random prefixes and deletes them). Without it, the suite
starts its own private redis-server on a free loopback port for the session and stops it at the
end, so it never writes into whatever happens to answer on the default port."""

from __future__ import annotations

import os

import pytest
import redis

from fleet.local.embedded import start_redis


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
