"""The gateway when its Redis goes away, and at its edges: a real ``fleet gateway`` process on a
Redis of the test's own (AOF on) that the tests stop and start again, called with httpx and the
official ``openai`` SDK.

- task-event streams ride out a Redis restart (a follower resumes after its last event, a first
  follow after the restart gets the whole stream), and a Redis that stays away ends a stream with
  an ``event: error`` carrying ``E_BROKER_UNAVAILABLE``, never a silent empty 200;
- while Redis is down, chat and task routes answer 503 ``E_BROKER_UNAVAILABLE`` with Retry-After,
  ``/health`` answers 503 naming Redis and ``/livez`` 200;
- a request body over ``gateway.max_body_bytes`` is 413 ``E_TOO_LARGE``, declared or streamed;
- a wrong method is 405 with a code and ``Allow``, a trailing slash is 404, not a bare redirect.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis

from fleet.core.codes import Code
from fleet.core.config import Settings, load_settings
from fleet.core.keys import Keys
from fleet.core.models import Envelope
from fleet.core.results import ResultStore
from tests.support.fleet_harness import RestartableRedis
from tests.support.gateway_support import config_with_keys, lone_gateway
from tests.support.waiting import wait_until

MAX_BODY_BYTES = 64_000
BROKER_WAIT_S = 1.0


@dataclass
class Door:
    url: str
    keys: dict[str, str]
    broker: RestartableRedis
    settings: Settings

    def headers(self, project: str = "translate") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[project]}"}

    def results(self) -> ResultStore:
        return ResultStore(redis.Redis.from_url(self.broker.url), Keys(self.settings.key_prefix), self.settings)


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    broker = RestartableRedis()
    config, keys = config_with_keys(
        tmp_path_factory.mktemp("gateway-robust"), broker_url=broker.url,
        backend={"url": "http://127.0.0.1:9"},  # nothing listens there: token counts are estimates
        gateway={"max_body_bytes": MAX_BODY_BYTES, "broker_wait_s": BROKER_WAIT_S},
        admission={"backend_gate": False})
    try:
        with lone_gateway(config) as (url, _process):
            yield Door(url, keys, broker, load_settings(config, env={}))
    finally:
        broker.close()


def submit(door: Door) -> str:
    made = httpx.post(f"{door.url}/v1/tasks", headers=door.headers(), timeout=30,
                      json={"messages": [{"role": "user", "content": "follow me"}]})
    assert made.status_code == 200, made.text
    return str(made.json()["id"])


def events_of(lines: Iterator[str], most: int | None = None) -> list[tuple[str, object]]:
    """(type, data) of the SSE events until the stream ends (or ``most`` of them)."""
    seen: list[tuple[str, object]] = []
    kind = ""
    for line in lines:
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            seen.append((kind, json.loads(line.removeprefix("data: "))))
            if len(seen) == most:
                break
    return seen


def chat() -> dict[str, object]:
    return {"model": "local", "messages": [{"role": "user", "content": "hello"}]}


def test_task_events_ride_out_a_redis_restart(door: Door) -> None:
    task_id = submit(door)
    url = f"{door.url}/v1/tasks/{task_id}/events"
    with httpx.stream("GET", url, headers=door.headers(), timeout=60) as before:
        lines = before.iter_lines()
        first = events_of(lines, most=1)
        door.broker.stop()
        door.broker.start()
        # The first follow after the restart: the whole stream, not an empty 200.
        with httpx.stream("GET", url, headers=door.headers(), timeout=60) as after:
            assert after.status_code == 200
            door.results().publish(Envelope.failure(task_id, "translate", Code.E_CANCELLED, "test over"))
            seen_after = events_of(after.iter_lines())
        rest = events_of(lines)
    assert [kind for kind, _ in seen_after][-1] == "final"
    assert seen_after[0] == first[0]
    # The follower from before resumes after its last event: the final one, nothing twice.
    assert [kind for kind, _ in rest] == [kind for kind, _ in seen_after[1:]]


def test_a_redis_that_stays_away_ends_an_event_stream_with_a_coded_error(door: Door) -> None:
    task_id = submit(door)
    try:
        with httpx.stream("GET", f"{door.url}/v1/tasks/{task_id}/events", headers=door.headers(),
                          timeout=60) as stream:
            lines = stream.iter_lines()
            events_of(lines, most=1)
            door.broker.stop()
            seen = events_of(lines)
    finally:
        door.broker.start()
    kind, data = seen[-1]
    assert kind == "error"
    assert data["error"]["code"] == "E_BROKER_UNAVAILABLE"  # type: ignore[index]


def test_while_redis_is_down_requests_get_503_with_a_code_and_health_says_why(door: Door) -> None:
    sdk = openai.OpenAI(base_url=f"{door.url}/v1", api_key=door.keys["translate"], max_retries=0)
    door.broker.stop()
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            sdk.chat.completions.create(**chat())  # type: ignore[call-overload]
        assert caught.value.status_code == 503
        assert caught.value.code == "E_BROKER_UNAVAILABLE"
        assert caught.value.response.headers["retry-after"]
        for method, path in (("POST", "/v1/tasks"), ("GET", "/v1/tasks/some-task")):
            answer = httpx.request(method, f"{door.url}{path}", headers=door.headers(), timeout=30,
                                   json={"messages": [{"role": "user", "content": "x"}]})
            assert answer.status_code == 503, (method, path, answer.text)
            assert answer.json()["error"]["code"] == "E_BROKER_UNAVAILABLE"
            assert str(door.broker.port) not in answer.text  # where the broker is stays inside
            assert answer.headers["retry-after"]
        health = httpx.get(f"{door.url}/health", timeout=30)
        assert health.status_code == 503
        assert health.json()["redis"] != "ok"
        assert httpx.get(f"{door.url}/livez", timeout=30).status_code == 200
    finally:
        door.broker.start()
    wait_until(lambda: httpx.get(f"{door.url}/health", timeout=30).status_code == 200, 30,
               "the gateway is ready again")
    assert httpx.get(f"{door.url}/health", timeout=30).json()["redis"] == "ok"


def test_a_body_over_max_body_bytes_is_413_declared_or_streamed(door: Door) -> None:
    big = json.dumps({**chat(), "messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]}).encode()

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        for start in range(0, len(big), 4096):
            yield big[start:start + 4096]

    for path in ("/v1/chat/completions", "/v1/tasks", "/v1/batches"):  # batches: not before
        for content in (big, chunks()):
            answer = httpx.post(f"{door.url}{path}", headers={**door.headers(), "content-type": "application/json"},
                                content=content, timeout=30)
            assert answer.status_code == 413, (path, answer.text)
            error = answer.json()["error"]
            assert error["code"] == "E_TOO_LARGE" and "max_body_bytes" in error["message"]
    small = httpx.post(f"{door.url}/v1/tasks", headers=door.headers(), timeout=30,
                       json={"messages": [{"role": "user", "content": "x" * 1000}]})
    assert small.status_code == 200, small.text


def test_a_wrong_method_is_405_with_a_code_and_a_trailing_slash_is_not_a_redirect(door: Door) -> None:
    wrong = httpx.get(f"{door.url}/v1/chat/completions", headers=door.headers(), timeout=30)
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "E_INPUT_INVALID"
    assert wrong.json()["error"]["type"] == "MethodNotAllowedError"
    put = httpx.put(f"{door.url}/v1/files", headers=door.headers(), timeout=30)
    assert put.status_code == 405 and put.headers["allow"] == "GET, HEAD, POST"
    slash = httpx.get(f"{door.url}/v1/files/", headers=door.headers(), timeout=30)
    assert slash.status_code == 404
    assert slash.json()["error"]["code"] == "E_NOT_FOUND"
