"""Files and batches of the gateway against a real ``fleet gateway`` process on the test Redis,
driven through the official ``openai`` SDK: per-project byte quota, what a batch line may not set,
lines whose job vanished, the completion window, error files, list cursors, and what another
project's key gets, result files that take no quota, a create that fails half way, one project's
flood of batch calls, a file without a valid line. No prep worker runs here, so a batch's jobs
stay queued unless a test makes them vanish, publishes their results as a worker would, or the
window passes."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from fleet.core.apikeys import mint
from fleet.core.codes import Code
from fleet.core.config import Settings, load_settings
from fleet.core.keys import Keys, job_ref
from fleet.core.models import Envelope, Usage
from fleet.core.results import ResultStore
from fleet.local.embedded import start_redis
from tests.support.gateway_support import config_with_keys, lone_gateway, set_keys
from tests.support.testenv import TEST_REDIS_URL, delete_prefix
from tests.support.waiting import wait_until

MAX_PROJECT_BYTES = 10_000


class Door:
    def __init__(self, url: str, config: Path, keys: dict[str, str]) -> None:
        self.url, self.config, self.keys = url, config, keys
        self.settings: Settings = load_settings(config, env={})
        self.redis = redis.Redis.from_url(TEST_REDIS_URL)

    def sdk(self, project: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.keys[project], max_retries=0)

    def rows(self, project: str, batch_id: str) -> list[dict[str, Any]]:
        """The batch's stored lines (number, custom id, error, code, job id), with the errors
        of lines whose submit failed."""
        keys = Keys(self.settings.key_prefix)
        fields = self.redis.hgetall(keys.gateway_batch(job_ref(project, batch_id)))
        rows: list[dict[str, Any]] = json.loads(fields[b"lines"])
        for name, raw in fields.items():
            if name.startswith(b"e:"):
                error, code = json.loads(raw)
                rows[int(name[2:])].update(error=error, code=code)
        return rows

    def job_message(self, project: str, job_id: str) -> dict[str, Any]:
        """The signed job as the gateway submitted it."""
        raw = self.redis.hget(Keys(self.settings.key_prefix).job(job_ref(project, job_id)), "signed")
        assert raw is not None
        job: dict[str, Any] = json.loads(raw)["job"]
        return job

    def answer(self, project: str, job_id: str, content: str, usage: Usage | None = None) -> None:
        """Publish a job's result as an inference worker would."""
        ResultStore(self.redis, Keys(self.settings.key_prefix), self.settings).publish(Envelope(
            job_id=job_id, project=project, code=Code.OK, content=content, usage=usage or Usage()))

    def result_code(self, project: str, job_id: str) -> str | None:
        raw = self.redis.get(Keys(self.settings.key_prefix).result(job_ref(project, job_id)))
        return json.loads(raw)["code"] if raw else None

    def vanish(self, project: str, job_id: str) -> None:
        """What an expired or lost job leaves behind: neither its record nor a result."""
        keys = Keys(self.settings.key_prefix)
        self.redis.delete(keys.job(job_ref(project, job_id)), keys.result(job_ref(project, job_id)))


def start_door(tmp: Path, **gateway: Any) -> tuple[Path, dict[str, str]]:
    return config_with_keys(
        tmp, backend={"url": "http://127.0.0.1:9"},  # nothing listens: nothing is ever answered
        gateway={"max_file_bytes": 4000, "max_files": 6, "max_project_bytes": MAX_PROJECT_BYTES,
                 "max_batches": 10, **gateway})


@contextmanager
def own_door(tmp: Path, broker_url: str = TEST_REDIS_URL, **gateway: Any) -> Iterator[Door]:
    """A gateway of the test's own (its own settings, a fresh key prefix) on ``broker_url``."""
    config, keys = start_door(tmp, **gateway)
    if broker_url != TEST_REDIS_URL:
        text = config.read_text(encoding="utf-8").replace(TEST_REDIS_URL, broker_url)
        config.write_text(text, encoding="utf-8")
    with lone_gateway(config) as (url, _process):
        door = Door(url, config, keys)
        door.redis = redis.Redis.from_url(broker_url)
        try:
            yield door
        finally:
            delete_prefix(door.redis, door.settings.key_prefix)
            door.redis.close()


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


def create_in_background(client: openai.OpenAI, lines: int) -> tuple[threading.Thread, list[Any]]:
    """Upload ``lines`` lines and create their batch on a thread of its own (started); the batch
    object lands in the list once the create answers."""
    uploaded = client.files.create(
        file=("in.jsonl", jsonl([line(str(i)) for i in range(lines)])), purpose="batch")
    answer: list[Any] = []
    creating = threading.Thread(target=lambda: answer.append(client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")))
    creating.start()
    return creating, answer

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
    ``expired`` status and no error lines for what was not done; then its expired line said
    E_DEADLINE while its job's own result (once a worker ran the cancel) said E_CANCELLED."""
    with own_door(tmp_path, batch_window_s=1) as door:
        client = door.sdk("triage")
        batch = create(client, [line("a"), {"custom_id": "bad", "messages": "nope"}])
        assert batch.status == "in_progress"
        done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status == "expired" and b,
                          60, "the batch to expire", every_s=0.2)
        assert done.expired_at and done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (0, 2)
        errors = file_lines(client, done.error_file_id)
        assert [(row["custom_id"], row["code"]) for row in errors] == [
            ("a", "E_DEADLINE"), ("bad", "E_INPUT_INVALID")]
        job = door.rows("triage", batch.id)[0]["job"]
        assert door.redis.exists(Keys(door.settings.key_prefix).cancel(job_ref("triage", job)))
        assert door.result_code("triage", job) == "E_DEADLINE"  # the job's own result agrees


def test_result_files_take_no_quota_store_no_copy_and_stream(tmp_path: Path) -> None:
    """Before, a batch's output file was a second copy of its results, stored whatever the
    project's byte quota: 5 results of 200 KB made a 1 MB file against a 10 KB quota, and the
    project could upload nothing more."""
    with own_door(tmp_path) as door:
        client = door.sdk("triage")
        batch = create(client, [line(str(i)) for i in range(5)] + [{"custom_id": "bad", "messages": 1}])
        for i, row in enumerate(door.rows("triage", batch.id)[:5]):
            door.answer("triage", row["job"], f"{i}" * 200_000,
                        Usage(prompt_tokens=10, completion_tokens=20, reasoning_tokens=5))
        done = client.batches.retrieve(batch.id)
        assert done.status == "completed" and done.output_file_id and done.error_file_id
        blob = b"x" * 3000 + b"\n"
        assert client.files.create(file=("more.jsonl", blob), purpose="batch").bytes == len(blob)
        out = client.files.retrieve(done.output_file_id)
        assert out.bytes > 1_000_000 > MAX_PROJECT_BYTES
        content = client.files.content(done.output_file_id).read()
        assert len(content) == out.bytes
        rows = [json.loads(row) for row in content.splitlines()]
        assert [row["custom_id"] for row in rows] == [str(i) for i in range(5)]
        assert rows[3]["response"]["body"]["choices"][0]["message"]["content"] == "3" * 200_000
        assert [row["code"] for row in file_lines(client, done.error_file_id)] == ["E_INPUT_INVALID"]
        keys = Keys(door.settings.key_prefix)
        stored = door.redis.hgetall(keys.gateway_file(job_ref("triage", done.output_file_id)))
        assert set(stored) == {b"meta", b"batch", b"part"}  # no copy of the results
        assert not door.redis.exists(keys.gateway_file_body(job_ref("triage", done.output_file_id)))
        assert done.usage is not None and (done.usage.input_tokens, done.usage.output_tokens) == (50, 100)
        assert done.usage.output_tokens_details.reasoning_tokens == 25


def test_a_file_without_a_valid_line_makes_a_failed_batch(door: Door) -> None:
    """Before, such a batch ended ``completed`` with every line in its error file; OpenAI's
    batch is ``failed`` with ``errors``, and no job is submitted."""
    client = door.sdk("triage")
    batch = create(client, [{"custom_id": "a", "messages": "nope"}, line("b", band="interactive")])
    assert batch.status == "failed" and batch.failed_at and batch.errors is not None
    assert [(e.line, e.code) for e in batch.errors.data or []] == [(1, "E_INPUT_INVALID"),
                                                                   (2, "E_INPUT_INVALID")]
    assert all(row["job"] is None for row in door.rows("triage", batch.id))
    assert client.batches.retrieve(batch.id).status == "failed"


def test_a_create_that_fails_half_way_leaves_a_visible_cancellable_batch(tmp_path: Path) -> None:
    """Before, create added the batch to the index and submitted every line before it wrote the
    batch: a Redis error half way was a 500 and the jobs submitted so far ran unseen, with no
    batch to retrieve or cancel (and the SDK's retry of the 500 made a second batch). Here the
    gateway's Redis user loses access to job keys half way through a create."""
    private = start_redis()
    admin = redis.Redis.from_url(private.url)
    try:
        admin.acl_setuser("gateway", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                          commands=["+@all"])
        with own_door(tmp_path, broker_url=private.url.replace("//", "//gateway:pw@"),
                      max_file_bytes=400_000, max_project_bytes=1_000_000) as door:
            client = door.sdk("triage")
            creating, answer = create_in_background(client, 3000)
            keys = Keys(door.settings.key_prefix)

            def submitting() -> str | None:
                ids = door.redis.zrange(keys.gateway_batches("triage"), 0, -1)
                if not ids:
                    return None
                batch_id: str = ids[0].decode()
                progress = door.redis.hget(keys.gateway_batch(job_ref("triage", batch_id)), "submitted")
                return batch_id if progress and int(progress) >= 10 else None

            batch_id = wait_until(submitting, 60, "the create to submit some lines")
            admin.acl_setuser("gateway", enabled=True, reset_keys=True,
                              keys=[f"{door.settings.key_prefix}gw*"])
            creating.join(120)
            admin.acl_setuser("gateway", enabled=True, keys=["*"])
            assert answer and answer[0].id == batch_id and answer[0].status == "in_progress"
            rows = door.rows("triage", batch_id)
            errors = {row["code"] for row in rows if row["error"]}
            assert errors == {"E_BROKER_UNAVAILABLE"}
            sent = [row["job"] for row in rows if not row["error"]]
            assert 10 <= len(sent) < 3000
            assert all(door.redis.exists(keys.job(job_ref("triage", job))) for job in sent)
            listed = client.batches.list().data
            assert [b.id for b in listed] == [batch_id]
            assert listed[0].request_counts is not None and listed[0].request_counts.total == 3000
            assert client.batches.cancel(batch_id).status == "cancelling"
            assert all(door.redis.exists(keys.cancel(job_ref("triage", job))) for job in sent)
    finally:
        admin.close()
        private.close()


def test_a_batch_cancelled_while_it_is_created_sends_no_more_lines(tmp_path: Path) -> None:
    """Before, a batch could not be seen, let alone cancelled, until its create had sent every
    line. Now a cancel during the create stops it: the lines sent are cancelled, the others
    fail E_CANCELLED without being sent."""
    with own_door(tmp_path, max_file_bytes=400_000, max_project_bytes=1_000_000) as door:
        client = door.sdk("triage")
        creating, answer = create_in_background(client, 3000)
        keys = Keys(door.settings.key_prefix)
        batch_id = wait_until(lambda: (ids := door.redis.zrange(keys.gateway_batches("triage"), 0, -1))
                              and door.redis.exists(keys.gateway_batch(job_ref("triage", ids[0].decode())))
                              and ids[0].decode(), 60, "the create to start")
        assert client.batches.retrieve(batch_id).status == "validating"
        assert client.batches.cancel(batch_id).status == "cancelling"
        creating.join(120)
        assert answer and answer[0].status == "cancelling"
        rows = door.rows("triage", batch_id)
        sent = [row["job"] for row in rows if not row["error"]]
        assert len(sent) < 3000
        assert {row["code"] for row in rows if row["error"]} == {"E_CANCELLED"}
        wait_until(lambda: client.batches.retrieve(batch_id) and all(  # a share per call
            door.redis.exists(keys.cancel(job_ref("triage", job))) for job in sent), 60,
            "the sent lines to be cancelled", every_s=0.2)
        unsent = [job_ref("triage", row["job"]) for row in rows if row["error"]]
        assert not any(door.redis.exists(keys.job(ref)) for ref in unsent)


def test_a_create_cut_by_a_stopped_gateway_is_ended_by_the_next_retrieve(tmp_path: Path) -> None:
    """Before, a gateway stopped half way through a create left the jobs it had sent running
    with no batch at all. Now the batch is there from the start; once its create has made no
    progress for gateway.batch_create_stall_s, a retrieve (on another gateway) ends it: the
    lines sent go on, the others fail E_INTERNAL, and no job runs outside the batch."""
    config, keys = start_door(tmp_path, max_file_bytes=400_000, max_project_bytes=1_000_000,
                              batch_create_stall_s=1)
    settings = load_settings(config, env={})
    fleet_keys = Keys(settings.key_prefix)
    client_redis = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        with lone_gateway(config) as (url, process):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["triage"], max_retries=0)
            uploaded = client.files.create(
                file=("in.jsonl", jsonl([line(str(i)) for i in range(3000)])), purpose="batch")
            creating = threading.Thread(target=lambda: pytest.raises(
                openai.APIConnectionError, client.batches.create, input_file_id=uploaded.id,
                endpoint="/v1/chat/completions", completion_window="24h"))
            creating.start()

            def submitting() -> str | None:
                ids = client_redis.zrange(fleet_keys.gateway_batches("triage"), 0, -1)
                progress = ids and client_redis.hget(
                    fleet_keys.gateway_batch(job_ref("triage", ids[0].decode())), "submitted")
                return ids[0].decode() if progress and int(progress) >= 10 else None

            batch_id = wait_until(submitting, 60, "the create to submit some lines")
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            creating.join(60)
        with lone_gateway(config) as (url, _process):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=keys["triage"], max_retries=0)
            assert [b.id for b in client.batches.list()] == [batch_id]
            batch = wait_until(lambda: (b := client.batches.retrieve(batch_id)).status == "in_progress" and b,
                               60, "the stopped create to be ended", every_s=0.2)
            assert batch.request_counts is not None and batch.request_counts.total == 3000
            door = Door(url, config, keys)
            rows = door.rows("triage", batch_id)
            sent = [row for row in rows if not row["error"]]
            assert 10 <= len(sent) < 3000 and batch.request_counts.failed == 3000 - len(sent)
            assert {row["code"] for row in rows if row["error"]} == {"E_INTERNAL"}
            assert all(client_redis.exists(fleet_keys.job(job_ref("triage", row["job"]))) for row in sent)
            unsent = [row["job"] for row in rows if row["error"]]
            for job in unsent:  # never sent, or sent as the gateway stopped and cancelled since
                ref = job_ref("triage", job)
                assert not client_redis.exists(fleet_keys.job(ref)) or client_redis.exists(fleet_keys.cancel(ref))
    finally:
        delete_prefix(client_redis, settings.key_prefix)
        client_redis.close()


def test_one_projects_flood_of_batch_calls_does_not_hold_up_another(tmp_path: Path) -> None:
    """Before, every project's batch calls shared one queue in front of gateway.batch_threads:
    a project creating large batches (or listing, which refreshed every batch) held every
    thread, and another project's retrieve waited behind all of it. A create of 800 lines holds
    its thread for seconds (a line costs a submit), many times a retrieve's round trip."""
    with own_door(tmp_path, max_file_bytes=400_000, max_project_bytes=1_000_000, batch_threads=4,
                  batch_calls_per_project=2) as door:
        other = door.sdk("assistant")
        mine = create(other, [line("mine")])
        hostile = door.sdk("translate")
        big = hostile.files.create(file=("in.jsonl", jsonl([line(str(i)) for i in range(800)])),
                                   purpose="batch")
        order = itertools.count()
        done: list[tuple[int, str, Any]] = []

        def flood(call: str) -> None:
            try:
                if call == "create":
                    result: Any = hostile.batches.create(input_file_id=big.id, completion_window="24h",
                                                         endpoint="/v1/chat/completions")
                else:
                    result = hostile.batches.list(limit=100)
            except openai.APIStatusError as exc:
                result = exc
            done.append((next(order), call, result))

        threads = [threading.Thread(target=flood, args=(call,))
                   for call in ["create"] * 6 + ["list"] * 6]
        for thread in threads:
            thread.start()
        keys = Keys(door.settings.key_prefix)
        wait_until(lambda: door.redis.zcard(keys.gateway_batches("translate")) >= 2, 60,
                   "the hostile project's creates to start")
        assert other.batches.retrieve(mine.id).id == mine.id
        answered_at = next(order)
        for thread in threads:
            thread.join(120)
        created = [seq for seq, call, result in done if call == "create"
                   and not isinstance(result, Exception)]
        refused = [result for _, _, result in done if isinstance(result, openai.APIStatusError)]
        assert created and all(seq > answered_at for seq in created)  # none answered first
        assert refused and {(r.status_code, r.code) for r in refused} == {(429, "E_BUSY")}
        assert all(r.response.headers["retry-after"] == "1" for r in refused)
