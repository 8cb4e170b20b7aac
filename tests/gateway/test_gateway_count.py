"""``gateway.exact_prompt_count``: exact counts ask the backend's ``/tokenize``; false counts with
the estimate and never asks (one round trip less per new prompt)."""

from __future__ import annotations

import pytest

from fleet.core.config import Settings
from fleet.gateway.app import Gateway
from fleet.gateway.auth import Caller, LiveSettings
from fleet.gateway.wire import parse_chat


@pytest.mark.parametrize("exact", [True, False])
def test_the_prompt_count_asks_the_backend_only_when_exact(redis_url: str, key_prefix: str,
                                                           exact: bool) -> None:
    settings = Settings(broker_url=redis_url, key_prefix=key_prefix,
                        backend={"url": "http://127.0.0.1:9"},  # nothing listens: a failed ask
                        gateway={"exact_prompt_count": exact},
                        security={"worker_secret": "the-workers-own-key-0123"},  # the cache salt
                        projects={"a": {"secret": "secret-a-123", "api_keys": []}})
    gateway = Gateway(LiveSettings(settings, None, lambda _: settings))
    try:
        caller = Caller("a", "interactive", settings.projects["a"], "test")
        req = parse_chat(b'{"model": "local", "messages": [{"role": "user", "content": "count me"}]}')
        prompt_tokens = gateway.build_body(req, caller, "job-1").prompt_tokens
        assert prompt_tokens > 0
        assert (gateway.counter.backend_calls > 0) is exact
    finally:
        gateway.vllm.close()
        gateway.executor.shutdown()


def test_a_request_is_counted_by_a_backend_of_its_own_model(redis_url: str, key_prefix: str) -> None:
    """Two models: a request naming "small" asks the small backend's /tokenize (its tokenizer),
    one naming "local" the big one's; neither asks the other's."""
    backends = [{"name": "big", "url": "http://127.0.0.1:9", "served_model_names": ["local"]},
                {"name": "small", "url": "http://127.0.0.1:10", "served_model_names": ["small"],
                 "max_model_len": 32768, "kv_pool_tokens": 64 * 1072}]
    settings = Settings(broker_url=redis_url, key_prefix=key_prefix, backends=backends,
                        gateway={"exact_prompt_count": True},
                        security={"worker_secret": "the-workers-own-key-0123"},
                        projects={"a": {"secret": "secret-a-123", "api_keys": []}})
    gateway = Gateway(LiveSettings(settings, None, lambda _: settings))
    try:
        caller = Caller("a", "interactive", settings.projects["a"], "test")
        small = parse_chat(b'{"model": "small", "messages": [{"role": "user", "content": "count me"}]}')
        assert gateway.build_body(small, caller, "job-1").prompt_tokens > 0
        big, little = gateway.counter_for(settings.backends[0]), gateway.counter_for(settings.backends[1])
        assert (big.backend_calls, little.backend_calls > 0) == (0, True)
        local = parse_chat(b'{"model": "local", "messages": [{"role": "user", "content": "and me"}]}')
        assert gateway.build_body(local, caller, "job-2").prompt_tokens > 0
        assert big.backend_calls > 0
    finally:
        gateway.vllm.close()
        gateway.executor.shutdown()
