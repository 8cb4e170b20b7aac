"""``fleet bench quota``: whether quotas hold across several admitting processes, and what they cost.

1. Exactness (``quota_exactness``). One ``fleet sim`` (32 seats), ``dispatchers`` dispatchers and
   ``gateways`` gateways (a gateway-only fleet: nothing is queued) on a private key prefix. Three
   projects, ``clients`` concurrent clients each, every client sending one non-streaming chat
   request after another to the gateways in turn (each request asks the simulator for a known
   number of reasoning and answer tokens, and its ``max_tokens`` is a little above them, so a
   reservation is close to what the turn spends): ``reports`` and ``translate`` with a
   tokens-per-minute quota (``over = "wait"``), ``triage`` with none. Run twice in the same
   session: first without any quota (the baseline), then with the two quotas.
   Per project and UTC minute of the quota run: the tokens the simulator served (each request's
   usage as its client got it, put in the minute the simulator received the request: its own
   request log) against the quota; a minute only partly inside the run counts too. (The sum of
   the worst cases reserved in a minute is no bound: a settle gives room back within the minute,
   which later requests take. What the quota bounds is cost held at any moment, settled turns
   plus running reservations, and so what was served.) And ``triage``'s output tokens/s with
   the quotas on against the baseline (its share must not fall: the quotas only hold the others).
3. A cache hit (``cache_latency``, ``fleet bench cache``): a new temperature-0 request (a model
   turn) and its identical repeat (answered from the project's exact-repeat cache), one after the
   other through one gateway, end to end; the model requests the simulator saw and the admissions
   the store made while the repeats were answered.
2. Cost (``quota_cost``). Admission pairs/s at a steady backlog (admit up to 8 grants per ADMIT
   call, release one by one, as ``fleet bench dispatch``) without quotas, with a quota on every
   project (limits high enough that none holds: every grant reserves, every call reads the
   windows and counts the projects' leases), and with quotas and each grant settled before its
   release (the worker's two extra round trips). The backlogs alternate in rounds in one Redis;
   the median round counts.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import shutil
import tempfile
import time
import tomllib
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import tomli_w

from fleet.bench.dispatch import PROJECTS, _Backlog, _delete
from fleet.bench.measure import percentile
from fleet.client import Client
from fleet.core.apikeys import mint
from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.redisconn import redis_client
from fleet.local.embedded import free_port
from fleet.local.processes import LocalFleet, wait_http
from schedulers.dispatcher import GRANTS_PER_CALL
from schedulers.policy.limits import Limits
from schedulers.policy.quota import Quota
from schedulers.store import make_store
from schedulers.store.base import StoreConfig

QUOTA_PROJECTS = ("reports", "translate")
FREE_PROJECT = "triage"
# tokens a request asks for; max_tokens = THINK + ANSWER + HEADROOM (below the projects' content
# reserve, so the planner gives it no thinking budget: the answer is the whole turn)
THINK, ANSWER, HEADROOM = 0, 200, 56
SEATS = 32
_MARK = re.compile(r"\bq(\d+)-([a-z]+)\b")


@dataclass
class Served:
    project: str
    prompt: int
    completion: int


@dataclass
class Run:
    served: dict[int, Served] = field(default_factory=dict)  # request number -> its usage
    received_at: dict[int, float] = field(default_factory=dict)  # request number -> the sim's arrival
    errors: dict[str, int] = field(default_factory=dict)
    started: float = 0.0
    ended: float = 0.0


class QuotaFleet:
    """The processes of one run (module docstring), under a fresh prefix."""

    def __init__(self, redis_url: str, quotas: dict[str, int], gateways: int, dispatchers: int,
                 speed: float, cache: bool = False, workers: int = 0) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="fleet-bench-quota-"))
        data = tomllib.loads(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
        data.update(broker_url=redis_url, key_prefix=f"qbench-{uuid.uuid4().hex[:8]}:")
        data["backend"]["max_num_seqs"] = SEATS
        data.setdefault("admission", {}).update(metrics_port=0, backend_gate=False, worker_gate=False)
        self.ports = [free_port() for _ in range(gateways)]
        data["gateway"] = {"port": self.ports[0], "max_queue_wait_s": 300}
        self.keys: dict[str, str] = {}
        for name, project in data["projects"].items():
            project["secret"] = secrets.token_urlsafe(24)  # the gateway refuses the example's
            key, entry = mint()
            project["api_keys"] = [entry]
            self.keys[name] = key
            if name in quotas:
                project["quota"] = {"tokens_per_minute": quotas[name]}
            if cache:
                project["repeat_cache"] = {"enabled": True}
        path = self.tmp / "fleet.toml"
        path.write_text(tomli_w.dumps(data), encoding="utf-8")
        self.settings = load_settings(path, env={})
        self.fleet = LocalFleet(self.settings, sim_speed=speed, workers=workers, dispatchers=dispatchers,
                                config_path=str(path), log_dir=str(self.tmp),
                                sim_args=["--max-num-seqs", str(SEATS)],
                                gateway_port=self.ports[0], inherit_env=False)

    def __enter__(self) -> QuotaFleet:
        self.fleet.start()
        for i, port in enumerate(self.ports[1:], start=1):
            self.fleet.spawn(f"gateway-{i}", ["gateway", "--port", str(port)])
            wait_http(f"http://127.0.0.1:{port}/health", timeout_s=30)
        self.sim_url = self.fleet.env["FLEET_BACKEND_URL"]
        return self

    def __exit__(self, *exc: object) -> None:
        self.fleet.close(grace_s=5)
        client = redis_client(self.settings)
        for key in client.scan_iter(match=f"{self.settings.key_prefix}*", count=1000):
            client.delete(key)
        client.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    async def load(self, clients: int, duration_s: float) -> Run:
        """``clients`` clients per project for ``duration_s`` seconds (module docstring)."""
        run = Run(started=time.time())
        counter = iter(range(10**9))
        stop_at = run.started + duration_s
        projects = (*QUOTA_PROJECTS, FREE_PROJECT)
        limits = httpx.Limits(max_connections=len(projects) * clients + 8)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            async def client(project: str, index: int) -> None:
                while time.time() < stop_at:
                    n = next(counter)
                    port = self.ports[n % len(self.ports)]
                    body = {"model": "local", "max_tokens": THINK + ANSWER + HEADROOM, "messages": [
                        {"role": "user", "content": f"q{n}-{project} [sim:think={THINK}] [sim:answer={ANSWER}]"}]}
                    try:
                        response = await http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                                                   headers={"Authorization": f"Bearer {self.keys[project]}"})
                    except httpx.HTTPError as exc:
                        run.errors[type(exc).__name__] = run.errors.get(type(exc).__name__, 0) + 1
                        continue
                    if response.status_code != 200:
                        code = str(response.status_code)
                        run.errors[code] = run.errors.get(code, 0) + 1
                        continue
                    usage = response.json()["usage"]
                    run.served[n] = Served(project, usage["prompt_tokens"], usage["completion_tokens"])

            async def log_reader() -> None:
                while time.time() < stop_at + 5:
                    await self._read_log(http, run)
                    await asyncio.sleep(1.0)

            reader = asyncio.create_task(log_reader())
            await asyncio.gather(*(client(p, i) for p in projects for i in range(clients)))
            await self._read_log(http, run)
            reader.cancel()
        run.ended = time.time()
        return run

    async def _read_log(self, http: httpx.AsyncClient, run: Run) -> None:
        """The simulator's request log (its last 2,000 requests): when each of ours arrived."""
        log = (await http.get(f"{self.sim_url}/sim/requests", params={"limit": 2000})).json()["requests"]
        for entry in log:
            body = entry["body"]  # the request body as received (a string)
            found = _MARK.search(body if isinstance(body, str) else json.dumps(body))
            if found:
                run.received_at.setdefault(int(found.group(1)), float(entry["received_at"]))


def _windows(run: Run, quotas: dict[str, int]) -> list[dict[str, Any]]:
    """Per quota project and minute: the tokens served against the quota."""
    served: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    for n, s in run.served.items():
        at = run.received_at.get(n)
        if at is None or s.project not in quotas:
            continue
        cell = served[(s.project, int(at // 60))]
        cell[0] += s.prompt + s.completion
        cell[1] += 1
    rows = []
    for (project, minute), (tokens, requests) in sorted(served.items()):
        start = minute * 60
        rows.append({"project": project, "minute": time.strftime("%H:%M", time.gmtime(start)),
                     "whole minute in the run": run.started <= start and start + 60 <= run.ended,
                     "requests": requests, "served tokens": tokens,
                     "quota": quotas[project], "served / quota": tokens / quotas[project]})
    return rows


def _output_per_s(run: Run, project: str) -> float:
    return sum(s.completion for s in run.served.values() if s.project == project) / (run.ended - run.started)


def quota_exactness(redis_url: str, *, quotas: dict[str, int] | None = None, clients: int = 16,
                    gateways: int = 3, dispatchers: int = 3, duration_s: float = 150.0,
                    baseline_s: float = 60.0, speed: float = 20.0) -> dict[str, Any]:
    """The two runs of part 1 (module docstring): the minutes of the quota run and the free
    project's output tokens/s with and without the quotas."""
    quotas = quotas or {"reports": 24_000, "translate": 12_000}
    with QuotaFleet(redis_url, {}, gateways, dispatchers, speed) as fleet:
        baseline = asyncio.run(fleet.load(clients, baseline_s))
    with QuotaFleet(redis_url, quotas, gateways, dispatchers, speed) as fleet:
        limited = asyncio.run(fleet.load(clients, duration_s))
    rows = _windows(limited, quotas)
    found = len([n for n in limited.served if n in limited.received_at])
    return {
        "minutes": rows,
        "worst served / quota": max((r["served / quota"] for r in rows), default=0.0),
        "requests answered (quota run)": len(limited.served),
        "of them found in the simulator's log": found,
        "errors (quota run)": limited.errors,
        "errors (baseline)": baseline.errors,
        f"{FREE_PROJECT} output tok/s, no quotas (baseline)": _output_per_s(baseline, FREE_PROJECT),
        f"{FREE_PROJECT} output tok/s, with quotas": _output_per_s(limited, FREE_PROJECT),
        "ratio to the baseline": (_output_per_s(limited, FREE_PROJECT)
                                  / max(_output_per_s(baseline, FREE_PROJECT), 1e-9)),
        "setup": f"{gateways} gateways, {dispatchers} dispatchers, {clients} clients per project, "
                 f"{SEATS} seats, sim speed {speed:g}, {THINK}+{ANSWER} tokens a request, "
                 f"max_tokens {THINK + ANSWER + HEADROOM}",
    }


def quota_cost(redis_url: str, jobs: int = 100_000, decisions: int = 500, rounds: int = 8) -> dict[str, float]:
    """Part 2 (module docstring): pairs/s without quotas, with them, and with settles too."""
    client = redis.Redis.from_url(redis_url)
    limits = Limits(max_num_seqs=512, kv_budget_tokens=10**12, max_long=512)
    high = Quota(tokens_per_minute=10**12, requests_per_minute=10**9, tokens_per_day=10**13,
                 tokens_per_month=10**14, max_in_flight=10**6)
    free = _Backlog(client, jobs, StoreConfig(limits=limits, gate=False))
    quoted = _Backlog(client, jobs, StoreConfig(limits=limits, gate=False,
                                                quotas={p: high for p in PROJECTS}))
    try:
        times: dict[str, list[float]] = {"free": [], "quota": [], "settle": []}
        for _ in range(rounds):
            times["free"].append(free.decide(decisions, GRANTS_PER_CALL, pipelined=False)[0])
            times["quota"].append(quoted.decide(decisions, GRANTS_PER_CALL, pipelined=False)[0])
            times["settle"].append(quoted.decide(decisions, GRANTS_PER_CALL, pipelined=False, settle=True)[0])
        free_s, quota_s, settle_s = (percentile(times[k], 50) for k in ("free", "quota", "settle"))
        return {
            "backlog jobs": float(jobs),
            "admission pairs/s, no quotas (baseline)": 1 / free_s,
            "admission pairs/s, quotas on every project": 1 / quota_s,
            "ratio to the baseline": free_s / quota_s,
            "admit + settle + release /s, quotas on": 1 / settle_s,
            "ratio to the baseline, with settles": free_s / settle_s,
            "Redis bytes per pending job, no quotas": free.bytes / jobs,
            "Redis bytes per pending job, quotas on": quoted.bytes / jobs,
        }
    finally:
        for backlog in (free, quoted):
            _delete(client, backlog.prefix)
        client.close()


def minutes_markdown(figures: dict[str, Any]) -> str:
    """The quota run's minutes as a Markdown table (README, docs/usage.md)."""
    lines = ["| project | minute (UTC) | whole minute | requests | served tokens | quota | served / quota |",
             "|---|---|---|---|---|---|---|"]
    for r in figures["minutes"]:
        lines.append(f"| {r['project']} | {r['minute']} | {'yes' if r['whole minute in the run'] else 'no'} | "
                     f"{r['requests']} | {r['served tokens']:,} | {r['quota']:,} | {r['served / quota']:.3f} |")
    return "\n".join(lines)



def cache_latency(redis_url: str, requests: int = 40, speed: float = 20.0, think: int = 100,
                  answer: int = 40) -> dict[str, float]:
    """A cache hit against a model turn, through one gateway and the machine otherwise idle:
    ``requests`` new temperature-0 requests (each a model turn: the miss), each followed by its
    identical repeat (the hit); end-to-end latency of both (p50, p99), the model requests the
    simulator saw, and the admissions the store made while the repeats were answered."""
    with QuotaFleet(redis_url, {}, gateways=1, dispatchers=1, speed=speed, cache=True, workers=1) as fleet:
        store = make_store(fleet.settings, redis_client(fleet.settings))
        url = f"http://127.0.0.1:{fleet.ports[0]}/v1/chat/completions"
        auth = {"Authorization": f"Bearer {fleet.keys[FREE_PROJECT]}"}
        misses, hits, in_flight, cached = [], [], 0, 0
        with httpx.Client(timeout=120) as http:
            before = http.get(f"{fleet.sim_url}/sim/stats").json()["total_requests"]
            for n in range(requests + 2):
                body = {"model": "local", "temperature": 0, "max_tokens": 4000, "messages": [
                    {"role": "user", "content": f"repeat {uuid.uuid4().hex} "
                                                f"[sim:think={think}] [sim:answer={answer}]"}]}
                times, admitted = [], []
                for _ in range(2):
                    started = time.perf_counter()
                    response = http.post(url, json=body, headers=auth)
                    times.append(time.perf_counter() - started)
                    response.raise_for_status()
                    admitted.append(store.snapshot().admissions)
                in_flight += admitted[1] - admitted[0]  # admissions while the repeat was answered
                cached += int(response.headers.get("x-fleet-cache") == "hit")
                if n >= 2:  # the first two warm connections and caches
                    misses.append(times[0])
                    hits.append(times[1])
            model_requests = http.get(f"{fleet.sim_url}/sim/stats").json()["total_requests"] - before
            queue = _queue_pairs(fleet, store, requests, think, answer)
            queue_requests = http.get(f"{fleet.sim_url}/sim/stats").json()["total_requests"] - before - model_requests
    return {
        "request pairs": float(requests + 2),
        "repeats answered from the cache": float(cached),
        "model requests the simulator saw": float(model_requests),
        "model turn (miss) p50 ms": 1000 * percentile(misses, 50),
        "model turn (miss) p99 ms": 1000 * percentile(misses, 99),
        "cache hit p50 ms": 1000 * percentile(hits, 50),
        "cache hit p99 ms": 1000 * percentile(hits, 99),
        "hit / miss, p50": percentile(hits, 50) / percentile(misses, 50),
        "admissions made for the repeats": float(in_flight),
        "queue jobs: repeats ended from the cache": queue["cached"],
        "queue jobs: model requests the simulator saw": float(queue_requests),
        "queue jobs: model turn (miss) p50 ms": 1000 * percentile(queue["misses"], 50),
        "queue jobs: cache hit p50 ms": 1000 * percentile(queue["hits"], 50),
        "queue jobs: hit / miss, p50": percentile(queue["hits"], 50) / percentile(queue["misses"], 50),
        "queue jobs: admissions made for the repeats": queue["admitted"],
    }


def _queue_pairs(fleet: QuotaFleet, store: Any, requests: int, think: int, answer: int) -> dict[str, Any]:
    """The same pairs as queue jobs (``fleet.Client``: submit, then wait for the envelope): the
    miss is prep, admission and a model turn, the repeat ends at prep (fleet/worker/repeats.py)."""
    misses, hits, admitted, cached = [], [], 0, 0
    with Client(fleet.settings) as client:
        for n in range(requests + 2):
            job = {"project": FREE_PROJECT, "temperature": 0, "max_tokens": 4000, "messages": [
                {"role": "user", "content": f"queued repeat {uuid.uuid4().hex} [sim:think={think}] "
                                            f"[sim:answer={answer}]"}]}
            times, before = [], 0
            for attempt in range(2):
                started = time.perf_counter()
                envelope = client.result(client.submit(job), timeout=120)
                times.append(time.perf_counter() - started)
                if envelope is None or not envelope.code.ok:
                    raise RuntimeError(f"queue job ended {envelope and envelope.code.value}")
                if attempt == 0:  # what the repeat alone makes
                    before = store.snapshot().admissions
            admitted += store.snapshot().admissions - before
            cached += int(envelope is not None and envelope.cached)
            if n >= 2:
                misses.append(times[0])
                hits.append(times[1])
    return {"misses": misses, "hits": hits, "admitted": float(admitted), "cached": float(cached)}
