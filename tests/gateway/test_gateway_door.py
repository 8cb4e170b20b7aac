"""The gateway's door on its own: keys, rotation, the queue-wait limit and task isolation, against a
real ``fleet gateway`` process on the test Redis with no dispatcher and a full fleet: the cap is 1
and the test holds that one slot, so nothing the gateway enqueues is ever admitted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import redis

from fleet.core.apikeys import mint
from fleet.core.codes import Code
from fleet.core.config import load_settings
from fleet.core.keys import Keys
from fleet.core.models import Envelope
from fleet.core.results import ResultStore
from schedulers.store import make_store
from schedulers.store.base import PendingItem
from tests.support.gateway_support import config_with_keys, lone_gateway, set_keys
from tests.support.testenv import TEST_REDIS_URL, delete_prefix
from tests.support.waiting import wait_until

MAX_WAIT_S = 1.0


Door = tuple[str, Path, dict[str, str], subprocess.Popen[bytes]]


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    config, keys = config_with_keys(
        tmp_path_factory.mktemp("gateway-door"),
        # nothing listens on the backend: token counts are estimates
        backend={"url": "http://127.0.0.1:9", "max_num_seqs": 1},
        gateway={"max_queue_wait_s": MAX_WAIT_S, "keepalive_s": 0.2, "reload_check_s": 0.05,
                 "max_file_bytes": 4000, "max_files": 3, "max_batch_lines": 5, "max_batches": 2},
        admission={"lease_ttl_s": 3600, "backend_gate": False},
    )
    settings = load_settings(config, env={})
    store = make_store(settings, redis.Redis.from_url(TEST_REDIS_URL))
    store.add_pending(PendingItem("slot-holder", "research", 10, 10))
    assert store.admit_next(time.time()).grant is not None
    with lone_gateway(config) as (url, process):
        yield url, config, keys, process
    client = redis.Redis.from_url(TEST_REDIS_URL)
    delete_prefix(client, load_settings(config, env={}).key_prefix)
    client.close()


def chat(text: str = "hello") -> dict:
    return {"model": "local", "messages": [{"role": "user", "content": text}]}


def test_a_bad_key_gets_401_with_an_openai_error_body(door: Door) -> None:
    url, _config, _keys, _process = door
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="fk-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        sdk.models.list()
    assert caught.value.status_code == 401
    assert caught.value.code == "E_AUTH"
    missing = httpx.post(f"{url}/v1/chat/completions", json=chat(), timeout=10)
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "E_AUTH"
    assert "Bearer" in missing.json()["error"]["message"]


def test_models_lists_the_backend_model(door: Door) -> None:
    url, _config, keys, _process = door
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["assistant"], max_retries=0)
    assert [m.id for m in sdk.models.list()] == ["local"]


def test_bad_requests_name_the_field_with_a_code(door: Door) -> None:
    url, _config, keys, _process = door
    headers = {"Authorization": f"Bearer {keys['assistant']}"}
    answers = {
        "unknown field": httpx.post(f"{url}/v1/chat/completions", headers=headers,
                                    json={**chat(), "temprature": 1}, timeout=10),
        "no messages": httpx.post(f"{url}/v1/chat/completions", headers=headers,
                                  json={"model": "local", "messages": []}, timeout=10),
        "not json": httpx.post(f"{url}/v1/chat/completions", headers=headers, content=b"{",
                               timeout=10),
    }
    for what, answer in answers.items():
        assert answer.status_code == 400, what
        assert answer.json()["error"]["code"] == "E_INPUT_INVALID", what
    assert "temprature" in answers["unknown field"].json()["error"]["message"]
    other = httpx.post(f"{url}/v1/chat/completions", headers=headers,
                       json={**chat(), "model": "gpt-4"}, timeout=10)
    assert other.status_code == 404 and other.json()["error"]["code"] == "E_NOT_FOUND"


def test_a_wait_past_the_limit_is_429_with_retry_after_and_leaves_no_pending_item(
    door: Door,
) -> None:
    url, config, keys, _process = door
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["reports"], max_retries=0)
    with pytest.raises(openai.RateLimitError) as caught:
        sdk.chat.completions.create(**chat())
    assert caught.value.code == "E_QUEUE_TIMEOUT"
    assert int(caught.value.response.headers["retry-after"]) >= 1
    settings = load_settings(config, env={})
    snapshot = make_store(settings, redis.Redis.from_url(TEST_REDIS_URL)).snapshot()
    assert snapshot.pending.get("reports", {}).get("interactive", 0) == 0


def test_a_batch_key_waits_in_the_batch_band(door: Door) -> None:
    url, config, _keys, _process = door
    key, entry = mint("batch")
    settings = load_settings(config, env={})
    set_keys(config, "assistant", [*settings.projects["assistant"].api_keys, entry])
    store = make_store(settings, redis.Redis.from_url(TEST_REDIS_URL))

    def status() -> int:
        return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                         timeout=10).status_code

    wait_until(lambda: status() == 200, 30, "the gateway to see the batch key")
    seen: list[dict] = []
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, f"{url}/v1/chat/completions", json=chat(), timeout=30,
                             headers={"Authorization": f"Bearer {key}"})
        wait_until(lambda: seen.append(store.snapshot().pending.get("assistant", {})) or seen[-1],
                   30, "the request to wait in line")
        assert answer.result().status_code == 429
    assert seen[-1] == {"batch": 1}


def test_a_waiting_stream_sends_nothing_until_its_wait_ends_in_a_429(door: Door) -> None:
    """The status is decided before the first byte (keep-alives while waiting only with
    gateway.wait_keepalive): a wait that ends is a 429 with Retry-After, which SDKs retry."""
    url, _config, keys, _process = door
    headers = {"Authorization": f"Bearer {keys['triage']}"}
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=headers,
                      json={**chat(), "stream": True}, timeout=30) as response:
        assert response.status_code == 429
        assert int(response.headers["retry-after"]) >= 1
        body = json.loads(response.read())
    assert body["error"]["code"] == "E_QUEUE_TIMEOUT"


def test_keys_rotate_without_a_restart(door: Door) -> None:
    url, config, keys, process = door
    new_key, new_entry = mint()
    newer_key, newer_entry = mint()

    def status(key: str) -> int:
        return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                         timeout=10).status_code

    assert status(new_key) == 401
    set_keys(config, "research", [new_entry])  # the file changes: picked up on its mtime
    wait_until(lambda: status(new_key) == 200, 30, "the gateway to see the new key")
    assert status(keys["research"]) == 401
    mtime = config.stat().st_mtime_ns
    set_keys(config, "research", [new_entry, newer_entry])
    os.utime(config, ns=(mtime, mtime))  # the same mtime as before: only a SIGHUP reloads now
    os.kill(process.pid, signal.SIGHUP)
    wait_until(lambda: status(newer_key) == 200, 30, "the gateway to reload on SIGHUP")
    assert status(new_key) == 200


def test_a_project_sees_only_its_own_tasks(door: Door) -> None:
    url, _config, keys, _process = door

    def call(method: str, path: str, project: str, **kwargs: object) -> httpx.Response:
        return httpx.request(method, f"{url}{path}", timeout=10,
                             headers={"Authorization": f"Bearer {keys[project]}"}, **kwargs)

    made = call("POST", "/v1/tasks", "reports",
                json={"messages": [{"role": "user", "content": "summarise"}]})
    assert made.status_code == 200, made.text
    task_id = made.json()["id"]
    mine = call("GET", f"/v1/tasks/{task_id}", "reports")
    assert mine.status_code == 200 and mine.json()["status"] == "submitted"
    for method, path in (("GET", f"/v1/tasks/{task_id}"), ("GET", f"/v1/tasks/{task_id}/events"),
                         ("DELETE", f"/v1/tasks/{task_id}")):
        theirs = call(method, path, "translate")
        assert theirs.status_code == 404, (method, path)
        assert theirs.json()["error"]["code"] == "E_NOT_FOUND"
    unknown = call("GET", "/v1/tasks/no-such-task", "reports")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "E_NOT_FOUND"
    foreign = call("POST", "/v1/tasks", "reports",
                   json={"project": "translate", "messages": [{"role": "user", "content": "x"}]})
    assert foreign.status_code == 400 and foreign.json()["error"]["code"] == "E_INPUT_INVALID"
    # Cancel is a signed request a prep worker acts on; this gateway runs without workers, so the
    # request is accepted and the task has not ended (tests/e2e/test_namespaces.py runs cancels through workers).
    cancelled = call("DELETE", f"/v1/tasks/{task_id}", "reports")
    assert cancelled.json()["cancelled"] is True
    after = call("GET", f"/v1/tasks/{task_id}", "reports").json()
    assert after["envelope"] is None and after["status"] == "submitted"


FOLLOWERS = 200


def test_two_hundred_task_event_followers_share_one_reader(door: Door) -> None:
    """More followers than redis-py's pool has connections (100): each gets its task's events
    through the one shared reader, and the gateway still answers other requests meanwhile."""
    url, config, keys, _process = door
    headers = {"Authorization": f"Bearer {keys['translate']}"}
    task_ids = [httpx.post(f"{url}/v1/tasks", headers=headers, timeout=30, json={
        "messages": [{"role": "user", "content": f"follow me {n}"}]}).json()["id"] for n in range(5)]

    async def follow(client: httpx.AsyncClient, task_id: str, started: asyncio.Queue[str]
                     ) -> list[str]:
        kinds: list[str] = []
        async with client.stream("GET", f"{url}/v1/tasks/{task_id}/events", headers=headers) as events:
            assert events.status_code == 200
            async for line in events.aiter_lines():
                if line.startswith("event: "):
                    kinds.append(line.removeprefix("event: "))
                    if len(kinds) == 1:
                        started.put_nowait(task_id)
        return kinds

    async def crowd() -> tuple[list[list[str]], int]:
        started: asyncio.Queue[str] = asyncio.Queue()
        limits = httpx.Limits(max_connections=FOLLOWERS + 10)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            followers = [asyncio.create_task(follow(client, task_ids[n % len(task_ids)], started))
                         for n in range(FOLLOWERS)]
            for _ in range(FOLLOWERS):  # every follower has had its first event: all are attached
                await asyncio.wait_for(started.get(), 120)
            status = (await client.get(f"{url}/v1/tasks/{task_ids[0]}", headers=headers)).status_code
            settings = load_settings(config, env={})
            results = ResultStore(redis.Redis.from_url(TEST_REDIS_URL), Keys(settings.key_prefix), settings)
            for task_id in task_ids:
                results.publish(Envelope.failure(task_id, "translate", Code.E_CANCELLED, "test over"))
            return await asyncio.wait_for(asyncio.gather(*followers), 120), status

    seen, status = asyncio.run(crowd())
    assert status == 200
    assert len(seen) == FOLLOWERS
    assert all(kinds[-1] == "final" and len(kinds) >= 2 for kinds in seen)


def batch_file(n: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                   for i in range(n)).encode()


def test_a_project_sees_only_its_own_files_and_batches(door: Door) -> None:
    url, _config, keys, _process = door
    mine = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["translate"], max_retries=0)
    theirs = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["assistant"], max_retries=0)
    uploaded = mine.files.create(file=("in.jsonl", batch_file(2)), purpose="batch")
    batch = mine.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                completion_window="24h")
    assert mine.batches.retrieve(batch.id).status == "in_progress"  # no workers here
    for call in (lambda: theirs.files.retrieve(uploaded.id), lambda: theirs.files.content(uploaded.id),
                 lambda: theirs.files.delete(uploaded.id), lambda: theirs.batches.retrieve(batch.id),
                 lambda: theirs.batches.cancel(batch.id),
                 lambda: theirs.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.code == "E_NOT_FOUND"
    assert uploaded.id not in [f.id for f in theirs.files.list()]
    assert batch.id not in [b.id for b in theirs.batches.list()]
    assert mine.files.retrieve(uploaded.id).id == uploaded.id  # still there for its owner
    assert mine.files.delete(uploaded.id).deleted


def test_files_and_batches_have_size_line_and_count_caps_with_codes(door: Door) -> None:
    url, _config, keys, _process = door
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["triage"], max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
    assert caught.value.status_code == 413 and caught.value.code == "E_TOO_LARGE"
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("long.jsonl", batch_file(6)), purpose="batch")
    assert caught.value.status_code == 413 and "max_batch_lines" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("in.jsonl", batch_file(1)), purpose="fine-tune")
    assert caught.value.code == "E_INPUT_INVALID" and "purpose" in caught.value.message
    files = [client.files.create(file=("in.jsonl", batch_file(1)), purpose="batch") for _ in range(3)]
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("in.jsonl", batch_file(1)), purpose="batch")
    assert caught.value.status_code == 413 and "max_files" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=files[0].id, endpoint="/v1/embeddings",  # type: ignore[arg-type]
                              completion_window="24h")
    assert caught.value.code == "E_INPUT_INVALID"
    for _ in range(2):
        client.batches.create(input_file_id=files[0].id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    with pytest.raises(openai.APIStatusError) as caught:
        client.batches.create(input_file_id=files[0].id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    assert caught.value.status_code == 413 and "max_batches" in caught.value.message
