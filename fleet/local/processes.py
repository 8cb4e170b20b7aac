"""Starting and stopping the fleet's processes for ``fleet up`` and ``fleet demo``.

``LocalFleet`` brings up, in order: the broker (fleet/local/embedded.py decides: configured, answering
or a private redis-server), ``fleet sim`` when no ``FLEET_BACKEND_URL`` is set, the dispatcher
and the workers, each as a child process that inherits ``FLEET_BROKER_URL`` /
``FLEET_BACKEND_URL`` so all of them agree on where things are. ``close`` stops them in the
reverse order: SIGTERM, then SIGKILL after a grace period, so nothing is left behind for the
next run. (In production the Procfile runs the same commands under honcho.)
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from fleet.core.config import Settings
from fleet.local.embedded import EmbeddedRedis, ensure_broker, free_port

log = logging.getLogger(__name__)


@dataclass
class LocalFleet:
    settings: Settings
    sim_speed: float = 25.0
    sim_args: list[str] = field(default_factory=list)
    workers: int = 1
    worker_concurrency: int = 40
    dispatchers: int = 1
    log_level: str = "WARNING"
    config_path: str | None = None
    log_dir: str | None = None  # children's output goes to <log_dir>/<name>.log when set
    extra_env: dict[str, str] = field(default_factory=dict)  # FLEET_* overrides for children
    env: dict[str, str] = field(default_factory=dict)
    broker: EmbeddedRedis | None = None
    children: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self) -> LocalFleet:
        self.broker = ensure_broker(self.settings.broker_url)
        self.env = {**os.environ, **self.extra_env, "FLEET_BROKER_URL": self.broker.url,
                    "FLEET_KEY_PREFIX": self.settings.key_prefix}
        if self.config_path:
            self.env["FLEET_CONFIG"] = self.config_path
        if not self.env.get("FLEET_BACKEND_URL"):
            self._start_sim()
        for n in range(self.dispatchers):
            extra = {} if n == 0 else {"FLEET_ADMISSION_METRICS_PORT": "0"}
            self.spawn(f"dispatcher-{n}", ["dispatcher", "--log-level", self.log_level], extra)
        for n in range(self.workers):
            self.spawn(f"worker-{n}", ["worker", "--concurrency", str(self.worker_concurrency),
                                       "--hostname", f"fleet-{n}-{os.getpid()}@%h",
                                       "--log-level", self.log_level])
        return self

    def _start_sim(self) -> None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.env["FLEET_BACKEND_URL"] = url
        self.spawn("sim", ["sim", "--port", str(port), "--speed", str(self.sim_speed),
                           *self.sim_args])
        wait_http(f"{url}/health", timeout_s=30)

    def spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> None:
        env = {**self.env, **(extra_env or {})}
        output = None
        if self.log_dir:
            output = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115
        try:
            process = subprocess.Popen([sys.executable, "-m", "fleet", *args], env=env,
                                       start_new_session=True, stdout=output,
                                       stderr=subprocess.STDOUT if output else None)
        finally:
            if output is not None:
                output.close()
        self.children.append((name, process))
        log.info("started %s pid=%d", name, process.pid)

    def check(self) -> list[str]:
        """Names of children that died."""
        return [name for name, p in self.children if p.poll() is not None]

    def close(self, grace_s: float = 10.0) -> None:
        for _name, process in reversed(self.children):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _name, process in reversed(self.children):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)
        self.children.clear()
        if self.broker is not None:
            self.broker.close()

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")
        time.sleep(0.1)
