"""``fleet bench loss``: what a Redis crash costs, per Redis configuration (docs/operations.md).

For each configuration the bench starts a redis-server of its own, the fleet on it (``fleet sim``,
a dispatcher, a worker of every role), submits ``jobs`` jobs and, once ``crash_after`` of them have
their result, ``kill -9``s Redis mid-batch and starts it again on the same port and folder. Then it
waits for the fleet to finish what it still knows of and counts, against what the producer saw
before the crash:

- submitted jobs lost: neither a job record nor a final envelope after the restart (no envelope
  will ever come: ``Client.result`` answers E_NOT_FOUND);
- results lost: final envelopes readable before the crash and gone after it;
- ended once: surviving jobs that ended with exactly one envelope; stuck: survivors still without
  one when ``settle_s`` passes.

Configurations: ``aof``: ``appendonly yes``, ``appendfsync everysec`` (the fleet's recommendation);
``none``: no AOF and no RDB snapshot. A ``kill -9`` of the Redis process is not a crash of the
machine: with ``everysec`` the file is written before Redis replies and the kernel keeps it, so
only a power loss or kernel crash can lose the last second (not measured here).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fleet.client import Client
from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.errors import NotFound
from fleet.core.keys import job_ref
from fleet.local.embedded import EmbeddedRedis, free_port, start_redis
from fleet.local.processes import LocalFleet

CONFIGS = {"aof": True, "none": False}


@dataclass
class LossRow:
    config: str
    submitted: int
    results_before: int
    jobs_lost: int
    results_lost: int
    ended_once: int
    stuck: int
    restart_s: float


def _server(port: int, folder: str, appendonly: bool) -> EmbeddedRedis:
    return start_redis(port=port, folder=folder, appendonly=appendonly)


def measure(config: str, *, jobs: int, crash_after: int, speed: float, settle_s: float) -> LossRow:
    folder = tempfile.mkdtemp(prefix="fleet-bench-loss-")
    port = free_port()
    appendonly = CONFIGS[config]
    server = _server(port, folder, appendonly)
    settings = load_settings(EXAMPLE_CONFIG, env={}, broker_url=server.url, key_prefix=f"loss-{uuid.uuid4().hex[:8]}:",
                             admission={"metrics_port": 0, "lease_ttl_s": 5},
                             backend={"max_num_seqs": 8})
    env = {"FLEET_ADMISSION_METRICS_PORT": "0", "FLEET_ADMISSION_LEASE_TTL_S": "5",
           "FLEET_BACKEND_MAX_NUM_SEQS": "8"}  # the children read FLEET_*, not ``settings``
    fleet = LocalFleet(settings, sim_speed=speed, local_broker=True, log_dir=folder, extra_env=env,
                       inherit_env=False,
                       sim_args=["--think-min-tokens", "100", "--think-max-tokens", "300",
                                 "--answer-min-tokens", "10", "--answer-max-tokens", "40"])
    try:
        with fleet:
            client = Client(settings, retry_s=60)
            ids = [client.submit({"project": "assistant", "id": f"loss-{n}", "band": "batch",
                                  "messages": [{"role": "user", "content": f"question {n}"}]})
                   for n in range(jobs)]
            refs = [job_ref("assistant", i) for i in ids]
            while sum(client.results.get(r) is not None for r in refs) < crash_after:
                time.sleep(0.05)
            before = {r for r in refs if client.results.get(r) is not None}
            assert server.process is not None
            os.kill(server.process.pid, signal.SIGKILL)
            server.process.wait()
            started = time.monotonic()
            server = _server(port, folder, appendonly)
            restart_s = time.monotonic() - started
            client.redis.connection_pool.disconnect()
            row = _count(client, config, refs, before, settle_s)
            row.restart_s = restart_s
            client.close()
            return row
    finally:
        server.close()
        shutil.rmtree(folder, ignore_errors=True)


def _count(client: Client, config: str, refs: list[str], before: set[str], settle_s: float) -> LossRow:
    known = [r for r in refs if client.results.job_record(r) or client.results.get(r) is not None]
    results_lost = sum(client.results.get(r) is None for r in before)
    deadline = time.monotonic() + settle_s
    pending = set(known)
    while pending and time.monotonic() < deadline:
        for ref in list(pending):
            try:
                if client.results.get(ref) is not None:
                    pending.discard(ref)
            except NotFound:
                pending.discard(ref)
        time.sleep(0.2)
    envelopes = _envelope_counts(client)
    return LossRow(config=config, submitted=len(refs), results_before=len(before),
                   jobs_lost=len(refs) - len(known), results_lost=results_lost,
                   ended_once=sum(envelopes.get(r, 0) == 1 for r in known), stuck=len(pending),
                   restart_s=0.0)


def _envelope_counts(client: Client) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _id, fields in client.redis.xrange(client.keys.results("assistant")):
        envelope: dict[str, Any] = json.loads(fields[b"envelope"])
        ref = job_ref(envelope["project"], envelope["job_id"])
        counts[ref] = counts.get(ref, 0) + 1
    return counts


def loss_bench(*, configs: list[str], jobs: int, crash_after: int, speed: float,
               settle_s: float) -> list[LossRow]:
    return [measure(c, jobs=jobs, crash_after=crash_after, speed=speed, settle_s=settle_s)
            for c in configs]


def rows_markdown(rows: list[LossRow]) -> str:
    lines = ["| Redis | submitted | results before the crash | jobs lost | results lost | "
             "survivors ended exactly once | stuck |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.config} | {r.submitted} | {r.results_before} | {r.jobs_lost} | "
                     f"{r.results_lost} | {r.ended_once} of {r.submitted - r.jobs_lost} | {r.stuck} |")
    return "\n".join(lines) + "\n"
