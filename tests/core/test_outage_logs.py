"""A broker outage writes a bounded number of log lines (fleet/core/outagelog.py): a private
redis-server with an append-only file is killed with ``kill -9`` and started again while live
events are emitted and lease keepers watch their jobs. Before, every dropped event and every
keeper's every check wrote a WARNING of its own (thousands per outage on a busy worker)."""

from __future__ import annotations

import logging

import pytest
import redis

from fleet.core.events import EventSink
from fleet.core.keys import Keys, job_ref
from fleet.worker.lease import LeaseKeeper
from tests.support.fleet_harness import RestartableRedis
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def kill(broker: RestartableRedis) -> None:
    assert broker.server.process is not None
    broker.server.process.kill()
    broker.server.process.wait(timeout=10)


def outage_lines(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]


def test_dropped_live_events_are_one_line_per_outage_with_their_count(
        broker: RestartableRedis, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    client = redis.Redis.from_url(broker.url, socket_timeout=1, socket_connect_timeout=1)
    sinks = [EventSink(client, Keys("t-outage:"), job_ref("research", f"j{n}"), 600) for n in range(5)]
    sinks[0].emit("queued")
    kill(broker)
    for _ in range(40):
        for sink in sinks:
            sink.emit("reasoning", text="...")
    broker.server = broker.start()
    sinks[0].emit("final", code="OK")
    lines = outage_lines(caplog, "fleet.core.events")
    assert [r.getMessage().split(":")[0] for r in lines] == ["live events", "live events"], lines
    assert "broker unavailable (ConnectionError)" in lines[0].getMessage()
    assert "200 live events dropped meanwhile" in lines[1].getMessage()
    assert all(r.exc_info is None for r in lines)
    assert sum(sink.dropped for sink in sinks) == 200


class _NoStore:
    """A store never asked within the test (renewals every ttl/3 = 20 s)."""

    def renew(self, *_args: object) -> bool:
        raise AssertionError("not renewed within the test")


def test_lease_keepers_riding_out_an_outage_write_two_lines_in_all(
        broker: RestartableRedis, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    client = redis.Redis.from_url(broker.url, socket_timeout=1, socket_connect_timeout=1)
    checks = {"n": 0}

    def cancel_requested() -> bool:
        checks["n"] += 1
        return bool(client.exists("t-outage:cancel"))

    keepers = [LeaseKeeper(_NoStore(), cancel_requested, f"job-{n}", 1, ttl_s=60.0)  # type: ignore[arg-type]
               for n in range(5)]
    for keeper in keepers:
        keeper.__enter__()
    try:
        kill(broker)
        failed_from = checks["n"]
        wait_until(lambda: checks["n"] - failed_from >= 20, 30, "keepers to check during the outage")
        broker.server = broker.start()
        wait_until(lambda: len(outage_lines(caplog, "fleet.worker.lease")) >= 2, 30, "the back line")
        back_at = checks["n"]  # a few more checks (two a keeper): nothing more to log
        wait_until(lambda: checks["n"] - back_at >= 10, 30, "keepers to check with the broker back")
    finally:
        for keeper in keepers:
            keeper.__exit__(None, None, None)
    lines = outage_lines(caplog, "fleet.worker.lease")
    assert len(lines) == 2, [r.getMessage() for r in lines]
    assert lines[0].getMessage().startswith("lease keepers: broker unavailable")
    assert lines[1].getMessage().startswith("lease keepers: broker back after")
    assert not any(k.lost or k.cancelled for k in keepers)
