"""fleet/prep/tokens.py: exact counts from /tokenize, the Redis cache by content hash, the estimate
and the short circuit when the backend is down (a real refused socket), Redis being down."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fleet.core.keys import Keys
from fleet.prep.tokens import TokenCounter, estimate_text
from tests.support.tokenize_stub import fake_tokenize


class Calls:
    def __init__(self, handler) -> None:
        self.handler = handler
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        return self.handler(request)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_exact_count_is_cached_by_content_hash(redis_client: redis.Redis, key_prefix: str) -> None:
    calls = Calls(fake_tokenize)
    keys = Keys(key_prefix)
    counter = TokenCounter(
        "http://backend", "local", redis_client, keys, transport=httpx.MockTransport(calls)
    )
    assert counter.count_text("x" * 400) == (100, True)
    assert counter.count_text("x" * 400) == (100, True)
    assert len(calls.bodies) == 1 and counter.max_model_len == 4096
    cached = list(redis_client.scan_iter(match=f"{key_prefix}tokcache:*"))
    assert len(cached) == 1 and int(redis_client.get(cached[0])) == 100
    assert 0 < redis_client.ttl(cached[0]) <= 7 * 24 * 3600
    # Another counter (another worker) reuses the entry without asking the backend.
    other_calls = Calls(fake_tokenize)
    other = TokenCounter(
        "http://backend", "local", redis_client, keys, transport=httpx.MockTransport(other_calls)
    )
    assert other.count_text("x" * 400) == (100, True) and other_calls.bodies == []
    # A different model is a different tokenizer: no shared entry.
    third = TokenCounter(
        "http://backend", "other", redis_client, keys, transport=httpx.MockTransport(other_calls)
    )
    assert third.count_text("x" * 400) == (100, True) and len(other_calls.bodies) == 1


def test_a_count_seen_before_needs_neither_tokenize_nor_redis(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """The queue path's latency: a prompt counted before by this counter is answered from the
    process (the Redis entry deleted here would otherwise send it to /tokenize again); the
    process keeps ``local_entries`` counts, least recently used dropped first."""
    calls = Calls(fake_tokenize)
    counter = TokenCounter("http://backend", "local", redis_client, Keys(key_prefix),
                           transport=httpx.MockTransport(calls), local_entries=2)
    messages = [{"role": "user", "content": "Summarise the nightly batch."}]
    first = counter.count_messages(messages)
    counter.count_text("a" * 40)
    assert len(calls.bodies) == 2

    def forget_redis() -> None:
        for key in redis_client.scan_iter(match=f"{key_prefix}tokcache:*"):
            redis_client.delete(key)

    forget_redis()
    assert counter.count_messages(messages) == first and counter.count_text("a" * 40) == (10, True)
    assert len(calls.bodies) == 2  # no /tokenize call, and Redis had nothing to give
    counter.count_text("b" * 40)  # a third entry: the least recently used (the messages) goes
    forget_redis()
    assert counter.count_text("a" * 40) == (10, True) and len(calls.bodies) == 3
    assert counter.count_messages(messages) == first and len(calls.bodies) == 4


def test_count_messages_sends_the_chat_shape(redis_client: redis.Redis, key_prefix: str) -> None:
    calls = Calls(fake_tokenize)
    counter = TokenCounter(
        "http://backend",
        "local",
        redis_client,
        Keys(key_prefix),
        transport=httpx.MockTransport(calls),
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [{"role": "system", "content": "s" * 40}, {"role": "user", "content": "u" * 8}]
    tokens, exact = counter.count_messages(messages, tools)
    assert exact and tokens == 3 + 10 + 3 + 2 + len(json.dumps(tools)) // 4
    body = calls.bodies[0]
    assert body["model"] == "local" and body["messages"] == messages and body["tools"] == tools
    assert counter.count_messages(messages) != (tokens, True)  # tools are part of the key


def test_unreachable_backend_estimates_and_short_circuits(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    now = [1000.0]
    counter = TokenCounter(
        f"http://127.0.0.1:{free_port()}",
        "local",
        redis_client,
        Keys(key_prefix),
        timeout_s=2.0,
        down_s=5.0,
        clock=lambda: now[0],
    )
    assert counter.count_text("a" * 394) == (100, False)
    assert counter.last_failure and "ConnectError" in counter.last_failure
    assert counter.backend_calls == 1
    assert counter.count_messages([{"role": "user", "content": "hi"}])[1] is False
    assert counter.backend_calls == 1  # circuit open: the dead backend is not asked again
    now[0] += 5.1
    counter.count_text("b" * 10)
    assert counter.backend_calls == 2  # retried once the window passed
    assert list(redis_client.scan_iter(match=f"{key_prefix}tokcache:*")) == []  # never cached


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(500, text="boom"),
        httpx.Response(200, json={"nope": 1}),
        httpx.Response(200, text="not json"),
    ],
)
def test_bad_answers_fall_back_to_the_estimate(
    response: httpx.Response, redis_client: redis.Redis, key_prefix: str
) -> None:
    counter = TokenCounter(
        "http://backend",
        "local",
        redis_client,
        Keys(key_prefix),
        transport=httpx.MockTransport(lambda request: response),
    )
    assert counter.count_text("z" * 40) == (estimate_text("z" * 40), False)
    assert counter.last_failure is not None


def test_redis_down_still_counts_exactly() -> None:
    dead = redis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    counter = TokenCounter(
        "http://backend", "local", dead, Keys("t:"), transport=httpx.MockTransport(fake_tokenize)
    )
    assert counter.count_text("y" * 80) == (20, True)


def test_estimate_errs_long_on_non_latin_text() -> None:
    assert estimate_text("") == 0
    assert estimate_text("a" * 394) == 100
    assert estimate_text("日本語のテキスト") == 8  # one token per CJK character
    assert estimate_text("abcd日本") == 2 + 2


def test_estimate_only_mode_without_a_backend(redis_client: redis.Redis, key_prefix: str) -> None:
    counter = TokenCounter("", "local", redis_client, Keys(key_prefix))
    assert counter.count_text("q" * 79) == (21, False)
    assert counter.backend_calls == 0 and counter.last_failure == "no backend configured"
