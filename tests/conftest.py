"""Fixtures shared by every test folder (the helpers are in tests/support).

Redis: the test Redis of tests/support/testenv.py (``FLEET_TEST_REDIS_URL``, or a private
redis-server for the session). Every test gets its own key prefix and deletes only the keys under
that prefix when it ends; nothing it did not create is ever flushed."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest
import redis

from fleet.core.keys import Keys
from fleet.prep.tokens import TokenCounter
from tests.support.testenv import TEST_REDIS_URL, delete_prefix

if TYPE_CHECKING:
    from tests.support.fleet_harness import RestartableRedis

pytest_plugins = ["tests.support.worker_runtime"]


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
    """A TokenCounter whose backend is a MockTransport /tokenize (tests/support/tokenize_stub.py)."""
    from tests.support.tokenize_stub import fake_tokenize

    with TokenCounter("http://backend", "local", redis_client, Keys(key_prefix),
                      transport=httpx.MockTransport(fake_tokenize)) as made:
        yield made


@pytest.fixture
def broker() -> Iterator[RestartableRedis]:
    """A private redis-server with an append-only file that a test may stop, kill and start again
    on the same port (tests/support/fleet_harness.py); a module may define its own ``broker``."""
    from tests.support.fleet_harness import RestartableRedis as Server  # the harness loads the fleet

    server = Server()
    yield server
    server.close()
