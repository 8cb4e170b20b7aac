"""Quotas in a real fleet: ``fleet sim``, a dispatcher, an inference worker and ``fleet gateway``
as processes on the test Redis, clients on the official ``openai`` SDK and the fleet's own.

- research (``over = "refuse"``, 3 requests a minute): each answer carries OpenAI's
  ``x-ratelimit-*`` headers counting down; the fourth request in the minute is a 429 the SDK
  raises as ``RateLimitError``, with ``Retry-After`` and code E_QUOTA_EXCEEDED; another
  project's key spends none of research's quota. A request larger than the token quota is a
  400 (asking again never helps).
- triage (``over = "wait"``, 2,900 a minute, jobs reserving ~1,250 and spending ~80): two jobs go
  at once, the third waits (hold ``quota``) until the first one's turn settles and gives back
  what it did not spend, then runs in the same minute; the minute's counter then equals what the
  usage ledger counted for the three turns.
- translate (1,000 tokens a day, jobs reserving more than 8,000): refused by prep,
  E_INPUT_INVALID naming the quota, never admitted.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from fleet.cli.queues import queues_table
from fleet.cli.top import read_frame, render
from fleet.core.apikeys import digest, mint
from fleet.core.codes import Code
from fleet.core.usage import UsageLedger, key_label
from fleet.core.usagereport import totals
from schedulers.policy.quota import Windows
from schedulers.store.keyquota import KeyQuotas
from tests.support.fleet_harness import Harness
from tests.support.gateway_support import config_with_keys
from tests.support.rendering import rendered

pytestmark = pytest.mark.slow

SIM_ARGS = ["--think-min-tokens", "20", "--think-max-tokens", "40",
            "--answer-min-tokens", "5", "--answer-max-tokens", "10"]
TRIAGE_TPM = 2_900


LIMITED_KEY, LIMITED_ENTRY = mint()  # an assistant key with a quota of its own
FREE_KEY, FREE_ENTRY = mint()  # another assistant key, without one
TASK_KEY, TASK_ENTRY = mint()  # a key whose tasks are refused past 2 requests a minute
WAIT_KEY, WAIT_ENTRY = mint()  # a key whose tasks wait past 1 request a minute


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, dict[str, str]]]:
    config, keys = config_with_keys(
        tmp_path_factory.mktemp("fleet-quota"),
        projects={
            "assistant": {"api_keys": [LIMITED_ENTRY, FREE_ENTRY, TASK_ENTRY, WAIT_ENTRY], "key_quotas": {
                key_label(digest(LIMITED_KEY)): {"requests_per_minute": 2, "over": "refuse"},
                key_label(digest(TASK_KEY)): {"requests_per_minute": 2, "over": "refuse"},
                key_label(digest(WAIT_KEY)): {"requests_per_minute": 1, "over": "wait"}}},
            "research": {"quota": {"requests_per_minute": 3, "tokens_per_minute": 10_000, "over": "refuse"}},
            "triage": {"thinking_budget": 1000, "content_reserve": 200,
                       "quota": {"tokens_per_minute": TRIAGE_TPM, "requests_per_minute": 100}},
            "translate": {"quota": {"tokens_per_day": 1_000}},
        },
        backend={"max_num_seqs": 8},
        admission={"backend_gate": False},
    )
    with Harness(config, sim_speed=100, sim_args=SIM_ARGS, workers=1, gateway=True) as harness:
        yield harness, keys


def _early_in_a_minute(margin_s: float = 12.0) -> None:
    """Wait until at least ``margin_s`` of the current UTC minute are left, so that what a test
    counts falls in one quota window."""
    left = Windows.at(time.time()).minute_end - time.time()
    if left < margin_s:
        time.sleep(left + 0.2)


def _quota_minute(harness: Harness, project: str) -> dict[bytes, bytes]:
    minute = Windows.at(time.time()).minute
    return harness.client.redis.hgetall(f"{harness.client.keys.dispatch}quota:{project}:m:{minute}")


def test_the_gateway_counts_down_then_answers_429_with_retry_after(fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, keys = fleet
    base = f"http://127.0.0.1:{harness.settings.gateway.port}/v1"
    client = openai.OpenAI(base_url=base, api_key=keys["research"], max_retries=0)
    other = openai.OpenAI(base_url=base, api_key=FREE_KEY, max_retries=0)
    _early_in_a_minute()
    messages = [{"role": "user", "content": f"Quota {uuid.uuid4().hex}. [sim:think=20] [sim:answer=5]"}]
    remaining = []
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(model="local", messages=messages, max_tokens=300)
        assert raw.parse().choices[0].message.content
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        assert raw.headers["x-ratelimit-limit-tokens"] == "10000"
        assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
        remaining.append(int(raw.headers["x-ratelimit-remaining-requests"]))
        # another project's key, in between: research's quota does not move
        assert other.chat.completions.create(model="local", messages=messages, max_tokens=50).choices
    assert remaining == [3, 2, 1]
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="local", messages=messages, max_tokens=300)
    response = refused.value.response
    assert response.headers["x-fleet-code"] == Code.E_QUOTA_EXCEEDED.value
    assert response.json()["error"]["code"] == Code.E_QUOTA_EXCEEDED.value
    assert "requests_per_minute" in response.json()["error"]["message"]
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(_quota_minute(harness, "research")[b"r"]) == 3
    assert _quota_minute(harness, "assistant") == {}  # no quota, nothing reserved


def test_a_request_larger_than_the_token_quota_is_a_400(
        fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, keys = fleet
    response = httpx.post(f"http://127.0.0.1:{harness.settings.gateway.port}/v1/chat/completions",
                          headers={"Authorization": f"Bearer {keys['research']}"}, timeout=30,
                          json={"model": "local", "max_tokens": 70_000,
                                "messages": [{"role": "user", "content": "a long answer, please"}]})
    # asking again never helps: a 400 the SDKs do not retry, not a 429
    assert response.status_code == 400
    assert response.json()["error"]["code"] == Code.E_INPUT_INVALID.value
    assert response.json()["error"]["param"] == "max_tokens"
    assert "smallest token quota" in response.json()["error"]["message"]
    assert "retry-after" not in response.headers


def test_a_job_over_the_minute_waits_for_a_settle_and_the_window_equals_the_ledger(
        fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, _keys = fleet
    _early_in_a_minute(15.0)
    text = "Sort this ticket {}. [sim:think=30] [sim:answer=8]"
    ids = [harness.client.submit({"project": "triage", "messages": [
        {"role": "user", "content": text.format(uuid.uuid4().hex)}]}) for _ in range(3)]
    envelopes = [harness.client.result(job_id, timeout=60) for job_id in ids]
    assert [e.code for e in envelopes] == [Code.OK] * 3
    stats = harness.client.redis.hgetall(f"{harness.client.keys.dispatch}stats")
    assert int(stats.get(b"hold:quota", 0)) >= 1  # the third waited for room
    minute = _quota_minute(harness, "triage")
    ledger = UsageLedger(harness.client.redis, harness.client.keys, harness.settings.usage)
    now = time.time()
    counted = totals(ledger.read("triage", now - 3600, now + 3600))
    spent = counted["prompt_tokens"] + counted["reasoning_tokens"] + counted["answer_tokens"]
    assert counted["requests"] == 3
    assert int(minute[b"t"]) == spent  # reservations settled to the ledger's own figures
    assert int(minute[b"r"]) == 3
    # the setup: two worst cases (prompt + 1,200 each) fit the minute, three do not, so the
    # third ran in this minute only because a settle gave room back
    prompt = counted["prompt_tokens"] / 3
    assert 2 * (prompt + 1_200) <= TRIAGE_TPM < 3 * (prompt + 1_200)
    # what the operator sees: fleet queues and fleet top name the project's window and its holds
    held = int(stats[b"quota_held:triage"])
    queues = rendered(queues_table(harness.settings, harness.client.redis), width=300)
    row = next(line for line in queues.splitlines() if line.strip("│ ").startswith("triage"))
    assert f"{spent:,}/2,900 t/min" in row and row.rstrip(" │").endswith(str(held)), row
    top = rendered(render(read_frame(harness.settings, harness.client.redis, time.time()), live=False), width=300)
    assert f"{spent:,}/2,900 t/min · 3/100 req/min (held {held}x)" in top, top


def test_a_job_larger_than_the_day_quota_is_refused_before_admission(fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, _keys = fleet
    job_id = harness.client.submit({"project": "translate", "messages": [
        {"role": "user", "content": "Translate: bonjour"}]})
    envelope = harness.client.result(job_id, timeout=30)
    assert envelope.code == Code.E_INPUT_INVALID
    assert "smallest token quota (1,000)" in envelope.message
    assert not envelope.attempts


def test_an_api_key_quota_binds_that_key_only(fleet: tuple[Harness, dict[str, str]]) -> None:
    """assistant's limited key: two requests a minute, the third a 429 naming the key's limit;
    the project's other key goes on, and spends nothing of the limited key's quota."""
    harness, _keys = fleet
    base = f"http://127.0.0.1:{harness.settings.gateway.port}/v1"
    limited = openai.OpenAI(base_url=base, api_key=LIMITED_KEY, max_retries=0)
    free = openai.OpenAI(base_url=base, api_key=FREE_KEY, max_retries=0)
    _early_in_a_minute()
    messages = [{"role": "user", "content": f"Key {uuid.uuid4().hex}. [sim:think=10] [sim:answer=5]"}]
    for _ in range(2):
        raw = limited.chat.completions.with_raw_response.create(model="local", messages=messages, max_tokens=200)
        assert raw.headers["x-ratelimit-limit-requests"] == "2"
    with pytest.raises(openai.RateLimitError) as refused:
        limited.chat.completions.create(model="local", messages=messages, max_tokens=200)
    assert "this API key's requests_per_minute = 2" in refused.value.response.json()["error"]["message"]
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 60
    for _ in range(3):  # the other key of the same project: not held, and not counted
        assert free.chat.completions.create(model="local", messages=messages, max_tokens=200).choices
    quotas = KeyQuotas(harness.client.redis, harness.client.keys)
    assert quotas.used("assistant", key_label(digest(LIMITED_KEY)), time.time())[1] == 2
    assert quotas.used("assistant", key_label(digest(FREE_KEY)), time.time()) == (0, 0, 0, 0)


def _task(base: str, key: str, text: str) -> str:
    reply = httpx.post(f"{base}/tasks", headers={"authorization": f"Bearer {key}"}, timeout=30,
                       json={"messages": [{"role": "user", "content": text}], "max_tokens": 200})
    assert reply.status_code == 200, reply.text
    return str(reply.json()["id"])


def test_a_keys_quota_binds_its_tasks_with_its_chat_requests(fleet: tuple[Harness, dict[str, str]]) -> None:
    """Jobs the gateway submits for a key (/v1/tasks) reserve that key's quota at each turn's claim,
    in the same windows as its chat requests: one chat request and one task fill a key's two
    requests a minute, and its next task ends E_QUOTA_EXCEEDED naming the key's limit (``over =
    "refuse"``); a key with ``over = "wait"`` has its second task wait, holding no slot, until
    the minute resets, then run."""
    harness, _keys = fleet
    base = f"http://127.0.0.1:{harness.settings.gateway.port}/v1"
    client, label = harness.client, key_label(digest(TASK_KEY))
    _early_in_a_minute()
    text = f"Task {uuid.uuid4().hex}. [sim:think=10] [sim:answer=5]"
    chat = openai.OpenAI(base_url=base, api_key=TASK_KEY, max_retries=0)
    assert chat.chat.completions.create(model="local", messages=[{"role": "user", "content": text}],
                                        max_tokens=200).choices
    first = client.result(_task(base, TASK_KEY, text), timeout=60, project="assistant")
    assert first is not None and first.code.ok, first
    second = client.result(_task(base, TASK_KEY, text), timeout=60, project="assistant")
    assert second is not None and second.code == Code.E_QUOTA_EXCEEDED and not second.attempts
    assert f"quota of API key {label}: requests_per_minute 2 reached" in second.message
    assert KeyQuotas(client.redis, client.keys).used("assistant", label, time.time())[1] == 2
    # over = "wait": the second task of the minute runs once the minute is over
    minute_end = Windows.at(time.time()).minute_end
    waited = client.result(_task(base, WAIT_KEY, text), timeout=60, project="assistant")
    assert waited is not None and waited.code.ok
    if time.time() >= minute_end - 1:  # the first crossed the minute itself: the next one's turn
        minute_end = Windows.at(time.time()).minute_end
    held_id = _task(base, WAIT_KEY, text)
    held = client.result(held_id, timeout=90, project="assistant")
    assert held is not None and held.code.ok and held.attempts
    assert held.attempts[0].started_at >= minute_end  # sent to vLLM only in the next minute
