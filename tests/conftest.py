"""Shared fixtures.

Redis: ``FLEET_TEST_REDIS_URL`` points the suite at a Redis of your choosing (a database you can
spare; the suite touches only keys under its own random prefixes and deletes them). Without it, the
suite starts its own private redis-server on a free loopback port for the session and stops it at
the end, so it never writes into whatever happens to answer on the default port.

Every test gets its own key prefix and deletes only the keys under that prefix when it ends;
nothing it did not create is ever flushed."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest
import redis

from fleet.core.keys import Keys
from fleet.local.embedded import start_redis
from fleet.prep.tokens import TokenCounter

if TYPE_CHECKING:
    from tests.fleet_harness import RestartableRedis


def _test_redis_url() -> str:
    configured = os.environ.get("FLEET_TEST_REDIS_URL")
    if configured:
        return configured
    return start_redis().url  # stopped (and its folder removed) when the session exits


TEST_REDIS_URL = _test_redis_url()
SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared"))


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


@pytest.fixture
def redis_url() -> str:
    return TEST_REDIS_URL


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"t-{uuid.uuid4().hex[:10]}:"
    yield prefix
    delete_prefix(redis.Redis.from_url(redis_url), prefix)


@pytest.fixture
def redis_client(redis_url: str, key_prefix: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def counter(redis_client: redis.Redis, key_prefix: str) -> Iterator[TokenCounter]:
    """A TokenCounter whose backend is a MockTransport /tokenize (tests/test_tokens.py)."""
    from tests.test_tokens import fake_tokenize

    with TokenCounter("http://backend", "local", redis_client, Keys(key_prefix),
                      transport=httpx.MockTransport(fake_tokenize)) as made:
        yield made


@pytest.fixture
def broker() -> Iterator[RestartableRedis]:
    """A private redis-server with an append-only file that a test may stop, kill and start again
    on the same port (tests/fleet_harness.py); a module may define its own ``broker``."""
    from tests.fleet_harness import RestartableRedis as Server  # the harness loads the fleet

    server = Server()
    yield server
    server.close()
