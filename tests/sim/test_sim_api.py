"""``fleet sim`` as a real process, driven by the official ``openai`` SDK."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from fleet.sim.server import SimProcess, start_sim_process
from tests.support.sim_client import metric, stats, user, wait_for

SPEED = 200.0


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    proc = start_sim_process(speed=SPEED, seed=7, log_level="warning")
    yield proc
    proc.stop()


@pytest.fixture
def client(sim: SimProcess) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=sim.base_url + "/v1", api_key="x", max_retries=0)
    yield c
    c.close()


def test_streaming_reasoning_then_content_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="local", messages=user("[sim:think=120] [sim:answer=40] hi"), stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Request-Id": "abc"})
    reasoning, content, kinds, finish, usage = [], [], [], None, None
    for chunk in stream:
        assert chunk.id == "chatcmpl-abc"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning"):
                reasoning.append(extra["reasoning"])
                kinds.append("r")
            if choice.delta.content:
                content.append(choice.delta.content)
                kinds.append("c")
            finish = choice.finish_reason or finish
    assert finish == "stop"
    assert kinds == sorted(kinds, reverse=True) and "r" in kinds and "c" in kinds
    assert usage is not None and usage.completion_tokens == 120 + 1 + 40
    assert usage.completion_tokens_details.reasoning_tokens == 120
    assert len("".join(reasoning)) > 120 * 2


def test_non_streaming_and_same_request_reproduces(client: openai.OpenAI) -> None:
    def ask(seed: int | None) -> Any:
        return client.chat.completions.create(
            model="local", messages=user("[sim:think=50] tell me"), max_tokens=400, seed=seed)

    a, b, c = ask(None), ask(None), ask(12345)
    msg = a.choices[0].message
    assert msg.content and (msg.model_extra or {}).get("reasoning")
    assert a.usage.completion_tokens_details.reasoning_tokens == 50
    assert a.choices[0].finish_reason in ("stop", "length")
    assert msg.content == b.choices[0].message.content
    assert msg.content != c.choices[0].message.content


def test_models_tokenize_detokenize(sim: SimProcess, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["local"]
    messages = user("count me please")
    tok = httpx.post(sim.base_url + "/tokenize",
                     json={"messages": messages, "add_generation_prompt": True}).json()
    assert tok["max_model_len"] == 262_144 and tok["count"] == len(tok["tokens"])
    resp = client.chat.completions.create(model="local", messages=messages, max_tokens=5)
    assert resp.usage.prompt_tokens == tok["count"]
    back = httpx.post(sim.base_url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back["prompt"].startswith("<|im_start|>user\ncount me please")
    assert httpx.get(sim.base_url + "/health").status_code == 200
    assert httpx.get(sim.base_url + "/load").json() == {"server_load": 0}


TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}},
    {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"], "additionalProperties": False}}},
]


def test_tool_call_streaming_hermes_shape(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="local", messages=user("[sim:think=30] [sim:tool=weather] weather?"), tools=TOOLS,
        stream=True)
    calls: list[Any] = []
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            calls.extend(choice.delta.tool_calls or [])
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    first = calls[0]
    assert first.index == 0 and first.type == "function" and first.id.startswith("chatcmpl-tool-")
    assert first.function.name == "weather"
    args = json.loads("".join(c.function.arguments or "" for c in calls[1:]))
    jsonschema.validate(args, TOOLS[1]["function"]["parameters"])


def test_tool_call_non_streaming_first_tool(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="local", messages=user("[sim:think=30] [sim:tool] look it up"), tools=TOOLS)
    assert resp.choices[0].finish_reason == "tool_calls"
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "lookup" and "q" in json.loads(call.function.arguments)
    plain = client.chat.completions.create(
        model="local", messages=user("[sim:think=30] [sim:answer=5] no tool"), tools=TOOLS)
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls


def test_parallel_tool_calls_in_one_answer_streamed_and_not(client: openai.OpenAI) -> None:
    """``[sim:parallel=3]``: three hermes calls in one answer, as vLLM's parser hands them out."""
    text = user("[sim:think=30] [sim:tool=weather] [sim:parallel=3] weather in three cities?")
    stream = client.chat.completions.create(model="local", messages=text, tools=TOOLS, stream=True)
    by_index: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = by_index.setdefault(delta.index, {"id": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and sorted(by_index) == [0, 1, 2]
    assert len({c["id"] for c in by_index.values()}) == 3
    for call in by_index.values():
        jsonschema.validate(json.loads(call["arguments"]), TOOLS[1]["function"]["parameters"])
    full = client.chat.completions.create(model="local", messages=text, tools=TOOLS)
    calls = full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "tool_calls" and len(calls) == 3
    assert all(c.function.name == "weather" and json.loads(c.function.arguments) for c in calls)


SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["title", "items", "status"],
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 40},
        "status": {"enum": ["ok", "fail"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "required": ["n"], "additionalProperties": False,
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                           "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}},
    },
}


def test_json_schema_output_is_valid(client: openai.OpenAI) -> None:
    for i in range(3):
        resp = client.chat.completions.create(
            model="local", messages=user(f"[sim:think=20] report {i}"),
            response_format={"type": "json_schema",
                             "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}})
        jsonschema.validate(json.loads(resp.choices[0].message.content), SCHEMA)
    obj = client.chat.completions.create(model="local", messages=user("[sim:think=20] obj"),
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_errors(sim: SimProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model="local", messages=user("x [sim:prompt_pad=300000]"))
    assert too_long.value.status_code == 400
    assert too_long.value.body["param"] == "input_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=user("hi"))
    for bad in (-5, 2.5, True):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="local", messages=user("hi"),
                                           extra_body={"thinking_token_budget": bad})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="local", messages=user("hi"),
                                       stream_options={"include_usage": True})
    raw = httpx.post(sim.base_url + "/v1/chat/completions", json={"model": "nope",
                                                                  "messages": user("x")})
    assert raw.status_code == 404
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_thinking_budget_forces_answer(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="local", messages=user("[sim:think=5000] [sim:answer=30] think hard"),
        max_tokens=1_000, extra_body={"thinking_token_budget": 200})
    assert resp.usage.completion_tokens_details.reasoning_tokens <= 200 + 3
    assert resp.choices[0].message.content and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == 200 + 1 + 30


def test_budget_without_room_gives_length_and_no_content(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="local", messages=user("[sim:think=5000] no room"), max_tokens=100,
        extra_body={"thinking_token_budget": 300})
    assert resp.choices[0].finish_reason == "length"
    assert not resp.choices[0].message.content
    assert resp.usage.completion_tokens == 100


def test_thinking_off(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="local", messages=user("[sim:answer=20] quick"),
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert not (resp.choices[0].message.model_extra or {}).get("reasoning")
    assert resp.usage.completion_tokens == 20


def test_disconnect_frees_sequence(sim: SimProcess, client: openai.OpenAI) -> None:
    base = stats(sim)["aborted"]
    stream = client.chat.completions.create(
        model="local", messages=user("[sim:think=200000] endless"), stream=True)
    for _ in zip(range(3), stream, strict=False):
        pass
    assert stats(sim)["running"] == 1
    stream.close()
    st = wait_for(sim, lambda s: s["running"] == 0)
    assert st["aborted"] == base + 1 and st["kv_blocks_used"] == 0


def test_forty_concurrent_requests_running_32_waiting_8(sim: SimProcess) -> None:
    # Streams closed by earlier tests may still be winding down on a loaded machine: start idle.
    base = wait_for(sim, lambda s: s["running"] + s["waiting"] == 0)["total_requests"]

    async def scenario() -> tuple[float, float, dict[str, Any]]:
        client = openai.AsyncOpenAI(base_url=sim.base_url + "/v1", api_key="x", max_retries=0)
        # Each request holds its slot before its first token: the KV pool never fills, so no
        # preemption moves a runner back to waiting however slowly the 40 requests arrive.
        streams = await asyncio.gather(*[
            client.chat.completions.create(
                model="local", messages=user(f"[sim:slow_first_token=100000] [sim:think=20] held job {i}"),
                stream=True)
            for i in range(40)])
        await asyncio.to_thread(wait_for, sim, lambda s: s["total_requests"] >= base + 40)
        running = metric(sim, "vllm:num_requests_running")
        waiting = metric(sim, "vllm:num_requests_waiting")
        for s in streams:
            await s.close()
        await client.close()
        return running, waiting, await asyncio.to_thread(
            wait_for, sim, lambda s: s["running"] + s["waiting"] == 0)

    running, waiting, after = asyncio.run(scenario())
    assert (running, waiting) == (32, 8)
    assert after["max_running_seen"] >= 32 and after["kv_blocks_used"] == 0
    assert after["max_waiting_seen"] >= 8


def test_a_request_that_finds_a_free_slot_never_counts_as_waiting(
        sim: SimProcess, client: openai.OpenAI) -> None:
    wait_for(sim, lambda s: s["running"] + s["waiting"] == 0)
    httpx.post(sim.base_url + "/sim/reset", timeout=5)
    client.chat.completions.create(model="local", messages=user("[sim:think=5] [sim:answer=3] hi"))
    assert stats(sim)["max_waiting_seen"] == 0


def test_metrics_names_and_labels(sim: SimProcess) -> None:
    text = httpx.get(sim.base_url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:request_queue_time_seconds_count"):
        assert name + '{' in text, name
    assert 'model_name="local"' in text and 'finished_reason="stop"' in text
    assert metric(sim, "vllm:generation_tokens_total") > 0


def test_non_streaming_disconnect_aborts(sim: SimProcess) -> None:
    base = stats(sim)["aborted"]
    body = {"model": "local", "messages": user("[sim:think=200000] patient")}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(sim.base_url + "/v1/chat/completions", json=body, timeout=0.5)
    st = wait_for(sim, lambda s: s["aborted"] == base + 1)
    assert st["running"] == 0


def test_metrics_counters_match_the_requests_sent() -> None:
    """A fresh simulator, idle gaps between requests as in a long run: every prompt is counted and
    no queue time is negative."""
    from prometheus_client.parser import text_string_to_metric_families

    proc = start_sim_process(speed=SPEED, seed=11, log_level="warning")
    try:
        c = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="x", max_retries=0)
        prompt_tokens = completion_tokens = 0
        for i in range(6):
            r = c.chat.completions.create(
                model="local", messages=user(f"[sim:think=20] [sim:answer=5] short question {i}"))
            assert r.usage is not None
            prompt_tokens += r.usage.prompt_tokens
            completion_tokens += r.usage.completion_tokens
            wait_for(proc, lambda s: s["running"] + s["waiting"] == 0)  # idle before the next one
        c.close()
        samples = {s.name: s.value for f in text_string_to_metric_families(
            httpx.get(proc.base_url + "/metrics", timeout=5).text) for s in f.samples}
    finally:
        proc.stop()
    assert samples["vllm:prompt_tokens_total"] == prompt_tokens > 0
    assert samples["vllm:generation_tokens_total"] == completion_tokens
    assert samples["vllm:request_prompt_tokens_sum"] == prompt_tokens
    assert samples["vllm:request_queue_time_seconds_count"] == 6
    assert samples["vllm:request_queue_time_seconds_sum"] >= 0
    assert samples["vllm:time_to_first_token_seconds_sum"] >= 0


def test_parallel_is_capped_so_a_huge_count_answers_at_once(client: openai.OpenAI) -> None:
    """``[sim:parallel=100000]`` answers with ``MAX_PARALLEL`` calls (building 100,000 hung)."""
    from fleet.sim.scenarios import MAX_PARALLEL

    full = client.chat.completions.create(
        model="local", messages=user("[sim:think=5] [sim:tool=weather] [sim:parallel=100000] w?"),
        tools=TOOLS)
    assert full.choices[0].finish_reason == "tool_calls"
    assert len(full.choices[0].message.tool_calls) == MAX_PARALLEL == 64


@pytest.mark.parametrize("marker", [
    "parallel=inf", "parallel=-1", "parallel=nan", "think=1e400", "answer=-3", "prompt_pad=inf",
    "slow_first_token=nan", "stall=-1", "dead=inf", "think=lots"])
def test_a_bad_numeric_marker_is_a_plain_400(sim: SimProcess, client: openai.OpenAI,
                                              marker: str) -> None:
    """Non-finite, negative or non-numeric values are refused (``parallel=inf`` crashed the
    request with an uncaught OverflowError); the engine stays alive for the next request."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="local", messages=user(f"[sim:{marker}] hi"),
                                       tools=TOOLS)
    assert f"[sim:{marker}]" in refused.value.body["message"]
    assert refused.value.body["param"] == "messages"
    ok = client.chat.completions.create(model="local", messages=user("[sim:think=5] fine"))
    assert ok.choices[0].finish_reason == "stop"


def test_served_model_names_as_vllm_serves_them() -> None:
    from fleet.sim.__main__ import parse_args

    options = parse_args(["--served-model-name", "qwen3-next", "default", "--profile", "tiny"])
    assert options.served_model_name == ("qwen3-next", "default")
    assert parse_args(options.to_args()) == options
    with start_sim_process(speed=SPEED, log_level="warning", profile="tiny",
                           served_model_name=("qwen3-next", "default")) as named:
        cards = httpx.get(named.base_url + "/v1/models").json()["data"]
        assert [card["id"] for card in cards] == ["qwen3-next", "default"]
        client = openai.OpenAI(base_url=named.base_url + "/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(model="default", messages=user("[sim:answer=5] hi"))
        assert answer.model == "qwen3-next"  # vLLM answers with the first served name
        raw = httpx.post(named.base_url + "/v1/chat/completions",
                         json={"model": "local", "messages": user("x")})
        assert raw.status_code == 404
        assert raw.json() == {"error": {"message": "The model `local` does not exist.",
                                        "type": "NotFoundError", "param": "model", "code": 404}}
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="local", messages=user("x"))
