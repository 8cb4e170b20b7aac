"""``fleet sim``'s ``/v1/completions`` and its two chat templates, as a real process, driven by the
official ``openai`` SDK: how the fleet continues a cut reasoning (fleet/infer/resume.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from fleet.sim.server import SimProcess, start_sim_process
from fleet.sim.tokenizer import Tokenizer
from tests.support.sim_client import user

SPEED = 200.0
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    proc = start_sim_process(speed=SPEED, seed=3, log_level="warning")
    yield proc
    proc.stop()


@pytest.fixture
def client(sim: SimProcess) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=sim.base_url + "/v1", api_key="x", max_retries=0)
    yield c
    c.close()


def rendered(sim: SimProcess, text: str) -> list[int]:
    body = {"messages": user(text), "add_generation_prompt": True}
    return list(httpx.post(sim.base_url + "/tokenize", json=body).json()["tokens"])


def encoded(sim: SimProcess, text: str) -> list[int]:
    """``text``'s ids as the server encodes them (it decodes only ids it has produced)."""
    body = {"prompt": text, "add_special_tokens": False}
    return list(httpx.post(sim.base_url + "/tokenize", json=body).json()["tokens"])


def streamed(client: openai.OpenAI, prompt: list[int], **extra: Any) -> tuple[str, str | None, Any]:
    stream = client.completions.create(model="local", prompt=prompt, stream=True,
                                       stream_options={"include_usage": True}, **extra)
    text, finish, usage = [], None, None
    for chunk in stream:
        assert chunk.object == "text_completion"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.text)
            finish = choice.finish_reason or finish
    return "".join(text), finish, usage


def test_a_reasoning_resumed_in_the_prompt_thinks_only_the_rest(sim: SimProcess,
                                                               client: openai.OpenAI) -> None:
    question = "[sim:think=400] [sim:answer=20] resume me"
    kept = " so far we have found that x is 3" * 20
    tokens = Tokenizer()
    prompt = rendered(sim, question) + encoded(sim, kept)
    text, finish, usage = streamed(client, prompt, max_tokens=2000, stop=["</think>"])
    assert finish == "stop" and "</think>" not in text
    assert usage.completion_tokens == 400 - tokens.count(kept)  # the rest of a 400-token thought
    # Without the stop string the rest of the thought, </think> and the answer come as text.
    whole, finish, usage = streamed(client, prompt, max_tokens=2000)
    assert finish == "stop" and whole.count("</think>") == 1
    assert usage.completion_tokens == 400 - tokens.count(kept) + 1 + 20


def test_after_a_closed_reasoning_only_the_answer_comes_in_its_schema(sim: SimProcess,
                                                                     client: openai.OpenAI) -> None:
    prompt = rendered(sim, "[sim:think=300] json please") + encoded(
        sim, "we worked it out\n</think>\n\n")
    text, finish, usage = streamed(
        client, prompt, max_tokens=500,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "n", "schema": SCHEMA}}})
    assert finish == "stop" and "</think>" not in text
    assert set(json.loads(text)) == {"n"}
    one_shot = client.completions.create(model="local", prompt=prompt, max_tokens=500)
    assert one_shot.choices[0].text and one_shot.usage is not None


def test_bad_completion_requests_are_refused_as_vllm_does(sim: SimProcess) -> None:
    for body, status in (({"model": "other", "prompt": "x"}, 404), ({"prompt": []}, 400),
                         ({"prompt": "x", "stop": 3}, 400), ({"prompt": [1, "a"]}, 400)):
        response = httpx.post(sim.base_url + "/v1/completions", json=body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["code"] == status


def test_the_plain_template_leaves_think_to_the_model() -> None:
    with start_sim_process(speed=SPEED, log_level="warning", chat_template="plain") as plain:
        ids = rendered(plain, "hello")
        text = httpx.post(plain.base_url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text.endswith("<|im_start|>assistant\n") and "<think>" not in text
    with start_sim_process(speed=SPEED, log_level="warning") as qwen3:
        ids = rendered(qwen3, "hello")
        text = httpx.post(qwen3.base_url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_the_servers_own_time_to_first_token_is_kept_per_request(sim: SimProcess,
                                                                  client: openai.OpenAI) -> None:
    before = httpx.get(sim.base_url + "/sim/ttft").json()
    streamed(client, rendered(sim, "[sim:think=50] [sim:slow_first_token=3] timed"), max_tokens=200)
    after = httpx.get(sim.base_url + "/sim/ttft").json()
    assert after["total"] == before["total"] + 1
    assert after["seconds"][-1] >= 3.0  # simulated seconds: the held first token counts
