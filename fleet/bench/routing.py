"""``fleet bench backends --routing``: the fleet's routing against round-robin and least-loaded on
real simulators (docs/backends.md, section 9).

Each run is a fresh fleet (its own key prefix, one ``fleet sim`` per backend, one dispatcher, the
inference workers), so no run finds another's prompts in a prefix cache. Every backend is a
replica of one model with the deployment's sizes except its sequence cap (``seats``); the
policies are ``routing.policy`` (placement.py ``pick``). The one-server *oracle* is the same
workload on a single simulator holding every seat and every backend's KV pool: it computes each
prefix once, which is what perfect routing with no eviction would reach; routing's hit rate is
given as a share of it.

Workload (closed loop, the deployment's shapes): every project of the example config runs
conversation clients in proportion to its weight, so a fair fleet serves each the same tokens per
weight. A conversation starts with the editor's tool block (about 26K tokens, the assistant's 63
tools written out as text: one block per project, never shared across projects since every
project has its own ``cache_salt``) and its project's stable system prompt plus glossary (2K to
8K tokens, by project); each turn adds the last answer and a new question, and after
``turns_per_conversation`` turns the client starts a new conversation. One turn in ten is instead
a 60K-token report nobody sent before. A client sends its next job once the last one ended.

Figures, per run (the simulators' own counters and the envelopes):

* prefix hit rate: ``prefix_cache_hits`` / ``prefix_cache_queries`` summed over the simulators;
* time to first token, p50 and p90: from submission (queue wait included) to the first token;
* output tokens/s over the run;
* Jain's index over the projects' served tokens (prompt + output) per weight;
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

log = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_loaded", "fleet")
SIM_ARGS = ["--answer-min-tokens", "30", "--answer-max-tokens", "60"]
THINK = 150  # reasoning tokens per turn ([sim:think=N])
TOOL_BLOCK_WORDS = 21_000  # about 26K tokens as the simulator counts them (six-letter words)
SYSTEM_WORDS = {"assistant": 6_400, "reports": 4_800, "translate": 3_200, "triage": 1_600, "research": 2_400}
REPORT_WORDS = 48_000  # about 60K tokens
QUESTION_WORDS = 300


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
    tokens_per_s: float = 0.0
    jain: float = 0.0
    per_backend: dict[str, int] = field(default_factory=dict)  # jobs each backend served
    prefix: str = ""  # the run's key prefix (deleted at its end)


def _words(tag: str, count: int) -> str:
    """``count`` words of a text named by ``tag`` (the same tag, the same text)."""
    local = random.Random(tag)
    vocabulary = [f"{tag[:3]}{n:03d}" for n in range(997)]
    return " ".join(local.choice(vocabulary) for _ in range(count))


class Conversation:
    """One client's conversation (module docstring): its messages so far."""

    def __init__(self, project: str, rng: random.Random, turns: int) -> None:
        self.project, self.rng, self.turns = project, rng, turns
        self.start()

    def start(self) -> None:
        tools = _words(f"tools-{self.project}", TOOL_BLOCK_WORDS)
        system = _words(f"system-{self.project}", SYSTEM_WORDS.get(self.project, 3_000))
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"Tools you may call:\n{tools}\n\nProject rules:\n{system}"}]
        self.turn = 0

    def next_job(self) -> tuple[dict[str, Any], bool]:
        """The next job, and whether it belongs to the conversation (False: a report)."""
        nonce = uuid.uuid4().hex
        if self.rng.random() < 0.1:
            report = _words(f"report-{nonce}", REPORT_WORDS)
            return self._job([{"role": "user", "content": f"[sim:think={THINK}] summarise: {report}"}]), False
        if self.turn >= self.turns:
            self.start()
        question = _words(f"q-{nonce}", QUESTION_WORDS)
        self.messages.append({"role": "user", "content": f"[sim:think={THINK}] {question}"})
        self.turn += 1
        return self._job(list(self.messages)), True

    def answered(self, envelope: Envelope | None, in_conversation: bool) -> None:
        if not in_conversation:
            return
        if envelope is None or not envelope.content:
            self.start()  # lost or failed: a new conversation
            return
        self.messages.append({"role": "assistant", "content": envelope.content})

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
        for backend in data["backends"]:
            backend["kv_pool_tokens"] = int(entry.get("kv_pool_tokens", 530_000)) * pools
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
    per_weight = max(1, round(run.load * seats_in_all / sum(weights.values())))
    clients = [(project, i) for project, w in weights.items() for i in range(max(1, round(w * per_weight)))]
    before = {name: _stats(url) for name, url in urls.items()}
    ended: list[tuple[str, Envelope | None]] = []
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
                envelope = client.result(job_id, timeout=240)
                conversation.answered(envelope, in_conversation)
                with lock:
                    ended.append((project, envelope))

    threads = [threading.Thread(target=client_loop, args=c, daemon=True) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.time() - started
    after = {name: _stats(url) for name, url in urls.items()}
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
    run.jain = jain([served[p] / w for p, w in weights.items()])
    counts: dict[str, int] = defaultdict(int)
    for e in envelopes:
        counts[e.backend or settings.backends[0].name] += 1
    run.per_backend = dict(counts)


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
                  seats: int = 8, duration_s: float = 40.0, speed: float = 20.0, turns: int = 6,
                  seed: int = 7, policies: tuple[str, ...] = POLICIES) -> list[RoutingRun]:
    """Every policy on every size and load, and the one-server oracle of each (module docstring);
    the same seed, so every policy of a size and load gets the same clients and first prompts."""
    runs = []
    for backends in sizes:
        for load in loads:
            oracle = one_run(redis_url, "least_loaded", 1, seats * backends, load, duration_s, speed, turns, seed,
                             pools=backends)
            oracle.policy, oracle.backends = "oracle (one server)", backends
            runs.append(oracle)
            for policy in policies:
                runs.append(one_run(redis_url, policy, backends, seats, load, duration_s, speed, turns, seed))
    return runs


def markdown(runs: list[RoutingRun]) -> str:
    lines = ["| backends | load | policy | hit rate | of oracle | TTFT p50 s | TTFT p90 s | p90 / least-loaded "
             "| out tok/s | / least-loaded | Jain | jobs | lost |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        group = [r for r in runs if r.backends == run.backends and r.load == run.load]
        oracle = next((r for r in group if r.policy.startswith("oracle")), None)
        least = next((r for r in group if r.policy == "least_loaded"), None)
        of_oracle = run.hit_rate / oracle.hit_rate if oracle and oracle.hit_rate else 0.0
        p90_ratio = run.ttft_p90 / least.ttft_p90 if least and least.ttft_p90 else 0.0
        tok_ratio = run.tokens_per_s / least.tokens_per_s if least and least.tokens_per_s else 0.0
        lines.append(f"| {run.backends} | {run.load:.0%} | {run.policy} | {run.hit_rate:.3f} | {of_oracle:.2f} "
                     f"| {run.ttft_p50:.2f} | {run.ttft_p90:.2f} | {p90_ratio:.2f} | {run.tokens_per_s:.0f} "
                     f"| {tok_ratio:.2f} | {run.jain:.3f} | {run.jobs} | {run.lost} |")
    return "\n".join(lines)
