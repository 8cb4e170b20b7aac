"""Every body a real gateway sends, checked against OpenAI's published OpenAPI description
(tests/support/openapi/): chat completions, each streamed chunk, the model list, file and batch
objects and their lists, batch output and error lines, and error bodies, sent as answers or as a
stream's error event. The bodies are read raw (httpx, not the SDK, which would accept and hide
what it does not know); the fleet's deliberate differences (vLLM's ``reasoning``, the fleet's own
fields) are named with their reasons in ``tests/support/openapi_check.py``, and any other field,
a wrong type or a missing required field fails."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.fleet_harness import Harness
from tests.support.gateway_support import config_with_keys
from tests.support.openapi_check import DIFFERENCES, assert_conforms, problems
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

SIM_ARGS = ["--think-min-tokens", "10", "--think-max-tokens", "30",
            "--answer-min-tokens", "5", "--answer-max-tokens", "15"]
MAX_BODY_BYTES = 65_536
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITY_SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, dict[str, str]]]:
    config, keys = config_with_keys(
        tmp_path_factory.mktemp("gateway-conformance"),
        backend={"max_num_seqs": 4},
        admission={"backend_gate": False},
        gateway={"max_body_bytes": MAX_BODY_BYTES},
    )
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True, concurrency=4) as harness:
        yield harness, keys


@pytest.fixture(scope="module")
def http(fleet: tuple[Harness, dict[str, str]]) -> Iterator[httpx.Client]:
    harness, keys = fleet
    with httpx.Client(base_url=f"http://127.0.0.1:{harness.settings.gateway.port}/v1", timeout=60,
                      headers={"Authorization": f"Bearer {keys['reports']}"}) as client:
        yield client


def chat(messages_text: str, **fields: Any) -> dict[str, Any]:
    return {"model": "local", "messages": [{"role": "user", "content": messages_text}], **fields}


CHATS = {
    "prose": chat("Name a colour. [sim:think=8]"),
    "tool call": chat("Weather in Oslo? [sim:tool] [sim:think=5]", tools=[WEATHER], tool_choice="auto"),
    "two tool calls": chat("Oslo and Bergen. [sim:tool] [sim:parallel=2] [sim:think=5]", tools=[WEATHER]),
    "json schema": chat("A city. [sim:think=5]", response_format=CITY_SCHEMA),
    "json object": chat("A city as JSON. [sim:think=5]", response_format={"type": "json_object"}),
    "no content": chat("Say nothing. [sim:empty] [sim:think=5]"),
    "cut at max_tokens": chat("Ramble. [sim:think=40] [sim:answer=40]", max_tokens=20),
}


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE answer, in order (comments skipped)."""
    events = []
    for block in response.text.split("\n\n"):
        data = [line[len("data: "):] for line in block.split("\n") if line.startswith("data: ")]
        if data:
            events.append("\n".join(data))
    return events


# -- chat completions ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(CHATS))
def test_a_chat_completion_conforms(http: httpx.Client, kind: str) -> None:
    reply = http.post("/chat/completions", json=CHATS[kind])
    assert reply.status_code == 200, reply.text
    assert_conforms("CreateChatCompletionResponse", reply.json())


@pytest.mark.parametrize("kind", list(CHATS))
def test_each_streamed_chunk_conforms(http: httpx.Client, kind: str) -> None:
    body = {**CHATS[kind], "stream": True, "stream_options": {"include_usage": True}}
    reply = http.post("/chat/completions", json=body)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = sse_events(reply)
    assert events[-1] == "[DONE]" and len(events) >= 4
    chunks = [json.loads(event) for event in events[:-1]]
    for chunk in chunks:
        assert_conforms("CreateChatCompletionStreamResponse", chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] in ("stop", "length", "tool_calls")


def test_an_error_event_in_a_stream_conforms(http: httpx.Client) -> None:
    reply = http.post("/chat/completions", json={**chat("Fail midway. [sim:error_event]"), "stream": True})
    assert reply.status_code == 200
    events = sse_events(reply)
    assert events[-1] == "[DONE]"
    errors = [json.loads(e) for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1
    assert_conforms("ErrorResponse", errors[0])
    for chunk in (json.loads(e) for e in events[:-1] if "error" not in json.loads(e)):
        assert_conforms("CreateChatCompletionStreamResponse", chunk)


# -- error bodies -------------------------------------------------------------------------------
ERRORS: dict[str, tuple[str, str, dict[str, Any], int]] = {
    # name: (method, path, httpx options, status)
    "no key": ("POST", "/chat/completions", {"json": chat("hi"), "headers": {"Authorization": ""}}, 401),
    "a key no project has": ("GET", "/models", {"headers": {"Authorization": "Bearer fk-" + "x" * 43}}, 401),
    "another model": ("POST", "/chat/completions", {"json": {**chat("hi"), "model": "gpt-4o"}}, 404),
    "an unknown field": ("POST", "/chat/completions", {"json": {**chat("hi"), "temprature": 1}}, 400),
    "a wrong type": ("POST", "/chat/completions", {"json": {**chat("hi"), "max_tokens": True}}, 400),
    "not JSON": ("POST", "/chat/completions", {"content": b"{nope", "headers": {"Content-Type": "application/json"}},
                 400),
    "a prompt too long": ("POST", "/chat/completions",
                          {"json": chat("[sim:prompt_pad=300000] Too long.")}, 400),
    "a body too large": ("POST", "/chat/completions", {"json": chat("x" * MAX_BODY_BYTES)}, 413),
    "an unknown route": ("GET", "/nothing-here", {}, 404),
    "another method": ("DELETE", "/models", {}, 405),
    "an unknown file": ("GET", "/files/file-nothing", {}, 404),
    "an unknown batch": ("GET", "/batches/batch_nothing", {}, 404),
    "a bad list limit": ("GET", "/files", {"params": {"limit": 0}}, 400),
    "a purpose other than batch": ("POST", "/files", {"files": {"file": ("a.jsonl", b"{}\n")},
                                                       "data": {"purpose": "assistants"}}, 400),
    "a batch of an unknown file": ("POST", "/batches", {"json": {
        "input_file_id": "file-nothing", "endpoint": "/v1/chat/completions", "completion_window": "24h"}}, 404),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_an_error_body_conforms(http: httpx.Client, case: str) -> None:
    method, path, options, status = ERRORS[case]
    reply = http.request(method, path, **options)
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert_conforms("ErrorResponse", body)
    assert body["error"]["code"].startswith("E_")  # the fleet's code, a string as OpenAI's are


# -- models, files, batches ---------------------------------------------------------------------
def test_the_model_list_conforms(http: httpx.Client) -> None:
    reply = http.get("/models")
    assert reply.status_code == 200
    assert_conforms("ListModelsResponse", reply.json())
    assert [m["id"] for m in reply.json()["data"]] == ["local"]


def test_file_objects_and_lists_conform(fleet: tuple[Harness, dict[str, str]], http: httpx.Client) -> None:
    harness, keys = fleet
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat("hi")}
    uploaded = http.post("/files", files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")},
                         data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    assert_conforms("OpenAIFile", uploaded.json())
    file_id = uploaded.json()["id"]
    assert_conforms("OpenAIFile", http.get(f"/files/{file_id}").json())
    assert_conforms("ListFilesResponse", http.get("/files", params={"limit": 5}).json())
    empty = http.get("/files", headers={"Authorization": f"Bearer {keys['triage']}"}).json()
    assert empty["data"] == []
    assert_conforms("ListFilesResponse", empty)
    deleted = http.delete(f"/files/{file_id}")
    assert deleted.status_code == 200
    assert_conforms("DeleteFileResponse", deleted.json())


def upload(http: httpx.Client, lines: list[dict[str, Any]]) -> str:
    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    reply = http.post("/files", files={"file": ("in.jsonl", text)}, data={"purpose": "batch"})
    assert reply.status_code == 200, reply.text
    return str(reply.json()["id"])


def create_batch(http: httpx.Client, file_id: str) -> dict[str, Any]:
    reply = http.post("/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                        "completion_window": "24h", "metadata": {"run": "conformance"}})
    assert reply.status_code == 200, reply.text
    batch: dict[str, Any] = reply.json()
    assert_conforms("Batch", batch)
    return batch


def test_batch_objects_and_result_lines_conform(http: httpx.Client) -> None:
    lines = [
        {"custom_id": "prose", "method": "POST", "url": "/v1/chat/completions", "body": CHATS["prose"]},
        {"custom_id": "tool", "method": "POST", "url": "/v1/chat/completions", "body": CHATS["tool call"]},
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": "nope"}},
    ]
    batch = create_batch(http, upload(http, lines))

    def final() -> dict[str, Any] | None:
        body: dict[str, Any] = http.get(f"/batches/{batch['id']}").json()
        assert_conforms("Batch", body)  # every state it passes through
        return body if body["status"] == "completed" else None

    done = wait_until(final, 120, "the batch to complete", every_s=0.2)
    assert_conforms("ListBatchesResponse", http.get("/batches", params={"limit": 5}).json())
    output = [json.loads(row) for row in http.get(f"/files/{done['output_file_id']}/content").text.splitlines()]
    errors = [json.loads(row) for row in http.get(f"/files/{done['error_file_id']}/content").text.splitlines()]
    assert [row["custom_id"] for row in output] == ["prose", "tool"] and len(errors) == 1
    for row in output + errors:
        assert_conforms("FleetBatchLine", row)
    for row in output:
        assert_conforms("CreateChatCompletionResponse", row["response"]["body"])


def test_a_cancelled_and_a_failed_batch_conform(http: httpx.Client) -> None:
    slow = [{"custom_id": f"slow-{n}", "method": "POST", "url": "/v1/chat/completions",
             "body": chat(f"Think long {n}. [sim:think=100000]", thinking_token_budget=100_000)} for n in range(2)]
    batch = create_batch(http, upload(http, slow))
    cancelled = http.post(f"/batches/{batch['id']}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert_conforms("Batch", cancelled.json())
    done = wait_until(lambda: (b := http.get(f"/batches/{batch['id']}").json())["status"] == "cancelled" and b,
                      120, "the batch to end cancelled", every_s=0.2)
    assert_conforms("Batch", done)
    failed = create_batch(http, upload(http, [{"custom_id": "bad", "body": {"messages": "nope"}}]))
    assert failed["status"] == "failed" and failed["errors"]["data"]


# -- the check itself --------------------------------------------------------------------------
def test_a_wrong_type_a_missing_field_or_an_unknown_field_fails_the_check(http: httpx.Client) -> None:
    """The schemas are not so loose that anything passes: a real answer, broken in one place at a
    time, is refused each time."""
    answer = http.post("/chat/completions", json=CHATS["tool call"]).json()
    assert problems("CreateChatCompletionResponse", answer) == []
    breaks = {
        "created as a string": lambda b: b.update(created=str(b["created"])),
        "no model": lambda b: b.pop("model"),
        "no finish_reason": lambda b: b["choices"][0].pop("finish_reason"),
        "an unknown finish_reason": lambda b: b["choices"][0].update(finish_reason="done"),
        "content as a number": lambda b: b["choices"][0]["message"].update(content=5),
        "arguments as an object": lambda b: b["choices"][0]["message"]["tool_calls"][0]["function"].update(
            arguments={}),
        "an unnamed extra field": lambda b: b["choices"][0]["message"].update(thoughts="..."),
        "usage tokens as floats": lambda b: b["usage"].update(prompt_tokens=1.5),
    }
    for name, mutate in breaks.items():
        broken = copy.deepcopy(answer)
        mutate(broken)
        assert problems("CreateChatCompletionResponse", broken), f"{name} passed the check"


def test_every_difference_has_a_reason() -> None:
    assert all(len(why) > 20 for fields in DIFFERENCES.values() for _, why in fields.values())
