"""The client libraries projects use, each in this process against a real fleet (``fleet sim``, a
dispatcher, ``fleet gateway`` as processes): LangChain's ``ChatOpenAI``, pydantic-ai's
``OpenAIChatModel``, ``litellm.completion`` and the OpenAI Agents SDK's
``OpenAIChatCompletionsModel``. For each: a streamed chat, a tool round trip (the library runs
the tool and sends its result back), structured output (``response_format`` json_schema) and a
hang-up mid-stream that frees the slot. The libraries talk to the gateway through a recording
proxy (tests/support/recording_proxy.py), so each test also says what the library sent that the
``openai`` SDK alone does not (docs/gateway.md's table)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import (
    Awaitable,
    Callable,
    Iterator,
)
from typing import Any

import pytest
from pydantic import BaseModel

from tests.support.fleet_harness import FleetProbe, Harness
from tests.support.gateway_support import config_with_keys
from tests.support.recording_proxy import Recorder, recording_proxy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

SIM_ARGS = ["--think-min-tokens", "10", "--think-max-tokens", "30",
            "--answer-min-tokens", "5", "--answer-max-tokens", "15"]
# A stream that stalls (200 s at speed 50) after some reasoning: still running when the client
# hangs up, so only the hang-up can free its slot.
STALLING = "Think it over. [sim:think=400] [sim:stall=10000]"
WEATHER_CALLS: list[str] = []


class City(BaseModel):
    name: str
    population: int


def get_weather(city: str) -> str:
    """The weather in a city."""
    WEATHER_CALLS.append(city)
    return f"Sunny in {city}, 21 degrees."


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, dict[str, str], Recorder]]:
    config, keys = config_with_keys(
        tmp_path_factory.mktemp("gateway-client-libraries"),
        backend={"max_num_seqs": 4},
        admission={"backend_gate": False},
    )
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True, concurrency=2) as harness, \
            recording_proxy(f"http://127.0.0.1:{harness.settings.gateway.port}") as recorder:
        yield harness, keys, recorder


@pytest.fixture
def probe(fleet: tuple[Harness, dict[str, str], Recorder]) -> FleetProbe:
    return FleetProbe(fleet[0])


@pytest.fixture
def base(fleet: tuple[Harness, dict[str, str], Recorder]) -> str:
    return fleet[2].url + "/v1"


@pytest.fixture
def key(fleet: tuple[Harness, dict[str, str], Recorder]) -> str:
    return fleet[1]["reports"]


@pytest.fixture
def recorder(fleet: tuple[Harness, dict[str, str], Recorder]) -> Recorder:
    return fleet[2]


def last_chats(recorder: Recorder, mark: int) -> list[dict[str, Any]]:
    return [s.body for s in recorder.since(mark) if s.path.endswith("/chat/completions") and s.body]


def freed_after_hang_up(probe: FleetProbe, aborted_before: int) -> None:
    """The hung-up request's lease is released and the backend aborted its sequence."""
    wait_until(lambda: probe.snapshot().in_flight == 0, 30, "the lease to be released")
    stats = wait_until(lambda: (s := probe.sim_stats())["aborted"] > aborted_before and s, 30,
                       "the simulator to abort the sequence")
    assert stats["running"] == 0 and stats["aborted"] == aborted_before + 1


def tool_round_trip_checks(recorder: Recorder, mark: int) -> list[dict[str, Any]]:
    """Two chat requests, the second carrying the tool call and the library's tool result."""
    chats = last_chats(recorder, mark)
    assert len(chats) == 2, [json.dumps(c)[:300] for c in chats]
    assert chats[0]["tools"][0]["function"]["name"] == "get_weather"
    messages = chats[1]["messages"]
    call = next(m for m in messages if m["role"] == "assistant" and m.get("tool_calls"))
    result = next(m for m in messages if m["role"] == "tool")
    assert result["tool_call_id"] == call["tool_calls"][0]["id"] and "Sunny in" in str(result["content"])
    return chats


# -- LangChain ------------------------------------------------------------------------------------
def langchain_model(base: str, key: str, **options: Any) -> Any:
    chat_openai = pytest.importorskip("langchain_openai").ChatOpenAI
    return chat_openai(model="local", base_url=base, api_key=key, max_retries=0, **options)


def test_langchain_streams(base: str, key: str, recorder: Recorder) -> None:
    mark = recorder.mark()
    chunks = list(langchain_model(base, key).stream("Name a colour. [sim:think=8]"))
    assert "".join(str(c.content) for c in chunks).strip()
    [sent] = last_chats(recorder, mark)
    assert sent["stream"] is True


def test_langchain_runs_a_tool_and_sends_the_result_back(base: str, key: str, recorder: Recorder) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    model = langchain_model(base, key).bind_tools([get_weather])
    mark = recorder.mark()
    messages: list[Any] = [HumanMessage("Weather in Oslo? [sim:tool=get_weather/1] [sim:think=5]")]
    first = model.invoke(messages)
    assert first.tool_calls and first.tool_calls[0]["name"] == "get_weather"
    messages.append(first)
    for call in first.tool_calls:
        messages.append(ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"]))
    second = model.invoke(messages)
    assert second.content and not second.tool_calls
    tool_round_trip_checks(recorder, mark)


def test_langchain_structured_output(base: str, key: str, recorder: Recorder) -> None:
    mark = recorder.mark()
    city = langchain_model(base, key).with_structured_output(City, method="json_schema").invoke(
        "A city. [sim:think=5]")
    assert isinstance(city, City)
    [sent] = last_chats(recorder, mark)
    assert sent["response_format"]["type"] == "json_schema"


def test_langchain_hang_up_frees_the_slot(fleet: tuple[Harness, dict[str, str], Recorder], key: str,
                                          probe: FleetProbe) -> None:
    aborted = probe.sim_stats()["aborted"]
    direct = f"http://127.0.0.1:{fleet[0].settings.gateway.port}/v1"
    stream = langchain_model(direct, key).stream(STALLING)
    next(iter(stream))
    stream.close()
    freed_after_hang_up(probe, aborted)


# -- pydantic-ai ----------------------------------------------------------------------------------
def pydantic_agent(base: str, key: str, **options: Any) -> Any:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("local", provider=OpenAIProvider(base_url=base, api_key=key))
    return Agent(model, **options)


def test_pydantic_ai_streams(base: str, key: str, recorder: Recorder) -> None:
    agent = pydantic_agent(base, key)
    mark = recorder.mark()

    async def run() -> str:
        async with agent.run_stream("Name a colour. [sim:think=8]") as result:
            return "".join([delta async for delta in result.stream_text(delta=True)])

    assert asyncio.run(run()).strip()
    [sent] = last_chats(recorder, mark)
    assert sent["stream"] is True


def test_pydantic_ai_runs_a_tool_and_sends_the_result_back(base: str, key: str, recorder: Recorder) -> None:
    agent = pydantic_agent(base, key, tools=[get_weather])
    mark = recorder.mark()
    result = agent.run_sync("Weather in Bergen? [sim:tool=get_weather/1] [sim:think=5]")
    assert result.output.strip()
    chats = tool_round_trip_checks(recorder, mark)
    # pydantic-ai sends the reasoning the gateway gave it back on its assistant message
    call = next(m for m in chats[1]["messages"] if m["role"] == "assistant")
    assert call.get("reasoning") or call.get("reasoning_content"), call


def test_pydantic_ai_structured_output(base: str, key: str, recorder: Recorder) -> None:
    from pydantic_ai import NativeOutput

    agent = pydantic_agent(base, key, output_type=NativeOutput(City))
    mark = recorder.mark()
    city = agent.run_sync("A city. [sim:think=5]").output
    assert isinstance(city, City)
    [sent] = last_chats(recorder, mark)
    assert sent["response_format"]["type"] == "json_schema"


def test_pydantic_ai_hang_up_frees_the_slot(fleet: tuple[Harness, dict[str, str], Recorder], key: str,
                                            probe: FleetProbe) -> None:
    aborted = probe.sim_stats()["aborted"]
    agent = pydantic_agent(f"http://127.0.0.1:{fleet[0].settings.gateway.port}/v1", key)

    async def run() -> None:
        # run_stream waits for the answer's first part (the reasoning is read before it), so the
        # hang-up comes at the model request's first event, as an app showing reasoning would
        async with agent.iter(STALLING) as run:
            async for node in run:
                if agent.is_model_request_node(node):
                    async with node.stream(run.ctx) as events:
                        async for _ in events:
                            break
                    return

    asyncio.run(run())
    freed_after_hang_up(probe, aborted)


# -- litellm --------------------------------------------------------------------------------------
def litellm_module() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the cost map
    return pytest.importorskip("litellm")


# litellm's own pydantic models warn when first built (a TypedDict's ReadOnly items)
litellm_warnings = pytest.mark.filterwarnings("ignore:.* `ReadOnly` qualifier:UserWarning")


@litellm_warnings
def test_litellm_streams(base: str, key: str, recorder: Recorder) -> None:
    litellm = litellm_module()
    mark = recorder.mark()
    stream = litellm.completion(model="openai/local", api_base=base, api_key=key, stream=True,
                                messages=[{"role": "user", "content": "Name a colour. [sim:think=8]"}])
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.strip()
    [sent] = last_chats(recorder, mark)
    assert sent["stream"] is True


@litellm_warnings
def test_litellm_runs_a_tool_and_sends_the_result_back(base: str, key: str, recorder: Recorder) -> None:
    litellm = litellm_module()
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages: list[Any] = [{"role": "user", "content": "Weather in Tromso? [sim:tool=get_weather/1] [sim:think=5]"}]
    mark = recorder.mark()
    first = litellm.completion(model="openai/local", api_base=base, api_key=key, messages=messages, tools=tools)
    calls = first.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    messages.append(first.choices[0].message)  # litellm's own pattern: the message object as it came
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": get_weather(**json.loads(call.function.arguments))})
    second = litellm.completion(model="openai/local", api_base=base, api_key=key, messages=messages, tools=tools)
    assert second.choices[0].message.content
    tool_round_trip_checks(recorder, mark)


@litellm_warnings
def test_litellm_structured_output(base: str, key: str, recorder: Recorder) -> None:
    litellm = litellm_module()
    mark = recorder.mark()
    answer = litellm.completion(model="openai/local", api_base=base, api_key=key, response_format=City,
                                messages=[{"role": "user", "content": "A city. [sim:think=5]"}])
    City.model_validate_json(answer.choices[0].message.content)
    [sent] = last_chats(recorder, mark)
    assert sent["response_format"]["type"] == "json_schema"


@litellm_warnings
def test_litellm_hang_up_frees_the_slot(fleet: tuple[Harness, dict[str, str], Recorder], key: str,
                                        probe: FleetProbe) -> None:
    litellm = litellm_module()
    aborted = probe.sim_stats()["aborted"]
    stream = litellm.completion(model="openai/local", api_key=key, stream=True,
                                api_base=f"http://127.0.0.1:{fleet[0].settings.gateway.port}/v1",
                                messages=[{"role": "user", "content": STALLING}])
    next(iter(stream))
    stream.completion_stream.response.close()
    freed_after_hang_up(probe, aborted)


# -- the OpenAI Agents SDK ------------------------------------------------------------------------
def with_agent(base: str, key: str, body: Callable[[Any], Awaitable[Any]], **options: Any) -> Any:
    """``body(agent)`` in a fresh event loop, with a client of its own closed in that loop (the
    SDK's ``run_sync`` keeps one loop across calls, and a client's generators outlive it)."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers

    async def run() -> Any:
        client = AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        try:
            model = agents.OpenAIChatCompletionsModel(model="local", openai_client=client)
            return await body(agents.Agent(name="assistant", instructions="Answer briefly.", model=model,
                                           **options))
        finally:
            await client.close()

    return asyncio.run(run())


def test_agents_sdk_streams(base: str, key: str, recorder: Recorder) -> None:
    from agents import Runner
    from openai.types.responses import ResponseTextDeltaEvent

    async def body(agent: Any) -> str:
        result = Runner.run_streamed(agent, "Name a colour. [sim:think=8]")
        return "".join([event.data.delta async for event in result.stream_events()
                        if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent)])

    mark = recorder.mark()
    assert with_agent(base, key, body).strip()
    [sent] = last_chats(recorder, mark)
    assert sent["stream"] is True


def test_agents_sdk_runs_a_tool_and_sends_the_result_back(base: str, key: str, recorder: Recorder) -> None:
    from agents import Runner, function_tool

    async def body(agent: Any) -> Any:
        return (await Runner.run(agent, "Weather in Narvik? [sim:tool=get_weather/1] [sim:think=5]")).final_output

    mark = recorder.mark()
    assert str(with_agent(base, key, body, tools=[function_tool(get_weather)])).strip()
    tool_round_trip_checks(recorder, mark)


def test_agents_sdk_structured_output(base: str, key: str, recorder: Recorder) -> None:
    from agents import Runner

    async def body(agent: Any) -> Any:
        return (await Runner.run(agent, "A city. [sim:think=5]")).final_output

    mark = recorder.mark()
    assert isinstance(with_agent(base, key, body, output_type=City), City)
    [sent] = last_chats(recorder, mark)
    assert sent["response_format"]["type"] == "json_schema"


def test_agents_sdk_hang_up_frees_the_slot(fleet: tuple[Harness, dict[str, str], Recorder], key: str,
                                           probe: FleetProbe) -> None:
    from agents import Runner

    async def body(agent: Any) -> None:
        result = Runner.run_streamed(agent, STALLING)
        async for event in result.stream_events():
            if event.type == "raw_response_event":
                result.cancel()
                break

    aborted = probe.sim_stats()["aborted"]
    with_agent(f"http://127.0.0.1:{fleet[0].settings.gateway.port}/v1", key, body)
    freed_after_hang_up(probe, aborted)
