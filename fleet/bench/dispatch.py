"""``fleet bench dispatch``: the dispatcher benchmarks that need only the dispatcher (and,
for saturation, ``fleet sim``); the whole-fleet runs (Celery workers, crash, long prompts,
fairness, the five-client baseline) are in fleet/bench/fleet/, and ``fleet bench dispatch``
runs both (docs/performance.md has the figures and the command).

``backlog_overhead``  no backend at all: a steady backlog (1,000 as the baseline, then
                      ``--jobs``) in one RedisStore, then admission decisions per second (each an
                      admit + release on the real Lua scripts; up to 8 grants per ADMIT call, or
                      one; releases one by one or pipelined), the Redis memory the backlog takes
                      (MEMORY USAGE of every dispatcher key) and the dispatcher process's own
                      memory (it holds nothing per job).
``saturation``        ``fleet sim`` at ``--speed`` as the backend, ``run_dispatcher`` in a thread,
                      and a pool of in-bench "workers" playing the inference worker: claim the
                      lease, stream the chat completion with httpx, release it in ``finally``. Measures mean
                      in-flight / cap over the busy period (while jobs were still pending), the
                      simulator's own peak running count, release-to-next-admission latency and
                      release-to-next-request-at-the-backend latency (the simulator's request log).
"""

from __future__ import annotations

import bisect
import math
import resource
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import redis
from rich.table import Table

from fleet.bench.measure import percentile
from fleet.core.config import Settings
from fleet.core.keys import Keys
from fleet.infer.sse import iter_events
from schedulers.dispatcher import GRANTS_PER_CALL, run_dispatcher
from schedulers.store import make_store
from schedulers.store.base import Grant, PendingItem, StoreConfig
from schedulers.store.redis_store import RedisStore

PROJECTS = ("assistant", "reports", "translate", "triage", "research")


def _delete(client: redis.Redis, prefix: str) -> None:
    keys = list(client.scan_iter(match=f"{prefix}*", count=2000))
    for start in range(0, len(keys), 1000):
        client.delete(*keys[start : start + 1000])


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class _Backlog:
    """A steady backlog of ``jobs`` pending jobs in one RedisStore under its own prefix."""

    def __init__(self, client: redis.Redis, jobs: int, config: StoreConfig | None = None,
                 eligible: int = 1) -> None:
        self.client, self.jobs, self.next, self.eligible = client, jobs, jobs, eligible
        self.prefix = f"bench-{uuid.uuid4().hex[:8]}:"
        self.store = RedisStore(client, Keys(self.prefix), config or StoreConfig(gate=False))
        started = time.perf_counter()
        for start in range(0, jobs, 1000):
            self.store.add_pending_many(self.item(i) for i in range(start, min(jobs, start + 1000)))
        self.submit_s = time.perf_counter() - started
        self.bytes = _key_bytes(client, self.prefix)

    def item(self, i: int) -> PendingItem:
        return PendingItem(f"j{i}", PROJECTS[i % 5], 500 + i % 4000, 1000, enqueued_at=1e9 + i,
                           eligible=self.eligible)

    def decide(self, decisions: int, per_call: int, pipelined: bool, settle: bool = False) -> tuple[float, float]:
        """Seconds per admit+release pair, over ``decisions`` pairs, end to end (the client's
        clock) and inside Redis (the scripts' own time, ``_script_s``); admitted jobs come back,
        untimed. ``settle``: each grant's quota reservation is settled before its release, as an
        inference worker does (fleet bench quota)."""
        decide_s, server_s, done = 0.0, 0.0, 0
        while done < decisions:
            server_before = _script_s(self.client)
            started = time.perf_counter()
            grants = [r.grant for r in self.store.admit_many(2e9 + self.next, per_call) if r.grant]
            for grant in grants if settle else ():
                self.store.settle(grant.job_id, grant.fence, 100)
            if pipelined:
                self.store.release_many((grant.job_id, grant.fence) for grant in grants)
            else:
                for grant in grants:
                    self.store.release(grant.job_id, grant.fence)
            decide_s += time.perf_counter() - started
            server_s += _script_s(self.client) - server_before
            assert grants
            done += len(grants)
            self.store.add_pending_many(self.item(self.next + k) for k in range(len(grants)))
            self.next += len(grants)
        return decide_s / done, server_s / done


def _script_s(client: redis.Redis) -> float:
    """Seconds Redis has spent running scripts (``INFO commandstats``, EVALSHA), ever: a figure
    of the server alone, which round trips and the client's CPU do not move."""
    return float(client.info("commandstats").get("cmdstat_evalsha", {}).get("usec", 0)) / 1e6


def backlog_overhead(
    redis_url: str,
    jobs: int = 100_000,
    ways: tuple[tuple[int, bool], ...] = ((GRANTS_PER_CALL, False),),
    decisions: int = 500,
    rounds: int = 8,
) -> list[dict]:
    """Admission decisions per second at a steady backlog of 1,000 jobs (the baseline) and of
    ``jobs``, once per way of ``ways`` = (grants per ADMIT call, pipelined releases):
    ``admit_many`` (up to that many grants per ADMIT call, as the dispatcher asks) and one release
    per grant (as workers do: one after the other from this one client, or the call's releases in
    one pipeline, as several workers finishing at once). Both backlogs stay in Redis and the
    measurements alternate between them, ``rounds`` times ``decisions`` pairs each; the median
    round counts, so a machine busy with other work slows both sides alike. Each way also gets
    the scripts' own time inside Redis per pair (``INFO commandstats``): whether the decision
    itself stays flat with the backlog, apart from round trips and the bench's one client, and
    the pairs/s a single Redis allows when many clients call at once (its scripts run one at a
    time)."""
    client = redis.Redis.from_url(redis_url)
    rss_before = _rss_mb()
    small, big = _Backlog(client, 1_000), _Backlog(client, jobs)
    try:
        out = []
        for per_call, pipelined in ways:
            times: dict[int, list[float]] = {1_000: [], jobs: []}
            server: dict[int, list[float]] = {1_000: [], jobs: []}
            for _ in range(rounds):
                for backlog in (small, big):
                    pair_s, server_s = backlog.decide(decisions, per_call, pipelined)
                    times[backlog.jobs].append(pair_s)
                    server[backlog.jobs].append(server_s)
            base_s, big_s = percentile(times[1_000], 50), percentile(times[jobs], 50)
            server_base_s, server_big_s = percentile(server[1_000], 50), percentile(server[jobs], 50)
            out.append({
                "grants per ADMIT call (at most)": per_call,
                "releases": "pipelined" if pipelined else "one by one",
                "admission decisions/s, 1,000 backlog (baseline)": 1 / base_s,
                f"admission decisions/s, {jobs:,} backlog": 1 / big_s,
                "ratio to the baseline": base_s / big_s,
                f"admit+release latency ms, {jobs:,} backlog": 1000 * big_s,
                "Redis script time us per pair, 1,000 backlog": 1e6 * server_base_s,
                f"Redis script time us per pair, {jobs:,} backlog": 1e6 * server_big_s,
                "Redis script time, ratio to the baseline": server_base_s / server_big_s,
                f"pairs/s Redis itself allows, {jobs:,} backlog (parallel clients)": 1 / server_big_s,
            })
        out.append({
            "backlog jobs": jobs,
            "submit jobs/s": jobs / big.submit_s,
            "Redis bytes per pending job": big.bytes / jobs,
            "Redis MB for the backlog": big.bytes / 1e6,
            "dispatcher RSS MB (peak)": _rss_mb(),
            "dispatcher RSS growth MB": _rss_mb() - rss_before,
        })
        return out
    finally:
        for backlog in (small, big):
            _delete(client, backlog.prefix)
        client.close()


def _key_bytes(client: redis.Redis, prefix: str) -> int:
    total = 0
    keys = list(client.scan_iter(match=f"{prefix}*", count=2000))
    for start in range(0, len(keys), 1000):
        pipe = client.pipeline(transaction=False)
        for key in keys[start : start + 1000]:
            pipe.memory_usage(key)
        total += sum(v or 0 for v in pipe.execute())
    return total


@dataclass
class _Timeline:
    lock: threading.Lock = field(default_factory=threading.Lock)
    grants: list[float] = field(default_factory=list)
    releases: list[float] = field(default_factory=list)

    def add(self, kind: str, t: float) -> None:
        with self.lock:
            (self.grants if kind == "grant" else self.releases).append(t)


def _stream(http: httpx.Client, grant: Grant, think: int, answer: int) -> int:
    body = {
        "model": "local",
        "stream": True,
        "max_tokens": think + answer + 64,
        "messages": [
            {
                "role": "user",
                "content": f"job {grant.job_id} [sim:think={think}] [sim:answer={answer}]",
            }
        ],
    }
    chunks = 0
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        for event in iter_events(response.iter_bytes()):
            if event.data is not None and not event.is_done:
                chunks += 1
    return chunks


def saturation(
    redis_url: str,
    jobs: int = 400,
    cap: int = 32,
    speed: float = 50.0,
    think: int = 200,
    answer: int = 50,
    gate: bool = True,
) -> dict:
    from fleet.sim.server import start_sim_process

    sim = start_sim_process(speed=speed, max_num_seqs=cap, log_level="warning")
    client = redis.Redis.from_url(redis_url)
    prefix = f"bench-{uuid.uuid4().hex[:8]}:"
    settings = Settings.model_validate(
        {
            "key_prefix": prefix,
            "backend": {"url": sim.base_url, "max_num_seqs": cap},
            "admission": {"backend_gate": gate, "metrics_port": 0, "lease_ttl_s": 600},
        }
    )
    store = make_store(settings, client)
    timeline, stop = _Timeline(), threading.Event()
    http = httpx.Client(
        base_url=sim.base_url, timeout=120, limits=httpx.Limits(max_connections=cap * 2)
    )
    pool = ThreadPoolExecutor(max_workers=cap * 2)
    done = threading.Semaphore(0)

    def work(grant: Grant) -> None:
        try:
            store.claim(grant.job_id, grant.fence, "bench", time.time())  # as inference workers do
            _stream(http, grant, think, answer)
        finally:
            timeline.add("release", time.time())
            store.release(grant.job_id, grant.fence)
            done.release()

    def send(grant: Grant) -> None:
        timeline.add("grant", time.time())
        pool.submit(work, grant)

    try:
        httpx.post(sim.base_url + "/sim/reset", timeout=10)
        dispatcher = threading.Thread(
            target=run_dispatcher, args=(settings, redis.Redis.from_url(redis_url), send, stop)
        )
        dispatcher.start()
        started = time.time()
        store.add_pending_many(
            PendingItem(
                f"s{i}", PROJECTS[i % 5], 300, think + answer + 64, enqueued_at=started + i * 1e-6
            )
            for i in range(jobs)
        )
        for _ in range(jobs):
            done.acquire(timeout=600)
        elapsed_s = time.time() - started
        stats = httpx.get(sim.base_url + "/sim/stats", timeout=10).json()
        log = httpx.get(sim.base_url + "/sim/requests", params={"limit": 2000}, timeout=30).json()
        holds = store.snapshot().holds
    finally:
        stop.set()
        store.wake()
        pool.shutdown(wait=True)
        http.close()
        sim.stop()
        _delete(client, prefix)
        client.close()
    received = sorted(r["received_at"] for r in log.get("requests", []))
    return _saturation_figures(timeline, received, stats, cap, jobs, elapsed_s, holds)


def _saturation_figures(
    timeline: _Timeline,
    received: list[float],
    stats: dict,
    cap: int,
    jobs: int,
    elapsed_s: float,
    holds: dict[str, int],
) -> dict:
    grants, releases = sorted(timeline.grants), sorted(timeline.releases)
    busy_end = grants[-1]  # the last admission: the backlog was non-empty until then
    events = sorted([(t, 1) for t in grants] + [(t, -1) for t in releases])
    area, level, last = 0.0, 0, grants[0]
    for t, delta in events:
        if t > busy_end:
            break
        area += level * (t - last)
        level, last = level + delta, t
    mean_in_flight = area / (busy_end - grants[0]) if busy_end > grants[0] else float("nan")
    to_grant = _gaps(releases, grants, busy_end)
    to_backend = _gaps(releases, received, busy_end)
    return {
        "jobs": jobs,
        "cap": cap,
        "wall s": elapsed_s,
        "mean in-flight / cap (busy period, leases)": mean_in_flight / cap,
        "sim max_running_seen": stats.get("max_running_seen"),
        "sim max_waiting_seen": stats.get("max_waiting_seen"),
        "release -> next admission p50 ms": 1000 * percentile(to_grant, 50, default=math.nan),
        "release -> next admission p99 ms": 1000 * percentile(to_grant, 99, default=math.nan),
        "release -> next request at backend p50 ms": 1000 * percentile(to_backend, 50, default=math.nan),
        "release -> next request at backend p99 ms": 1000 * percentile(to_backend, 99, default=math.nan),
        "sim output tok/s (wall)": stats.get("generation_tokens", 0) / elapsed_s,
        "holds by reason": ", ".join(f"{k}={v}" for k, v in sorted(holds.items())),
    }


def _gaps(releases: list[float], followers: list[float], busy_end: float) -> list[float]:
    """For each release during the busy period, the time to the first follower event after it."""
    gaps = []
    for t in releases:
        if t >= busy_end:
            break
        index = bisect.bisect_left(followers, t)
        if index < len(followers):
            gaps.append(followers[index] - t)
    return gaps


def dispatch_bench(
    redis_url: str,
    jobs: int = 100_000,
    saturation_jobs: int = 400,
    speed: float = 50.0,
    with_sim: bool = True,
) -> Table:
    """Run the benchmarks and return one table of figures (the lead registers the command).

    The backlog figures come for a 1,000-job backlog (the baseline) and the ``jobs`` backlog,
    with up to 8 grants per ADMIT call (releases one by one, and pipelined) and with one grant
    per call (what a dispatcher that asked for one at a time would get)."""
    table = Table(title="fleet bench dispatch")
    table.add_column("benchmark")
    table.add_column("figure")
    table.add_column("value", justify="right")
    ways = ((GRANTS_PER_CALL, False), (GRANTS_PER_CALL, True), (1, False))
    *per_way, memory = backlog_overhead(redis_url, jobs, ways)
    runs: list[tuple[str, dict]] = [
        (f"backlog, {w['grants per ADMIT call (at most)']} per call, releases {w['releases']}", w)
        for w in per_way
    ]
    runs.append(("backlog memory", memory))
    if with_sim:
        runs.append(("saturation", saturation(redis_url, saturation_jobs, speed=speed)))
    for name, figures in runs:
        for key, value in figures.items():
            table.add_row(name, key, f"{value:,.2f}" if isinstance(value, float) else str(value))
    return table
