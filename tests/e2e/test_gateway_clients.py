"""What OpenAI clients send, through a real fleet (``fleet sim``, a dispatcher, ``fleet gateway``)
at cap 4 with the example configuration and the gateway's default settings, driven by the
official ``openai`` SDK: an editor's coding assistant (a 21K-character system prompt, 63 tools,
streaming), a multi-turn conversation sending back the reasoning the gateway gave (as pydantic-ai
does), ``developer`` messages, validation errors naming their field, and a crowd of streams that
all end answered or with a 429 the SDK retries."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.support.fleet_harness import FleetProbe, Harness
from tests.support.gateway_support import config_with_keys

pytestmark = pytest.mark.slow

CAP = 4
# A wait far shorter than the default (so the crowd's test runs in seconds) but longer than the
# keep-alive period, so a waiting stream would have had its 200 if comments were on; a 429's
# Retry-After is one such wait.
MAX_QUEUE_WAIT_S = 3
KEEPALIVE_S = 1
SIM_ARGS = ["--think-min-tokens", "20", "--think-max-tokens", "40",
            "--answer-min-tokens", "5", "--answer-max-tokens", "15"]
TOOL_COUNT = 63


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, dict[str, str]]]:
    config, keys = config_with_keys(
        tmp_path_factory.mktemp("gateway-clients"),
        projects={"triage": {"disallowed_tools": "refuse"}, "research": {"prompt_budget_tokens": 2000}},
        backend={"max_num_seqs": CAP},
        admission={"backend_gate": False},
        gateway={"max_queue_wait_s": MAX_QUEUE_WAIT_S, "keepalive_s": KEEPALIVE_S},
    )
    with Harness(config, sim_speed=2, sim_args=SIM_ARGS, gateway=True) as harness:
        yield harness, keys


@pytest.fixture
def probe(fleet: tuple[Harness, dict[str, str]]) -> FleetProbe:
    return FleetProbe(fleet[0])


def base_url(harness: Harness) -> str:
    return f"http://127.0.0.1:{harness.settings.gateway.port}/v1"


def sdk(fleet: tuple[Harness, dict[str, str]], project: str, **options: Any) -> openai.OpenAI:
    harness, keys = fleet
    return openai.OpenAI(base_url=base_url(harness), api_key=keys[project], **options)


def coding_tools(count: int = TOOL_COUNT) -> list[dict[str, Any]]:
    """``count`` function tools of an editor's assistant, about 1,240 characters of JSON Schema each."""
    tools = []
    for n in range(count):
        properties = {f"arg_{k}": {"type": "string", "description": f"Argument {k} of tool {n}: "
                                   + "the path, pattern or text the tool works on. " * 2 + "Required. "}
                      for k in range(6)}
        tools.append({"type": "function", "function": {
            "name": f"editor_tool_{n}", "description": f"Editor tool number {n}.",
            "parameters": {"type": "object", "properties": properties, "required": ["arg_0"]}}})
    return tools


def stream_text(stream: Any) -> tuple[str, list[Any], Any]:
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    return content, calls, chunks


# -- tools -------------------------------------------------------------------------------------
def test_the_coding_assistant_gets_its_tools_and_a_tool_call_back(
    fleet: tuple[Harness, dict[str, str]], probe: FleetProbe,
) -> None:
    tools = coding_tools()
    assert 75_000 <= len(json.dumps(tools)) <= 82_000
    system = ("You are the editor's coding assistant. Follow the workspace rules. " * 320)[:21_000]
    stream = sdk(fleet, "reports", max_retries=0).chat.completions.create(
        model="local", stream=True, stream_options={"include_usage": True}, tools=tools,  # type: ignore[arg-type]
        tool_choice="auto",
        messages=[{"role": "system", "content": system},
                  {"role": "user", "content": "hello [sim:tool=editor_tool_7] [sim:think=10]"}])
    _, calls, chunks = stream_text(stream)
    sent = probe.sim_requests(chunks[0].id.removeprefix("chatcmpl-"))[0]
    assert len(sent["tools"]) == TOOL_COUNT and sent["tool_choice"] == "auto"
    assert chunks[-1].usage.prompt_tokens > 24_000  # the tools counted, as the model saw them
    assert calls and calls[0].function.name == "editor_tool_7" and calls[0].type == "function"
    assert calls[0].id and isinstance(json.loads("".join(c.function.arguments or "" for c in calls)), dict)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


def test_a_project_allowlist_removes_other_tools_and_says_so(
    fleet: tuple[Harness, dict[str, str]], probe: FleetProbe,
) -> None:
    raw = sdk(fleet, "assistant", max_retries=0).chat.completions.with_raw_response.create(
        model="local", tools=coding_tools(2) + [  # type: ignore[operator]
            {"type": "function", "function": {"name": "search_docs", "parameters": {"type": "object"}}}],
        messages=[{"role": "user", "content": "look it up [sim:tool=search_docs] [sim:think=5]"}])
    answer = raw.parse()
    assert "editor_tool_0, editor_tool_1" in raw.headers["x-fleet-warnings"]
    sent = probe.sim_requests(answer.id.removeprefix("chatcmpl-"))[0]
    assert [t["function"]["name"] for t in sent["tools"]] == ["search_docs"]
    assert answer.choices[0].message.tool_calls[0].function.name == "search_docs"  # type: ignore[index, union-attr]


def test_a_refusing_project_answers_400_naming_the_tool(fleet: tuple[Harness, dict[str, str]]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(fleet, "triage", max_retries=0).chat.completions.create(
            model="local", tools=coding_tools(1),  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "hi"}])
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "E_TOOL_REJECTED" and error["param"] == "tools"
    assert "editor_tool_0" in error["message"]


# -- what multi-turn clients send back ------------------------------------------------------------
def test_a_second_turn_sending_back_the_reasoning_is_answered(
    fleet: tuple[Harness, dict[str, str]], probe: FleetProbe,
) -> None:
    client = sdk(fleet, "reports", max_retries=0)
    first = client.chat.completions.create(
        model="local", messages=[{"role": "user", "content": "Name a colour. [sim:think=8]"}])
    reasoning = (first.choices[0].message.model_extra or {})["reasoning"]
    assistant = {"role": "assistant", "content": first.choices[0].message.content, "reasoning": reasoning}
    older = {"role": "assistant", "content": "Blue.", "reasoning_content": "An older server's name."}
    second = client.chat.completions.create(model="local", messages=[  # type: ignore[misc]
        {"role": "user", "content": "Name a colour."}, older, {"role": "user", "content": "Another."},
        assistant, {"role": "user", "content": "And one more. [sim:think=8]"}])
    assert second.choices[0].message.content
    sent = probe.sim_requests(second.id.removeprefix("chatcmpl-"))[0]["messages"]
    assert sent[-2] == {"role": "assistant", "content": assistant["content"], "reasoning": reasoning}
    assert sent[-4]["reasoning"] == "An older server's name." and "reasoning_content" not in sent[-4]


def test_a_developer_message_is_sent_as_system_instructions(
    fleet: tuple[Harness, dict[str, str]], probe: FleetProbe,
) -> None:
    answer = sdk(fleet, "reports", max_retries=0).chat.completions.create(
        model="local", messages=[{"role": "developer", "content": "Answer in one word."},
                                 {"role": "user", "content": "Colour? [sim:think=5]"}])
    sent = probe.sim_requests(answer.id.removeprefix("chatcmpl-"))[0]["messages"]
    assert {"role": "system", "content": "Answer in one word."} in sent


# -- admission ------------------------------------------------------------------------------------
def test_forty_streams_at_cap_four_end_answered_or_with_a_retryable_429(
    fleet: tuple[Harness, dict[str, str]],
) -> None:
    """Default retries; each stream holds its slot about half a second (speed 2), so the crowd of
    40 at cap 4 takes about five seconds: it waits longer than a keep-alive period and some past
    the wait."""
    client = sdk(fleet, "translate", timeout=120)  # the SDK's default retries
    outcomes: list[str] = []
    lock = threading.Lock()

    def one(n: int) -> None:
        try:
            content, _, _ = stream_text(client.chat.completions.create(
                model="local", stream=True,
                messages=[{"role": "user", "content": f"crowd {n} [sim:think=40] [sim:answer=10]"}]))
            outcome = "answered" if content else "empty"
        except openai.RateLimitError:
            outcome = "429"
        except openai.APIError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [o for o in outcomes if o not in ("answered", "429")] == []
    assert outcomes.count("answered") >= CAP


# -- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": True}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": 5}]}, "messages.1.content"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"model": "gpt-4o"}, "model"),
])
def test_a_refused_field_is_named_in_param(fleet: tuple[Harness, dict[str, str]], fields: dict[str, Any],
                                            param: str) -> None:
    request: dict[str, Any] = {"model": "local", "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(openai.APIStatusError) as caught:
        sdk(fleet, "reports", max_retries=0).chat.completions.create(**request)
    assert caught.value.status_code in (400, 404)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error


def test_a_prompt_too_long_is_explained_to_a_chat_client(fleet: tuple[Harness, dict[str, str]]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(fleet, "research", max_retries=0).chat.completions.create(  # a 2,000-token prompt budget
            model="local", messages=[{"role": "user", "content": "Summarise the minutes. " * 600}])
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "E_PROMPT_TOO_LONG" and error["param"] == "messages"
    assert "allow_trim" not in error["message"] and "Shorten the conversation" in error["message"]
