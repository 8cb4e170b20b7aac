"""``fleet top`` and ``fleet tail`` ride out a broker outage (fleet/cli/outage.py): a private
redis-server with an append-only file is killed with ``kill -9`` and started again on the same port
and folder while the real commands watch it. They say since when the broker is away, keep running,
and carry on once it is back (``tail`` from the event after the last one it showed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from fleet.core.config import load_settings
from fleet.core.events import EventSink
from fleet.core.keys import Keys, job_ref
from tests.support.fleet_harness import RestartableRedis, make_config
from tests.support.processes import kill_tree
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def fleet_env(config: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    return env | {"FLEET_CONFIG": str(config), "COLUMNS": "200"} | extra


def stop(broker: RestartableRedis) -> None:
    assert broker.server.process is not None
    broker.server.process.kill()
    broker.server.process.wait(timeout=10)


def test_fleet_tail_rides_out_a_broker_restart_and_resumes_after_its_last_event(
        tmp_path: Path, broker: RestartableRedis) -> None:
    config = make_config(tmp_path, broker_url=broker.url)
    settings = load_settings(config, env={})
    ref = job_ref("research", "watched-1")
    events = EventSink(redis.Redis.from_url(broker.url), Keys(settings.key_prefix), ref, 3600)
    events.emit("queued", project="research")
    out, errors = tmp_path / "tail.out", tmp_path / "tail.err"
    with out.open("wb") as stdout, errors.open("wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "fleet", "tail", ref], env=fleet_env(config),
                                   stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: "queued" in out.read_text() or process.poll() is not None, 60, "the first event")
        stop(broker)
        wait_until(lambda: "broker unavailable since" in errors.read_text() or process.poll() is not None,
                   60, "tail to say the broker is away")
        assert process.poll() is None, errors.read_text()
        broker.server = broker.start()
        events = EventSink(redis.Redis.from_url(broker.url), Keys(settings.key_prefix), ref, 3600)
        events.emit("final", code="OK")
        assert process.wait(timeout=60) == 0, errors.read_text()
    finally:
        kill_tree(process)
    assert "broker back at" in errors.read_text()
    assert len(errors.read_text().strip().splitlines()) == 2, errors.read_text()
    text = out.read_text()
    assert text.count("queued") == 1 and "final" in text, text


def test_fleet_top_rides_out_a_broker_restart(tmp_path: Path, broker: RestartableRedis) -> None:
    config = make_config(tmp_path, broker_url=broker.url)
    out = tmp_path / "top.out"
    # a terminal as far as rich is concerned: the live view redraws into the file
    env = fleet_env(config, TTY_COMPATIBLE="1", TTY_INTERACTIVE="1")
    with out.open("wb") as stdout:
        process = subprocess.Popen([sys.executable, "-m", "fleet", "top"], env=env, stdout=stdout,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: "in flight" in out.read_text() or process.poll() is not None, 60, "a frame")
        stop(broker)
        wait_until(lambda: "broker unavailable since" in out.read_text() or process.poll() is not None,
                   60, "top to say the broker is away")
        assert process.poll() is None, out.read_text()
        frames = out.read_text().count("in flight")
        broker.server = broker.start()
        wait_until(lambda: out.read_text().rsplit("broker unavailable since", 1)[1].count("in flight") > 1
                   or process.poll() is not None, 60, "frames after the broker is back")
        assert process.poll() is None, out.read_text()
        assert out.read_text().count("in flight") > frames
    finally:
        kill_tree(process)
