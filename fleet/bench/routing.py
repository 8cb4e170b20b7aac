"""``fleet bench backends --routing``: the fleet's routing against round-robin and least-loaded on
real simulators (docs/backends.md, section 9).

Each run is a fresh fleet (its own key prefix, one ``fleet sim`` per backend, one dispatcher, the
inference workers), so no run finds another's prompts in a prefix cache. Every backend is a
replica of one model with the deployment's sizes except its sequence cap (``seats``); the
policies are ``routing.policy`` (placement.py ``pick``). Each run's hit rate is given as a share
of its *oracle's*: an oracle placement of that run's own requests (``oracle_hit_rate``: every
request the simulators logged in the run, in arrival order, sent to the server whose cache holds
its longest prefix, each cache known exactly, load ignored). With ``one_server`` a run of the same
workload on a single simulator holding every seat and every backend's KV pool is added (it
computes each prefix once, but under a closed loop serves another mix of requests, so it bounds
nothing).

Workload (closed loop, the deployment's shapes): every project of the example config runs
clients in proportion to its weight, each sending its next job once the last one ended. The
assistant's clients are the editor's conversations: a 26K-token first prompt (its 63 tools
written out as text and its system prompt), each turn adding the last answer and about 2K tokens
of question and pasted material, a new conversation after ``turns`` turns (so up to about 42K
tokens: many conversations at once hold more than one server's pool, which is where sending each
to the server that holds it pays). The other projects send one-shot jobs: their stable system
prompt plus glossary (2K to 8K tokens, by project) and a question of about 1K tokens. One job in
ten, of every client, is instead a 60K-token report nobody sent before. Prefixes are never shared
across projects (each has its own ``cache_salt``).

Figures, per run (the simulators' own counters and the envelopes):

* prefix hit rate: ``prefix_cache_hits`` / ``prefix_cache_queries`` summed over the simulators,
  and the oracle's over the same requests;
* time to first token, p50 and p90: from submission (queue wait included) to the first token
  (real seconds at the simulators' speed);
* the servers' own time to first token, p50 and p90: from a request's arrival at its simulator to
  its first token, in simulated seconds (the deployment's seconds: a cached prefix saves its
  prefill here at full size), over every backend's requests (``GET /sim/ttft``), and the p90 of
  the requests other than the reports' (whose never-cached prefill sets the whole p90);
* output tokens/s over the run;
* Jain's index over each project's served tokens (prompt + output) relative to what least-loaded
  served it in the same size and load (closed-loop demand differs by project, so shares per
  weight say nothing here; 1.000: routing took no project's share, whatever it gave the others);
* ``stayed``: of the editor's later turns, the share that ran on the backend of the turn before;
* jobs without exactly one final envelope (must be 0).

Load: ``load`` x the seats in all as concurrent clients (0.5 and 0.9 of the joint capacity).
Failure handling: each fleet is stopped and its keys deleted in ``finally``; a client whose job
gets no envelope in time counts it as lost and goes on.
"""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from fleet.bench.fleet.harness import fleet_toml, write_toml
from fleet.bench.measure import jain, percentile
from fleet.client import Client
from fleet.core.config import load_settings
from fleet.core.models import Envelope
from fleet.local.processes import LocalFleet
from fleet.sim.app import REQUEST_LOG_SIZE
from fleet.sim.kvcache import PrefixCache

log = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_loaded", "fleet", "first_token")
SIM_ARGS = ["--answer-min-tokens", "30", "--answer-max-tokens", "60"]
THINK = 150  # reasoning tokens per turn ([sim:think=N])
# Texts are made of five-letter words, one token each as the simulator counts them.
EDITOR = "assistant"  # the project whose clients are the editor's conversations
TOOL_BLOCK_WORDS = 20_000  # its 63 tools, beside a 6K system prompt: a 26K-token first prompt
SYSTEM_WORDS = {"assistant": 6_000, "reports": 8_000, "translate": 5_000, "triage": 2_000, "research": 3_500}
REPORT_WORDS = 60_000
TURN_WORDS = 2_000  # an editor turn's question and the file or tool output pasted in
QUESTION_WORDS = 1_000  # a one-shot job's question


@dataclass
class RoutingRun:
    policy: str
    backends: int
    load: float
    jobs: int = 0
    lost: int = 0
    hit_rate: float = 0.0
    ttft_p50: float = 0.0
    ttft_p90: float = 0.0
    # the servers' own time to first token (arrival at the simulator to its first token, in
    # simulated seconds: the deployment's seconds), p50 and p90 over every backend's requests
    server_ttft_p50: float = 0.0
    server_ttft_p90: float = 0.0
    server_ttft_p90_others: float = 0.0  # the same p90 without the reports' requests
    tokens_per_s: float = 0.0
    jain: float = 0.0
    per_backend: dict[str, int] = field(default_factory=dict)  # jobs each backend served
    stayed: float = 0.0  # of the editor's later turns, the share on the previous turn's backend
    served: dict[str, float] = field(default_factory=dict)  # project -> tokens served (prompt + output)
    prefix: str = ""  # the run's key prefix (deleted at its end)
    # the oracle placement's hit rate over this run's own requests (``oracle_hit_rate``), and how
    # many requests it placed (0: the servers' logs did not cover the run)
    oracle_hit_rate: float = 0.0
    oracle_requests: int = 0


def _words(tag: str, count: int) -> str:
    """``count`` words of a text named by ``tag`` (the same tag, the same text)."""
    local = random.Random(tag)
    vocabulary = [f"{tag[:2]}{n:03d}" for n in range(997)]
    return " ".join(local.choice(vocabulary) for _ in range(count))


class Conversation:
    """One client's jobs (module docstring): the editor's conversation so far, or a project's
    one-shot jobs on its stable prefix (a conversation that restarts every turn)."""

    def __init__(self, project: str, rng: random.Random, turns: int) -> None:
        self.project, self.rng, self.turns = project, rng, turns
        self.start()

    def start(self) -> None:
        system = _words(f"system-{self.project}", SYSTEM_WORDS.get(self.project, 3_000))
        if self.project == EDITOR:
            system = f"Tools you may call:\n{_words('tools', TOOL_BLOCK_WORDS)}\n\nRules:\n{system}"
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.turn = 0
        self.last_backend: str | None = None

    def next_job(self) -> tuple[dict[str, Any], bool]:
        """The next job, and whether it belongs to the conversation (False: a report)."""
        nonce = uuid.uuid4().hex
        if self.rng.random() < 0.1:
            report = _words(f"report-{nonce}", REPORT_WORDS)
            return self._job([{"role": "user", "content": f"[sim:think={THINK}] summarise: {report}"}]), False
        if self.turn >= (self.turns if self.project == EDITOR else 1):
            self.start()
        question = _words(f"q-{nonce}", TURN_WORDS if self.project == EDITOR else QUESTION_WORDS)
        self.messages.append({"role": "user", "content": f"[sim:think={THINK}] {question}"})
        self.turn += 1
        return self._job(list(self.messages)), True

    def answered(self, envelope: Envelope | None, in_conversation: bool) -> bool | None:
        """Take the answer in; for a later turn of the conversation, whether it ran on the
        backend of the turn before it (None: a first turn, a report or no answer)."""
        if not in_conversation or self.project != EDITOR:
            return None
        if envelope is None or not envelope.content:
            self.start()  # lost or failed: a new conversation
            return None
        self.messages.append({"role": "assistant", "content": envelope.content})
        stayed = None if self.turn == 1 else envelope.backend == self.last_backend
        self.last_backend = envelope.backend
        return stayed

    def _job(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        return {"project": self.project, "messages": messages, "thinking_budget": THINK + 50,
                "content_reserve": 200, "metadata": {"submitted_at": time.time()}}


def _settings_toml(redis_url: str, speed: float, backends: int, seats: int, policy: str,
                   folder: Path, pools: int) -> Path:
    """The bench's fleet.toml: ``backends`` replicas of ``seats`` sequences each, ``pools`` times
    the deployment's KV pool each (the oracle's one server: every backend's), under ``policy``."""
    def configure(data: dict[str, Any]) -> None:
        entry = data.pop("backend")
        data["backends"] = [{**entry, "name": f"gpu-{chr(97 + i)}", "max_num_seqs": seats,
                             "served_model_names": [entry.get("model", "local")]}
                            for i in range(backends)]
        for backend in data["backends"]:  # the oracle's one server: every backend's pool and longs
            backend["kv_pool_tokens"] = int(entry.get("kv_pool_tokens", 530_000)) * pools
            backend["max_long"] = int(entry.get("max_long", 3)) * pools
        data["routing"] = {"policy": policy}
        for project in data["projects"].values():
            project.pop("allowed_tools", None)  # no tool rounds: one turn per job
            project.pop("tool_registry", None)

    path = folder / "fleet.toml"
    write_toml(path, fleet_toml(redis_url, speed, 30.0, seats, configure))
    return path


def one_run(redis_url: str, policy: str, backends: int, seats: int, load: float, duration_s: float,
            speed: float, turns: int, seed: int, pools: int = 1) -> RoutingRun:
    """One fresh fleet of ``backends`` simulators under ``policy`` at ``load`` (module docstring)."""
    folder = Path(tempfile.mkdtemp(prefix="fleet-routing-"))
    path = _settings_toml(redis_url, speed, backends, seats, policy, folder, pools)
    settings = load_settings(path, env={})
    entry = settings.backends[0]
    sizes = [] if backends > 1 else [  # one entry: the harness passes no sizes of its own
        "--max-num-seqs", str(entry.max_num_seqs), "--kv-pool-tokens", str(entry.kv_pool_tokens)]
    fleet = LocalFleet(settings, sim_speed=speed, sim_args=[*SIM_ARGS, *sizes], workers=1, worker_concurrency=64,
                       dispatchers=1, config_path=str(path), log_dir=str(folder), local_broker=True,
                       inherit_env=False)
    run = RoutingRun(policy, backends, load, prefix=settings.key_prefix)
    try:
        fleet.start()
        urls = fleet.backend_urls()
        entries = [e.model_copy(update={"url": urls[e.name]}) for e in settings.backends]
        settings = settings.model_copy(update={"backends": entries, "backend": entries[0]})
        _measure(run, settings, urls, seats * backends, duration_s, turns, seed)
    finally:
        fleet.close(grace_s=5)
        _delete_prefix(redis_url, settings.key_prefix)
        shutil.rmtree(folder, ignore_errors=True)
    return run


def _measure(run: RoutingRun, settings: Any, urls: dict[str, str], seats_in_all: int, duration_s: float,
             turns: int, seed: int) -> None:
    weights = {name: p.weight for name, p in settings.projects.items()}
    clients = [(project, i) for project, count in client_counts(weights, round(run.load * seats_in_all)).items()
               for i in range(count)]
    before = {name: _stats(url) for name, url in urls.items()}
    ttft_before = {name: _ttfts(url)[0] for name, url in urls.items()}
    reports: set[str] = set()  # the reports' job ids
    ended: list[tuple[str, Envelope | None]] = []
    stays: list[bool] = []
    lock = threading.Lock()
    stop_at = time.time() + duration_s
    started = time.time()

    def client_loop(project: str, index: int) -> None:
        rng = random.Random(f"{seed}-{project}-{index}")
        conversation = Conversation(project, rng, turns)
        with Client(settings) as client:
            while time.time() < stop_at:
                job, in_conversation = conversation.next_job()
                job_id = client.submit(job)
                if not in_conversation:
                    with lock:
                        reports.add(job_id)
                envelope = client.result(job_id, timeout=240)
                stayed = conversation.answered(envelope, in_conversation)
                with lock:
                    ended.append((project, envelope))
                    if stayed is not None:
                        stays.append(stayed)

    threads = [threading.Thread(target=client_loop, args=c, daemon=True) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.time() - started
    after = {name: _stats(url) for name, url in urls.items()}
    server_ttfts: list[tuple[str, float]] = []
    for name, url in urls.items():
        total, samples = _ttfts(url)
        server_ttfts += samples[len(samples) - min(len(samples), total - ttft_before[name]):]
    seconds = [t for _, t in server_ttfts]
    others = [t for rid, t in server_ttfts if rid.rsplit("-", 1)[0] not in reports]
    run.server_ttft_p50 = percentile(seconds, 50, default=0.0)
    run.server_ttft_p90 = percentile(seconds, 90, default=0.0)
    run.server_ttft_p90_others = percentile(others, 90, default=0.0)
    queries = sum(after[n]["prefix_cache_queries"] - before[n]["prefix_cache_queries"] for n in urls)
    hits = sum(after[n]["prefix_cache_hits"] - before[n]["prefix_cache_hits"] for n in urls)
    envelopes = [e for _, e in ended if e is not None]
    run.jobs, run.lost = len(ended), sum(1 for _, e in ended if e is None)
    run.hit_rate = hits / queries if queries else 0.0
    ttfts = [(e.timings.queued_s or 0.0) + e.timings.first_token_s for e in envelopes
             if e.timings.first_token_s is not None]
    run.ttft_p50, run.ttft_p90 = percentile(ttfts, 50, default=0.0), percentile(ttfts, 90, default=0.0)
    run.tokens_per_s = sum(e.usage.completion_tokens for e in envelopes) / elapsed
    served: dict[str, float] = defaultdict(float)
    for project, e in ended:
        if e is not None:
            served[project] += (e.usage.prompt_tokens or 0) + e.usage.completion_tokens
    run.served = dict(served)
    counts: dict[str, int] = defaultdict(int)
    for e in envelopes:
        counts[e.backend or settings.backends[0].name] += 1
    run.per_backend = dict(counts)
    run.stayed = sum(stays) / len(stays) if stays else 0.0
    logs = [_run_requests(url, started) for url in urls.values()]
    if all(log is not None for log in logs):
        entry = settings.backends[0]
        run.oracle_hit_rate, run.oracle_requests = oracle_hit_rate(
            [requests for requests in logs if requests is not None], entry.kv_pool_tokens, entry.block_tokens)
    else:
        log.warning("a simulator's request log does not cover the run: no oracle for %s", run.policy)


def client_counts(weights: dict[str, float], total: int) -> dict[str, int]:
    """``total`` clients shared by weight (largest remainder), at least one per project."""
    whole = sum(weights.values())
    exact = {p: max(1.0, total * w / whole) for p, w in weights.items()}
    counts = {p: int(x) for p, x in exact.items()}
    by_remainder = sorted(exact, key=lambda p: (counts[p] - exact[p], p))
    for p in by_remainder[: max(0, total - sum(counts.values()))]:
        counts[p] += 1
    return counts


def _ttfts(url: str) -> tuple[int, list[tuple[str, float]]]:
    """A simulator's ended requests so far and its last (request id, time to first token) samples
    (``GET /sim/ttft``)."""
    data = httpx.get(f"{url}/sim/ttft", timeout=10).json()
    return int(data["total"]), [(str(r), float(x)) for r, x in zip(data["requests"], data["seconds"], strict=True)]


def oracle_hit_rate(logs: list[list[dict[str, Any]]], pool_tokens: int, block_tokens: int) -> tuple[float, int]:
    """The prefix hit rate of an oracle placement of a run's own requests (``logs``: each
    simulator's request log entries of the run, with their ``blocks`` and ``prompt_tokens``): every
    request in arrival order, on as many servers as there are logs, each with the simulator's own
    prefix cache (fleet/sim/kvcache.py ``PrefixCache``: whole blocks, least recently used over
    ``pool_tokens``), sent to the server whose cache holds its longest prefix (ties: the one that
    took the fewest requests so far, then the first): every cache known exactly, load ignored.
    Returns (hits / queries in tokens, as the simulators count them; requests placed).

    A greedy reference, not an upper bound: placing a request where it hits most now can evict
    what a later one would have hit (two caches of 4 blocks, prompts sharing prefixes in the
    order B B C D A A D: greedy 0.333, the best placement 0.381, by exhaustive search), it ignores
    time (the simulator counts a hit at prefill, the greedy one at arrival), and each run's
    reference is over that run's own requests, so a policy can score above it and two policies'
    shares do not share a denominator."""
    entries = sorted((e for log in logs for e in log if "blocks" in e), key=lambda e: e["received_at"])
    caches = [PrefixCache(pool_tokens // block_tokens, block_tokens) for _ in logs]
    taken = [0] * len(caches)
    for entry in entries:
        blocks, tokens = [int(b) for b in entry["blocks"]], int(entry["prompt_tokens"])
        best = max(range(len(caches)), key=lambda i: (caches[i].peek(blocks, tokens), -taken[i], -i))
        caches[best].lookup(blocks, tokens)
        caches[best].insert(blocks)
        taken[best] += 1
    queries, hits = sum(c.queries for c in caches), sum(c.hits for c in caches)
    return (hits / queries if queries else 0.0), len(entries)


def _run_requests(url: str, since: float) -> list[dict[str, Any]] | None:
    """A simulator's logged requests received since ``since`` (None: its log no longer reaches
    back that far, so it cannot stand for the run's requests)."""
    logged = httpx.get(f"{url}/sim/requests", params={"limit": 100_000}, timeout=30).json()["requests"]
    if logged and logged[0]["received_at"] >= since and len(logged) >= REQUEST_LOG_SIZE:
        return None
    return [e for e in logged if e["received_at"] >= since]


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/sim/stats", timeout=10).json()


def _delete_prefix(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=2000))
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start : start + 1000])
    except redis.ConnectionError as exc:
        log.warning("keys under %s not deleted: %s", prefix, exc)
    finally:
        client.close()


def routing_bench(redis_url: str, sizes: tuple[int, ...] = (2, 4), loads: tuple[float, ...] = (0.5, 0.9),
                  seats: int = 8, duration_s: float = 40.0, speed: float = 20.0, turns: int = 8,
                  seed: int = 7, policies: tuple[str, ...] = POLICIES, one_server: bool = False) -> list[RoutingRun]:
    """Every policy on every size and load (and with ``one_server`` the one-server run of each:
    module docstring); the same seed, so every policy of a size and load gets the same clients and
    first prompts."""
    runs = []
    for backends in sizes:
        for load in loads:
            group = []
            if one_server:
                single = one_run(redis_url, "least_loaded", 1, seats * backends, load, duration_s, speed, turns,
                                 seed, pools=backends)
                single.policy, single.backends = "one server", backends
                group.append(single)
            group += [one_run(redis_url, policy, backends, seats, load, duration_s, speed, turns, seed)
                      for policy in policies]
            least = next((r for r in group if r.policy == "least_loaded"), None)
            for run in group:  # 0 without a least-loaded run to compare with
                run.jain = relative_jain(run, least) if least else 0.0
            runs += group
    return runs


def relative_jain(run: RoutingRun, baseline: RoutingRun) -> float:
    """Jain's index over each project's served tokens in ``run`` relative to ``baseline``'s."""
    shares = [run.served.get(p, 0.0) / baseline.served[p] for p in baseline.served if baseline.served[p] > 0]
    return jain(shares) if shares else 0.0


def markdown(runs: list[RoutingRun]) -> str:
    lines = ["| backends | load | policy | hit rate | oracle's (own requests) | of oracle | TTFT p50 s | TTFT p90 s "
             "| p90 / least-loaded "
             "| server TTFT p50 / p90 (sim s) | server p90 / least-loaded "
             "| server p90 without reports (sim s) | / least-loaded "
             "| out tok/s | / least-loaded | Jain | stayed | jobs | lost |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        group = [r for r in runs if r.backends == run.backends and r.load == run.load]
        least = next((r for r in group if r.policy == "least_loaded"), None)
        of_oracle = run.hit_rate / run.oracle_hit_rate if run.oracle_hit_rate else 0.0
        p90_ratio = run.ttft_p90 / least.ttft_p90 if least and least.ttft_p90 else 0.0
        tok_ratio = run.tokens_per_s / least.tokens_per_s if least and least.tokens_per_s else 0.0
        server_ratio = run.server_ttft_p90 / least.server_ttft_p90 if least and least.server_ttft_p90 else 0.0
        others_ratio = (run.server_ttft_p90_others / least.server_ttft_p90_others
                        if least and least.server_ttft_p90_others else 0.0)
        lines.append(f"| {run.backends} | {run.load:.0%} | {run.policy} | {run.hit_rate:.3f} "
                     f"| {run.oracle_hit_rate:.3f} | {of_oracle:.2f} "
                     f"| {run.ttft_p50:.2f} | {run.ttft_p90:.2f} | {p90_ratio:.2f} "
                     f"| {run.server_ttft_p50:.2f} / {run.server_ttft_p90:.2f} | {server_ratio:.2f} "
                     f"| {run.server_ttft_p90_others:.2f} | {others_ratio:.2f} "
                     f"| {run.tokens_per_s:.0f} "
                     f"| {tok_ratio:.2f} | {run.jain:.3f} | {run.stayed:.2f} | {run.jobs} | {run.lost} |")
    return "\n".join(lines)
