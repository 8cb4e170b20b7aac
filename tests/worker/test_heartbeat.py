"""Inference workers' heartbeats (fleet/worker/heartbeat.py) through real worker processes, a real
``fleet sim`` and the test Redis: the dispatcher's ``no_workers`` gate counts live worker processes,
whatever their hosts' clocks say and whatever their Celery node names are, and a worker that stops
cleanly closes the gate at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from fleet.client import Client
from fleet.core.config import load_settings
from fleet.core.keys import Keys
from fleet.local.processes import LocalFleet
from fleet.worker.heartbeat import WorkerGate, live_worker_names, live_workers
from tests.support.fleet_harness import make_config
from tests.support.waiting import wait_until

SKEW_S = 3600.0  # far more than the lapse: a host whose clock is an hour off


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[LocalFleet]:
    """``fleet sim`` only: each test starts the inference workers it needs."""
    config = make_config(tmp_path)
    local = LocalFleet(load_settings(config, env={}), workers=0, dispatchers=0,
                       config_path=str(config), log_dir=str(tmp_path))
    local.start()
    try:
        yield local
    finally:
        local.close(grace_s=5)


def start_infer(fleet: LocalFleet, name: str, hostname: str, env: dict[str, str] | None = None) -> None:
    fleet.spawn(name, ["worker", "--role", "infer", "--concurrency", "2", "--hostname", hostname,
                       "--log-level", "INFO"], env)


def process(fleet: LocalFleet, name: str) -> subprocess.Popen:
    return next(p for n, p in fleet.children if n == name)


def stop_cleanly(fleet: LocalFleet, name: str) -> None:
    """SIGTERM (a warm shutdown, as systemd or honcho stop a worker) and wait for the exit."""
    worker = process(fleet, name)
    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=60)


def skewed_clock(tmp_path: Path, offset_s: float) -> dict[str, str]:
    """The environment of a process whose wall clock is ``offset_s`` off (a host without NTP)."""
    folder = tmp_path / "skewed"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import time\n_real = time.time\n"
        f"time.time = lambda: _real() + {offset_s}\n", encoding="utf-8")
    return {"PYTHONPATH": str(folder)}


def test_a_worker_whose_clock_is_behind_still_counts(fleet: LocalFleet, tmp_path: Path) -> None:
    """Before, the entry's lapse was the worker's own clock + 15 s: a host an hour behind wrote
    entries that had lapsed already, and the gate held admissions with a live worker."""
    client = redis.Redis.from_url(fleet.broker.url)  # type: ignore[union-attr]
    keys = Keys(fleet.settings.key_prefix)
    start_infer(fleet, "worker-skewed", "skewed@%h", skewed_clock(tmp_path, -SKEW_S))
    wait_until(lambda: client.zcard(keys.infer_workers) > 0, 60, "the skewed worker's heartbeat")
    assert live_workers(client, keys) == 1
    assert WorkerGate(client, keys)() == ""
    client.close()


def test_a_killed_worker_whose_clock_is_ahead_lapses(fleet: LocalFleet, tmp_path: Path) -> None:
    """Before, a host an hour ahead wrote entries that lapsed an hour late: after its kill -9 the
    gate stayed open for that hour and admitted into a queue nobody read."""
    client = redis.Redis.from_url(fleet.broker.url)  # type: ignore[union-attr]
    keys = Keys(fleet.settings.key_prefix)
    gate = WorkerGate(client, keys)
    start_infer(fleet, "worker-skewed", "skewed@%h", skewed_clock(tmp_path, SKEW_S))
    wait_until(lambda: gate() == "", 60, "the skewed worker's heartbeat")
    worker = process(fleet, "worker-skewed")
    os.killpg(worker.pid, signal.SIGKILL)  # no shutdown: the entry stays until it lapses
    worker.wait(timeout=10)
    wait_until(lambda: gate() == "no_workers", 60, "the killed worker's entry to lapse")
    client.close()


def test_two_workers_with_one_node_name_count_twice(fleet: LocalFleet) -> None:
    """Before, both wrote one entry (the node name): stopping one removed it while the other ran,
    and a dead twin's entry was renewed by the live one."""
    client = redis.Redis.from_url(fleet.broker.url)  # type: ignore[union-attr]
    keys = Keys(fleet.settings.key_prefix)
    for n in range(2):
        start_infer(fleet, f"worker-{n}", "twin@samehost")
    wait_until(lambda: live_workers(client, keys) == 2, 60, "both twins' heartbeats")
    assert live_worker_names(client, keys) == ["twin@samehost", "twin@samehost"]
    for command, line in ((["queues"], "live inference workers 2: twin@samehost x2"),
                          (["top", "--once"], "inference workers 2: twin@samehost x2")):
        shown = subprocess.run([sys.executable, "-m", "fleet", *command], env={**fleet.env, "COLUMNS": "200"},
                               capture_output=True, text=True, timeout=60)
        assert line in shown.stdout, shown.stdout + shown.stderr
    stop_cleanly(fleet, "worker-0")
    assert live_workers(client, keys) == 1
    assert WorkerGate(client, keys)() == ""
    client.close()


def test_a_clean_stop_of_the_last_worker_closes_the_gate_at_once(fleet: LocalFleet) -> None:
    client = redis.Redis.from_url(fleet.broker.url)  # type: ignore[union-attr]
    keys = Keys(fleet.settings.key_prefix)
    gate = WorkerGate(client, keys)
    start_infer(fleet, "worker-0", "last@%h")
    wait_until(lambda: gate() == "", 60, "the worker's heartbeat")
    stop_cleanly(fleet, "worker-0")
    assert live_workers(client, keys) == 0
    assert gate() == "no_workers"
    client.close()


def test_a_worker_leaves_as_its_warm_shutdown_starts(tmp_path: Path) -> None:
    """A warm shutdown lets the running streams finish, which may take minutes, but the worker
    takes no new task from the moment it starts: before, its entry stayed live until the end, and
    the dispatchers admitted into a queue nobody read."""
    config = make_config(tmp_path)
    settings = load_settings(config, env={})
    with LocalFleet(settings, workers=0, dispatchers=1, config_path=str(config),
                    log_dir=str(tmp_path)) as local:
        client = redis.Redis.from_url(local.broker.url)  # type: ignore[union-attr]
        keys = Keys(settings.key_prefix)
        local.spawn("worker-0", ["worker", "--concurrency", "4", "--hostname", "busy@%h",
                                 "--log-level", "INFO"])
        wait_until(lambda: live_workers(client, keys) == 1, 60, "the worker's heartbeat")
        sim = local.env["FLEET_BACKEND_URL"]
        with Client(settings.model_copy(update={"broker_url": local.broker.url})) as producer:  # type: ignore[union-attr]
            producer.submit({"project": "assistant", "messages": [
                {"role": "user", "content": "[sim:think=1000000] [sim:answer=5]"}]})
            wait_until(lambda: httpx.get(f"{sim}/sim/stats").json()["running"] == 1, 60,
                       "the job's stream to start")
            worker = process(local, "worker-0")
            worker.send_signal(signal.SIGTERM)
            wait_until(lambda: live_workers(client, keys) == 0, 60, "the worker to leave")
            assert worker.poll() is None  # still finishing its stream
        client.close()
