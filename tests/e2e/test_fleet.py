"""The fleet end to end: real Redis, a real simulator, dispatcher and Celery worker processes."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from fleet.core.codes import Code
from tests.support.fleet_harness import Harness, make_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    config = make_config(tmp_path_factory.mktemp("fleet"), admission={"lease_ttl_s": 5})
    with Harness(config) as harness:
        yield harness


def ask(project: str, text: str, **extra) -> dict:
    return {"project": project, "messages": [{"role": "user", "content": text}],
            "thinking_budget": 2000, **extra}


def test_round_trip_for_every_project(fleet):
    ids = {p: fleet.client.submit(ask(p, f"[sim:think=300] [sim:answer=40] hello from {p}"))
           for p in fleet.settings.projects}
    for project, job_id in ids.items():
        envelope = fleet.client.result(job_id, timeout=120)
        assert envelope is not None, project
        assert envelope.code == Code.OK, (project, envelope.code, envelope.message)
        assert envelope.project == project and envelope.content
        assert envelope.usage.completion_tokens > 0 and envelope.usage.prompt_tokens > 0
        assert envelope.attempts and envelope.timings.total_s is not None
        # the backend that served it: the one [backend] of these settings
        assert envelope.backend == fleet.settings.backend.name == "default"
        assert {attempt.backend for attempt in envelope.attempts} == {"default"}
        status = fleet.client.status(job_id)
        assert status["state"] == "final" and status["code"] == "OK"


def test_bad_jobs_end_with_their_code_and_the_worker_keeps_going(fleet):
    client = fleet.client
    malformed = client.submit_raw(
        {"id": "m1", "project": "triage", "messages": "not a list", "colour": "red"},
        project="triage", job_id="m1")
    forged = client.submit_raw(ask("reports", "x") | {"id": "f1"}, project="reports",
                               job_id="f1", secret="not-the-real-secret")
    ghost = client.submit_raw(ask("ghost", "x") | {"id": "g1"}, project="ghost", job_id="g1",
                              secret="whatever-secret")
    assert client.result(malformed, timeout=60).code == Code.E_INPUT_INVALID
    forged_env = client.result(forged, timeout=60)
    assert forged_env.code == Code.E_AUTH and "bad signature" in forged_env.message
    assert client.result(ghost, timeout=60).code == Code.E_AUTH
    rejections = client.redis.xrange(client.keys.rejections)
    assert {f[b"job_id"] for _, f in rejections} >= {b"f1", b"g1"}
    reports = client.redis.xrange(client.keys.results("reports"))
    assert all(json.loads(f[b"envelope"])["job_id"] != "f1" for _, f in reports)
    after = client.submit(ask("triage", "[sim:think=200] still alive?"))
    assert client.result(after, timeout=60).code == Code.OK
    assert fleet.fleet.check() == []


def test_idempotency_key_returns_the_first_job(fleet):
    first = fleet.client.submit(ask("research", "[sim:think=100] once", idempotency_key="k-1"))
    second = fleet.client.submit(ask("research", "[sim:think=100] once", idempotency_key="k-1"))
    assert first == second
    assert fleet.client.result(first, timeout=60).code == Code.OK


def test_cancel_a_running_job_closes_its_stream(fleet):
    job_id = fleet.client.submit(ask("reports", "[sim:stall=100000] wait forever"))
    for event in fleet.client.events(job_id, idle_timeout_s=60):
        if event["type"] in ("attempt", "reasoning"):
            break
    assert fleet.client.cancel(job_id) is True
    envelope = fleet.client.result(job_id, timeout=30)
    assert envelope.code == Code.E_CANCELLED
    stats = httpx.get(f"{fleet.backend_url}/sim/stats", timeout=5).json()
    assert stats["running"] == 0


def test_batch_cli_writes_one_line_per_input(fleet, tmp_path):
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "local", "messages": [{"role": "user", "content": "[sim:think=100] a"}]}},
        "this line is broken",
        {"messages": [{"role": "user", "content": "[sim:think=100] b"}], "metadata": {"n": 2}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    env = dict(fleet.fleet.env)
    run = subprocess.run([sys.executable, "-m", "fleet", "batch", str(src), "--project", "triage",
                          "--wait", "--out", str(out), "--timeout", "120"],
                         env=env, capture_output=True, text=True, timeout=180)
    # written as they arrive: the refused line at once, the answers when they come
    rows = sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda r: r["custom_id"])
    assert [r["custom_id"] for r in rows] == ["a", "line-2", "line-3"]
    assert [r["code"] for r in rows] == ["OK", "E_INPUT_INVALID", "OK"]
    assert rows[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert run.returncode == 1  # one line failed
