"""Scenario markers of ``fleet sim`` (see fleet/sim/scenarios.py), against a real process."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from fleet.sim.scenarios import FAULTS, ScenarioBook
from fleet.sim.server import SimProcess, start_sim_process
from tests.support.sim_client import metric, stats, user, wait_for


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    proc = start_sim_process(speed=200.0, seed=11, log_level="warning")
    yield proc
    proc.stop()


@pytest.fixture
def client(sim: SimProcess) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=sim.base_url + "/v1", api_key="x", max_retries=0)
    yield c
    c.close()


def reasoning_of(resp: Any) -> str:
    return (resp.choices[0].message.model_extra or {}).get("reasoning") or ""


def sse_lines(sim: SimProcess, text: str) -> tuple[int, list[str], Exception | None]:
    body = {"model": "local", "messages": user(text), "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", sim.base_url + "/v1/chat/completions", json=body,
                      timeout=30) as resp:
        try:
            for line in resp.iter_lines():
                if line:
                    lines.append(line)
        except httpx.HTTPError as exc:
            return resp.status_code, lines, exc
    return resp.status_code, lines, None


def test_normal_reasoning_does_not_repeat(client: openai.OpenAI) -> None:
    text = reasoning_of(client.chat.completions.create(
        model="local", messages=user("[sim:think=3000] [sim:answer=5] plain"), max_tokens=4000))
    sentences = [s for s in re.split(r"(?<=[.?])\s+", text) if s]
    assert len(sentences) > 100
    assert len(set(sentences)) == len(sentences)


def test_loop_repeats_a_paragraph_exactly_until_max_tokens(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="local", messages=user("[sim:loop] go"),
                                          max_tokens=1_500)
    paragraphs = [p for p in reasoning_of(resp).split("\n\n") if p.strip()]
    assert resp.choices[0].finish_reason == "length" and not resp.choices[0].message.content
    repeated = max(set(paragraphs[1:]), key=paragraphs.count)
    assert paragraphs.count(repeated) >= 4


def test_loop_fuzzy_near_duplicates(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="local", messages=user("[sim:loop_fuzzy] go"),
                                          max_tokens=1_500)
    paragraphs = [p for p in reasoning_of(resp).split("\n\n") if p.strip()][-5:-1]
    assert len(paragraphs) >= 3 and len(set(paragraphs)) == len(paragraphs)
    for a, b in zip(paragraphs, paragraphs[1:], strict=False):
        wa, wb = a.split(), b.split()
        same = sum(x == y for x, y in zip(wa, wb, strict=False))
        assert same >= len(wa) - 3


def test_loop_short_repeats_a_passage_with_edits_in_one_paragraph(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="local", messages=user("[sim:loop_short] go"),
                                          max_tokens=3_000)
    assert resp.choices[0].finish_reason == "length" and not resp.choices[0].message.content
    reasoning = reasoning_of(resp)
    lead, loop = reasoning.rsplit("\n\n", 1)
    assert "\n" not in loop and len(loop) > 4 * len(lead)  # a lead, then one endless paragraph
    loop = loop.lower()
    opening = " ".join(re.sub(r"\d+", "#", loop).split()[:6])  # numbers aside
    starts = re.compile(re.escape(opening).replace("\\#", r"\d+").replace("\\ ", r"\s+"))
    repetitions = [r for r in starts.split(loop) if r.strip()]
    assert len(repetitions) >= 8  # the passage keeps coming back...
    masked = {re.sub(r"\d+", "#", r) for r in repetitions}
    assert len(set(repetitions)) > len(masked)  # ...with its numbers redrawn


def test_slow_first_token_and_stall_in_simulated_time(sim: SimProcess,
                                                      client: openai.OpenAI) -> None:
    httpx.post(sim.base_url + "/sim/reset")
    client.chat.completions.create(
        model="local", messages=user("[sim:slow_first_token=60] [sim:think=20] [sim:answer=5] a"))
    ttft = metric(sim, "vllm:time_to_first_token_seconds_sum")
    assert ttft >= 60.0
    client.chat.completions.create(
        model="local", messages=user("[sim:stall=90] [sim:think=40] [sim:answer=5] b"))
    assert metric(sim, "vllm:time_to_first_token_seconds_sum") - ttft < 5.0
    assert metric(sim, "vllm:e2e_request_latency_seconds_sum") >= 60.0 + 90.0


def test_http_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="local", messages=user("[sim:http500] x"))
    with pytest.raises(openai.APIStatusError) as busy:
        client.chat.completions.create(model="local", messages=user("[sim:http503] x"))
    assert busy.value.status_code == 503
    assert busy.value.body["type"] == "ServiceUnavailableError"


def test_drop_closes_without_done(sim: SimProcess) -> None:
    status, lines, error = sse_lines(sim, "[sim:drop] [sim:think=400] bye")
    assert status == 200 and isinstance(error, httpx.RemoteProtocolError)
    assert any('"reasoning"' in line for line in lines)
    assert "data: [DONE]" not in lines
    wait_for(sim, lambda s: s["running"] == 0)


def test_error_event_mid_stream(sim: SimProcess, client: openai.OpenAI) -> None:
    status, lines, error = sse_lines(sim, "[sim:error_event] [sim:think=400] oops")
    assert status == 200 and error is None
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == 500
    assert any('"reasoning"' in line for line in lines[:-2])
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(
                model="local", messages=user("[sim:error_event] [sim:think=400] sdk"),
                stream=True):
            pass


def test_bad_json_and_empty(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    resp = client.chat.completions.create(
        model="local", messages=user("[sim:bad_json] [sim:think=10] j"),
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    with pytest.raises(ValueError):
        json.loads(resp.choices[0].message.content or "")
    empty = client.chat.completions.create(
        model="local", messages=user("[sim:empty] [sim:think=30] e"))
    assert empty.choices[0].finish_reason == "stop" and not empty.choices[0].message.content
    assert reasoning_of(empty)


def test_prompt_pad_counts_as_prompt(sim: SimProcess, client: openai.OpenAI) -> None:
    messages = user("[sim:prompt_pad=40000] [sim:think=5] [sim:answer=5] pad")
    count = httpx.post(sim.base_url + "/tokenize", json={"messages": messages}).json()["count"]
    resp = client.chat.completions.create(model="local", messages=messages)
    assert resp.usage.prompt_tokens == count + 40_000
    assert stats(sim)["max_long_running_seen"] >= 1


def test_marker_limited_to_first_k_requests(client: openai.OpenAI) -> None:
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="local",
                                           messages=user("[sim:http500/2] [sim:think=5] k"))
    ok = client.chat.completions.create(model="local",
                                        messages=user("[sim:http500/2] [sim:think=5] k"))
    assert ok.choices[0].finish_reason in ("stop", "length")
    other_first = [{"role": "user", "content": "another task"}, {"role": "assistant",
                   "content": "ok"}, {"role": "user", "content": "[sim:http500/2] k"}]
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="local", messages=other_first)


def test_prefix_cache_hits_on_shared_system_prompt(sim: SimProcess,
                                                   client: openai.OpenAI) -> None:
    system = " ".join(f"rule {i}: keep answers short and exact." for i in range(400))
    before = stats(sim)["prefix_cache_hits"]
    for i in range(3):
        client.chat.completions.create(model="local", max_tokens=3, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}])
    hits = stats(sim)["prefix_cache_hits"] - before
    assert hits > 0 and hits % 1072 == 0


def test_request_log(sim: SimProcess, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="local", messages=user("[sim:think=3] logged"),
                                   extra_body={"request_id": "log-me"})
    last = httpx.get(sim.base_url + "/sim/requests", params={"limit": 1}).json()["requests"]
    assert last[0]["id"] == "log-me"
    assert last[0]["body"]["messages"][0]["content"].endswith("logged")


def test_the_request_log_names_a_prompts_blocks_alike_in_every_simulator(sim: SimProcess,
                                                                         client: openai.OpenAI) -> None:
    """Equal prompts log equal block hashes in two simulator processes (what the routing bench's
    oracle compares across servers); another cache_salt changes every block."""
    other = start_sim_process(speed=200.0, seed=12, log_level="warning")
    long_text = " ".join(f"w{i % 97}" for i in range(4_000))
    try:
        logged = []
        for base_url, salt in ((sim.base_url, None), (other.base_url, None), (other.base_url, "p2")):
            with openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0) as c:
                c.chat.completions.create(model="local", max_tokens=2, messages=user(long_text),
                                          extra_body={"cache_salt": salt} if salt else {})
            logged.append(httpx.get(base_url + "/sim/requests", params={"limit": 1}).json()["requests"][0])
    finally:
        other.stop()
    plain, again, salted = logged
    assert plain["prompt_tokens"] == again["prompt_tokens"] == salted["prompt_tokens"] > 2 * 1072
    assert len(plain["blocks"]) == plain["prompt_tokens"] // 1072 >= 2
    assert plain["blocks"] == again["blocks"]
    assert not set(plain["blocks"]) & set(salted["blocks"])


def test_fault_rate_is_seeded() -> None:
    draws = [[ScenarioBook(seed=3, fault_rate=0.5).resolve("x", "x").active for _ in range(1)]
             for _ in range(2)]
    assert draws[0] == draws[1]
    book = ScenarioBook(seed=3, fault_rate=1.0)
    faults = [next(iter(book.resolve("x", "x").active)) for _ in range(40)]
    assert set(faults) == set(FAULTS)
    assert not ScenarioBook(seed=3, fault_rate=0.0).resolve("x", "x").active


def test_dead_engine_fails_inflight_and_health(sim: SimProcess, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="local", messages=user("[sim:think=200000] victim"), stream=True)
    next(iter(stream))
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="local", messages=user("[sim:dead] die"))
    assert httpx.get(sim.base_url + "/health").status_code == 503
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    httpx.post(sim.base_url + "/sim/reset")
    assert httpx.get(sim.base_url + "/health").status_code == 200


def test_a_crashing_request_streams_then_takes_the_engine_down(sim: SimProcess, client: openai.OpenAI) -> None:
    """``crash``: the request's stream opens (200) and streams reasoning, then the engine dies:
    this stream breaks, another in flight fails, /health answers 503 until the engine is back."""
    bystander = client.chat.completions.create(
        model="local", messages=user("[sim:think=200000] bystander"), stream=True)
    next(iter(bystander))
    status, lines, error = sse_lines(sim, "[sim:crash] [sim:think=400] the poison")
    assert status == 200 and error is not None  # an open stream, cut without [DONE]
    assert any('"reasoning"' in line for line in lines) and "data: [DONE]" not in lines
    assert httpx.get(sim.base_url + "/health").status_code == 503
    with pytest.raises(openai.APIError):
        for _ in bystander:
            pass
    httpx.post(sim.base_url + "/sim/revive")
    assert httpx.get(sim.base_url + "/health").status_code == 200


def _cached(client: openai.OpenAI, messages: list[dict[str, Any]], salt: str | None) -> int:
    extra = {"cache_salt": salt} if salt is not None else {}
    answer = client.chat.completions.create(model="local", max_tokens=3, messages=messages,
                                            extra_body=extra)
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return answer.usage.prompt_tokens_details.cached_tokens or 0


def test_a_prompt_cached_under_one_salt_never_hits_under_another(client: openai.OpenAI) -> None:
    """As vLLM: the salt goes into the first block's hash, so the whole chain differs; requests
    without a salt share the unsalted chain. Before, the simulator ignored ``cache_salt``."""
    document = " ".join(f"clause {i} of the salted contract." for i in range(600))
    doc = [{"role": "user", "content": document}]
    assert _cached(client, doc, "salt-of-beta") == 0
    hit = _cached(client, doc, "salt-of-beta")
    assert hit > 0 and hit % 1072 == 0  # the same salt: whole blocks
    assert _cached(client, doc, "salt-of-alpha") == 0
    assert _cached(client, doc, None) == 0
    assert _cached(client, doc, None) == hit


def test_a_cache_salt_must_be_a_non_empty_string(client: openai.OpenAI) -> None:
    for bad in ("", 7, ["x"]):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="local", messages=user("hi"),
                                           extra_body={"cache_salt": bad})
        assert refused.value.body["param"] == "cache_salt"
