"""Shared fixtures. Every test gets its own key prefix on Redis database 15, and deletes only
the keys under that prefix when it ends; nothing it did not create is ever flushed."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis

from fleet.keys import Keys
from fleet.tokens import TokenCounter

TEST_REDIS_URL = os.environ.get("FLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared"))


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
