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

from fleet.core.usage import UsageLedger
from fleet.core.usagereport import totals
from tests.support.fleet_harness import FleetProbe, Harness
from tests.support.gateway_support import config_with_keys

pytestmark = pytest.mark.slow

CACHED = {"repeat_cache": {"enabled": True, "wait_s": 30}}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, dict[str, str]]]:
    config, keys = config_with_keys(tmp_path_factory.mktemp("fleet-rcache"),
                                    projects={"assistant": CACHED, "research": CACHED},
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
