"""The dispatcher as an operator runs it: several on one host, and logs that say what matters.

- two real ``fleet dispatcher`` processes with the same metrics port: the second warns and runs on;
- an idle dispatcher whose gate scrapes a real ``fleet sim`` logs no per-request httpx lines;
- a hold that lasts many rounds is logged once, and a summary line comes once a minute.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from fleet.core.config import Settings, load_settings
from fleet.core.keys import Keys
from fleet.local.embedded import free_port
from fleet.local.processes import wait_http
from schedulers.dispatcher import run_dispatcher
from schedulers.store import make_store
from schedulers.store.base import PendingItem
from tests.support.fleet_harness import make_config
from tests.support.testenv import TEST_REDIS_URL, delete_prefix
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def cleanup_prefix() -> Iterator[list[str]]:
    prefixes: list[str] = []
    yield prefixes
    client = redis.Redis.from_url(TEST_REDIS_URL)
    for prefix in prefixes:
        delete_prefix(client, prefix)
    client.close()


def fleet_process(args: list[str], config: Path | None, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    if config is not None:
        env["FLEET_CONFIG"] = str(config)
    with log.open("wb") as output:
        return subprocess.Popen([sys.executable, "-m", "fleet", *args], env=env, stdin=subprocess.DEVNULL,
                                stdout=output, stderr=subprocess.STDOUT)


def wait_for_line(process: subprocess.Popen, log: Path, text: str) -> None:
    wait_until(lambda: text in log.read_text() or process.poll() is not None, 60, repr(text))
    assert process.poll() is None, log.read_text()


def stop(process: subprocess.Popen) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


def test_a_second_dispatcher_on_a_busy_metrics_port_warns_and_runs(
    tmp_path: Path, cleanup_prefix: list[str]
) -> None:
    port = free_port()
    config = make_config(tmp_path, admission={"metrics_port": port, "backend_gate": False})
    cleanup_prefix.append(load_settings(config, env={}).key_prefix)
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first = fleet_process(["dispatcher", "--log-level", "INFO"], config, logs[0])
    second = None
    try:
        wait_for_line(first, logs[0], f"dispatcher metrics on 127.0.0.1:{port}")  # metrics_host
        second = fleet_process(["dispatcher", "--log-level", "INFO"], config, logs[1])
        wait_for_line(second, logs[1], "dispatcher running")
        assert first.poll() is None
    finally:
        codes = [stop(first)] + ([stop(second)] if second is not None else [])
    second_log = logs[1].read_text()
    assert f"WARNING schedulers.metrics: metrics port {port} is in use" in second_log
    assert codes == [0, 0]  # SIGTERM is a clean stop
    assert all("dispatcher stopped" in log.read_text() for log in logs)


def test_an_idle_dispatcher_scraping_the_backend_logs_no_http_lines(
    tmp_path: Path, cleanup_prefix: list[str]
) -> None:
    sim_port = free_port()
    sim = fleet_process(["sim", "--port", str(sim_port), "--log-level", "warning"], None,
                        tmp_path / "sim.log")
    dispatcher = None
    try:
        wait_http(f"http://127.0.0.1:{sim_port}/health", 60, alive=lambda: sim.poll() is None)
        config = make_config(tmp_path, backend={"url": f"http://127.0.0.1:{sim_port}"},
                             admission={"backend_gate": True, "scrape_interval_s": 0.2})
        settings = load_settings(config, env={})
        cleanup_prefix.append(settings.key_prefix)
        log = tmp_path / "dispatcher.log"
        dispatcher = fleet_process(["dispatcher", "--log-level", "INFO"], config, log)
        wait_for_line(dispatcher, log, "dispatcher running")
        client = redis.Redis.from_url(TEST_REDIS_URL)
        seen: set[bytes] = set()

        def scraped_five_times() -> bool:
            seen.add(client.hget(f"{Keys(settings.key_prefix).dispatch}backend", "scraped_at") or b"")
            return len(seen - {b""}) >= 5

        wait_until(scraped_five_times, 60, "five backend scrapes")
        client.close()
        assert stop(dispatcher) == 0
    finally:
        if dispatcher is not None and dispatcher.poll() is None:
            stop(dispatcher)
        stop(sim)
    text = log.read_text()
    assert "dispatcher running" in text and "dispatcher stopped" in text
    assert "backend gate: open" in text
    assert "httpx" not in text and "HTTP Request" not in text


class FakeClock:
    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        import time

        return time.time() + self.offset_s


def test_a_lasting_hold_is_logged_once_and_a_summary_each_minute(
    redis_client: redis.Redis, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(key_prefix=key_prefix, backend={"max_num_seqs": 1},
                        admission={"backend_gate": False, "metrics_port": 0, "lease_ttl_s": 3600})
    store = make_store(settings, redis_client)
    clock, stop_event, grants = FakeClock(), threading.Event(), []
    caplog.set_level(logging.INFO, logger="schedulers")
    thread = threading.Thread(target=run_dispatcher, daemon=True,
                              args=(settings, redis_client, grants.append, stop_event, clock))
    thread.start()
    try:
        for n in range(4):  # one admitted, the rest held by the cap, round after round
            store.add_pending(PendingItem(f"j{n}", "p", 100, 100))
        for _ in range(5):
            store.wake()
        wait_until(lambda: store.snapshot().holds.get("seqs", 0) >= 6, 60, "six rounds held by the cap")
        clock.offset_s = 61.0
        store.wake()
        wait_until(lambda: any("last 60 s" in r.getMessage() for r in caplog.records), 60, "a summary")
    finally:
        stop_event.set()
        store.wake()
        thread.join(timeout=30)
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("admission held: seqs") == 1
    summary = next(m for m in messages if m.startswith("last 60 s"))
    assert "admitted=1" in summary and "now seqs" in summary
    assert "in flight=1 pending=3" in summary
    assert len(grants) == 1
