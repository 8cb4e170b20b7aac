"""The exact-repeat cache in a real fleet: ``fleet sim``, a dispatcher and ``fleet gateway`` as
processes, clients on the official ``openai`` SDK. ``assistant`` and ``research`` opt in.

- A repeat of a temperature-0 request is answered from the first answer: the simulator sees one
  request, the second answer says ``cached`` (body, ``X-Fleet-Cache``), streamed or not, and the
  ledger counts a cache hit, no model request.
- Eight identical requests at once make one model request (no stampede); all eight get the
  same answer.
- A sampling request (temperature above 0, no seed) is never served from the cache.
- Another project sending the very same request runs it: caches are per project.
- ``fleet cache stats`` shows the hits; ``fleet cache clear`` drops the answers, and the next
  repeat runs again.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from fleet.cli.queues import queues_table
from fleet.cli.top import read_frame, render
from fleet.core.usage import UsageLedger
from fleet.core.usagereport import totals
from tests.support.fleet_harness import FleetProbe, Harness
from tests.support.gateway_support import config_with_keys
from tests.support.rendering import rendered

pytestmark = pytest.mark.slow

CACHED = {"repeat_cache": {"enabled": True, "wait_s": 30}}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, dict[str, str]]]:
    config, keys = config_with_keys(tmp_path_factory.mktemp("fleet-rcache"),
                                    projects={"assistant": CACHED, "research": CACHED,
                                              "triage": {"repeat_cache": {"enabled": True, "wait_s": 1.5}}},
                                    backend={"max_num_seqs": 16}, admission={"backend_gate": False})
    with Harness(config, sim_speed=50, workers=1, gateway=True) as harness:
        yield harness, keys


def _client(harness: Harness, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{harness.settings.gateway.port}/v1", api_key=key,
                         max_retries=0)


def _sim_requests(harness: Harness) -> int:
    return int(httpx.get(f"{harness.backend_url}/sim/stats", timeout=10).json()["total_requests"])


def _ask(client: openai.OpenAI, text: str, **extra: object) -> tuple[str, dict[str, str], dict]:
    raw = client.chat.completions.with_raw_response.create(
        model="local", messages=[{"role": "user", "content": text}], max_tokens=400, **extra)
    answer = raw.parse()
    return answer.choices[0].message.content or "", dict(raw.headers), answer.model_dump()


def test_a_repeat_is_answered_from_the_first_answer(fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, keys = fleet
    client = _client(harness, keys["assistant"])
    text = f"Summarise ticket {uuid.uuid4().hex}. [sim:think=20] [sim:answer=12]"
    before = _sim_requests(harness)
    first, first_headers, first_body = _ask(client, text, temperature=0)
    assert _sim_requests(harness) == before + 1 and "x-fleet-cache" not in first_headers
    second, headers, body = _ask(client, text, temperature=0)
    assert _sim_requests(harness) == before + 1  # no model request
    assert second == first and headers["x-fleet-cache"] == "hit" and body["cached"] is True
    assert body["usage"]["completion_tokens"] == first_body["usage"]["completion_tokens"]
    # streamed, the same answer
    stream = client.chat.completions.create(model="local", messages=[{"role": "user", "content": text}],
                                            max_tokens=400, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == first
    assert _sim_requests(harness) == before + 1
    ledger = UsageLedger(harness.client.redis, harness.client.keys, harness.settings.usage)
    now = time.time()
    counted = totals(ledger.read("assistant", now - 3600, now + 3600))
    assert counted["cache_hits"] >= 2 and counted["requests"] >= 1


def test_identical_requests_arriving_together_run_once(fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, keys = fleet
    client = _client(harness, keys["assistant"])
    text = f"Classify {uuid.uuid4().hex}. [sim:think=300] [sim:answer=10]"  # long enough to overlap
    before = _sim_requests(harness)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _ask(client, text, seed=7)[0], range(8)))
    assert len(set(answers)) == 1 and answers[0]
    assert _sim_requests(harness) == before + 1
    stats = FleetProbe(harness).cli("cache", "stats", "--project", "assistant")
    assert stats.returncode == 0, stats.stderr
    row = next(line for line in stats.stdout.splitlines() if "assistant" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[1] == "yes" and int(cells[3].replace(",", "")) >= 7 and int(cells[5].replace(",", "")) >= 1


def test_sampling_requests_and_other_projects_are_not_served_from_it(
        fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, keys = fleet
    text = f"Draft a reply {uuid.uuid4().hex}. [sim:think=10] [sim:answer=8]"
    client = _client(harness, keys["assistant"])
    before = _sim_requests(harness)
    for _ in range(2):
        _, headers, _ = _ask(client, text, temperature=0.7)
        assert "x-fleet-cache" not in headers
    assert _sim_requests(harness) == before + 2
    _ask(client, text, temperature=0)  # now kept for assistant ...
    _, headers, body = _ask(_client(harness, keys["research"]), text, temperature=0)
    assert "x-fleet-cache" not in headers and "cached" not in body  # ... never for research
    assert _sim_requests(harness) == before + 4


def test_clear_drops_the_answers(fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, keys = fleet
    client = _client(harness, keys["research"])
    text = f"Check {uuid.uuid4().hex}. [sim:think=10] [sim:answer=8]"
    _ask(client, text, temperature=0)
    assert _ask(client, text, temperature=0)[1].get("x-fleet-cache") == "hit"
    cleared = FleetProbe(harness).cli("cache", "clear", "--project", "research")
    assert cleared.returncode == 0 and "kept answers dropped" in cleared.stdout, cleared.stderr
    before = _sim_requests(harness)
    assert "x-fleet-cache" not in _ask(client, text, temperature=0)[1]
    assert _sim_requests(harness) == before + 1
    unknown = FleetProbe(harness).cli("cache", "clear", "--project", "nobody")
    assert unknown.returncode == 2 and "E_INPUT_INVALID" in unknown.stderr + unknown.stdout


# -- queue jobs (fleet/worker/repeats.py) ------------------------------------------------------
def _job(text: str, project: str = "assistant", **extra: object) -> dict[str, object]:
    return {"project": project, "messages": [{"role": "user", "content": text}], "max_tokens": 600,
            "temperature": 0, **extra}


def test_a_queue_job_repeat_ends_with_the_first_jobs_answer(fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, _ = fleet
    client, text = harness.client, f"Tag invoice {uuid.uuid4().hex}. [sim:think=20] [sim:answer=12]"
    untrusted = [{"role": "user", "content": "Tag it.", "untrusted": False},
                 {"role": "user", "content": f"Pasted from outside: {uuid.uuid4().hex}. [sim:answer=9]",
                  "untrusted": True}]
    before = _sim_requests(harness)
    first = client.result(client.submit(_job(text, metadata={"n": 1})), timeout=60)
    assert first is not None and first.code.ok and not first.cached and first.attempts
    again_id = client.submit(_job(text, metadata={"n": 2}))
    again = client.result(again_id, timeout=60)
    assert again is not None and again.code == first.code and again.cached
    assert again.job_id == again_id and again.metadata == {"n": 2} and again.attempts == []
    assert again.content == first.content and again.reasoning == first.reasoning
    assert again.usage.completion_tokens == 0 and first.usage.completion_tokens > 0  # nothing spent for it
    assert _sim_requests(harness) == before + 1  # no model request, no slot for the repeat
    # another project sending the very same job runs it; a sampling job is never served
    other = client.result(client.submit(_job(text, project="research")), timeout=60)
    assert other is not None and other.code.ok and not other.cached
    sampled = client.result(client.submit(_job(text, temperature=0.7)), timeout=60)
    assert sampled is not None and not sampled.cached
    assert _sim_requests(harness) == before + 3
    # untrusted content is fenced with a new random tag each time: still the same request
    fenced = [client.result(client.submit({**_job(text), "messages": untrusted}), timeout=60) for _ in range(2)]
    assert all(e is not None and e.code.ok for e in fenced)
    assert [bool(e.cached) for e in fenced if e is not None] == [False, True]
    assert _sim_requests(harness) == before + 4


def test_identical_queue_jobs_arriving_together_run_once(fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, _ = fleet
    client = harness.client
    text = f"Route {uuid.uuid4().hex}. [sim:think=400] [sim:answer=10]"  # long enough to overlap
    before = _sim_requests(harness)
    ids = [client.submit(_job(text, seed=11)) for _ in range(6)]
    ends = [client.result(job_id, timeout=120) for job_id in ids]
    assert all(e is not None and e.code.ok for e in ends)
    assert len({e.content for e in ends if e is not None}) == 1
    assert sum(1 for e in ends if e is not None and e.cached) == 5
    assert _sim_requests(harness) == before + 1


def test_when_the_computing_job_fails_a_waiting_one_computes(fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, _ = fleet
    client, probe = harness.client, FleetProbe(harness)
    text = f"Audit {uuid.uuid4().hex}. [sim:think=200] [sim:stall=200] [sim:answer=10]"  # ~4 s
    before = _sim_requests(harness)
    runner = client.submit(_job(text))
    deadline = time.monotonic() + 60
    while probe.state(runner) != "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    waiters = [client.submit(_job(text)) for _ in range(2)]
    deadline = time.monotonic() + 60
    while not all(probe.state(w) == "pending" for w in waiters) and time.monotonic() < deadline:
        time.sleep(0.05)
    # the operator sees them: deferred, in `fleet queues`' waiting column
    queues = rendered(queues_table(harness.settings, harness.client.redis), width=300)
    row = next(line for line in queues.splitlines() if line.strip("│ ").startswith("assistant"))
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[5] == "2", queues
    top = rendered(render(read_frame(harness.settings, harness.client.redis, time.time()), live=False), width=300)
    top_row = next(line for line in top.splitlines() if line.strip("│ ").startswith("assistant"))
    assert top_row.rstrip(" │").endswith("2"), top  # fleet top's last column: waiting
    assert client.cancel(runner)
    ended = client.result(runner, timeout=60)
    assert ended is not None and ended.code.value == "E_CANCELLED"
    ends = [client.result(w, timeout=120) for w in waiters]
    assert all(e is not None and e.code.ok for e in ends)
    assert sorted(bool(e.cached) for e in ends if e is not None) == [False, True]
    assert _sim_requests(harness) == before + 2  # the cancelled runner's and one waiter's


def test_a_waiter_nobody_served_is_served_at_its_claim_or_runs(fleet: tuple[Harness, dict[str, str]]) -> None:
    """``wait_s`` bounds the wait whatever happens to the computing job: a waiter its worker never
    served (here its entry in the waiters' set is gone, as when that worker dies between keeping
    the answer and serving them) is promoted at its not-before time and finds the answer at its
    claim; a waiter whose computing job outlives ``wait_s`` runs itself."""
    harness, _ = fleet
    client, probe, redis_client = harness.client, FleetProbe(harness), harness.client.redis
    text = f"Sort {uuid.uuid4().hex}. [sim:think=100] [sim:stall=50] [sim:answer=10]"  # ~1 s
    before = _sim_requests(harness)
    runner = client.submit(_job(text, project="triage"))
    while probe.state(runner) != "running":
        time.sleep(0.02)
    waiter = client.submit(_job(text, project="triage"))
    deadline = time.monotonic() + 30
    while not list(redis_client.scan_iter(match=harness.client.keys.rcache("triage", "jwait:*"))):
        assert time.monotonic() < deadline, "the second job never waited"
        time.sleep(0.02)
    for key in redis_client.scan_iter(match=harness.client.keys.rcache("triage", "jwait:*")):
        redis_client.delete(key)  # the waiters the computing job's worker would have served
    first, second = client.result(runner, timeout=60), client.result(waiter, timeout=60)
    assert first is not None and first.code.ok and not first.cached
    assert second is not None and second.code == first.code and second.cached
    assert _sim_requests(harness) == before + 1
    # a computing job longer than wait_s: the waiter runs itself once its wait is over
    slow = f"Sort {uuid.uuid4().hex}. [sim:think=100] [sim:stall=250] [sim:answer=10]"  # ~5 s
    runner = client.submit(_job(slow, project="triage"))
    while probe.state(runner) != "running":
        time.sleep(0.02)
    waiter = client.submit(_job(slow, project="triage"))
    second = client.result(waiter, timeout=60)
    first = client.result(runner, timeout=60)
    assert second is not None and second.code.ok and not second.cached and second.attempts
    assert first is not None and first.code.ok
    assert _sim_requests(harness) == before + 3  # it ran, and the answer that came meanwhile did not cut it
