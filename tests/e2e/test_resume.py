"""Continuing a cut reasoning (``routing.continue_cut_turns``, fleet/infer/resume.py) on a REAL fleet:
dispatcher, workers and ``fleet sim`` processes.

- A stream dropped half-way through a 3,000-token reasoning (``[sim:drop/1]``): with ``continue``
  the next turn sends the same prompt with the reasoning so far to ``/v1/completions`` and the
  simulator generates only the rest (its own generation counter says so), the envelope's
  reasoning holds both parts and its last attempt says how many tokens it continued; with
  ``restart`` the whole reasoning is generated again and nothing goes to ``/v1/completions``.
- Two replicas, the one thinking is killed (SIGKILL) half-way: the turn continues on the other.
- A backend whose template does not open ``<think>`` (``fleet sim --chat-template plain``): the
  turn restarts with carry-over and the envelope's warning says why.
- A job with a schema: the continued answer is checked against it like any answer.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from fleet.core.codes import Code
from tests.support.fleet_harness import Harness, kill_the_busy_backend, make_config

pytestmark = pytest.mark.slow

SIM_ARGS = ["--answer-min-tokens", "20", "--answer-max-tokens", "40"]
THINK = 3000
SCHEMA = {"type": "object", "properties": {"total": {"type": "integer"}}, "required": ["total"],
          "additionalProperties": False}


def job(text: str, **extra: Any) -> dict[str, Any]:
    return {"project": "assistant", "messages": [{"role": "user", "content": text}],
            "thinking_budget": 6000, **extra}


def sim_stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/sim/stats", timeout=10).json()


def logged(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/sim/requests", params={"limit": 2000}, timeout=10).json()["requests"]


def config(tmp_path, mode: str, **sections: Any):
    return make_config(tmp_path, routing={"continue_cut_turns": mode},
                       retry={"backoff_base_s": 0.05, "backoff_max_s": 0.2}, **sections)


@pytest.mark.parametrize("mode", ["continue", "restart"])
def test_a_dropped_reasoning_continues_where_it_stopped(tmp_path, mode: str) -> None:
    with Harness(config(tmp_path, mode), sim_speed=50, sim_args=SIM_ARGS) as fleet:
        envelope = fleet.client.result(
            fleet.client.submit(job(f"[sim:think={THINK}] [sim:drop/1] [sim:answer=30] add")), timeout=120)
        assert envelope is not None and envelope.code == Code.OK, envelope
        generated = sim_stats(fleet.backend_url)["generation_tokens"]
        paths = [entry.get("path") for entry in logged(fleet.backend_url)]
        first, last = envelope.attempts[0], envelope.attempts[-1]
        assert len(envelope.attempts) == 2 and first.code == Code.E_STREAM_DROPPED
        half = first.usage.reasoning_tokens  # what the cut stream had generated
        assert THINK // 3 < half < THINK
        assert generated >= half + last.usage.completion_tokens  # the engine's own count agrees
        if mode == "continue":
            assert last.continued_tokens == half
            assert paths.count("/v1/completions") == 2  # the rest of the thought, then the answer
            salts = {e["body"].get("cache_salt") for e in logged(fleet.backend_url)}
            assert len(salts) == 1 and None not in salts  # the project's own prefix cache, always
            # the server's counts: the rest of the thought, then the answer; the half only once
            assert last.usage.completion_tokens == (THINK - half) + 30
            assert last.usage.reasoning_tokens == THINK - half
            assert len(envelope.reasoning or "") > 4 * THINK * 0.8  # both parts of the thought
        else:
            assert last.continued_tokens == 0 and "/v1/completions" not in paths
            assert last.usage.completion_tokens == THINK + 1 + 30


def test_a_turn_cut_by_a_killed_backend_continues_on_the_other(tmp_path) -> None:
    replica = {"served_model_names": ["local"], "max_num_seqs": 4, "max_model_len": 262144,
               "kv_pool_tokens": 530000, "url": "http://127.0.0.1:1", "max_num_batched_tokens": 2048,
               "block_tokens": 1072, "long_prompt_tokens": 32768, "max_long": 3}
    cfg = config(tmp_path, "continue", backends=[{"name": "a", **replica}, {"name": "b", **replica}])
    with Harness(cfg, sim_speed=20, sim_args=SIM_ARGS) as fleet:
        job_id = fleet.client.submit(job(f"[sim:think={THINK}] [sim:answer=30] far"))
        victim = kill_the_busy_backend(fleet, THINK // 3)
        envelope = fleet.client.result(job_id, timeout=180)
        assert envelope is not None and envelope.code == Code.OK, envelope
        survivor = "b" if victim == "a" else "a"
        last = envelope.attempts[-1]
        assert envelope.attempts[0].backend == victim and last.backend == survivor
        assert last.continued_tokens == envelope.attempts[0].usage.reasoning_tokens > THINK // 4
        assert last.usage.reasoning_tokens == THINK - last.continued_tokens
        assert [e.get("path") for e in logged(fleet.sim_urls[survivor])].count("/v1/completions") == 2


def test_a_template_that_does_not_open_think_restarts_with_carry_over(tmp_path) -> None:
    with Harness(config(tmp_path, "continue"), sim_speed=50,
                 sim_args=[*SIM_ARGS, "--chat-template", "plain"]) as fleet:
        envelope = fleet.client.result(
            fleet.client.submit(job(f"[sim:think={THINK}] [sim:drop/1] [sim:answer=30] add")), timeout=120)
        assert envelope is not None and envelope.code == Code.OK, envelope
        assert envelope.attempts[-1].continued_tokens == 0
        assert any("thought again: the backend's chat template does not open <think>" in w
                   for w in envelope.warnings), envelope.warnings
        assert "/v1/completions" not in [e.get("path") for e in logged(fleet.backend_url)]


def test_a_continued_answer_meets_the_jobs_schema(tmp_path) -> None:
    with Harness(config(tmp_path, "continue"), sim_speed=50, sim_args=SIM_ARGS) as fleet:
        envelope = fleet.client.result(fleet.client.submit(job(
            f"[sim:think={THINK}] [sim:drop/1] sum", response_schema=SCHEMA)), timeout=120)
        assert envelope is not None and envelope.code == Code.OK, envelope
        assert envelope.attempts[-1].continued_tokens > 0
        assert set(envelope.parsed) == {"total"}
        answer = [e for e in logged(fleet.backend_url) if e.get("path") == "/v1/completions"][-1]
        assert answer["body"]["response_format"]["json_schema"]["schema"] == SCHEMA


SEARCH = {"type": "function", "function": {"name": "search_docs", "description": "search the docs",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}}, "required": ["query"]}}}


def test_a_cut_turn_with_tools_continues_to_the_call_the_model_makes(tmp_path) -> None:
    """A job that sends tools (the client runs them), cut half-way through its reasoning: the
    continuation thinks the rest and its answer, written as a hermes block on the completions
    route, ends the job as the chat route's tool call would: OK with the call (name, JSON
    arguments) and no markup in the content."""
    with Harness(config(tmp_path, "continue"), sim_speed=50, sim_args=SIM_ARGS) as fleet:
        envelope = fleet.client.result(fleet.client.submit(job(
            f"[sim:think={THINK}] [sim:drop/1] [sim:tool=search_docs] find the invoices", tools=[SEARCH])),
            timeout=120)
        assert envelope is not None and envelope.code == Code.OK, envelope
        assert envelope.attempts[-1].continued_tokens > 0
        [call] = envelope.tool_calls
        assert call["function"]["name"] == "search_docs"
        assert isinstance(json.loads(call["function"]["arguments"])["query"], str)
        assert "<tool_call>" not in (envelope.content or "")
        paths = [entry.get("path") for entry in logged(fleet.backend_url)]
        assert paths.count("/v1/chat/completions") == 1 and paths.count("/v1/completions") == 2, paths
