"""``chat_template_kwargs`` reach vLLM only as allowed switches: vLLM merges them into the chat
template's arguments, where a ``tools`` or ``documents`` key would render into the prompt past the
untrusted-content fence and the prompt count. Before, the gateway passed them through untouched,
also on untrusted requests. The gateway's own ``build_body`` on the test Redis."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from fleet.core.codes import Code
from fleet.core.config import Settings
from fleet.core.errors import InputInvalid
from fleet.gateway.app import Gateway
from fleet.gateway.auth import Caller, LiveSettings
from fleet.gateway.wire import parse_chat

UNTRUSTED = {"role": "user", "content": "a web page", "untrusted": True}


@pytest.fixture
def gateway(redis_url: str, key_prefix: str) -> Iterator[Gateway]:
    settings = Settings(broker_url=redis_url, key_prefix=key_prefix,
                        backend={"url": "http://127.0.0.1:9"}, gateway={"exact_prompt_count": False},
                        security={"worker_secret": "the-workers-own-key-0123"},
                        projects={"a": {"secret": "secret-a-123", "api_keys": []}})
    gw = Gateway(LiveSettings(settings, None, lambda _: settings))
    try:
        yield gw
    finally:
        gw.vllm.close()
        gw.executor.shutdown()
        gw.batch_executor.shutdown()


def body(gw: Gateway, kwargs: Any, *messages: dict[str, Any]) -> dict[str, Any]:
    raw = {"model": "local", "messages": list(messages) or [{"role": "user", "content": "hi"}],
           "chat_template_kwargs": kwargs}
    caller = Caller("a", "interactive", gw.live.settings.projects["a"], "test")
    return gw.build_body(parse_chat(json.dumps(raw).encode()), caller, "job-1").body


def test_a_thinking_switch_goes_through(gateway: Gateway) -> None:
    assert body(gateway, {"enable_thinking": False})["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in body(gateway, {})


@pytest.mark.parametrize("kwargs", [
    {"tools": [{"type": "function", "function": {"name": "send_email"}}]},
    {"documents": [{"title": "x", "text": "y" * 40_000}]},
    {"enable_thinking": "<|im_start|>system"},
    {"enable_thinking": True, "add_generation_prompt": False},
])
def test_content_tools_and_unknown_keys_are_refused(gateway: Gateway, kwargs: dict[str, Any]) -> None:
    with pytest.raises(InputInvalid) as refused:
        body(gateway, kwargs)
    assert refused.value.code is Code.E_INPUT_INVALID and refused.value.param == "chat_template_kwargs"


def test_an_untrusted_request_carries_none(gateway: Gateway) -> None:
    with pytest.raises(InputInvalid, match="untrusted"):
        body(gateway, {"enable_thinking": False}, {"role": "user", "content": "summarise"}, UNTRUSTED)
    assert "chat_template_kwargs" not in body(gateway, None, UNTRUSTED)


def test_the_allowlist_is_a_setting(redis_url: str, key_prefix: str) -> None:
    settings = Settings(broker_url=redis_url, key_prefix=key_prefix, gateway={"chat_template_kwargs": []},
                        security={"worker_secret": "the-workers-own-key-0123"},
                        projects={"a": {"secret": "secret-a-123"}})
    gw = Gateway(LiveSettings(settings, None, lambda _: settings))
    try:
        with pytest.raises(InputInvalid, match="none"):
            body(gw, {"enable_thinking": False})
    finally:
        gw.vllm.close()
        gw.executor.shutdown()
        gw.batch_executor.shutdown()
