"""``fleet bench dispatch`` (whole-fleet part): the dispatcher benchmarks that need every process of
the fleet, every figure next to its baseline measured in the same run, against one ``fleet sim``.

Scenarios (``fleet_bench(only=...)``, rows of scenario / figure / value / target / verdict):
  fairness    one project submits 10x the others: token shares while all are backlogged, Jain's
              index, a small project's p95 wait vs the same run without the big project
  saturation  N short jobs: mean in-flight / cap, the simulator's peak, tok/s vs an ideal closed
              loop of ``cap`` streams, and five independent clients x 16 straight at the sim
  long        10% real 60K-token prompts: long in-flight, short-job p95 with / without them, with
              the default and a paced prefill bucket; a 32-thread FIFO and five clients x 16
  crash       kill -9 of one of two workers five times (a replacement started each time):
              exactly one Envelope per job, time from kill to the backend back at cap
  idle        one tiny job at a time through ``fleet.Client`` on an idle fleet: the time of each
              hop (``IDLE_HOPS``) and the latency the fleet adds to the backend's own

What runs (``FleetBench``): a generated fleet.toml (the example's five projects, Redis DB 15, a
private key prefix ``fbench-<hex>:``), then ``LocalFleet`` starts the simulator and the Celery
workers as real processes; the dispatcher is started per phase, only after every job of the phase
is prepared and pending, so "N jobs queued" means queued at the dispatcher. Between phases the
dispatcher is stopped and the simulator's counters are reset (``POST /sim/reset``). The in-bench
"direct" clients (the ideal closed loop, the FIFO drained by 32 threads, five independent
projects) send the same request bodies straight at the same simulator with httpx, streaming.

Measuring:
  * a sampler thread reads ``/sim/stats`` (and the store's snapshot) every 50 ms; mean
    in-flight over a window is the simulator's own time integral (``running_seconds`` over
    ``sim_time``), tokens per second its ``generation_tokens`` over real time.
  * the busy period is the first to the last admission (fleet: an infer task starting, from the
    envelopes' timings; direct clients: the first and last request sent): the backlog was
    non-empty all along.
  * latency "service" = admitted (fleet) / sent (direct) -> final; "e2e" = phase start -> final.
  * CPU: each child process's utime+stime from /proc and the whole machine's busy share over
    the phase, so a CPU-bound shortfall shows as such.

Settings scaled by ``--speed`` so proportions stay those of the real deployment: the prefill
token bucket (``admission.prefill_tokens_per_s`` x speed; the paced run's ``hol_bypass_s`` /
speed) and the server's prefill rate the quiet long prefills count with
(``backend.prefill_tokens_per_s`` x speed). Lease TTL is not scaled (it is about
detecting a dead worker in real time).

Failure handling: everything started is stopped in ``close`` (also on error), and every key under
the prefix is deleted (SCAN + DEL, never FLUSHDB).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import random
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

from fleet.client import Client
from fleet.core.config import EXAMPLE_CONFIG, Settings, load_settings
from fleet.core.models import Envelope
from fleet.core.results import ResultFollower
from fleet.infer.sse import iter_events
from fleet.local.processes import LocalFleet
from schedulers.policy.limits import long_prefills_at_once
from schedulers.store import make_store

log = logging.getLogger(__name__)

PROJECTS = ("assistant", "reports", "translate", "triage", "research")
TOPIC = "Summarise the operational risks of the nightly batch and propose two checks."


# -- workload -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One job: who sends it, its exact reasoning/answer lengths, and whether its prompt is long."""

    project: str
    think: int
    answer: int
    long: bool = False
    tag: str = ""
    extra: str = ""  # more scenario markers (fleet/bench/continuations.py), made unique by the tag

    @property
    def thinking_budget(self) -> int:
        return self.think + 64

    @property
    def content_reserve(self) -> int:
        return self.answer + 64


def short_mix(n: int, think: int, answer: int, projects: tuple[str, ...] = PROJECTS) -> list[Spec]:
    """``n`` short jobs round-robin over ``projects``; lengths vary +-25% (seeded) around the mean."""
    rng = random.Random(7)
    return [
        Spec(
            projects[i % len(projects)],
            int(think * rng.uniform(0.75, 1.25)),
            int(answer * rng.uniform(0.75, 1.25)),
            tag=f"s{i}",
        )
        for i in range(n)
    ]


def with_long(specs: list[Spec], share: float) -> list[Spec]:
    """Every ``1/share``-th job becomes a long-prompt job (same lengths otherwise)."""
    step = round(1 / share)
    return [Spec(s.project, s.think, s.answer, long=(i % step == step - 1), tag=s.tag) for i, s in enumerate(specs)]


class LongText:
    """A ~``target`` token document for the simulator's tokenizer; each job gets a unique head so
    the simulator's prefix cache never hits (a real 60K-token prompt, sent and counted as such)."""

    def __init__(self, base_url: str, target_tokens: int) -> None:
        rng = random.Random(11)
        words = (
            "ledger",
            "queue",
            "invoice",
            "shard",
            "latency",
            "replica",
            "batch",
            "cursor",
            "budget",
            "region",
            "tenant",
            "kernel",
            "packet",
            "vector",
            "schema",
        )
        unit = lambda: f"{rng.choice(words)} {rng.randint(0, 999)}."  # noqa: E731
        body = " ".join(unit() for _ in range(target_tokens // 3))
        count = _tokenize(base_url, body)
        if count > target_tokens:  # cut to size by the measured characters per token
            body = body[: int(len(body) * target_tokens / count * 1.002)]
            count = _tokenize(base_url, body)
        while count < target_tokens:  # top up until the count reaches the target
            body += " " + " ".join(unit() for _ in range((target_tokens - count) // 4 + 2))
            count = _tokenize(base_url, body)
        self.body, self.tokens = body, count

    def content(self, tag: str) -> str:
        return f"Document {tag} {uuid.uuid4().hex}:\n{self.body}\n\n{TOPIC}"


def _tokenize(base_url: str, text: str) -> int:
    reply = httpx.post(base_url + "/tokenize", json={"prompt": text}, timeout=60)
    reply.raise_for_status()
    return int(reply.json()["count"])


def content_of(spec: Spec, long_text: LongText | None) -> str:
    markers = f"[sim:think={spec.think}] [sim:answer={spec.answer}]"
    if spec.extra:  # /K markers count per first message: this job's own
        markers += f" (job {spec.tag}) {spec.extra}"
    if spec.long:
        assert long_text is not None
        return f"{long_text.content(spec.tag)} {markers}"
    return f"{TOPIC} {markers}"


def job_of(spec: Spec, long_text: LongText | None) -> dict[str, Any]:
    return {
        "project": spec.project,
        "thinking_budget": spec.thinking_budget,
        "content_reserve": spec.content_reserve,
        "metadata": {"tag": spec.tag, "long": spec.long},
        "messages": [{"role": "user", "content": content_of(spec, long_text)}],
    }


def body_of(spec: Spec, long_text: LongText | None, model: str) -> dict[str, Any]:
    """What the inference worker sends for this job (same messages, caps and budget)."""
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": spec.thinking_budget + spec.content_reserve,
        "thinking_token_budget": spec.thinking_budget,
        "messages": [{"role": "user", "content": content_of(spec, long_text)}],
    }


# -- measuring ----------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if values else float("nan")


class Sampler:
    """Samples ``/sim/stats`` (plus the dispatcher store's in-flight and pending) every
    ``interval_s`` in a thread; ``window`` turns two instants into the simulator's own figures."""

    def __init__(self, base_url: str, store: Any = None, interval_s: float = 0.05) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=10)
        self.store, self.interval_s = store, interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.http.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stats = self.http.get("/sim/stats").json()
                if self.store is not None:
                    snap = self.store.snapshot()
                    stats["leases"] = snap.in_flight
                    stats["pending"] = sum(sum(b.values()) for b in snap.pending.values())
                stats["t"] = time.time()
                self.samples.append(stats)
            except (httpx.HTTPError, redis.RedisError) as exc:
                log.warning("sampler: %s", exc)
            self._stop.wait(self.interval_s)

    def between(self, t0: float, t1: float) -> list[dict[str, Any]]:
        return [s for s in self.samples if t0 <= s["t"] <= t1]

    def window(self, t0: float, t1: float, cap: int) -> dict[str, float]:
        inside = self.between(t0, t1)
        if len(inside) < 2:
            return {
                "mean in-flight / cap": float("nan"),
                "output tok/s": float("nan"),
                "mean waiting": float("nan"),
                "max waiting": float("nan"),
            }
        a, b = inside[0], inside[-1]
        sim_dt = b["sim_time"] - a["sim_time"]
        return {
            "mean in-flight / cap": (b["running_seconds"] - a["running_seconds"]) / sim_dt / cap,
            "output tok/s": (b["generation_tokens"] - a["generation_tokens"]) / (b["t"] - a["t"]),
            "mean waiting": sum(s["waiting"] for s in inside) / len(inside),
            "max waiting": max(s["waiting"] for s in inside),
            "window s": b["t"] - a["t"],
        }


class CpuMeter:
    """CPU seconds of given processes and the machine's busy share between ``start`` and ``stop``."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before = self._read()

    @staticmethod
    def _proc(pid: int) -> float:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            return 0.0

    @staticmethod
    def _machine() -> tuple[float, float]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + values[4]
        return sum(values) - idle, float(sum(values))

    def _read(self) -> dict[str, Any]:
        return {
            "t": time.time(),
            "self": time.process_time(),
            "machine": self._machine(),
            **{name: self._proc(pid) for name, pid in self.pids.items()},
        }

    def stop(self) -> dict[str, float]:
        after = self._read()
        wall = after["t"] - self.before["t"]
        busy = (after["machine"][0] - self.before["machine"][0]) / max(
            1.0, after["machine"][1] - self.before["machine"][1]
        )
        figures = {
            "machine busy %": 100 * busy,
            "bench process CPU %": 100 * (after["self"] - self.before["self"]) / wall,
        }
        for name in self.pids:
            figures[f"{name} CPU %"] = 100 * (after[name] - self.before[name]) / wall
        return figures


# -- direct clients -------------------------------------------------------------------------------
@dataclass
class DirectRecord:
    project: str
    long: bool
    sent: float
    done: float
    tokens: int
    ok: bool


def stream_once(http: httpx.Client, body: dict[str, Any]) -> tuple[int, bool]:
    tokens, ok = 0, False
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return 0, False
        for event in iter_events(response.iter_bytes()):
            if event.is_done:
                ok = True
            elif event.data is not None and '"usage"' in event.data:
                usage = json.loads(event.data).get("usage") or {}
                tokens = int(usage.get("completion_tokens") or tokens)
    return tokens, ok


def run_direct(
    base_url: str, groups: dict[str, tuple[int, list[dict[str, Any]]]], specs: dict[str, list[Spec]]
) -> tuple[list[DirectRecord], float, float, float]:
    """Each group: ``concurrency`` threads popping its own FIFO of bodies straight at the sim.
    Returns the records, the start, the last send and the end (unix s)."""
    records: list[DirectRecord] = []
    lock = threading.Lock()
    last_sent = [0.0]
    threads = []
    total = sum(c for c, _ in groups.values())
    http = httpx.Client(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=total + 8))
    start = time.time()
    for name, (concurrency, bodies) in groups.items():
        fifo: queue.SimpleQueue[tuple[dict[str, Any], Spec]] = queue.SimpleQueue()
        for body, spec in zip(bodies, specs[name], strict=True):
            fifo.put((body, spec))

        def drain(fifo: queue.SimpleQueue = fifo) -> None:  # type: ignore[type-arg]
            while True:
                try:
                    body, spec = fifo.get_nowait()
                except queue.Empty:
                    return
                sent = time.time()
                with lock:
                    last_sent[0] = max(last_sent[0], sent)
                try:
                    tokens, ok = stream_once(http, body)
                except httpx.HTTPError:
                    tokens, ok = 0, False
                with lock:
                    records.append(DirectRecord(spec.project, spec.long, sent, time.time(), tokens, ok))

        threads += [threading.Thread(target=drain, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    http.close()
    return records, start, last_sent[0], time.time()


# -- the fleet ------------------------------------------------------------------------------------
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
    def admitted_at(e: Envelope) -> float:
        return (e.timings.queued_s or 0.0) + _submitted(e)

    @staticmethod
    def finished_at(e: Envelope) -> float:
        return (e.timings.total_s or 0.0) + _submitted(e)


def _submitted(e: Envelope) -> float:
    return float(e.metadata["submitted_at"])


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
        write_toml(self.tmp / "fleet.toml", data)
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
                      *_partial_prefill_args(self.settings)],
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
            self.settings = self.settings.model_copy(
                update={"backend": self.settings.backend.model_copy(update={"url": self.base_url})}
            )
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


def stats_max(sampler: Sampler) -> dict[str, Any]:
    last = sampler.samples[-1] if sampler.samples else {}
    return {k: last.get(k) for k in ("max_running_seen", "max_waiting_seen", "max_long_running_seen", "preemptions")}


def codes(envelopes: list[Envelope]) -> str:
    return " ".join(f"{c}={n}" for c, n in sorted(Counter(e.code.value for e in envelopes).items()))


def by_project(envelopes: list[Envelope]) -> dict[str, list[Envelope]]:
    out: dict[str, list[Envelope]] = defaultdict(list)
    for e in envelopes:
        out[e.project].append(e)
    return out


# -- scenarios ------------------------------------------------------------------------------------
Row = tuple[str, str, str, str, str]  # scenario, figure, value, target, verdict


def _f(value: float, digits: int = 2) -> str:
    return f"{value:,.{digits}f}"


def _verdict(ok: bool | None, shortfall: str = "") -> str:
    if ok is None:
        return ""
    return "met" if ok else f"NOT met{': ' + shortfall if shortfall else ''}"


def _fleet_latencies(run: FleetRun, ids: dict[str, Spec], long: bool | None = None) -> dict[str, list[float]]:
    service, e2e = [], []
    for e in run.envelopes:
        spec = ids.get(e.job_id)
        if spec is None or (long is not None and spec.long != long):
            continue
        service.append(FleetRun.finished_at(e) - FleetRun.admitted_at(e))
        e2e.append(FleetRun.finished_at(e) - run.start)
    return {"service": service, "e2e": e2e}


def _direct_latencies(records: list[DirectRecord], start: float, long: bool | None = None) -> dict[str, list[float]]:
    chosen = [r for r in records if long is None or r.long == long]
    return {"service": [r.done - r.sent for r in chosen], "e2e": [r.done - start for r in chosen]}


def _lat(lat: dict[str, list[float]]) -> str:
    return (
        f"service p50 {_f(percentile(lat['service'], 0.5))} / p95 {_f(percentile(lat['service'], 0.95))} s; "
        f"e2e p95 {_f(percentile(lat['e2e'], 0.95))} s"
    )


def _cpu(figures: dict[str, float]) -> str:
    return ", ".join(f"{k.replace(' CPU %', '')} {v:.0f}%" for k, v in figures.items())


def saturation(fb: FleetBench, n: int, think: int, answer: int) -> list[Row]:
    cap, rows, samplers = fb.cap, [], []  # type: ignore[var-annotated]
    specs = short_mix(n, think, answer)
    run, ids = fb.run_fleet(specs, None, samplers)
    prep = fb.prep_figures
    fleet_w = samplers[-1].window(run.first_admit, run.last_admit, cap)
    fleet_max = stats_max(samplers[-1])
    records, start, last_sent, end, cpu_i = fb.run_direct({"ideal": (cap, specs)}, None, samplers)
    ideal_w = samplers[-1].window(start, last_sent, cap)
    groups = {p: (16, [s for s in specs if s.project == p]) for p in PROJECTS}
    b_records, b_start, b_last, b_end, cpu_b = fb.run_direct(groups, None, samplers)
    base_w = samplers[-1].window(b_start, b_last, cap)
    base_all = samplers[-1].window(b_start, b_end, cap)
    base_max = stats_max(samplers[-1])
    sc = f"saturation ({n} short jobs)"
    ratio = fleet_w["output tok/s"] / ideal_w["output tok/s"]
    rows += [
        (
            sc,
            "jobs finished / codes",
            f"{len(run.envelopes)} / {codes(run.envelopes)}",
            f"{n} OK",
            _verdict(run.missing == 0 and all(e.ok for e in run.envelopes)),
        ),
        (sc, "busy period (first..last admission) s", _f(run.last_admit - run.first_admit), "", ""),
        (
            sc,
            "mean in-flight / cap, busy period (sim running_seconds)",
            _f(fleet_w["mean in-flight / cap"], 3),
            ">= 0.97",
            _verdict(fleet_w["mean in-flight / cap"] >= 0.97, f"{_f(fleet_w['mean in-flight / cap'], 3)}"),
        ),
        (sc, "ideal closed loop: mean in-flight / cap", _f(ideal_w["mean in-flight / cap"], 3), "", ""),
        (
            sc,
            "max in-flight at the backend (sim max_running_seen)",
            str(fleet_max["max_running_seen"]),
            f"<= {cap}",
            _verdict(fleet_max["max_running_seen"] <= cap),
        ),
        (
            sc,
            "sim max_waiting_seen (fleet)",
            str(fleet_max["max_waiting_seen"]),
            "<= 1 (the sim counts every arrival once before admitting it)",
            _verdict(fleet_max["max_waiting_seen"] <= 1),
        ),
        (
            sc,
            "submit / all prepared and pending (before the dispatcher starts)",
            f"{prep[0]} jobs: submitted in {_f(prep[1])} s, pending after {_f(prep[2])} s "
            f"({_f(prep[0] / prep[2], 0)} jobs/s)",
            "",
            "",
        ),
        (
            sc,
            "output tok/s fleet / ideal closed loop",
            f"{_f(fleet_w['output tok/s'], 0)} / {_f(ideal_w['output tok/s'], 0)} = {_f(ratio, 3)}",
            ">= 0.97",
            _verdict(ratio >= 0.97, f"{_f(100 * (1 - ratio), 1)}% below ideal"),
        ),
        (sc, "latency fleet", _lat(_fleet_latencies(run, ids)), "", ""),
        (sc, "latency ideal closed loop", _lat(_direct_latencies(records, start)), "", ""),
        (sc, "CPU during fleet run", _cpu(run.cpu), "", ""),
        (sc, "CPU during ideal run", _cpu(cpu_i), "", ""),
        (
            "baseline: saturation, 5 clients x 16",
            "sim max_running / max_waiting_seen",
            f"{base_max['max_running_seen']} / {base_max['max_waiting_seen']}",
            "",
            "",
        ),
        (
            "baseline: saturation, 5 clients x 16",
            "mean / max waiting in vLLM's queue (whole run)",
            f"{_f(base_all['mean waiting'], 1)} / {base_all['max waiting']}",
            "",
            "",
        ),
        ("baseline: saturation, 5 clients x 16", "output tok/s", _f(base_w["output tok/s"], 0), "", ""),
        ("baseline: saturation, 5 clients x 16", "latency", _lat(_direct_latencies(b_records, b_start)), "", ""),
        ("baseline: saturation, 5 clients x 16", "CPU", _cpu(cpu_b), "", ""),
    ]
    return rows


def _partial_prefill_args(settings: Settings) -> list[str]:
    """The simulator started with the chunked-prefill flags fleet.toml says the server has."""
    backend = settings.backend
    return ["--max-num-partial-prefills", str(backend.max_num_partial_prefills),
            "--max-long-partial-prefills", str(backend.max_long_partial_prefills),
            "--long-prefill-token-threshold", str(backend.long_prefill_token_threshold)]


def long_runs(fb: FleetBench, paced: dict[str, str], paced_label: str) -> list[tuple[str, dict[str, str] | None]]:
    """The fleet runs of the long-prompt scenario: the settings as given; with several long
    prefills per quiet window, also the rule before (one per window) on the same server; the
    paced bucket unless its rate is 0."""
    runs: list[tuple[str, dict[str, str] | None]] = [("default settings", None)]
    if long_prefills_at_once(fb.settings) > 1:
        runs.append(("one long prefill per quiet window (the rule before)",
                     {"FLEET_BACKEND_MAX_LONG_PARTIAL_PREFILLS": "1"}))
    if paced:
        runs.append((paced_label, paced))
    return runs


def paced_env(fb: FleetBench, prefill_tokens_per_s: float, burst_tokens: int, hol_bypass_s: float) -> dict[str, str]:
    """Dispatcher settings for the paced long-prompt run (rates x speed, times / speed)."""
    return {
        "FLEET_ADMISSION_PREFILL_TOKENS_PER_S": str(prefill_tokens_per_s * fb.speed),
        "FLEET_ADMISSION_PREFILL_BURST_TOKENS": str(burst_tokens),
        "FLEET_ADMISSION_HOL_BYPASS_S": str(hol_bypass_s / fb.speed),
    }


def long_prompts(
    fb: FleetBench, n: int, think: int, answer: int, long_tokens: int, paced_tokens_per_s: float = 1500.0
) -> list[Row]:
    cap, samplers = fb.cap, []  # type: ignore[var-annotated]
    max_long = fb.settings.backend.max_long
    long_text = LongText(fb.base_url, long_tokens)
    specs = with_long(short_mix(n, think, answer), 0.1)
    shorts = [s for s in specs if not s.long]
    run0, ids0 = fb.run_fleet(shorts, None, samplers)
    lat0 = _fleet_latencies(run0, ids0, long=False)
    p95_0 = percentile(lat0["service"], 0.95)
    rows: list[Row] = []
    sc = f"long prompts ({n} jobs, {sum(s.long for s in specs)} of {long_text.tokens:,} tokens)"
    paced = paced_env(fb, paced_tokens_per_s, long_tokens + 4096, 120.0) if paced_tokens_per_s > 0 else {}
    paced_label = (f"paced: prefill {paced_tokens_per_s:,.0f} tok/s, burst {long_tokens + 4096:,}, "
                   f"hol_bypass 120 s (sim time)")
    for label, env in long_runs(fb, paced, paced_label):
        run, ids = fb.run_fleet(specs, long_text, samplers, dispatcher_env=env)
        mx = stats_max(samplers[-1])
        w = samplers[-1].window(run.first_admit, run.last_admit, cap)
        lat = _fleet_latencies(run, ids, long=False)
        lat_long = _fleet_latencies(run, ids, long=True)
        p95, e95 = percentile(lat["service"], 0.95), percentile(lat["e2e"], 0.95)
        name = f"{sc}, fleet, {label}"
        rows += [
            (
                name,
                "jobs finished / codes",
                f"{len(run.envelopes)} / {codes(run.envelopes)}",
                f"{n} OK",
                _verdict(run.missing == 0 and all(e.ok for e in run.envelopes)),
            ),
            (
                name,
                "long in-flight at the backend (sim max_long_running_seen)",
                str(mx["max_long_running_seen"]),
                f"<= max_long {max_long}",
                _verdict(mx["max_long_running_seen"] <= max_long),
            ),
            (
                name,
                "max in-flight / max waiting (sim)",
                f"{mx['max_running_seen']} / {mx['max_waiting_seen']}",
                f"<= {cap} / <= 1",
                _verdict(mx["max_running_seen"] <= cap and mx["max_waiting_seen"] <= 1),
            ),
            (
                name,
                "short-job service p95 (admitted -> final) with / without long jobs",
                f"{_f(p95)} / {_f(p95_0)} s = {_f(p95 / p95_0)}x",
                "<= 1.3x",
                _verdict(p95 / p95_0 <= 1.3, f"{_f(p95 / p95_0)}x"),
            ),
            (
                name,
                "short-job e2e p95 (dispatcher start -> final) with / without long jobs",
                f"{_f(e95)} / {_f(percentile(lat0['e2e'], 0.95))} s",
                "",
                "",
            ),
            (
                name,
                "long-job service p50 / p95; long-job e2e p95",
                f"{_f(percentile(lat_long['service'], 0.5))} / {_f(percentile(lat_long['service'], 0.95))} s; "
                f"{_f(percentile(lat_long['e2e'], 0.95))} s",
                "",
                "",
            ),
            (
                name,
                "mean in-flight / cap, output tok/s (busy period)",
                f"{_f(w['mean in-flight / cap'], 3)}, {_f(w['output tok/s'], 0)}",
                "",
                "",
            ),
            (
                name,
                "makespan (without long jobs)",
                f"{_f(run.end - run.start)} s ({_f(run0.end - run0.start)} s)",
                "",
                "",
            ),
            (name, "CPU", _cpu(run.cpu), "", ""),
        ]
    f_rec, f_start, f_last, f_end, cpu_f = fb.run_direct({"fifo": (32, specs)}, long_text, samplers)
    f_max = stats_max(samplers[-1])
    f_w = samplers[-1].window(f_start, f_last, cap)
    f_lat = _direct_latencies(f_rec, f_start, long=False)
    f95 = percentile(f_lat["service"], 0.95)
    groups = {p: (16, [s for s in specs if s.project == p]) for p in PROJECTS}
    b_rec, b_start, b_last, b_end, _cpu_b = fb.run_direct(groups, long_text, samplers)
    b_max = stats_max(samplers[-1])
    b_w = samplers[-1].window(b_start, b_end, cap)
    fifo = f"{sc}, FIFO: 32 threads popping one queue, straight to the sim"
    base = f"baseline: {sc}, 5 clients x 16 straight to the sim"
    return rows + [
        (
            fifo,
            "long in-flight (sim max_long_running_seen)",
            str(f_max["max_long_running_seen"]),
            f"(fleet: <= {max_long})",
            "",
        ),
        (
            fifo,
            "short-job service p95 vs the fleet run without long jobs",
            f"{_f(f95)} / {_f(p95_0)} s = {_f(f95 / p95_0)}x",
            "",
            "",
        ),
        (fifo, "short-job latency", _lat(f_lat), "", ""),
        (
            fifo,
            "mean in-flight / cap, output tok/s",
            f"{_f(f_w['mean in-flight / cap'], 3)}, {_f(f_w['output tok/s'], 0)}",
            "",
            "",
        ),
        (fifo, "makespan, failed requests", f"{_f(f_end - f_start)} s, {sum(not r.ok for r in f_rec)}", "", ""),
        (fifo, "CPU", _cpu(cpu_f), "", ""),
        (
            base,
            "sim max_running / max_waiting / max_long_running",
            f"{b_max['max_running_seen']} / {b_max['max_waiting_seen']} / {b_max['max_long_running_seen']}",
            "",
            "",
        ),
        (
            base,
            "mean / max waiting in vLLM's queue (whole run)",
            f"{_f(b_w['mean waiting'], 1)} / {b_w['max waiting']}",
            "",
            "",
        ),
        (base, "short-job latency", _lat(_direct_latencies(b_rec, b_start, long=False)), "", ""),
        (base, "makespan", _f(b_end - b_start) + " s", "", ""),
    ]


FAIR_THINK = {"assistant": 160, "reports": 320, "translate": 240, "triage": 200, "research": 280}


def fluid_wait(costs: dict[str, list[float]], weights: dict[str, float], project: str, q: float) -> float:
    """Backend tokens served before ``project``'s ``q``-quantile job starts (the job at the index
    ``percentile`` picks) under exact weighted fair share (fluid start-time fair queuing), every
    project backlogged from the start with ``costs`` (its jobs' costs, in its order).

    All backlogged projects advance in virtual time together; reaching virtual time v takes
    sum over p of min(W_p, w_p * v) tokens (W_p: p's whole work), and the job starts at v = the
    project's earlier jobs' cost / its weight. The ratio of two such waits (with and without a
    big project) is what the policy itself prescribes, before job sizes and slots add their own."""
    own = costs[project]
    start = sum(own[: min(len(own) - 1, int(q * len(own)))]) / weights[project]
    return sum(min(sum(c), weights[p] * start) for p, c in costs.items())


def fairness(fb: FleetBench, n: int, heavy: str = "research", small: str = "triage") -> list[Row]:
    samplers: list[Sampler] = []
    weights = {p: fb.settings.projects[p].weight for p in PROJECTS}
    rng = random.Random(3)

    def specs_for(project: str, count: int) -> list[Spec]:
        return [
            Spec(project, int(FAIR_THINK[project] * rng.uniform(0.8, 1.2)), 40, tag=f"{project}{i}")
            for i in range(count)
        ]

    heavy_specs = specs_for(heavy, 10 * n)
    others = [s for group in zip(*(specs_for(p, n) for p in PROJECTS if p != heavy), strict=True) for s in group]
    run, ids = fb.run_fleet(heavy_specs + others, None, samplers)
    run0, ids0 = fb.run_fleet([s for s in others], None, samplers)
    # Shares while every project is backlogged: up to the first project's last admission.
    groups = by_project(run.envelopes)
    end = min(max(FleetRun.admitted_at(e) for e in es) for es in groups.values())
    cost: dict[str, float] = defaultdict(float)
    for e in run.envelopes:
        if FleetRun.admitted_at(e) < end:
            spec = ids[e.job_id]
            cost[e.project] += e.usage.prompt_tokens + spec.thinking_budget + spec.content_reserve
    total_cost, total_weight = sum(cost.values()), sum(weights.values())
    normalised = {p: (cost[p] / total_cost) / (weights[p] / total_weight) for p in PROJECTS}
    worst = max(normalised, key=lambda p: abs(normalised[p] - 1))
    j = jain(list(normalised.values()))

    def wait_p95(r: FleetRun, project: str) -> float:
        return percentile([FleetRun.admitted_at(e) - r.start for e in r.envelopes if e.project == project], 0.95)

    w, w0 = wait_p95(run, small), wait_p95(run0, small)
    job_costs: dict[str, list[float]] = defaultdict(list)
    for e in sorted(run.envelopes, key=_submitted):
        spec = ids[e.job_id]
        job_costs[e.project].append(e.usage.prompt_tokens + spec.thinking_budget + spec.content_reserve)
    without = {p: c for p, c in job_costs.items() if p != heavy}
    fluid = fluid_wait(job_costs, weights, small, 0.95) / fluid_wait(without, weights, small, 0.95)
    sc = f"fairness ({heavy} submits {10 * n} first, the others {n} each)"
    rows: list[Row] = [
        (
            sc,
            "jobs finished / codes",
            f"{len(run.envelopes)} / {codes(run.envelopes)}",
            "all OK",
            _verdict(run.missing == 0 and all(e.ok for e in run.envelopes)),
        ),
        (
            sc,
            "window with all five backlogged (s, admissions)",
            f"{_f(end - run.first_admit)} s, {sum(FleetRun.admitted_at(e) < end for e in run.envelopes)}",
            "",
            "",
        ),
    ]
    for p in PROJECTS:
        share = cost[p] / total_cost
        rows.append(
            (
                sc,
                f"token share {p} (weight {weights[p]:g})",
                f"{_f(100 * share, 1)}% vs {_f(100 * weights[p] / total_weight, 1)}% -> {_f(normalised[p], 3)}",
                "within 5% of weight",
                _verdict(abs(normalised[p] - 1) <= 0.05, f"{_f(100 * (normalised[p] - 1), 1)}%"),
            )
        )
    rows += [
        (sc, "Jain's index on weight-normalised shares", _f(j, 4), ">= 0.98", _verdict(j >= 0.98)),
        (sc, f"worst share error ({worst})", f"{_f(100 * (normalised[worst] - 1), 1)}%", "<= 5%", ""),
        (
            sc,
            f"{small} p95 wait (dispatcher start -> admitted) with {heavy} / without",
            f"{_f(w)} / {_f(w0)} s = {_f(w / w0)}x",
            "<= 1.2x",
            _verdict(w / w0 <= 1.2, f"{_f(w / w0)}x"),
        ),
        (sc, "the same ratio under exact weighted fair share (fluid model, these jobs' costs)",
         f"{_f(fluid)}x", "", ""),
    ]
    return rows


def crash(fb: FleetBench, n: int, think: int, answer: int, kills: int = 5) -> list[Row]:
    cap, ttl = fb.cap, fb.settings.admission.lease_ttl_s
    samplers: list[Sampler] = []
    recoveries: list[float] = []
    notes: list[str] = []

    def killer(start: float) -> None:
        try:
            for _ in range(kills):
                sampler = samplers[-1]
                time.sleep(1.0)
                _first_after(sampler, time.time(), cap, full=True, timeout_s=60)
                victim = next(name for name, _p in fb.fleet.children if name.startswith("worker"))
                t_kill = time.time()
                fb.stop(victim, signal.SIGKILL)
                fb.start_worker()
                dropped = _first_after(sampler, t_kill, cap, full=False, timeout_s=10)
                back = _first_after(sampler, dropped, cap, full=True, timeout_s=60)
                low = min(s["running"] for s in sampler.samples if t_kill < s["t"] < back)
                recoveries.append(back - t_kill)
                notes.append(f"{victim}: running fell to {low}, back at {cap} after {back - t_kill:.2f} s")
        except TimeoutError as exc:
            notes.append(f"killer stopped: {exc}")

    specs = short_mix(n, think, answer)
    run, ids = fb.run_fleet(specs, None, samplers, during=killer)
    counts: Counter[str] = Counter()
    for p in PROJECTS:
        entries: Any = fb.redis.xrange(fb.client.keys.results(p))
        for _id, fields in entries:
            job_id = Envelope.model_validate_json(fields[b"envelope"]).job_id
            if job_id in ids:
                counts[job_id] += 1
    missing = [j for j in ids if counts[j] == 0]
    doubled = [j for j in ids if counts[j] > 1]
    retried = sum(len(e.attempts) > 1 for e in run.envelopes)
    mx = stats_max(samplers[-1])
    sc = f"crash ({kills} x kill -9 of one of 2 workers, {n} jobs, lease TTL {ttl:g} s)"
    worst = max(recoveries) if recoveries else float("nan")
    return [
        (sc, "kills done", str(len(recoveries)), str(kills), _verdict(len(recoveries) == kills)),
        (
            sc,
            "jobs with exactly one Envelope (results streams) / none / more than one",
            f"{sum(c == 1 for c in counts.values())} / {len(missing)} / {len(doubled)}",
            f"{n} / 0 / 0",
            _verdict(not missing and not doubled and len(counts) == n),
        ),
        (sc, "codes; jobs with more than one attempt", f"{codes(run.envelopes)}; {retried}", "", ""),
        (
            sc,
            "kill -> sim running back at cap, s (each kill)",
            ", ".join(f"{r:.2f}" for r in recoveries),
            f"<= lease TTL {ttl:g}",
            _verdict(bool(recoveries) and worst <= ttl, f"worst {worst:.2f} s"),
        ),
        (
            sc,
            "max in-flight (sim max_running_seen)",
            str(mx["max_running_seen"]),
            f"<= {cap}",
            _verdict(mx["max_running_seen"] <= cap),
        ),
        *[(sc, "detail", note, "", "") for note in notes],
    ]


def _first_after(
    sampler: Sampler, after: float, cap: int, *, full: bool, hold_s: float = 0.0, timeout_s: float
) -> float:
    """Time of the first sample after ``after`` with running at cap (``full``) or below it; with
    ``hold_s``, the first such sample that stays so for ``hold_s`` (polls the sampler)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        since = None
        for s in list(sampler.samples):
            if s["t"] <= after:
                continue
            if (s["running"] >= cap) == full:
                since = s["t"] if since is None else since
                if s["t"] - since >= hold_s:
                    return since
            else:
                since = None
        time.sleep(0.02)
    raise TimeoutError(f"running {'at' if full else 'below'} cap {cap} not seen within {timeout_s:.0f} s")


SCENARIOS = ("fairness", "saturation", "long", "crash", "idle")
IDLE_HOPS = (
    "submit -> prepared (broker push, prep pick-up, verify, token count, store write)",
    "prepared -> admitted at the worker (dispatcher wake, admission, send, broker, pick-up, claim)",
    "admitted -> request at the backend (attempt set-up, HTTP)",
    "request at the backend -> envelope (backend time, validation)",
    "envelope -> Client.result returns (publish, XREAD wake)",
)


def idle_latency(fb: FleetBench, n: int) -> list[Row]:
    """One tiny job at a time through ``fleet.Client`` on an idle fleet (after one warm-up job):
    the time of each hop, from the client's clock at submit, the job's events (``prepared``,
    ``admitted``), the sim's request log (``received_at``), the envelope's ``finished_at`` and
    ``Client.result`` returning; added latency = submit -> result minus request at the backend
    -> envelope."""
    fb.wait_idle()
    fb.reset_sim()
    name = fb.start_dispatcher()
    hops: list[list[float]] = [[] for _ in IDLE_HOPS]
    added: list[float] = []
    spec = Spec("triage", think=1, answer=1)
    try:
        for i in range(n + 1):  # the first job warms the workers up and is not counted
            job = job_of(spec, None)
            job["id"] = uuid.uuid4().hex
            started = time.time()
            job_id = fb.client.submit(job)
            envelope = fb.client.result(job_id, timeout=120)
            returned = time.time()
            assert envelope is not None and envelope.ok, envelope
            events = {e["type"]: e["ts"] for e in fb.client.events(job_id, follow=False)}
            log_ = httpx.get(fb.base_url + "/sim/requests", params={"limit": 1}, timeout=10).json()
            received = float(log_["requests"][-1]["received_at"])
            marks = [started, events["prepared"], events["admitted"], received, envelope.finished_at,
                     returned]
            if i == 0:
                continue
            for hop, (a, b) in zip(hops, itertools.pairwise(marks), strict=True):
                hop.append(b - a)
            added.append((returned - started) - (envelope.finished_at - received))
    finally:
        fb.stop(name)
    scenario = f"idle fleet, {n} jobs one at a time through fleet.Client"
    rows: list[Row] = [
        (scenario, f"{hop} p50 / p99 ms",
         f"{_f(1000 * percentile(v, 0.5), 1)} / {_f(1000 * percentile(v, 0.99), 1)}", "", "")
        for hop, v in zip(IDLE_HOPS, hops, strict=True)
    ]
    p50, p99 = 1000 * percentile(added, 0.5), 1000 * percentile(added, 0.99)
    rows.append((scenario, "added latency p50 / p99 ms", f"{_f(p50, 1)} / {_f(p99, 1)}", "<= 8 / 25 ms",
                 _verdict(p50 <= 8 and p99 <= 25, f"{_f(p50, 1)} / {_f(p99, 1)} ms")))
    return rows


def fleet_bench(
    redis_url: str,
    speed: float = 5.0,
    jobs: int = 2000,
    think: int = 200,
    answer: int = 50,
    long_jobs: int = 200,
    long_tokens: int = 60_000,
    fair_n: int = 100,
    crash_jobs: int = 400,
    only: tuple[str, ...] = SCENARIOS,
    workers: int = 2,
    concurrency: int = 32,
    lease_ttl_s: float = 5.0,
    paced_tokens_per_s: float = 1500.0,
    idle_jobs: int = 100,
    partial_prefills: tuple[int, int] = (1, 1),
) -> list[Row]:
    """``partial_prefills``: the server's --max-num-partial-prefills and
    --max-long-partial-prefills, in fleet.toml and on the simulator alike."""
    rows: list[Row] = []

    def configure(data: dict[str, Any]) -> None:
        data["backend"]["max_num_partial_prefills"], data["backend"]["max_long_partial_prefills"] = partial_prefills

    with FleetBench(redis_url, speed, workers=workers, concurrency=concurrency, lease_ttl_s=lease_ttl_s,
                    configure=configure) as fb:
        rows.append(
            (
                "setup",
                "fleet",
                f"sim --speed {speed:g}, {workers} Celery workers x {concurrency} threads "
                f"(prep + infer), 1 dispatcher, cap {fb.cap}, max_long {fb.settings.backend.max_long}, "
                f"long threshold {fb.settings.backend.long_prompt_tokens}, lease TTL {lease_ttl_s:g} s, "
                f"prefill bucket {fb.settings.admission.prefill_tokens_per_s:,.0f} tok/s (60K x speed), "
                f"{os.cpu_count()} CPUs",
                "",
                "",
            )
        )
        for name in only:
            started = time.monotonic()
            if name == "saturation":
                rows += saturation(fb, jobs, think, answer)
            elif name == "long":
                rows += long_prompts(fb, long_jobs, think, answer, long_tokens, paced_tokens_per_s)
            elif name == "fairness":
                rows += fairness(fb, fair_n)
            elif name == "crash":
                rows += crash(fb, crash_jobs, think * 3, answer * 2)
            elif name == "idle":
                rows += idle_latency(fb, idle_jobs)
            log.warning("bench %s took %.0f s", name, time.monotonic() - started)
    return rows


def rows_table(rows: list[Row], title: str = "fleet bench dispatch --fleet") -> Any:
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for column in ("scenario", "figure", "value", "target", "verdict"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def rows_markdown(rows: list[Row]) -> str:
    """The rows as markdown tables, one per scenario (for docs/performance.md)."""
    out: list[str] = []
    current = None
    for scenario, figure, value, target, verdict in rows:
        if scenario != current:
            out += ["", f"#### {scenario}", "", "| figure | value | target | verdict |", "|---|---|---|---|"]
            current = scenario
        cells = [c.replace("|", "/") for c in (figure, value, target, verdict)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
