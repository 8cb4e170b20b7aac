"""The gateway's wire shapes: what a chat request may carry, and the chunks and bodies it answers."""

from __future__ import annotations

import json

import pytest

from fleet.core.codes import Code
from fleet.core.errors import InputInvalid
from fleet.gateway.wire import ChunkMaker, error_body, parse_chat, status_of


def body(**extra: object) -> bytes:
    return json.dumps({"model": "local", "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


@pytest.mark.parametrize(("extra", "named"), [
    ({"n": 2}, "n"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logprobs": True}, "logprobs"),
    ({"store": True}, "store"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"temprature": 1}, "temprature"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"temperature": 3}, "temperature"),
])
def test_a_request_the_gateway_cannot_honour_is_refused_naming_the_field(extra: dict, named: str) -> None:
    with pytest.raises(InputInvalid, match=named.replace(".", r"\.")):
        parse_chat(body(**extra))


def test_what_an_openai_client_sends_by_default_is_accepted() -> None:
    """The fields SDKs and editor plug-ins send unasked: neutral values and hints pass, and
    what vLLM honours goes through."""
    req = parse_chat(body(logprobs=False, top_logprobs=0, store=False, modalities=["text"], audio=None,
                          metadata={"trace": "x"}, user="me", service_tier="auto", n=1,
                          prompt_cache_key="k", logit_bias={"11": -100}, reasoning_effort="low"))
    assert req.passthrough() == {"logit_bias": {"11": -100}, "reasoning_effort": "low"}


def test_a_refused_field_is_named_in_the_error_bodys_param() -> None:
    with pytest.raises(InputInvalid) as caught:
        parse_chat(body(logprobs=True))
    assert caught.value.param == "logprobs"
    assert "log probabilities" in caught.value.message and "false" in caught.value.message
    assert error_body(caught.value.code, caught.value.message, caught.value.param)["error"]["param"] == "logprobs"


def test_untrusted_flags_and_sampling_fields_are_kept() -> None:
    req = parse_chat(body(stream=True, stream_options={"include_usage": True}, top_p=0.9, stop=["x"],
                          messages=[{"role": "user", "content": "doc", "untrusted": True}]))
    job = req.to_job("j", "reports", "batch")
    assert job.untrusted and job.band == "batch" and job.project == "reports"
    assert req.include_usage and req.passthrough() == {"top_p": 0.9, "stop": ["x"]}


def test_reasoning_goes_in_vllms_field_and_optionally_under_the_old_name() -> None:
    plain = json.loads(ChunkMaker("c", "local", False).delta("think", "", []).decode()[6:])
    assert plain["choices"][0]["delta"] == {"reasoning": "think"}
    both = json.loads(ChunkMaker("c", "local", True).delta("think", "say", []).decode()[6:])
    assert both["choices"][0]["delta"] == {"reasoning": "think", "reasoning_content": "think",
                                           "content": "say"}
    full = ChunkMaker("c", "local", True).full("say", "think", [], None, {"completion_tokens": 2}, Code.OK)
    message = full["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == ("think", "think", "say")
    assert full["choices"][0]["finish_reason"] == "stop" and full["usage"] == {"completion_tokens": 2}
    assert full["fleet"] == {"code": "OK"}


def test_every_error_body_carries_its_code_and_a_status() -> None:
    for code in Code:
        if code.ok:
            continue
        error = error_body(code, "why")["error"]
        assert error["code"] == code.value and error["message"] == "why"
        assert 400 <= status_of(code) < 600
    assert status_of(Code.E_AUTH) == 401 and status_of(Code.E_QUEUE_TIMEOUT) == 429
