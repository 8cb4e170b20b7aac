"""Benchmark: does a backlog of collect-heavy jobs lower the backend's utilization?

The design says it must not: jobs with sources are collected on their own queues
(``fleet.<project>.collect``, ``fleet worker --role collect``), ready jobs are prepared on the
projects' queues, and only prepared jobs ever reach the dispatcher, so no inference slot waits
for material. This measures it with the real fleet (separate processes: ``fleet sim``, one
dispatcher, one inference worker (threads), one prep worker (threads) and one collect worker
(prefork)), in one run, twice:

  alone         ``infer_jobs`` ready-to-run inference jobs spread over four projects;
  with backlog  the same jobs submitted right after ``heavy_jobs`` collect-heavy ``trim`` jobs
                (project ``research``; each ``sources_per_job`` unique ~``doc_kb`` KB documents
                fetched over HTTP from a local server or read from files, counted with
                ``/tokenize`` and trimmed), so the prep worker is busy the whole time.

For each phase the simulator's own counters give the backend's view: mean running sequences over
its busy period (``running_seconds / busy_seconds``), output tokens per simulated second, and the
busy period; the envelopes give the inference jobs' p50/p95 latency. Reported side by side with
the ratio with/alone.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis
from rich.table import Table

from fleet.bench.collect import Site, make_jobs, material_server
from fleet.bench.measure import percentile
from fleet.client import Client
from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.models import Envelope
from fleet.core.results import ResultFollower
from fleet.local.processes import LocalFleet

LIGHT_PROJECTS = ("assistant", "reports", "translate", "triage")


def _light_job(n: int) -> dict[str, Any]:
    return {"project": LIGHT_PROJECTS[n % len(LIGHT_PROJECTS)], "thinking_budget": 2000,
            "messages": [{"role": "user", "content": f"Question {n} [sim:think=600] [sim:answer=100]"}]}


def _phase(fleet: LocalFleet, client: Client, light: int, heavy: list[Any]) -> dict[str, float]:
    sim = fleet.env["FLEET_BACKEND_URL"]
    httpx.post(f"{sim}/sim/reset", timeout=10)
    follower = ResultFollower(client.results, set(client.settings.projects))
    heavy_ids = {client.submit(job) for job in heavy}
    light_ids = {client.submit(_light_job(n)) for n in range(light)}
    refs = {client.ref(i) for i in light_ids | heavy_ids}
    envelopes: list[Envelope] = list(follower.follow(refs, timeout_s=1800))
    stats = httpx.get(f"{sim}/sim/stats", timeout=10).json()
    light_env = [e for e in envelopes if e.job_id in light_ids]
    busy_s = stats["busy_seconds"] or 1e-9
    return {
        "mean_running": stats["running_seconds"] / busy_s,
        "tok_s": stats["generation_tokens"] / busy_s,
        "busy_s": busy_s,
        "light_ok": sum(e.ok for e in light_env),
        "heavy_ok": sum(e.ok for e in envelopes if e.job_id in heavy_ids),
        "p50": percentile([e.timings.total_s or 0.0 for e in light_env], 50, default=0.0),
        "p95": percentile([e.timings.total_s or 0.0 for e in light_env], 95, default=0.0),
    }


def bench_pipeline(redis_url: str, infer_jobs: int = 200, heavy_jobs: int = 40, sources_per_job: int = 3,
                   doc_kb: int = 200, speed: float = 30.0) -> Table:
    root = Path(tempfile.mkdtemp(prefix="fleet-bench-pipeline-"))
    settings = load_settings(EXAMPLE_CONFIG, env={}, broker_url=redis_url, key_prefix=f"bench-{uuid.uuid4().hex[:8]}:",
                             admission={"metrics_port": 0})
    env = {"FLEET_COLLECT_ALLOWED_ROOTS": f'["{root}"]',
           "FLEET_COLLECT_MAX_BYTES": str(8 * doc_kb * 1024), "FLEET_ADMISSION_METRICS_PORT": "0",
           "FLEET_COLLECT_ALLOW_NETWORKS": '["127.0.0.1/32"]'}  # the material server
    fleet = LocalFleet(settings, sim_speed=speed, workers=0, extra_env=env,
                       sim_args=["--log-level", "warning"], log_dir=str(root),
                       local_broker=True,  # the example's projects under a throwaway prefix
                       inherit_env=False)
    site = Site()
    with material_server(site) as base, fleet:
        fleet.spawn("infer-worker", ["worker", "--role", "infer", "--concurrency", "40",
                                     "--hostname", f"infer-{uuid.uuid4().hex[:6]}@%h",
                                     "--log-level", "WARNING"])
        fleet.spawn("prep-worker", ["worker", "--role", "prep", "--concurrency", "4",
                                    "--log-level", "WARNING",
                                    "--hostname", f"prep-{uuid.uuid4().hex[:6]}@%h"])
        fleet.spawn("collect-worker", ["worker", "--role", "collect", "--pool", "prefork",
                                       "--concurrency", "2", "--log-level", "WARNING",
                                       "--hostname", f"collect-{uuid.uuid4().hex[:6]}@%h"])
        run_settings = settings.model_copy(update={"broker_url": fleet.env["FLEET_BROKER_URL"]})
        heavy, _ = make_jobs("trim", heavy_jobs, sources_per_job, base, root, site,
                             doc_kb * 1024, tag=1)
        heavy = [job.model_copy(update={"project": "research"}) for job in heavy]
        with Client(run_settings) as client:
            _phase(fleet, client, 32, [])  # warm-up: workers connected, caches and pools built
            alone = _phase(fleet, client, infer_jobs, [])
            started = time.monotonic()
            loaded = _phase(fleet, client, infer_jobs, heavy)
            loaded_wall = time.monotonic() - started
    _cleanup(run_settings.broker_url, settings.key_prefix)  # after the workers stopped
    shutil.rmtree(root, ignore_errors=True)
    return _table(alone, loaded, infer_jobs, heavy_jobs, sources_per_job, doc_kb, loaded_wall)


def _cleanup(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        client.delete(key)
    client.close()


def _table(alone: dict[str, float], loaded: dict[str, float], light: int, heavy: int,
           per_job: int, doc_kb: int, wall_s: float) -> Table:
    table = Table(title=f"backend utilization: {light} inference jobs alone vs behind {heavy} "
                        f"collect-heavy jobs ({per_job} x {doc_kb} KB sources each)")
    table.add_column("figure")
    table.add_column("alone", justify="right")
    table.add_column("with backlog", justify="right")
    table.add_column("ratio", justify="right")
    rows = [("mean running over busy period", "mean_running", "{:.1f}"),
            ("output tok/s (simulated)", "tok_s", "{:.0f}"),
            ("busy period, simulated s", "busy_s", "{:.0f}"),
            ("inference p50 latency, s", "p50", "{:.2f}"),
            ("inference p95 latency, s", "p95", "{:.2f}")]
    for label, key, fmt in rows:
        ratio = loaded[key] / alone[key] if alone[key] else float("nan")
        table.add_row(label, fmt.format(alone[key]), fmt.format(loaded[key]), f"{ratio:.3f}")
    table.add_row("inference jobs OK", f"{alone['light_ok']:.0f}", f"{loaded['light_ok']:.0f}", "")
    table.add_row("collect-heavy jobs OK", "-", f"{loaded['heavy_ok']:.0f}", "")
    table.add_row("wall s of the loaded phase", "", f"{wall_s:.1f}", "")
    return table
