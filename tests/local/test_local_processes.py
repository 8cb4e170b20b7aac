"""Local process groups (``fleet up``, LocalFleet) as an operator meets them: real processes, real
signals. A stop signal of any kind takes every child down with the parent; a child that dies ends
the run at once, naming itself, its exit code and its last lines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from fleet.core.config import load_settings
from fleet.local.embedded import start_redis
from fleet.local.processes import ChildExited, LocalFleet
from tests.support.fleet_harness import make_config
from tests.support.processes import alive, descendants, kill_tree
from tests.support.testenv import TEST_REDIS_URL, delete_prefix
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

STOP_BOUND_S = 60  # LocalFleet.close: 10 s grace, then SIGKILL; a generous safety net on top


@pytest.fixture
def config(tmp_path: Path) -> Iterator[Path]:
    path = make_config(tmp_path)
    yield path
    client = redis.Redis.from_url(TEST_REDIS_URL)
    delete_prefix(client, load_settings(path, env={}).key_prefix)
    client.close()


def start_up(tmp_path: Path, config: Path) -> tuple[subprocess.Popen, Path, Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env["FLEET_CONFIG"] = str(config)
    out, errors = tmp_path / "up.out", tmp_path / "up.err"
    with out.open("wb") as stdout, errors.open("wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "fleet", "up", "--speed", "50"], env=env,
                                   stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: "Ctrl-C to stop" in out.read_text() or process.poll() is not None, 120,
                   "fleet up to start its children")
    except AssertionError:
        kill_tree(process)
        raise
    assert process.poll() is None, errors.read_text()
    return process, out, errors


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_fleet_up_stops_every_child_on_a_stop_signal(tmp_path: Path, config: Path, sig: int) -> None:
    process, _out, errors = start_up(tmp_path, config)
    children = descendants(process.pid)
    try:
        assert len(children) >= 3  # sim, dispatcher-0, worker-0
        process.send_signal(sig)
        assert process.wait(timeout=STOP_BOUND_S) == 0, errors.read_text()
        wait_until(lambda: not any(alive(pid) for pid in children), STOP_BOUND_S,
                   "every child of fleet up to be gone")
    finally:
        kill_tree(process)
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert "stopped by" in errors.read_text()


def test_fleet_up_ends_when_a_child_dies(tmp_path: Path, config: Path) -> None:
    process, out, errors = start_up(tmp_path, config)
    try:
        dispatcher = next(pid for pid in descendants(process.pid)
                          if "dispatcher" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"))
        wait_until(lambda: "dispatcher running" in out.read_text() + errors.read_text(), 60,
                   "the dispatcher's first line")
        os.kill(dispatcher, signal.SIGKILL)
        assert process.wait(timeout=STOP_BOUND_S) == 1
    finally:
        kill_tree(process)
    report = errors.read_text()
    assert "E_INTERNAL dispatcher-0 exited with code -9" in report
    assert "dispatcher running" in report  # its last lines, from its own output


def test_a_child_that_fails_at_start_is_reported_at_once(config: Path) -> None:
    settings = load_settings(config, env={})
    fleet = LocalFleet(settings, sim_args=["--no-such-option"])
    with pytest.raises(ChildExited) as caught:
        fleet.start()
    assert caught.value.name == "sim"
    assert caught.value.returncode == 2
    assert any("No such option" in line for line in caught.value.tail)
    assert "sim exited with code 2" in caught.value.message
    assert fleet.children == []  # start stopped what it had started


def test_the_private_redis_server_is_out_of_reach_of_a_terminal_ctrl_c() -> None:
    # A terminal sends Ctrl-C to its foreground process group: the broker must not be in it, or
    # it would go before the workers and dispatchers that are still stopping.
    with start_redis() as broker:
        assert broker.process is not None
        assert os.getsid(broker.process.pid) == broker.process.pid != os.getsid(0)
