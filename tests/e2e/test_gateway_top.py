"""``fleet top`` counts what the gateway served: chat completions through a real ``fleet gateway``
(with ``fleet sim`` and a dispatcher as processes, no inference worker: gateway requests need
none), then ``fleet top --once`` as an operator runs it. The project's results stream, which
producers' consumer groups read, still holds only the jobs they submitted."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from fleet.cli.top import WINDOW_S
from tests.support.fleet_harness import TEST_BROKER, Harness
from tests.support.gateway_support import config_with_keys

pytestmark = pytest.mark.slow

REQUESTS = 5


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, dict[str, str]]]:
    config, keys = config_with_keys(tmp_path_factory.mktemp("gateway-top"), backend={"max_num_seqs": 2},
                                    admission={"backend_gate": False, "worker_gate": False})
    with Harness(config, sim_speed=100, workers=0, gateway=True) as harness:
        yield harness, keys


def fleet_cli(harness: Harness, *args: str) -> str:
    env = {**os.environ, "FLEET_CONFIG": str(harness.fleet.config_path), "FLEET_BROKER_URL": TEST_BROKER,
           "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "fleet", *args], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def top_rows(harness: Harness) -> dict[str, list[str]]:
    """``fleet top --once``'s project rows: project -> pending, finished, mean wait s, tokens/s."""
    out = subprocess.CompletedProcess([], 0, fleet_cli(harness, "top", "--once"))
    rows = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 6:  # ... and waiting (deferred jobs), last
            rows[cells[0]] = cells[1:5]
    return rows


def test_fleet_top_counts_gateway_completions(fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, keys = fleet
    url = f"http://127.0.0.1:{harness.settings.gateway.port}/v1/chat/completions"
    completion_tokens, ids = 0, []
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {keys['assistant']}"}) as client:
        for n in range(REQUESTS):
            reply = client.post(url, json={"model": "local", "messages": [
                {"role": "user", "content": f"Question {n}. [sim:think=20] [sim:answer=10]"}]})
            assert reply.status_code == 200, reply.text
            completion_tokens += reply.json()["usage"]["completion_tokens"]
            ids.append(reply.json()["id"].removeprefix("chatcmpl-"))
    row = top_rows(harness)["assistant"]
    assert row[1] == str(REQUESTS), row
    assert row[2] != "-" and row[3] == f"{completion_tokens / WINDOW_S:.1f}", row
    # Not added to the stream producers' consumer groups read: they did not submit these.
    assert harness.client.redis.xlen(harness.client.keys.results("assistant")) == 0
    # One request by its id (the completion's, without "chatcmpl-"): its final event and code,
    # the same record `fleet status` reads; Flower has none of it (no Celery task).
    tail = fleet_cli(harness, "tail", "--no-follow", f"assistant/{ids[0]}")
    assert "final" in tail and '"code": "OK"' in tail, tail
