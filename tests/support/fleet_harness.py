"""A real fleet for integration tests: simulator, dispatcher and worker as separate processes
on the test Redis (tests/support/testenv.py) under a private key prefix, configured by a generated
fleet.toml."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import redis
import tomli_w

from fleet.client import Client
from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.local.embedded import EmbeddedRedis, free_port, start_redis
from fleet.local.processes import LocalFleet
from schedulers.store import make_store
from schedulers.store.base import StoreSnapshot
from schedulers.store.redis_store import RedisStore
from tests.support.testenv import TEST_REDIS_URL
from tests.support.waiting import wait_until

TEST_BROKER = TEST_REDIS_URL


class RestartableRedis:
    """A redis-server of the test's own (AOF on) on a fixed port and folder that a test may stop
    (cleanly, or ``kill -9``) and start again."""

    def __init__(self) -> None:
        self.port = free_port()
        self.folder = tempfile.mkdtemp(prefix="fleet-loss-")
        self.server: EmbeddedRedis = self.start()
        self.url = self.server.url

    def start(self) -> EmbeddedRedis:
        self.server = start_redis(port=self.port, folder=self.folder, appendonly=True)
        return self.server

    def stop(self) -> None:
        """A clean stop (SIGTERM: the append-only file is flushed); ``start`` brings it back."""
        self.server.close()

    def crash_and_restart(self, down_s: float = 1.0) -> None:
        """``kill -9``, ``down_s`` without a Redis (every process meets refused connections: the
        dispatcher's one-second rounds and scrapes, the workers' blocked reads), then ``start``."""
        assert self.server.process is not None
        os.kill(self.server.process.pid, signal.SIGKILL)
        self.server.process.wait(timeout=10)
        time.sleep(down_s)
        self.start()

    def close(self) -> None:
        self.server.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def write_config(path: Path, data: dict[str, Any]) -> None:
    path.write_text(tomli_w.dumps(data), encoding="utf-8")


def make_config(tmp: Path, **sections: Any) -> Path:
    """The example config on the test broker under a fresh prefix, with secrets of its own (workers
    refuse the example's public ones there); a dict argument updates that section
    (``backend={"max_num_seqs": 4}``), anything else sets a top-level key (``backends=[...]``
    replaces the example's [backend] with those entries)."""
    data = tomllib.loads(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
    data["broker_url"] = TEST_BROKER
    data["key_prefix"] = f"t-{uuid.uuid4().hex[:10]}:"
    for name, project in data["projects"].items():
        project["secret"] = f"test-{name}-{uuid.uuid4().hex}"
    data.setdefault("admission", {})["metrics_port"] = 0
    data.setdefault("gateway", {})["port"] = free_port()  # ``fleet up`` starts a gateway on it
    if "backends" in sections:  # [[backends]] entries stand in for the example's [backend]
        data.pop("backend", None)
    for name, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(name, {}).update(values)
        else:
            data[name] = values
    path = tmp / "fleet.toml"
    write_config(path, data)
    return path


def kill_the_busy_backend(harness: Harness, over_tokens: int) -> str:
    """SIGKILL the simulator of the backend (of two, "a" and "b") that has generated more than
    ``over_tokens`` tokens, once one has; its name."""
    busy: dict[str, str] = {}

    def generating() -> bool:
        for name, url in harness.sim_urls.items():
            if httpx.get(f"{url}/sim/stats", timeout=10).json()["generation_tokens"] > over_tokens:
                busy["name"] = name
                return True
        return False

    wait_until(generating, 60, "a backend generating")
    victim = busy["name"]
    child = "sim" if victim == "a" else "sim-b"  # the first backend's simulator is "sim"
    process = next(p for name, p in harness.fleet.children if name == child)
    os.killpg(process.pid, signal.SIGKILL)
    return victim


class Harness:
    def __init__(self, config: Path, sim_speed: float = 50.0, sim_args: list[str] | None = None,
                 workers: int = 1, dispatchers: int = 1, concurrency: int = 40,
                 gateway: bool = False) -> None:
        self.settings = load_settings(config, env={})
        self.fleet = LocalFleet(self.settings, sim_speed=sim_speed, sim_args=sim_args or [],
                                workers=workers, dispatchers=dispatchers,
                                worker_concurrency=concurrency, config_path=str(config),
                                gateway_port=self.settings.gateway.port if gateway else None)

    def __enter__(self) -> Harness:
        self.fleet.start()
        self.sim_urls = self.fleet.backend_urls()  # backend name -> its simulator
        self.backend_url = next(iter(self.sim_urls.values()))  # the first backend's
        if len(self.settings.backends) == 1:
            self.settings = self.settings.with_backend(url=self.backend_url)
        else:
            entries = [entry.model_copy(update={"url": self.sim_urls[entry.name]})
                       for entry in self.settings.backends]
            self.settings = self.settings.model_copy(update={"backends": entries, "backend": entries[0]})
        self.client = Client(self.settings)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.fleet.close()
        client = redis.Redis.from_url(TEST_BROKER)
        keys = list(client.scan_iter(match=f"{self.settings.key_prefix}*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start:start + 500])
        client.close()


# -- helpers for integration tests (what reached the simulator, what the fleet published) -------
class FleetProbe:
    """Read-only views of a running Harness: the simulator's request log and counters, the
    results streams and the dispatcher store."""

    def __init__(self, harness: Harness) -> None:
        self.h = harness

    def sim_requests(self, job_id: str | None = None, limit: int = 2000) -> list[dict[str, Any]]:
        """Chat request bodies the simulator received (oldest first), of one job if given."""
        reply = httpx.get(f"{self.h.backend_url}/sim/requests", params={"limit": limit},
                          timeout=10)
        bodies = [r["body"] for r in reply.json()["requests"]]
        if job_id is None:
            return bodies
        return [b for b in bodies if str(b.get("request_id", "")).startswith(f"{job_id}-")]

    def sim_stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.h.backend_url}/sim/stats", timeout=10).json()

    def sim_reset(self) -> None:
        httpx.post(f"{self.h.backend_url}/sim/reset", timeout=10).raise_for_status()

    def sim_kill(self) -> None:
        httpx.post(f"{self.h.backend_url}/sim/kill", timeout=10).raise_for_status()

    def sim_revive(self) -> None:
        httpx.post(f"{self.h.backend_url}/sim/revive", timeout=10).raise_for_status()

    def envelope_counts(self) -> Counter[str]:
        """How many envelopes each job id has across every project's results stream."""
        client, counts = self.h.client.redis, Counter[str]()
        for project in self.h.settings.projects:
            for _id, fields in client.xrange(self.h.client.keys.results(project)):
                counts[json.loads(fields[b"envelope"])["job_id"]] += 1
        return counts

    def store(self) -> RedisStore:
        return make_store(self.h.settings, self.h.client.redis)

    def snapshot(self) -> StoreSnapshot:
        return self.store().snapshot()

    def state(self, job_id: str) -> str:
        return self.h.client.results.job_record(self.h.client.ref(job_id)).get("state", "")

    def cli(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``python -m fleet ARGS`` against this fleet (same broker, prefix and config)."""
        env = {**self.h.fleet.env, "COLUMNS": "200"}
        return subprocess.run([sys.executable, "-m", "fleet", *args], env=env,
                              capture_output=True, text=True, timeout=timeout_s)

    # -- Celery remote control (every live worker must answer, else None) -------------------
    def live_workers(self) -> list[str]:
        return [name for name, p in self.h.fleet.children
                if name.startswith("worker-") and p.poll() is None]

    def _inspect(self, method: str) -> dict[str, Any] | None:
        live = len(self.live_workers())
        inspect = self.h.client._celery.control.inspect(timeout=5.0, limit=live)
        replies = getattr(inspect, method)() or {}
        return replies if len(replies) == live else None

    def active_tasks(self) -> dict[str, list[dict[str, Any]]] | None:
        """Celery node name -> the tasks it is running now."""
        return self._inspect("active")

    def active_task_ids(self) -> set[str] | None:
        active = self.active_tasks()
        return None if active is None else {t["id"] for tasks in active.values() for t in tasks}

    def tasks_taken(self, name: str) -> int | None:
        """How many tasks called ``name`` the live workers have taken since they started."""
        stats = self._inspect("stats")
        return None if stats is None else sum(s.get("total", {}).get(name, 0) for s in stats.values())

    def count_tasks_taken(self, name: str, timeout_s: float = 30) -> int:
        """``tasks_taken`` once every live worker answers."""
        found: list[int] = []

        def answered() -> bool:
            taken = self.tasks_taken(name)
            if taken is not None:
                found.append(taken)
            return taken is not None

        wait_until(answered, timeout_s, f"every worker to report its {name} count")
        return found[-1]
