"""What the gateway gives away or spends on a hostile request, against a real ``fleet gateway``
process on the test Redis (no dispatcher, no backend):

- JSON nested past ``MAX_JSON_DEPTH`` (fleet/core/limits.py) on any route that reads a JSON body is
  400 ``E_INPUT_INVALID`` naming the field, with no traceback in the gateway's log: 100,000 levels
  (which Python's parser cannot even read) and a few hundred (which it can, and which would reach
  every recursive walker after it); a body at the limit still goes through;
- ``/metrics`` answers only a metrics key (``gateway.metrics_keys``), never a project's API key or
  no key at all: its figures are every project's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from fleet.core.apikeys import mint
from fleet.core.config import load_settings
from fleet.core.limits import MAX_JSON_DEPTH
from tests.support.gateway_support import config_with_keys, lone_gateway
from tests.support.testenv import TEST_REDIS_URL, delete_prefix


@dataclass
class Door:
    url: str
    log: Path
    keys: dict[str, str]
    metrics_key: str

    def headers(self, project: str = "translate") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[project]}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    metrics_key, entry = mint()
    config, keys = config_with_keys(
        tmp_path_factory.mktemp("gateway-exposure"),
        backend={"url": "http://127.0.0.1:9"},  # nothing listens there: token counts are estimates
        gateway={"max_queue_wait_s": 0.2, "metrics_keys": [entry]},
        admission={"backend_gate": False})
    with lone_gateway(config) as (url, _process):
        yield Door(url, config.with_name("gateway.log"), keys, metrics_key)
    client = redis.Redis.from_url(TEST_REDIS_URL)
    delete_prefix(client, load_settings(config, env={}).key_prefix)
    client.close()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


HI = [{"role": "user", "content": "hi"}]


def body(shape: object, inner: str) -> bytes:
    """``shape`` as JSON with its ``"NEST"`` string replaced by ``inner`` (JSON text too deep for
    ``json.dumps`` to write)."""
    return json.dumps(shape).replace('"NEST"', inner).encode()


def test_json_nested_too_deep_is_400_naming_the_field_on_every_json_route(door: Door) -> None:
    deep, shallow = nested(100_000), nested(MAX_JSON_DEPTH + 1)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"a": "NEST"}}}
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": "NEST"}}
    cases = [
        ("/v1/chat/completions", body({"model": "local", "messages": "NEST"}, deep), "messages"),
        ("/v1/chat/completions", body({"model": "local", "messages": HI, "tools": [tool]}, nested(500)),
         "tools"),
        ("/v1/chat/completions", body({"model": "local", "messages": HI, "response_format": schema}, deep),
         "response_format"),
        ("/v1/tasks", body({"messages": HI, "metadata": {"a": "NEST"}}, shallow), "metadata"),
        ("/v1/tasks", deep.encode(), None),
        ("/v1/batches", body({"input_file_id": "NEST", "endpoint": "/v1/chat/completions"}, deep),
         "input_file_id"),
    ]
    for path, content, param in cases:
        reply = httpx.post(f"{door.url}{path}", content=content, headers=door.headers(), timeout=30)
        assert reply.status_code == 400, (path, param, reply.text)
        error = reply.json()["error"]
        assert (error["code"], error["param"]) == ("E_INPUT_INVALID", param), (path, error)
        assert f"nested deeper than {MAX_JSON_DEPTH}" in error["message"], error
    log = door.log.read_text(encoding="utf-8", errors="replace")
    assert "Traceback" not in log and "E_INTERNAL" not in log and "RecursionError" not in log, log[-3000:]


def test_json_nested_up_to_the_limit_is_read(door: Door) -> None:
    # the body's own object and "metadata"'s take two levels: the innermost list is level MAX
    content = body({"messages": HI, "metadata": {"a": "NEST"}}, nested(MAX_JSON_DEPTH - 2))
    reply = httpx.post(f"{door.url}/v1/tasks", content=content, headers=door.headers(), timeout=30)
    assert reply.status_code == 200, reply.text


def test_metrics_answer_only_a_metrics_key(door: Door) -> None:
    url = f"{door.url}/metrics"
    # a request counted under a project, so there is something to give away
    httpx.post(f"{door.url}/v1/chat/completions", headers=door.headers("assistant"), timeout=30,
               json={"model": "local", "messages": [{"role": "user", "content": "hi"}], "n": 2})
    for headers in ({}, {"Authorization": f"Bearer {door.keys['assistant']}"},
                    {"Authorization": "Bearer fk-not-a-metrics-key"}):
        reply = httpx.get(url, headers=headers, timeout=10)
        assert reply.status_code == 401, (headers, reply.text)
        assert reply.json()["error"]["code"] == "E_AUTH"
        assert "assistant" not in reply.text
    reply = httpx.get(url, headers={"Authorization": f"Bearer {door.metrics_key}"}, timeout=10)
    assert reply.status_code == 200, reply.text
    assert 'fleet_gateway_requests_total{code="E_INPUT_INVALID",project="assistant"}' in reply.text
