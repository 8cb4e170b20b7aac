"""``fleet demo`` writes only into a Redis it started itself unless a broker is named: a Redis
answering where the configuration points (the usual 127.0.0.1:6379) is never touched."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import redis

from fleet.local.embedded import free_port, start_redis
from tests.support.fleet_harness import make_config
from tests.support.processes import descendants, kill_tree
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def demo(config: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env |= {"FLEET_CONFIG": str(config), "COLUMNS": "200", **extra_env}
    return subprocess.run([sys.executable, "-m", "fleet", "demo", *args], env=env,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)


def test_demo_leaves_the_configured_redis_alone(tmp_path: Path) -> None:
    with start_redis() as default:  # stands for whatever answers where fleet.toml points
        config = make_config(tmp_path, broker_url=default.url)
        watcher = redis.Redis.from_url(default.url)
        connections = watcher.info("stats")["total_connections_received"]
        result = demo(config, "--jobs", "2", "--speed", "100")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "2 results, 0 not OK, 0 missing" in result.stdout
        assert f"broker {default.url}" not in result.stdout
        assert watcher.dbsize() == 0
        assert watcher.info("stats")["total_connections_received"] == connections  # nobody else came
        watcher.close()


def test_demo_runs_one_configured_backend_as_two_replicas_and_counts_each_ones_jobs(tmp_path: Path) -> None:
    """The example's one [backend] runs as gpu-a and gpu-b, a simulator each; the jobs, submitted
    at once, are spread over both (least loaded while nothing is cached), and the summary's
    backends column counts them: every job answered by one of the two, both used. The copy of
    the settings it wrote for them is gone after."""
    config = make_config(tmp_path)
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = demo(config, "--jobs", "20", "--speed", "30", TMPDIR=str(temp))
    assert result.returncode == 0, result.stdout + result.stderr
    assert not list(temp.glob("fleet-demo-config-*"))  # the copy of the settings, secrets and all
    assert "20 results, 0 not OK, 0 missing" in result.stdout
    assert re.search(r"backend gpu-a http://127\.0\.0\.1:\d+, gpu-b http://127\.0\.0\.1:\d+", result.stdout)
    counts = Counter()
    for backend, count in re.findall(r"\b(gpu-[ab])=(\d+)", result.stdout):
        counts[backend] += int(count)
    assert sum(counts.values()) == 20 and set(counts) == {"gpu-a", "gpu-b"}, result.stdout


def test_demo_on_a_named_broker_stays_on_it_whatever_fleet_broker_url_says(tmp_path: Path) -> None:
    """``--broker`` wins over FLEET_BROKER_URL, also for the replicas' settings: the demo runs on
    the named Redis (its keys deleted after) and never connects to the variable's."""
    with start_redis() as named, start_redis() as other:
        watchers = {url: redis.Redis.from_url(url) for url in (named.url, other.url)}
        before = {url: w.info("stats")["total_connections_received"] for url, w in watchers.items()}
        result = demo(make_config(tmp_path), "--jobs", "2", "--speed", "100", "--broker", named.url,
                      FLEET_BROKER_URL=other.url)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"broker {named.url}" in result.stdout and "gpu-b" in result.stdout
        assert watchers[named.url].info("stats")["total_connections_received"] > before[named.url] + 5
        assert watchers[other.url].info("stats")["total_connections_received"] == before[other.url]
        assert watchers[named.url].dbsize() == 0 and watchers[other.url].dbsize() == 0
        for watcher in watchers.values():
            watcher.close()


def test_demo_says_why_it_runs_one_backend_when_the_environment_sets_it(tmp_path: Path) -> None:
    result = demo(make_config(tmp_path), "--jobs", "2", "--speed", "100", FLEET_BACKEND_MAX_NUM_SEQS="8")
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("one backend, not 2 replicas: the backend is set by FLEET_BACKEND_MAX_NUM_SEQS: it runs as one "
            "server") in result.stdout
    assert "gpu-a" not in result.stdout and "2 results, 0 not OK, 0 missing" in result.stdout


def test_demo_refuses_a_named_broker_that_does_not_answer(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = demo(make_config(tmp_path), "--broker", url)
    assert result.returncode == 2
    assert f"E_INPUT_INVALID no Redis answers at {url}" in result.stderr


def test_demo_ends_at_once_when_a_process_of_the_fleet_dies(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env |= {"FLEET_CONFIG": str(make_config(tmp_path)), "COLUMNS": "200"}
    out = tmp_path / "demo.out"
    with out.open("wb") as output:
        process = subprocess.Popen([sys.executable, "-m", "fleet", "demo", "--jobs", "50", "--speed", "1"],
                                   env=env, stdout=output, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: "broker redis://" in out.read_text() or process.poll() is not None, 120,
                   "the demo to start its fleet")
        dispatcher = next(pid for pid in descendants(process.pid)
                          if b"dispatcher" in Path(f"/proc/{pid}/cmdline").read_bytes())
        os.kill(dispatcher, signal.SIGKILL)
        _out, errors = process.communicate(timeout=120)  # a safety net: the demo waited 300 s before
    finally:
        kill_tree(process)
    assert process.returncode == 1
    assert "E_INTERNAL dispatcher-0 exited with code -9" in errors.decode()
    assert "process logs kept in" in out.read_text()
