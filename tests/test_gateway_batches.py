"""Files and batches of the gateway against a real ``fleet gateway`` process on the test Redis,
driven through the official ``openai`` SDK: per-project byte quota, what a batch line may not set,
lines whose job vanished, the completion window, error files, list cursors, and what another
project's key gets. No prep worker runs here, so a batch's jobs stay queued unless a test makes
them vanish or the window passes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from fleet.core.apikeys import mint
from fleet.core.config import Settings, load_settings
from fleet.core.keys import Keys, job_ref

from .conftest import TEST_REDIS_URL, delete_prefix
from .fleet_harness import wait_until
from .gateway_support import config_with_keys, lone_gateway, set_keys

MAX_PROJECT_BYTES = 10_000


class Door:
    def __init__(self, url: str, config: Path, keys: dict[str, str]) -> None:
        self.url, self.config, self.keys = url, config, keys
        self.settings: Settings = load_settings(config, env={})
        self.redis = redis.Redis.from_url(TEST_REDIS_URL)

    def sdk(self, project: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.keys[project], max_retries=0)

    def rows(self, project: str, batch_id: str) -> list[dict[str, Any]]:
        """The batch's stored lines (number, custom id, error, code, job id)."""
        keys = Keys(self.settings.key_prefix)
        raw = self.redis.hget(keys.gateway_batch(job_ref(project, batch_id)), "lines")
        assert raw is not None
        rows: list[dict[str, Any]] = json.loads(raw)
        return rows

    def job_message(self, project: str, job_id: str) -> dict[str, Any]:
        """The signed job as the gateway submitted it."""
        raw = self.redis.hget(Keys(self.settings.key_prefix).job(job_ref(project, job_id)), "signed")
        assert raw is not None
        job: dict[str, Any] = json.loads(raw)["job"]
        return job

    def vanish(self, project: str, job_id: str) -> None:
        """What an expired or lost job leaves behind: neither its record nor a result."""
        keys = Keys(self.settings.key_prefix)
        self.redis.delete(keys.job(job_ref(project, job_id)), keys.result(job_ref(project, job_id)))


def start_door(tmp: Path, **gateway: Any) -> tuple[Path, dict[str, str]]:
    return config_with_keys(
        tmp, backend={"url": "http://127.0.0.1:9"},  # nothing listens: nothing is ever answered
        gateway={"max_file_bytes": 4000, "max_files": 6, "max_project_bytes": MAX_PROJECT_BYTES,
                 "max_batches": 10, **gateway})


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    config, keys = start_door(tmp_path_factory.mktemp("gateway-batches"))
    batch_key, entry = mint("batch")
    set_keys(config, "research", [entry])
    keys["research"] = batch_key
    with lone_gateway(config) as (url, _process):
        door = Door(url, config, keys)
        yield door
    delete_prefix(door.redis, door.settings.key_prefix)
    door.redis.close()


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def line(custom_id: str, **fields: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "messages": [{"role": "user", "content": f"q {custom_id}"}], **fields}


def create(client: openai.OpenAI, lines: list[dict[str, Any]]) -> Any:
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")


def file_lines(client: openai.OpenAI, file_id: str) -> list[dict[str, Any]]:
    return [json.loads(row) for row in client.files.content(file_id).text.splitlines()]


def test_a_hostile_project_fills_its_byte_quota_and_the_others_are_unaffected(door: Door) -> None:
    """Before, a key could store max_files x max_file_bytes (about 2 GB by default) in the
    broker's Redis: nothing counted a project's bytes."""
    hostile, other = door.sdk("translate"), door.sdk("assistant")
    blob = b"x" * 3000 + b"\n"  # one (bad) line: a file is only checked for size and line count
    kept = [hostile.files.create(file=("big.jsonl", blob), purpose="batch") for _ in range(3)]
    with pytest.raises(openai.APIStatusError) as caught:
        hostile.files.create(file=("big.jsonl", blob), purpose="batch")
    assert caught.value.status_code == 413 and caught.value.code == "E_TOO_LARGE"
    assert "max_project_bytes" in caught.value.message
    assert len(hostile.files.list().data) == 3  # the refused upload left nothing behind
    assert other.files.create(file=("big.jsonl", blob), purpose="batch").bytes == len(blob)
    with pytest.raises(openai.NotFoundError):  # no project frees another's quota
        other.files.delete(kept[0].id)
    assert hostile.files.delete(kept[0].id).deleted  # deleting frees its share at once
    assert hostile.files.create(file=("big.jsonl", blob), purpose="batch").bytes == len(blob)


def test_a_batch_line_cannot_choose_band_order_or_sources(door: Door) -> None:
    """Before, a line could set band, priority, deadline or sources: a batch key's line ran in
    the interactive band, and a line could ask prep to collect files or URLs."""
    client = door.sdk("research")  # a key minted with --band batch
    batch = create(client, [
        line("plain"),
        line("band", band="interactive"),
        line("priority", priority=10),
        line("deadline", deadline=4102444800),
        line("sources", sources=[{"type": "file", "path": "/etc/hostname"}]),
        {"custom_id": "openai", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "local", "priority": -5, "messages": [{"role": "user", "content": "q"}]}},
    ])
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.failed) == (6, 5)
    rows = door.rows("research", batch.id)
    plain = rows[0]["job"]
    assert plain and all(row["job"] is None for row in rows[1:])
    message = door.job_message("research", plain)
    assert message["band"] == "batch"
    assert message["deadline"] == batch.expires_at  # the completion window
    # An interactive key's batch is offline work too: it never competes with that key's chat.
    offline = create(door.sdk("reports"), [line("plain")])
    job = door.rows("reports", offline.id)[0]["job"]
    assert door.job_message("reports", job)["band"] == "batch"

    door.vanish("research", plain)  # let the batch finish, to read its error file
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id is None and done.error_file_id
    errors = {row["custom_id"]: row for row in file_lines(client, done.error_file_id)}
    numbers = {row["custom_id"]: row["n"] for row in rows}
    for field in ("band", "priority", "deadline", "sources"):
        assert errors[field]["code"] == "E_INPUT_INVALID"
        assert errors[field]["error"]["message"].startswith(f"line {numbers[field]}: {field}:")
    assert "priority" in errors["openai"]["error"]["message"]


def test_a_line_whose_job_vanished_fails_and_the_batch_completes(door: Door) -> None:
    """Before, a line whose job expired or was lost stayed unanswered, and its batch stayed
    in_progress until it expired from Redis."""
    client = door.sdk("triage")
    batch = create(client, [line("a"), line("b")])
    jobs = [row["job"] for row in door.rows("triage", batch.id)]
    door.vanish("triage", jobs[0])
    half = client.batches.retrieve(batch.id)
    assert half.status == "in_progress" and half.request_counts is not None
    assert (half.request_counts.completed, half.request_counts.failed) == (0, 1)
    door.vanish("triage", jobs[1])
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.completed_at and done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (2, 0, 2)
    assert done.output_file_id is None and done.error_file_id
    errors = file_lines(client, done.error_file_id)
    assert [(row["custom_id"], row["code"]) for row in errors] == [("a", "E_NOT_FOUND"), ("b", "E_NOT_FOUND")]
    assert client.batches.retrieve(batch.id) == done  # final: read again, the same
    theirs = door.sdk("assistant")
    with pytest.raises(openai.NotFoundError) as caught:
        theirs.files.content(done.error_file_id)
    assert caught.value.code == "E_NOT_FOUND"


def test_lists_page_with_after_and_limit_through_the_sdk(door: Door) -> None:
    """Before, the lists took only a limit: no cursor, has_more always false."""
    client = door.sdk("reports")
    for old in client.files.list().data:
        client.files.delete(old.id)
    uploaded = [client.files.create(file=(f"in{i}.jsonl", jsonl([line(str(i))])), purpose="batch")
                for i in range(5)]
    newest_first = [f.id for f in reversed(uploaded)]
    first = client.files.list(limit=2)
    assert [f.id for f in first.data] == newest_first[:2] and first.has_more
    assert [f.id for f in client.files.list(limit=2)] == newest_first  # the SDK follows `after`
    assert [f.id for f in client.files.list(limit=2, order="asc")] == newest_first[::-1]
    assert [f.id for f in client.files.list(after=newest_first[3])] == newest_first[4:]
    batches = [client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                     completion_window="24h") for f in uploaded[:3]]
    listed = [b.id for b in client.batches.list(limit=2)]  # paged by the SDK
    assert listed[:3] == [b.id for b in reversed(batches)] and len(set(listed)) == len(listed)
    assert [b.id for b in client.batches.list(after=batches[1].id)] == listed[2:]
    theirs = door.sdk("assistant")
    for call in (lambda: theirs.files.list(after=uploaded[0].id),
                 lambda: theirs.batches.list(after=batches[0].id)):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.code == "E_NOT_FOUND"
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.list(limit=0)
    assert caught.value.code == "E_INPUT_INVALID"


def test_a_batch_past_its_completion_window_expires(tmp_path: Path) -> None:
    """Before, a batch whose jobs never ran stayed in_progress until it expired from Redis: no
    ``expired`` status and no error lines for what was not done."""
    config, keys = start_door(tmp_path, batch_window_s=1)
    settings = load_settings(config, env={})
    client_redis = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        with lone_gateway(config) as (url, _process):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["triage"], max_retries=0)
            batch = create(client, [line("a"), {"custom_id": "bad", "messages": "nope"}])
            assert batch.status == "in_progress"
            done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status == "expired" and b,
                              60, "the batch to expire", every_s=0.2)
            assert done.expired_at and done.request_counts is not None
            assert (done.request_counts.completed, done.request_counts.failed) == (0, 2)
            errors = file_lines(client, done.error_file_id)
            assert [(row["custom_id"], row["code"]) for row in errors] == [
                ("a", "E_DEADLINE"), ("bad", "E_INPUT_INVALID")]
            job = json.loads(client_redis.hget(Keys(settings.key_prefix).gateway_batch(
                job_ref("triage", batch.id)), "lines"))[0]["job"]
            assert client_redis.exists(Keys(settings.key_prefix).cancel(job_ref("triage", job)))
    finally:
        delete_prefix(client_redis, settings.key_prefix)
        client_redis.close()
