"""A client's completion limit and the fleet's budget plan, and the usage a client reads, through a
real fleet (``fleet sim``, a dispatcher, a worker, ``fleet gateway``) with the example
configuration, driven by the official ``openai`` SDK: a request's ``max_tokens`` lowers the
thinking budget so the project's content reserve still fits, on the chat path and the queue path
(a batch line) alike, and below the reserve the model answers without thinking; the fleet's code of a
chat reaches its client; ``usage.prompt_tokens_details.cached_tokens`` reaches chat (streamed and
not), batch output lines and the Envelope."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.support.fleet_harness import FleetProbe, Harness
from tests.support.gateway_support import config_with_keys
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

SIM_ARGS = ["--think-min-tokens", "5", "--think-max-tokens", "10",
            "--answer-min-tokens", "3", "--answer-max-tokens", "6"]
# The example configuration's "assistant": thinking budget 1,200, content reserve 1,024.
PROJECT, BUDGET, RESERVE = "assistant", 1200, 1024
LONG_THOUGHT = "[sim:think=3000] [sim:answer=20]"  # thinks until the budget forces the end
DOCUMENT = " ".join(f"Clause {n} of the cached supply contract." for n in range(600))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, dict[str, str]]]:
    config, keys = config_with_keys(tmp_path_factory.mktemp("gateway-budget"),
                                    admission={"backend_gate": False}, gateway={"max_queue_wait_s": 60})
    with Harness(config, sim_speed=400, sim_args=SIM_ARGS, gateway=True) as harness:
        yield harness, keys


@pytest.fixture
def probe(fleet: tuple[Harness, dict[str, str]]) -> FleetProbe:
    return FleetProbe(fleet[0])


def sdk(fleet: tuple[Harness, dict[str, str]], project: str = PROJECT) -> openai.OpenAI:
    harness, keys = fleet
    return openai.OpenAI(base_url=f"http://127.0.0.1:{harness.settings.gateway.port}/v1",
                         api_key=keys[project], max_retries=0, timeout=120)


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


# -- finding: a client's max_tokens left no room for the answer ---------------------------------
def test_max_tokens_lowers_the_thinking_budget_so_the_answer_fits(
    fleet: tuple[Harness, dict[str, str]], probe: FleetProbe,
) -> None:
    """Before: the backend got the limit and the whole budget (1,200 > 1,500 - 1,024), the
    reasoning took what the answer needed."""
    raw = sdk(fleet).chat.completions.with_raw_response.create(
        model="local", max_tokens=1500, messages=user(f"Explain. {LONG_THOUGHT}"))
    answer = raw.parse()
    sent = probe.sim_requests(answer.id.removeprefix("chatcmpl-"))[0]
    assert (sent["thinking_token_budget"], sent["max_completion_tokens"]) == (1500 - RESERVE, 1500)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason == "stop"
    assert raw.headers["x-fleet-code"] == "OK"
    assert raw.headers["x-fleet-backend"] == "default"  # the backend that served it
    assert (answer.model_extra or {})["fleet"] == {"code": "OK", "backend": "default"}


def test_a_stream_cut_by_max_tokens_says_ok_truncated_on_its_last_chunk(
    fleet: tuple[Harness, dict[str, str]], probe: FleetProbe,
) -> None:
    stream = sdk(fleet).chat.completions.create(
        model="local", max_completion_tokens=1100, stream=True, stream_options={"include_usage": True},
        messages=user("Write at length. [sim:think=3000] [sim:answer=2000]"))
    chunks = list(stream)
    sent = probe.sim_requests(chunks[0].id.removeprefix("chatcmpl-"))[0]
    assert (sent["thinking_token_budget"], sent["max_completion_tokens"]) == (1100 - RESERVE, 1100)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert (chunks[-1].model_extra or {})["fleet"] == {"code": "OK_TRUNCATED", "backend": "default"}


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_limit_below_the_content_reserve_is_all_answer_and_no_thinking(
    fleet: tuple[Harness, dict[str, str]], probe: FleetProbe, field: str,
) -> None:
    """The issue's figures: budget 1,200, max_tokens 500. Before: the backend got the whole
    budget, the reasoning took all 500 tokens and the answer came back empty."""
    raw = sdk(fleet).chat.completions.with_raw_response.create(
        model="local", messages=user(f"Hi. {LONG_THOUGHT}"), **{field: 500})
    answer = raw.parse()
    sent = probe.sim_requests(answer.id.removeprefix("chatcmpl-"))[0]
    assert (sent["thinking_token_budget"], sent["max_completion_tokens"]) == (0, 500)
    assert answer.choices[0].message.content


def test_a_batch_line_s_max_tokens_is_planned_as_a_chat_s(
    fleet: tuple[Harness, dict[str, str]], probe: FleetProbe,
) -> None:
    """The queue path plans with the same function. Before: the line's max_tokens became the
    content reserve on top of the whole budget (1,200 + 1,500), and a limit below the reserve
    was sent as it was, beside the whole budget."""
    client = sdk(fleet)
    body = {"model": "local", "max_tokens": 1500, "messages": user(f"Explain. {LONG_THOUGHT}")}
    low = {**body, "max_tokens": 500}
    out, errors, _ = run_batch(client, [("planned", body), ("low", low)])
    line = out["planned"]
    sent = probe.sim_requests(line["response"]["request_id"])[0]
    assert (sent["thinking_token_budget"], sent["max_completion_tokens"]) == (1500 - RESERVE, 1500)
    assert line["code"] == "OK_THINKING_FORCED" and line["response"]["body"]["choices"][0]["message"]["content"]
    assert "low" not in errors, errors
    short = probe.sim_requests(out["low"]["response"]["request_id"])[0]
    assert (short["thinking_token_budget"], short["max_completion_tokens"]) == (0, 500)


# -- finding: cached_tokens always 0 -------------------------------------------------------------
def test_cached_tokens_reach_chat_batch_lines_and_the_envelope(fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, _ = fleet
    client = sdk(fleet)
    warm = client.chat.completions.create(model="local", messages=user(DOCUMENT))
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    block = harness.settings.backend.block_tokens
    assert (warm.usage.prompt_tokens_details.cached_tokens or 0) == 0
    again = client.chat.completions.create(model="local", messages=user(DOCUMENT))
    assert again.usage.prompt_tokens_details.cached_tokens >= 2 * block  # type: ignore[union-attr]
    chunks = list(client.chat.completions.create(
        model="local", messages=user(DOCUMENT), stream=True, stream_options={"include_usage": True}))
    details = chunks[-1].usage.prompt_tokens_details  # type: ignore[union-attr]
    assert details is not None and (details.cached_tokens or 0) >= 2 * block

    out, _, batch = run_batch(client, [("cached", {"model": "local", "messages": user(DOCUMENT)})])
    usage = out["cached"]["response"]["body"]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 2 * block
    assert batch.usage is not None
    assert batch.usage.input_tokens_details.cached_tokens == usage["prompt_tokens_details"]["cached_tokens"]

    job_id = harness.client.submit({"project": PROJECT, "messages": user(DOCUMENT)})
    envelope = harness.client.result(job_id, project=PROJECT, timeout=60)
    assert envelope is not None and envelope.usage.cached_tokens >= 2 * block


def run_batch(client: openai.OpenAI, bodies: list[tuple[str, dict[str, Any]]]
              ) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """An OpenAI batch of ``bodies`` (custom_id, body) run to its end: its output lines and error
    lines by custom_id, and the batch."""
    text = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                               "body": body}) + "\n" for cid, body in bodies).encode()
    uploaded = client.files.create(file=("in.jsonl", text), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b,
                      120, "the batch to complete", every_s=0.2)

    def lines(file_id: str | None) -> dict[str, Any]:
        if not file_id:
            return {}
        rows = [json.loads(row) for row in client.files.content(file_id).text.splitlines()]
        return {row["custom_id"]: row for row in rows}

    return lines(done.output_file_id), lines(done.error_file_id), done
