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
