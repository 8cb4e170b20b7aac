"""The whole-fleet harness: ``FleetBench`` runs one fleet (simulator and Celery workers as real
processes; a dispatcher per phase) for every whole-fleet phase, and ``FleetRun`` is what one
phase returns.

Setup: a generated fleet.toml (the example's five projects, a private key prefix
``fbench-<hex>:``), then ``LocalFleet`` starts the simulator and the workers. The dispatcher is
started per phase, only after every job of the phase is prepared and pending, so "N jobs queued"
means queued at the dispatcher. Between phases the dispatcher is stopped and the simulator's
counters are reset (``POST /sim/reset``).

Settings scaled by ``speed`` so proportions stay those of the real deployment: the prefill token
bucket (``admission.prefill_tokens_per_s`` x speed) and the server's prefill rate the quiet long
prefills count with (``backend.prefill_tokens_per_s`` x speed). Lease TTL is not scaled (it is
about detecting a dead worker in real time).

Failure handling: everything started is stopped in ``close`` (also on error), and every key under
the prefix is deleted (SCAN + DEL, never FLUSHDB).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import tomllib
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import tomli_w

from fleet.bench.fleet.direct import DirectRecord, run_direct
from fleet.bench.fleet.sampler import Sampler
from fleet.bench.fleet.workload import PROJECTS, LongText, Spec, body_of, job_of
from fleet.bench.measure import CpuMeter
from fleet.client import Client
from fleet.core.config import EXAMPLE_CONFIG, Settings, load_settings
from fleet.core.models import Envelope
from fleet.core.results import ResultFollower
from fleet.local.processes import LocalFleet
from schedulers.store import make_store

log = logging.getLogger(__name__)


def write_toml(path: Path, data: dict[str, Any]) -> None:
    path.write_text(tomli_w.dumps(data), encoding="utf-8")


@dataclass
class FleetRun:
    envelopes: list[Envelope]
    start: float  # dispatcher started
    first_admit: float
    last_admit: float
    end: float
    missing: int
    cpu: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def submitted_at(e: Envelope) -> float:
        return float(e.metadata["submitted_at"])

    @staticmethod
    def admitted_at(e: Envelope) -> float:
        return (e.timings.queued_s or 0.0) + FleetRun.submitted_at(e)

    @staticmethod
    def finished_at(e: Envelope) -> float:
        return (e.timings.total_s or 0.0) + FleetRun.submitted_at(e)


def fleet_toml(redis_url: str, speed: float, lease_ttl_s: float, cap: int,
               configure: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
    """The example's settings for the bench: its Redis, a private key prefix, the sequence cap,
    the prefill rates scaled by ``speed``; then ``configure``'s changes."""
    data = tomllib.loads(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
    data["broker_url"] = redis_url
    data["key_prefix"] = f"fbench-{uuid.uuid4().hex[:8]}:"
    data["backend"]["max_num_seqs"] = cap
    data["backend"]["prefill_tokens_per_s"] = float(data["backend"].get("prefill_tokens_per_s", 8000)) * speed
    admission = data.setdefault("admission", {})
    admission.update(
        metrics_port=0,
        lease_ttl_s=lease_ttl_s,
        prefill_tokens_per_s=float(admission.get("prefill_tokens_per_s", 60000)) * speed,
    )
    if configure is not None:
        configure(data)
    return data


def partial_prefill_args(settings: Settings) -> list[str]:
    """The simulator started with the chunked-prefill flags fleet.toml says the server has."""
    backend = settings.backend
    return ["--max-num-partial-prefills", str(backend.max_num_partial_prefills),
            "--max-long-partial-prefills", str(backend.max_long_partial_prefills),
            "--long-prefill-token-threshold", str(backend.long_prefill_token_threshold)]


class FleetBench:
    """One fleet (sim + workers; a dispatcher per phase) for all the whole-fleet phases."""

    def __init__(
        self,
        redis_url: str,
        speed: float,
        workers: int = 2,
        concurrency: int = 32,
        lease_ttl_s: float = 5.0,
        cap: int = 32,
        configure: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.redis_url, self.speed, self.cap = redis_url, speed, cap
        self.tmp = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
        write_toml(self.tmp / "fleet.toml", fleet_toml(redis_url, speed, lease_ttl_s, cap, configure))
        self.settings = load_settings(self.tmp / "fleet.toml", env={})
        long_threshold = self.settings.backend.long_prompt_tokens
        self.fleet = LocalFleet(
            self.settings,
            sim_speed=speed,
            workers=workers,
            worker_concurrency=concurrency,
            dispatchers=0,
            config_path=str(self.tmp / "fleet.toml"),
            log_dir=str(self.tmp),
            sim_args=["--long-threshold", str(long_threshold), "--max-num-seqs", str(cap),
                      *partial_prefill_args(self.settings)],
            local_broker=True,  # the example's projects under a throwaway prefix, for minutes
            inherit_env=False,
        )
        self.redis = redis.Redis.from_url(redis_url)
        self._dispatcher_n = 0
        self._worker_n = workers

    def __enter__(self) -> FleetBench:
        try:
            self.fleet.start()
            self.base_url = self.fleet.env["FLEET_BACKEND_URL"]
            self.settings = self.settings.with_backend(url=self.base_url)
            self.client = Client(self.settings)
            self.store = make_store(self.settings, self.redis)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            if hasattr(self, "client"):
                self.client.close()
            self.fleet.close(grace_s=5)
            keys = list(self.redis.scan_iter(match=f"{self.settings.key_prefix}*", count=2000))
            for start in range(0, len(keys), 1000):
                self.redis.delete(*keys[start : start + 1000])
        except redis.ConnectionError as exc:  # a stop signal stopped a private Redis first: nothing to delete
            log.warning("keys under %s not deleted: %s", self.settings.key_prefix, exc)
        finally:
            self.redis.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    # processes
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.fleet.children if p.poll() is None}

    def start_dispatcher(self, extra_env: dict[str, str] | None = None) -> str:
        name = f"dispatcher-{self._dispatcher_n}"
        self._dispatcher_n += 1
        self.fleet.spawn(name, ["dispatcher", "--log-level", "WARNING"], extra_env)
        return name

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        for index, (child, process) in enumerate(self.fleet.children):
            if child == name:
                if process.poll() is None:
                    os.killpg(process.pid, sig)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=5)
                del self.fleet.children[index]
                return

    def start_worker(self) -> str:
        name = f"worker-{self._worker_n}"
        self._worker_n += 1
        self.fleet.spawn(
            name,
            [
                "worker",
                "--concurrency",
                str(self.fleet.worker_concurrency),
                "--hostname",
                f"{name}-{os.getpid()}@%h",
                "--log-level",
                "WARNING",
            ],
        )
        return name

    def reset_sim(self) -> None:
        httpx.post(self.base_url + "/sim/reset", timeout=10).raise_for_status()

    def wait_idle(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = httpx.get(self.base_url + "/sim/stats", timeout=10).json()
            if stats["running"] == 0 and stats["waiting"] == 0:
                return
            time.sleep(0.2)
        raise RuntimeError("simulator did not go idle")

    # phases
    def submit(self, specs: list[Spec], long_text: LongText | None,
               job_extra: dict[str, Any] | None = None) -> dict[str, Spec]:
        ids: dict[str, Spec] = {}
        for spec in specs:
            job = {**job_of(spec, long_text), **(job_extra or {})}
            job["id"] = uuid.uuid4().hex
            job["metadata"]["submitted_at"] = time.time()
            job["submitted_at"] = job["metadata"]["submitted_at"]
            ids[self.client.submit(job)] = spec
        return ids

    def wait_prepared(self, count: int, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            snap = self.store.snapshot()
            pending = sum(sum(b.values()) for b in snap.pending.values())
            if pending >= count:
                return
            time.sleep(0.2)
        raise RuntimeError(f"only {pending} of {count} jobs prepared in {timeout_s:.0f} s")

    def run_fleet(
        self,
        specs: list[Spec],
        long_text: LongText | None,
        sampler_out: list[Sampler],
        timeout_s: float = 1200,
        during: Any = None,
        dispatcher_env: dict[str, str] | None = None,
        job_extra: dict[str, Any] | None = None,
    ) -> tuple[FleetRun, dict[str, Spec]]:
        """Submit every job, wait until all are pending, then start a dispatcher and collect."""
        self.wait_idle()
        follower = ResultFollower(self.client.results, set(PROJECTS))
        submit_started = time.time()
        ids = self.submit(specs, long_text, job_extra)
        submitted = time.time()
        self.wait_prepared(len(ids))
        self.prep_figures = (len(ids), submitted - submit_started, time.time() - submit_started)
        self.reset_sim()
        sampler = Sampler(self.base_url, self.store)
        sampler_out.append(sampler)
        with sampler:
            name, envelopes, start, end, figures = self._dispatch_and_collect(
                follower, ids, timeout_s, during, dispatcher_env)
        self.stop(name)
        admitted = sorted(FleetRun.admitted_at(e) for e in envelopes)
        run = FleetRun(
            envelopes,
            start,
            admitted[0] if admitted else start,
            admitted[-1] if admitted else end,
            end,
            len(ids) - len(envelopes),
            figures,
        )
        return run, ids

    def _dispatch_and_collect(
        self, follower: ResultFollower, ids: dict[str, Spec], timeout_s: float, during: Any,
        dispatcher_env: dict[str, str] | None,
    ) -> tuple[str, list[Envelope], float, float, dict[str, float]]:
        """Start a dispatcher (and ``during``'s thread) and follow every job to its envelope: the
        dispatcher's name (the caller stops it), the envelopes, the start and end instants and the
        CPU figures between."""
        cpu = CpuMeter(self.pids())
        start = time.time()
        name = self.start_dispatcher(dispatcher_env)
        watcher = threading.Thread(target=during, args=(start,), daemon=True) if during else None
        if watcher:
            watcher.start()
        envelopes = list(follower.follow({self.client.ref(i) for i in ids}, timeout_s))
        end = time.time()
        if watcher:
            watcher.join()
        figures = cpu.stop()
        return name, envelopes, start, end, figures

    def run_direct(
        self, groups: dict[str, tuple[int, list[Spec]]], long_text: LongText | None, sampler_out: list[Sampler]
    ) -> tuple[list[DirectRecord], float, float, float, dict]:
        self.wait_idle()
        model = self.settings.backend.model
        bodies = {name: (c, [body_of(s, long_text, model) for s in specs]) for name, (c, specs) in groups.items()}
        self.reset_sim()
        sampler = Sampler(self.base_url)
        sampler_out.append(sampler)
        with sampler:
            cpu = CpuMeter({"sim": self.pids()["sim"]})
            records, start, last_sent, end = run_direct(self.base_url, bodies, {n: s for n, (_c, s) in groups.items()})
            figures = cpu.stop()
        return records, start, last_sent, end, figures


def codes(envelopes: list[Envelope]) -> str:
    return " ".join(f"{c}={n}" for c, n in sorted(Counter(e.code.value for e in envelopes).items()))


def by_project(envelopes: list[Envelope]) -> dict[str, list[Envelope]]:
    out: dict[str, list[Envelope]] = defaultdict(list)
    for e in envelopes:
        out[e.project].append(e)
    return out


def fleet_latencies(run: FleetRun, ids: dict[str, Spec], long: bool | None = None) -> dict[str, list[float]]:
    """Service (admitted -> final) and e2e (dispatcher start -> final) latencies of the run's
    jobs, all of them or only the long (``long=True``) or short ones."""
    service, e2e = [], []
    for e in run.envelopes:
        spec = ids.get(e.job_id)
        if spec is None or (long is not None and spec.long != long):
            continue
        service.append(FleetRun.finished_at(e) - FleetRun.admitted_at(e))
        e2e.append(FleetRun.finished_at(e) - run.start)
    return {"service": service, "e2e": e2e}
