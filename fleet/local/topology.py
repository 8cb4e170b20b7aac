"""Redis servers a test or ``fleet bench chaos`` starts on loopback and then hurts on purpose.

``RedisNode``: one ``redis-server`` on a fixed free port and folder, so it can be stopped (SIGTERM,
which writes the AOF / snapshot it is configured for, as SHUTDOWN does), killed (``kill -9``) and
started again on the same port and data: a restart as an operator's Redis would see one. A node
acts on its own process only, never on whatever answers on its port: ``start`` waits for a server
whose ``INFO`` names the pid it started, so a port taken by another server meanwhile (free_port
only finds a port that was free a moment ago) is an error, not a Redis the caller then shuts down
or restarts.

``SentinelGroup``: one master, one replica and three Sentinels (quorum 2) watching the master under
``MASTER_NAME``, with ``down-after-milliseconds`` 1 s so a killed master is replaced within seconds.
``url`` is the broker URL every part of the fleet takes (``sentinel://...;...``, fleet/core/redisconn.py).
``kill_master`` kill -9s whichever node is master now and waits until the Sentinels name the other.

Every process runs in its own session and is stopped by ``close`` (SIGKILL after a grace), its
folder removed: nothing outlives the caller.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from fleet.local.embedded import free_port, redis_server_binary, track

MASTER_NAME = "fleetmaster"
DOWN_AFTER_MS = 1000


def _wait(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout_s:.0f} s: no")
        time.sleep(0.05)


def _answers(port: int) -> bool:
    client = redis.Redis(port=port, socket_timeout=0.3, socket_connect_timeout=0.3)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


@dataclass
class RedisNode:
    """One redis-server (``sentinel``: a Sentinel) on a fixed port and folder."""

    args: list[str] = field(default_factory=list)  # extra server options (--appendonly yes ...)
    sentinel_conf: str | None = None  # a Sentinel's config text (it rewrites the file)
    port: int = field(default_factory=free_port)
    folder: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="fleet-redis-node-"))
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        base = [redis_server_binary()]
        if self.sentinel_conf is not None:
            conf = Path(self.folder) / "sentinel.conf"
            if not conf.exists():
                conf.write_text(self.sentinel_conf, encoding="utf-8")
            base += [str(conf), "--sentinel"]
        return base + ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.folder,
                       "--daemonize", "no", *self.args]

    def start(self, timeout_s: float = 10.0) -> RedisNode:
        process = self.process = track(subprocess.Popen(self.command(), stdout=subprocess.DEVNULL,
                                                        stderr=subprocess.DEVNULL, start_new_session=True))
        _wait(lambda: self._serves() or process.poll() is not None, timeout_s,
              f"redis-server on port {self.port} answers")
        if process.poll() is not None:
            held = " (the port is held by another server, left alone)" if _answers(self.port) else ""
            raise RuntimeError(f"redis-server on port {self.port} exited with {process.returncode}{held}")
        return self

    def _serves(self) -> bool:
        """Does this node's own process answer on its port?"""
        client = redis.Redis(port=self.port, socket_timeout=0.3, socket_connect_timeout=0.3)
        try:
            return self.process is not None and int(client.info("server")["process_id"]) == self.process.pid
        except (redis.RedisError, OSError, KeyError, ValueError):
            return False
        finally:
            client.close()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """``kill -9``: nothing written that was not written already."""
        if self.alive():
            self.process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            self.process.wait(timeout=10)  # type: ignore[union-attr]

    def shutdown(self) -> None:
        """A clean stop of its own process (SIGTERM: like SHUTDOWN, the AOF is flushed and a
        snapshot saved if configured)."""
        if not self.alive():
            return
        self.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        try:
            self.process.wait(timeout=10)  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            self.kill()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def _sentinel_conf(master_port: int) -> str:
    return (f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER_NAME} 10000\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n")


@dataclass
class SentinelGroup:
    """Master, replica and three Sentinels on loopback."""

    data_args: list[str] = field(default_factory=lambda: ["--save", "", "--appendonly", "no"])
    nodes: list[RedisNode] = field(default_factory=list)  # master, replica (initially)
    sentinels: list[RedisNode] = field(default_factory=list)

    def start(self) -> SentinelGroup:
        try:
            master = RedisNode(list(self.data_args)).start()
            self.nodes.append(master)
            replica = RedisNode([*self.data_args, "--replicaof", "127.0.0.1", str(master.port)]).start()
            self.nodes.append(replica)
            _wait(lambda: self._in_sync(replica), 15, "the replica is in sync")
            for _ in range(3):
                self.sentinels.append(RedisNode(sentinel_conf=_sentinel_conf(master.port)).start())
            _wait(lambda: self._sentinels_see_replica(), 15, "every Sentinel sees the replica")
        except BaseException:
            self.close()
            raise
        return self

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://127.0.0.1:{s.port}" + ("/0" if n == 0 else "")
                        for n, s in enumerate(self.sentinels))

    def master_port(self) -> int | None:
        """The master's port as the Sentinels that answer name it (the first that answers)."""
        for node in self.sentinels:
            client = redis.Redis(port=node.port, socket_timeout=0.5, socket_connect_timeout=0.5)
            try:
                address = client.sentinel_get_master_addr_by_name(MASTER_NAME)
                if isinstance(address, tuple):
                    return int(address[1])
            except (redis.RedisError, OSError):
                continue
            finally:
                client.close()
        return None

    def master(self) -> RedisNode:
        port = self.master_port()
        return next(n for n in self.nodes if n.port == port)

    def kill_master(self, timeout_s: float = 30.0) -> tuple[RedisNode, float]:
        """kill -9 the master; return it and the seconds until a new master answered writes."""
        old = self.master()
        started = time.monotonic()
        old.kill()
        _wait(lambda: self._writable_master(old.port), timeout_s, "the Sentinels promoted a replica")
        return old, time.monotonic() - started

    def _writable_master(self, old_port: int) -> bool:
        port = self.master_port()
        if port is None or port == old_port:
            return False
        client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return client.info("replication").get("role") == "master"
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def _in_sync(self, replica: RedisNode) -> bool:
        client = redis.Redis(port=replica.port, socket_timeout=0.5)
        try:
            return client.info("replication").get("master_link_status") == "up"
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def _sentinels_see_replica(self) -> bool:
        for node in self.sentinels:
            client = redis.Redis(port=node.port, socket_timeout=0.5)
            try:
                if not client.sentinel_slaves(MASTER_NAME):
                    return False
            except (redis.RedisError, OSError):
                return False
            finally:
                client.close()
        return True

    def close(self) -> None:
        for node in [*self.sentinels, *self.nodes]:
            node.close()

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
