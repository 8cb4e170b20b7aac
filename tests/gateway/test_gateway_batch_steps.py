"""The steps of the gateway's batch routes in-process (a real ``Gateway`` on the test Redis, no
server), so that a create, a reader ending it and the clocks they use can be interleaved exactly
(where a stalled create is ended, and what decides that it stalled), and a result file's
download can be held mid-way (what it holds, and on which threads it runs)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from starlette.requests import Request

from fleet.core.batchfile import BatchLine
from fleet.core.codes import Code
from fleet.core.config import Settings
from fleet.core.errors import Busy
from fleet.core.keys import Keys, job_ref
from fleet.gateway import batches
from fleet.gateway.app import Gateway
from fleet.gateway.auth import Caller, LiveSettings
from fleet.gateway.batches import BatchRoutes
from fleet.gateway.batchrecord import Settled, State

WAIT_S = 30


def batch_file(count: int) -> bytes:
    return b"".join(json.dumps({
        "custom_id": str(i), "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "local", "messages": [{"role": "user", "content": f"line {i}"}]},
    }).encode() + b"\n" for i in range(count))


@contextmanager
def gateways(redis_url: str, key_prefix: str, count: int, **gateway: Any) -> Iterator[list[BatchRoutes]]:
    """``count`` gateways' batch routes on one Redis (nothing answers their jobs)."""
    settings = Settings(broker_url=redis_url, key_prefix=key_prefix,
                        backend={"url": "http://127.0.0.1:9"}, gateway=gateway,
                        projects={"a": {"secret": "secret-a-123", "api_keys": []}})
    started = [Gateway(LiveSettings(settings, None, lambda _: settings)) for _ in range(count)]
    try:
        yield [BatchRoutes(gw) for gw in started]
    finally:
        for gw in started:
            gw.vllm.close()
            gw.executor.shutdown()
            gw.batch_executor.shutdown()


def paused_create(routes: BatchRoutes, lines: int, pause_at: int) -> tuple[Future[Any], threading.Event]:
    """Start a create of ``lines`` lines on a thread and return once it is paused before
    submitting line index ``pause_at`` (the line before recorded, no ``ended`` seen): the
    create's future and the event that lets it go on."""
    paused, resume = threading.Event(), threading.Event()
    submit = routes._submit

    def pausing(line: BatchLine, expires_at: int, caller: Caller | None) -> tuple[str, str] | None:
        if line.number == pause_at + 1:
            paused.set()
            assert resume.wait(WAIT_S)
        return submit(line, expires_at, caller)

    routes._submit = pausing  # type: ignore[method-assign]
    file_id = routes.files.put("a", "in.jsonl", "batch", batch_file(lines))["id"]
    future: Future[Any] = Future()
    threading.Thread(target=lambda: future.set_result(routes._create("a", file_id, None)),
                     daemon=True).start()
    assert paused.wait(WAIT_S)
    return future, resume


def only_batch(routes: BatchRoutes) -> State:
    ids = routes.redis.zrange(routes.keys.gateway_batches("a"), 0, -1)
    assert len(ids) == 1
    return routes._load("a", ids[0].decode())


def cancelled(routes: BatchRoutes, keys: Keys, job_id: str) -> bool:
    return bool(routes.redis.exists(keys.cancel(job_ref("a", job_id))))


def test_a_reader_ending_a_stalled_create_never_fails_a_line_the_create_sent(
    redis_url: str, key_prefix: str
) -> None:
    """Before, a reader ending a create it took for dead set ``ended`` from the ``submitted`` it
    had loaded: a create recording the next line between that load and the write (and seeing
    no ``ended`` yet) went on, and the reader failed that sent line as "not submitted"
    E_INTERNAL and cancelled its job. Now ``ended`` is set from ``submitted`` as stored at that
    moment, in one transaction."""
    with gateways(redis_url, key_prefix, 2, batch_create_stall_s=0.001) as (creating, reading):
        keys = Keys(key_prefix)
        future, resume = paused_create(creating, 4, pause_at=1)  # line index 0 recorded
        # The reader loads the batch; then the create records line index 1, sees no ``ended``
        # and pauses before line index 2 until the reader is done ending it.
        paused_again, reader_done = threading.Event(), threading.Event()
        submit, load = creating._submit, reading._load

        def pause_again(line: BatchLine, expires_at: int, caller: Caller | None) -> tuple[str, str] | None:
            if line.number == 3:
                paused_again.set()
                assert reader_done.wait(WAIT_S)
            return submit(line, expires_at, caller)

        def load_then_let_the_create_go_on(project: str, batch_id: str) -> State:
            state = load(project, batch_id)
            if not resume.is_set():
                resume.set()
                assert paused_again.wait(WAIT_S)
            return state

        creating._submit = pause_again  # type: ignore[method-assign]
        reading._load = load_then_let_the_create_go_on  # type: ignore[method-assign]
        state = only_batch(creating)
        reading._end_create("a", state.meta["id"])
        reader_done.set()
        future.result(WAIT_S)
        state = only_batch(creating)
        assert [row["error"] is None for row in state.rows] == [True, True, False, False]
        assert {row["code"] for row in state.rows[2:]} == {"E_INTERNAL"}
        assert not cancelled(creating, keys, state.rows[1]["job"])
        assert cancelled(creating, keys, state.rows[2]["job"])  # sent as the reader ended it
        assert state.meta["status"] == "in_progress"


def test_a_reader_whose_clock_is_ahead_does_not_end_a_live_create(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a create's progress was stamped with its host's clock and compared with the
    reader's: a reader host more than gateway.batch_create_stall_s ahead ended a live create.
    Now both read Redis's clock."""
    with gateways(redis_url, key_prefix, 2, batch_create_stall_s=60) as (creating, reading):
        future, resume = paused_create(creating, 3, pause_at=1)
        batch_id = only_batch(creating).meta["id"]
        real_time = time.time
        with monkeypatch.context() as patched:
            patched.setattr(time, "time", lambda: real_time() + 3600)
            assert reading._refresh("a", batch_id)["status"] == "validating"
        assert not only_batch(reading).ended
        resume.set()
        assert future.result(WAIT_S)["status"] == "in_progress"
        assert all(row["error"] is None for row in only_batch(reading).rows)


def test_a_result_file_download_is_one_batch_call_on_the_batch_threads(
    redis_url: str, key_prefix: str
) -> None:
    """Before, a result file's chunks were rendered on chat's threads and counted against no
    limit: a project could download as many result files at once as it liked. Now a download
    holds one of its project's gateway.batch_calls_per_project from its start to its end, and
    renders on the batch threads."""
    with gateways(redis_url, key_prefix, 1, batch_calls_per_project=1) as (routes,):
        keys = Keys(key_prefix)
        file_id = routes.files.put("a", "in.jsonl", "batch", batch_file(3))["id"]
        batch = routes._create("a", file_id, None)
        for row in routes._load("a", batch["id"]).rows:  # their jobs vanish: every line fails
            routes.redis.delete(keys.job(job_ref("a", row["job"])))
        errors = routes._refresh("a", batch["id"])["error_file_id"]
        assert errors is not None
        rendered_on: list[str] = []
        render = routes._render

        def recording(*args: Any) -> bytes:
            rendered_on.append(threading.current_thread().name)
            return render(*args)

        routes._render = recording  # type: ignore[method-assign]
        caller = Caller("a", "batch", routes.gw.live.settings.projects["a"], "test")
        sent: list[bytes] = []

        async def download() -> None:
            request = Request({"type": "http", "method": "GET", "path_params": {"file_id": errors},
                               "headers": [], "query_string": b""})
            response = await routes.content(request, caller)
            with pytest.raises(Busy):  # the download holds the project's one batch call
                await routes.gw.run_batch("a", routes._refresh, "a", batch["id"])

            async def send(message: dict[str, Any]) -> None:
                sent.append(message.get("body", b""))

            async def receive() -> dict[str, Any]:
                await asyncio.sleep(WAIT_S)
                return {"type": "http.disconnect"}

            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
            assert (await routes.gw.run_batch("a", routes._refresh, "a", batch["id"]))["id"] == batch["id"]

        asyncio.run(download())
        assert len(b"".join(sent).splitlines()) == 3
        assert rendered_on and all(name.startswith("gateway-batch") for name in rendered_on)


def past_its_window(routes: BatchRoutes, batch_id: str) -> None:
    key = routes._key("a", batch_id)
    meta = json.loads(routes.redis.hget(key, "meta") or b"")
    routes.redis.hset(key, "meta", json.dumps({**meta, "expires_at": int(time.time()) - 1}))


def test_a_batch_past_its_window_is_ended_a_share_per_read_and_keeps_each_chunk(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the first read past the window expired every unanswered line in that one call
    (cancel, publish, read back, a task sent for each) and kept the outcomes only at its end: a
    10,000-line batch held a batch thread for minutes, its client's retries got E_BUSY and a
    call cut half way lost everything it had done. Now a read ends at most ENDS_PER_CALL lines
    and keeps them CHUNK_LINES at a time; the next read goes on."""
    monkeypatch.setattr(batches, "CHUNK_LINES", 2)
    monkeypatch.setattr(batches, "ENDS_PER_CALL", 4)
    with gateways(redis_url, key_prefix, 1) as (routes,):
        batch_id = routes._create("a", routes.files.put("a", "in.jsonl", "batch", batch_file(7))["id"],
                                  None)["id"]
        past_its_window(routes, batch_id)
        expire, calls = routes._expire, []

        def failing_third(*args: Any) -> Any:
            calls.append(args)
            if len(calls) == 3:
                raise redis.ConnectionError("Redis went away")
            return expire(*args)

        routes._expire = failing_third  # type: ignore[method-assign]
        with pytest.raises(redis.ConnectionError):
            routes._refresh("a", batch_id)
        assert len(routes._load("a", batch_id).settled) == 2  # the first chunk was kept
        routes._expire = expire  # type: ignore[method-assign]
        batch = routes._refresh("a", batch_id)
        assert batch["status"] == "in_progress" and batch["request_counts"]["failed"] == 6
        batch = routes._refresh("a", batch_id)
        assert batch["status"] == "expired" and batch["request_counts"]["failed"] == 7
        assert {outcome.code for outcome in routes._load("a", batch_id).settled.values()} == {
            Code.E_DEADLINE}


def test_a_cancelled_batch_cancels_a_share_of_its_jobs_per_call(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, cancelling a batch cancelled every waiting job in that one call. Now a call
    cancels at most ENDS_PER_CALL of them and the next reads go on where it stopped."""
    monkeypatch.setattr(batches, "ENDS_PER_CALL", 4)
    with gateways(redis_url, key_prefix, 1) as (routes,):
        keys = Keys(key_prefix)
        batch_id = routes._create("a", routes.files.put("a", "in.jsonl", "batch", batch_file(7))["id"],
                                  None)["id"]
        jobs = [row["job"] for row in routes._load("a", batch_id).rows]
        assert routes._cancel("a", batch_id)["status"] == "cancelling"
        assert [cancelled(routes, keys, job) for job in jobs] == [True] * 4 + [False] * 3
        assert routes._refresh("a", batch_id)["status"] == "cancelling"
        assert all(cancelled(routes, keys, job) for job in jobs)


def test_a_settled_line_keeps_its_cached_tokens_and_reads_one_kept_before_them() -> None:
    settled = Settled(Code.OK, 120, True, (900, 40, 30, 512))
    assert Settled.load(settled.dump().encode()) == settled
    assert Settled.load(b'["OK", 120, true, 900, 40, 30]').usage == (900, 40, 30, 0)
