"""A gateway request its backend cut goes on (``gateway.fail_over``, fleet/gateway/chat.py) on a
REAL fleet: the gateway, a dispatcher, ``fleet sim`` processes, the official ``openai`` SDK.

- A streamed reasoning dropped half-way (``[sim:drop/1]``) with ``routing.continue_cut_turns =
  "continue"``: the client's one stream goes on where it stopped (as long as a stream that was
  never cut, so nothing came twice), the rest through ``/v1/completions``, the answer's usage the
  thought once and the answer; the stream ends OK and the store holds nothing of it after.
- The same with ``restart``: the reasoning already reached the client, so the stream ends with the
  backend's error (a restart would stream the reasoning twice) and nothing is continued.
- Two replicas, the editor's request with tools (not streamed, so nothing reached the client):
  the replica running it is killed, the request runs again on the other and the client gets one
  answer from it (``x-fleet-backend``).
- ``fail_over = 0``: the cut is the client's error, as it was before; a backend that cuts every
  attempt is tried ``fail_over`` + 1 times, then the error is the client's.
- A backend whose template does not open ``<think>`` cannot continue: a request not streamed
  runs again, a streamed one whose reasoning went out ends with the error.
- Each grant's quota reservation is settled with its own attempts.
- A cut request that finds no seat again ends E_QUEUE_TIMEOUT (429); a spent retry budget does not stop a
  first failover, and stops a second; three replicas dropping every stream are tried once each.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from fleet.core.usage import UsageLedger
from fleet.core.usagereport import totals
from schedulers.policy.quota import Windows
from tests.support.fleet_harness import Harness, kill_the_busy_backend
from tests.support.gateway_support import METRICS_AUTH, config_with_keys
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

SIM_ARGS = ["--answer-min-tokens", "20", "--answer-max-tokens", "40"]
THINK = 1200  # within the test project's thinking budget: the whole thought is generated
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "a tool of the editor",
                                           "parameters": {"type": "object", "properties": {}}}}
         for i in range(8)]
# the editor's project as a deployment sets it up: the editor runs its own tools, all of them allowed
# (the example's assistant allows two names only, and the gateway removes the others)
EDITOR = {"assistant": {"allowed_tools": [t["function"]["name"] for t in TOOLS]}}


def replica(name: str) -> dict[str, Any]:
    return {"name": name, "url": "http://127.0.0.1:1", "served_model_names": ["local"], "max_num_seqs": 4,
            "max_model_len": 262144, "kv_pool_tokens": 530000, "max_num_batched_tokens": 2048,
            "block_tokens": 1072, "long_prompt_tokens": 32768, "max_long": 3}


def stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/sim/stats", timeout=10).json()


def paths(url: str) -> list[str]:
    logged = httpx.get(f"{url}/sim/requests", params={"limit": 2000}, timeout=10).json()["requests"]
    return [entry.get("path") for entry in logged]


def sdk(fleet: Harness, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{fleet.settings.gateway.port}/v1", api_key=key,
                         max_retries=0, timeout=120)


def streamed(client: openai.OpenAI, text: str) -> tuple[str, str, str | None, Any, Any]:
    """Reasoning, content, finish reason, the last chunk's fleet fields and the usage of one stream."""
    reasoning, content, finish, fleet_of, usage = [], [], None, None, None
    with client.chat.completions.create(model="local", stream=True, stream_options={"include_usage": True},
                                        messages=[{"role": "user", "content": text}]) as stream:
        for chunk in stream:
            extra = chunk.model_extra or {}
            fleet_of = extra.get("fleet", fleet_of)
            usage = chunk.usage.model_dump() if chunk.usage is not None else usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            reasoning.append((delta.model_extra or {}).get("reasoning") or "")
            content.append(delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(reasoning), "".join(content), finish, fleet_of, usage


def test_a_streamed_reasoning_cut_by_its_backend_continues_in_the_same_stream(tmp_path) -> None:
    config, keys = config_with_keys(tmp_path, routing={"continue_cut_turns": "continue"})
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True) as fleet:
        client = sdk(fleet, keys["assistant"])
        whole = streamed(client, f"[sim:think={THINK}] [sim:answer=30] a stream never cut")[0]
        httpx.post(f"{fleet.backend_url}/sim/reset", timeout=10)
        reasoning, content, finish, fleet_of, usage = streamed(
            client, f"[sim:think={THINK}] [sim:drop/1] [sim:answer=30] add")
        assert finish == "stop" and content, (finish, content)
        assert fleet_of is not None and fleet_of.get("code") == "OK", fleet_of
        # both parts of the thought in the one stream, none of it twice: as long as an uncut one
        assert 0.8 * len(whole) < len(reasoning) < 1.2 * len(whole), (len(reasoning), len(whole))
        sent = paths(fleet.backend_url)
        assert sent.count("/v1/chat/completions") == 1 and sent.count("/v1/completions") == 2, sent
        # the engine's own count: the reasoning once (the cut half, then the rest), and the answer
        # what the engine generated for it: the cut half, the rest of the thought, the answer
        assert usage is not None and usage["completion_tokens"] == THINK + 30, usage
        assert usage["completion_tokens_details"]["reasoning_tokens"] == THINK, usage
        store = fleet.client.keys.dispatch  # nothing of the request is left: no lease, item, reservation
        assert not any(fleet.client.redis.hlen(f"{store}{name}") for name in ("lease", "items", "qres"))


def test_with_restart_a_streamed_reasoning_cut_ends_with_the_backends_error(tmp_path) -> None:
    config, keys = config_with_keys(tmp_path, routing={"continue_cut_turns": "restart"})
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True) as fleet:
        with pytest.raises(openai.APIError) as caught:
            streamed(sdk(fleet, keys["assistant"]), f"[sim:think={THINK}] [sim:drop/1] [sim:answer=30] add")
        assert "E_STREAM_DROPPED" in str(caught.value.body), caught.value.body
        assert paths(fleet.backend_url) == ["/v1/chat/completions"]


def _killed_under(fleet: Harness, start: Any) -> tuple[str, Any]:
    """Start a request, kill the replica that is thinking on it; (victim, the request's future)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    future = pool.submit(start)
    pool.shutdown(wait=False)
    return kill_the_busy_backend(fleet, THINK // 3), future


def test_a_request_with_tools_whose_replica_dies_runs_again_on_the_other(tmp_path) -> None:
    config, keys = config_with_keys(tmp_path, EDITOR, backends=[replica("a"), replica("b")],
                                    retry={"backoff_base_s": 0.05, "backoff_max_s": 0.2})
    with Harness(config, sim_speed=20, sim_args=SIM_ARGS, gateway=True) as fleet:
        client = sdk(fleet, keys["assistant"])
        messages = [{"role": "user", "content": f"[sim:think={THINK}] [sim:answer=30] plan the change"}]
        victim, future = _killed_under(fleet, lambda: client.chat.completions.with_raw_response.create(
            model="local", messages=messages, tools=TOOLS))
        raw = future.result(timeout=180)
        answer = raw.parse()
        survivor = "b" if victim == "a" else "a"
        assert raw.headers["x-fleet-backend"] == survivor
        sent = httpx.get(f"{fleet.sim_urls[survivor]}/sim/requests", timeout=10).json()["requests"]
        assert len(sent[0]["body"]["tools"]) == len(TOOLS)  # the tools went with it
        assert answer.choices[0].finish_reason in ("stop", "tool_calls")
        assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
        assert paths(fleet.sim_urls[survivor]).count("/v1/chat/completions") == 1
        metrics = httpx.get(f"http://127.0.0.1:{fleet.settings.gateway.port}/metrics", headers=METRICS_AUTH,
                            timeout=10).text
        assert f'fleet_gateway_failovers_total{{backend="{victim}",how="restart",project="assistant"}} 1.0' \
            in metrics


def test_a_streamed_reasoning_whose_replica_dies_continues_on_the_other(tmp_path) -> None:
    config, keys = config_with_keys(tmp_path, backends=[replica("a"), replica("b")],
                                    routing={"continue_cut_turns": "continue"},
                                    retry={"backoff_base_s": 0.05, "backoff_max_s": 0.2})
    with Harness(config, sim_speed=20, sim_args=SIM_ARGS, gateway=True) as fleet:
        client = sdk(fleet, keys["assistant"])
        victim, future = _killed_under(fleet, lambda: streamed(client, f"[sim:think={THINK}] [sim:answer=30] far"))
        reasoning, content, finish, fleet_of, usage = future.result(timeout=180)
        survivor = "b" if victim == "a" else "a"
        assert finish == "stop" and content and fleet_of.get("code") == "OK", (finish, fleet_of)
        assert fleet_of.get("backend") == survivor  # the stream's last chunk names who finished it
        assert paths(fleet.sim_urls[survivor]) == ["/v1/completions", "/v1/completions"]
        assert stats(fleet.sim_urls[survivor])["generation_tokens"] < THINK  # only the rest of it
        assert len(reasoning) > 4 * THINK * 0.8
        assert usage is not None and usage["completion_tokens"] == THINK + 30, usage


def test_with_fail_over_off_the_cut_is_the_clients_error(tmp_path) -> None:
    config, keys = config_with_keys(tmp_path, gateway={"fail_over": 0})
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True) as fleet:
        with pytest.raises(openai.APIStatusError) as caught:
            sdk(fleet, keys["assistant"]).chat.completions.create(
                model="local", messages=[{"role": "user", "content": "[sim:think=400] [sim:drop/1] add"}])
        assert caught.value.response.headers.get("x-fleet-code") == "E_STREAM_DROPPED"
        assert paths(fleet.backend_url) == ["/v1/chat/completions"]


def test_a_failed_over_request_spends_its_quota_once_per_attempt(tmp_path) -> None:
    """Each grant reserves its worst case; the cut one is settled with what its attempt spent
    before the request goes back in line, the new one with the rest: the minute's token counter
    ends equal to what the usage ledger counted for both attempts, nothing left reserved."""
    quota = {"tokens_per_minute": 200_000, "requests_per_minute": 100}
    config, keys = config_with_keys(tmp_path, projects={"research": {"quota": quota}})
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True) as fleet:
        left = Windows.at(time.time()).minute_end - time.time()
        if left < 20:  # what the test counts falls in one window
            time.sleep(left + 0.2)
        answer = sdk(fleet, keys["research"]).chat.completions.create(
            model="local", messages=[{"role": "user", "content": "[sim:think=600] [sim:drop/1] [sim:answer=20] sum"}])
        assert answer.choices[0].message.content
        redis, prefix = fleet.client.redis, fleet.client.keys.dispatch
        # the last grant is settled once the answer went out: wait for it, then read the minute
        wait_until(lambda: not redis.hgetall(f"{prefix}qres"), 10, "the reservations settled")
        minute = redis.hgetall(f"{prefix}quota:research:m:{Windows.at(time.time()).minute}")
        ledger = UsageLedger(redis, fleet.client.keys, fleet.settings.usage)
        now = time.time()

        def counted() -> dict[str, int]:
            return totals(ledger.read("research", now - 3600, now + 3600))

        wait_until(lambda: counted()["requests"] == 2, 10, "both attempts in the ledger")
        spent = counted()
        assert int(minute[b"t"]) == spent["prompt_tokens"] + spent["reasoning_tokens"] + spent["answer_tokens"]
        assert int(minute[b"r"]) == 2  # two model requests, as a job's two turns count


def test_a_backend_that_cuts_every_attempt_is_tried_fail_over_plus_one_times(tmp_path) -> None:
    config, keys = config_with_keys(tmp_path, gateway={"fail_over": 2})
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True) as fleet:
        with pytest.raises(openai.APIStatusError) as caught:
            sdk(fleet, keys["assistant"]).chat.completions.create(
                model="local", messages=[{"role": "user", "content": "[sim:think=400] [sim:drop] add"}])
        assert caught.value.response.headers.get("x-fleet-code") == "E_STREAM_DROPPED"
        assert paths(fleet.backend_url) == ["/v1/chat/completions"] * 3


def test_a_template_that_cannot_continue_runs_a_request_again_or_ends_a_stream(tmp_path) -> None:
    config, keys = config_with_keys(tmp_path, routing={"continue_cut_turns": "continue"})
    with Harness(config, sim_speed=50, sim_args=[*SIM_ARGS, "--chat-template", "plain"], gateway=True) as fleet:
        client = sdk(fleet, keys["assistant"])
        ask = [{"role": "user", "content": f"[sim:think={THINK}] [sim:drop/1] [sim:answer=30] a"}]
        answer = client.chat.completions.create(model="local", messages=ask)
        assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.content
        assert paths(fleet.backend_url) == ["/v1/chat/completions"] * 2  # run again, nothing continued
        with pytest.raises(openai.APIError) as caught:
            streamed(client, f"[sim:think={THINK}] [sim:drop/1] [sim:answer=30] b")
        assert "E_STREAM_DROPPED" in str(caught.value.body), caught.value.body
        assert "/v1/completions" not in paths(fleet.backend_url)


def test_a_client_that_leaves_while_its_request_waits_to_fail_over_leaves_nothing(tmp_path) -> None:
    """One seat: A is cut and goes back in line behind B, which holds the seat; A's client gives
    up while A waits. A never runs again, and once B is answered the store holds no lease, item
    or reservation of either."""
    config, keys = config_with_keys(tmp_path, backend={"max_num_seqs": 1}, gateway={"max_queue_wait_s": 60})
    with Harness(config, sim_speed=2, sim_args=SIM_ARGS, gateway=True) as fleet:
        from concurrent.futures import ThreadPoolExecutor

        def ask(text: str, timeout_s: float) -> Any:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{fleet.settings.gateway.port}/v1",
                                   api_key=keys["assistant"], max_retries=0, timeout=timeout_s)
            return client.chat.completions.create(model="local", messages=[{"role": "user", "content": text}])

        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(ask, "[sim:think=400] [sim:drop/1] [sim:answer=10] a", 4.0)
            wait_until(lambda: stats(fleet.backend_url)["running"] == 1, 30, "A running")
            b = pool.submit(ask, "[sim:think=1200] [sim:answer=10] b", 120.0)  # ~7 s: past A's 4 s
            with pytest.raises(openai.APITimeoutError):
                a.result(timeout=60)
            assert b.result(timeout=120).choices[0].message.content
        sent = [entry["body"]["messages"][0]["content"][-1] for entry in
                httpx.get(f"{fleet.backend_url}/sim/requests", timeout=10).json()["requests"]]
        assert sent == ["a", "b"], sent  # A was cut once and never sent again
        store = fleet.client.keys.dispatch
        wait_until(lambda: not any(fleet.client.redis.hlen(f"{store}{name}") for name in ("lease", "items", "qres")),
                   10, "nothing left in the store")


def test_a_cut_request_that_finds_no_seat_again_ends_with_the_queue_timeout(tmp_path) -> None:
    """One seat: A is cut and goes back in line behind B, which holds the seat past A's wait
    (max_queue_wait_s). A's client gets the 429 E_QUEUE_TIMEOUT with Retry-After that a full fleet
    gives, saying its backend cut it; A is not sent again and B is answered."""
    config, keys = config_with_keys(tmp_path, backend={"max_num_seqs": 1}, gateway={"max_queue_wait_s": 3})
    with Harness(config, sim_speed=2, sim_args=SIM_ARGS, gateway=True) as fleet:
        from concurrent.futures import ThreadPoolExecutor

        client = sdk(fleet, keys["assistant"])

        def ask(text: str) -> Any:
            return client.chat.completions.create(model="local", messages=[{"role": "user", "content": text}])

        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(ask, "[sim:think=400] [sim:drop/1] [sim:answer=10] a")
            wait_until(lambda: stats(fleet.backend_url)["running"] == 1, 30, "A running")
            b = pool.submit(ask, "[sim:think=1800] [sim:answer=10] b")  # ~10 s: past A's 3 s
            with pytest.raises(openai.RateLimitError) as caught:
                a.result(timeout=60)
            assert b.result(timeout=120).choices[0].message.content
        response = caught.value.response
        assert response.headers.get("x-fleet-code") == "E_QUEUE_TIMEOUT"
        assert response.headers.get("retry-after") == "3"
        assert "cut by its backend" in str(caught.value.body), caught.value.body
        sent = [entry["body"]["messages"][0]["content"][-1] for entry in
                httpx.get(f"{fleet.backend_url}/sim/requests", timeout=10).json()["requests"]]
        assert sent == ["a", "b"], sent


def test_a_first_failover_is_free_and_a_second_is_paid_by_the_requests_project(tmp_path) -> None:
    """A crash cuts every stream on its server, the request that caused it or not, so a first
    failover is not paid from the project's retry budget (a token would charge the projects of
    the streams it cut); a request cut again is the likelier cause and its project pays. With
    the budget spent (and no credit per first attempt, budget_ratio 0): a request cut once goes
    back and is answered; one cut every time goes to the backend twice, not fail_over + 1 times,
    and the cut is its error."""
    from fleet.infer.retrying import RetryBudget

    config, keys = config_with_keys(tmp_path, retry={"budget_ratio": 0.0})
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True) as fleet:
        later = time.time() + 600  # written "later": no reserve trickles in while the test runs
        bucket = RetryBudget(fleet.client.redis, fleet.client.keys, "assistant", 0.0, clock=lambda: later)
        while bucket.try_spend():
            pass
        client = sdk(fleet, keys["assistant"])
        answer = client.chat.completions.create(
            model="local", messages=[{"role": "user", "content": "[sim:think=400] [sim:drop/1] add"}])
        assert answer.choices[0].message.content
        assert paths(fleet.backend_url) == ["/v1/chat/completions"] * 2
        httpx.post(f"{fleet.backend_url}/sim/reset", timeout=10).raise_for_status()
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(
                model="local", messages=[{"role": "user", "content": "[sim:think=400] [sim:drop] add"}])
        assert caught.value.response.headers.get("x-fleet-code") == "E_STREAM_DROPPED"
        assert paths(fleet.backend_url) == ["/v1/chat/completions"] * 2


def test_a_request_cut_on_every_backend_tries_each_of_three_once(tmp_path) -> None:
    """Three replicas, each dropping every stream: a failover never returns to a backend that
    cut the request while another is left, so its three attempts (fail_over 2) meet the three
    replicas once each, and the last backend's error is the client's."""
    config, keys = config_with_keys(tmp_path, backends=[replica("a"), replica("b"), replica("c")],
                                    gateway={"fail_over": 2})
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True) as fleet:
        with pytest.raises(openai.APIStatusError) as caught:
            sdk(fleet, keys["assistant"]).chat.completions.create(
                model="local", messages=[{"role": "user", "content": "[sim:think=400] [sim:drop] add"}])
        assert caught.value.response.headers.get("x-fleet-code") == "E_STREAM_DROPPED"
        assert {name: paths(url) for name, url in fleet.sim_urls.items()} == {
            name: ["/v1/chat/completions"] for name in ("a", "b", "c")}


def test_the_editors_streamed_request_with_tools_cut_mid_reasoning_continues_to_its_tool_call(tmp_path) -> None:
    """The editor streams with its tools; its reasoning is cut half-way (``[sim:drop/1]``) after
    the client has it. With ``continue`` the same stream goes on: the rest of the thought, then
    the tool call the model writes, read from the completions route's text as the chat route
    would (one call, its JSON arguments, finish_reason "tool_calls"), no markup in the content."""
    config, keys = config_with_keys(tmp_path, EDITOR, routing={"continue_cut_turns": "continue"})
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True) as fleet:
        client = sdk(fleet, keys["assistant"])
        reasoning, content, calls, finish, fleet_of = [], [], {}, None, None
        with client.chat.completions.create(
                model="local", stream=True, tools=TOOLS,
                messages=[{"role": "user", "content": f"[sim:think={THINK}] [sim:drop/1] [sim:tool=tool_3] edit"}],
        ) as stream:
            for chunk in stream:
                fleet_of = (chunk.model_extra or {}).get("fleet", fleet_of)
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                reasoning.append((delta.model_extra or {}).get("reasoning") or "")
                content.append(delta.content or "")
                for call in delta.tool_calls or []:
                    slot = calls.setdefault(call.index, {"name": "", "arguments": "", "id": None})
                    slot["id"] = call.id or slot["id"]
                    slot["name"] += (call.function.name or "") if call.function else ""
                    slot["arguments"] += (call.function.arguments or "") if call.function else ""
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and fleet_of is not None and fleet_of.get("code") == "OK", (finish, fleet_of)
        assert [c["name"] for c in calls.values()] == ["tool_3"] and calls[0]["id"]
        assert isinstance(json.loads(calls[0]["arguments"]), dict)
        assert "<tool_call>" not in "".join(content) and "".join(reasoning)
        sent = paths(fleet.backend_url)
        assert sent.count("/v1/chat/completions") == 1 and sent.count("/v1/completions") == 2, sent


def test_a_stream_cut_in_its_answer_goes_on_after_the_text_the_client_has(tmp_path) -> None:
    """Cut 100 tokens into its answer (``[sim:drop=500/1]`` after a 400-token thought): with
    ``continue`` the stream goes on after the text its client has, nothing of it twice (as long
    as an uncut answer), the rest from one completions request (the thought had ended), OK."""
    config, keys = config_with_keys(tmp_path, routing={"continue_cut_turns": "continue"})
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True) as fleet:
        client = sdk(fleet, keys["assistant"])
        _r, whole, _f, _fl, _u = streamed(client, "[sim:think=400] [sim:answer=200] an answer never cut")
        httpx.post(f"{fleet.backend_url}/sim/reset", timeout=10)
        reasoning, content, finish, fleet_of, _usage = streamed(
            client, "[sim:think=400] [sim:answer=200] [sim:drop=500/1] sum")
        assert finish == "stop" and fleet_of is not None and fleet_of.get("code") == "OK", (finish, fleet_of)
        assert 0.8 * len(whole) < len(content) < 1.2 * len(whole), (len(content), len(whole))
        assert paths(fleet.backend_url) == ["/v1/chat/completions", "/v1/completions"]
        # the continuation's prompt ends with the answer text the client had: what came after it
        # in the client's stream is the rest, in order
        logged = httpx.get(f"{fleet.backend_url}/sim/requests", timeout=10).json()["requests"]
        ids = next(e["body"]["prompt"] for e in logged if e.get("path") == "/v1/completions")
        prompt = httpx.post(f"{fleet.backend_url}/detokenize", json={"model": "local", "tokens": ids},
                            timeout=10).json()["prompt"]
        said = prompt[prompt.rindex("</think>") + len("</think>"):].lstrip("\n")
        assert len(said) > 50 and content.startswith(said) and len(content) > len(said), (said, content)


def test_an_answer_under_a_response_format_cut_after_its_text_began_ends_with_the_error(tmp_path) -> None:
    config, keys = config_with_keys(tmp_path, routing={"continue_cut_turns": "continue"})
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True) as fleet:
        with pytest.raises(openai.APIError) as caught, sdk(fleet, keys["assistant"]).chat.completions.create(
                model="local", stream=True, response_format={"type": "json_object"},
                messages=[{"role": "user", "content": "[sim:think=400] [sim:drop=420/1] sum"}]) as stream:
            for _chunk in stream:
                pass
        assert "E_STREAM_DROPPED" in str(caught.value.body), caught.value.body
        assert paths(fleet.backend_url) == ["/v1/chat/completions"]
