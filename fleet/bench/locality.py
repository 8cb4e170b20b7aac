"""``fleet bench locality``: on one backend, how far the fleet's admission order is from an oracle
order in prefix hit rate, and what locality-aware fair scheduling (DLPM: Cao et al. 2025, a
deficit-bounded longest-prefix-match) would gain and cost in fairness (docs/backends.md, section 6).

A replay, not a fleet: the order decides which prompts find their prefix cached, so each policy
runs the same closed-loop workload through the same model of one server, with the simulator's
own prefix cache (fleet/sim/kvcache.py ``PrefixCache``: whole 1,072-token blocks, chained hashes,
LRU over the pool's block count) and the deployment's sizes (the example config's backend: 32
sequences, a 530K-token KV pool). Nothing here touches Redis or a process: what is compared is
the ORDER alone, with every other thing equal.

Workload (the deployment's shapes, as ``fleet bench backends``' routing runs): clients of each
project in proportion to its weight, ``clients`` per sequence in all (1.5: a backlog of half the
seats; ordering only matters with a backlog), each sending its next job when the last ended. The
assistant's clients are the editor's conversations (a 26K-token first prompt: 63 tools and a 6K
system prompt; each turn adds the last answer and 2K tokens; a new conversation after ``turns``
turns); the others send one-shot jobs on their stable prefix (2K to 8K) with a 1K question; one
job in ten of every client is a 60K-token report no one sent before. Every project has its own
cache salt (no prefix is shared across projects).

Server model: a job holds a seat and its KV reservation (prompt + output limit, whole blocks)
from admission to its end; at admission its prompt is looked up (the hit counters) and its blocks
enter the cache; its uncached tokens prefill one prompt at a time at ``prefill_tokens_per_s``,
then it decodes ``output`` tokens at ``decode_tokens_per_s``.

The fleet's own order, ``fleet`` (``replay_fleet``: the dispatcher store itself), also with
locality in each project's line (``fleet_look8``, ``fleet_look32``: ``admission.locality_lookahead``
8 and 32, schedulers/policy/locality.py: each queue offers the most cached of its first 8 or 32,
as the store's own estimate sees it: prep's estimate when queued, stale once the server took in a
pool's worth of uncached tokens since).

The replay's own policies (who goes when a seat is free; a pick that does not fit the KV pool waits for room, no
job passing it, as the fleet's head-of-line hold does):

* ``fair``: the fleet's order: token-weighted start-time fair queuing across projects
  (schedulers/policy/fairshare.py ``start_tag``, ``charge``), first in, first out within one.
* ``oracle``: longest prefix match over every waiting job (the most cached tokens first; ties:
  the oldest), fairness ignored: what ordering alone can reach for hit rate here.
* ``dlpm``: longest prefix match among the jobs of the projects whose service (tokens admitted
  per unit of weight; a project back from idle starts at the least-served one's) is within
  ``deficit`` of the least-served waiting project's: locality within a bounded fairness deficit.
  ``dlpm_8`` and ``dlpm_1`` look only at each project's first 8 (or 1: the heads admission reads
  today) in line; ``dlpm_wait120`` lets a job that waited 120 s go first, cached or not (a bound
  on the wait locality adds within a project).

Figures (after a warm-up of the first fifth of the admissions): prefix hit rate (hits / queries,
tokens, as vLLM counts), output tokens per second, time to first token p50/p90 (admission wait
and prefill), Jain's index over each project's served tokens relative to what ``fair`` served it
(1.000: the policy took no project's share), and the largest lead an admitted job's project had
over the least-served waiting project (tokens admitted per unit of weight: what ``dlpm`` bounds).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections import defaultdict
from dataclasses import dataclass, field

from fleet.bench.measure import jain, percentile
from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.sim.kvcache import PrefixCache
from schedulers.policy.fairshare import charge, start_tag
from schedulers.policy.locality import Locality
from schedulers.store.base import PendingItem, StoreConfig
from schedulers.store.memory_store import MemoryStore

POLICIES = ("fleet", "fleet_look8", "fleet_look32", "fair", "oracle", "dlpm", "dlpm_8", "dlpm_1", "dlpm_wait120")
# the fleet's own store with ``admission.locality_lookahead`` (schedulers/policy/locality.py)
FLEET_LOCALITY = {"fleet": Locality(), "fleet_look8": Locality(8), "fleet_look32": Locality(32)}
# per policy: how far into each project's line it looks (None: every waiting job), and how long a
# job may wait before it goes first, cached or not (None: no bound)
LOOKAHEAD: dict[str, int | None] = {"oracle": None, "dlpm": None, "dlpm_8": 8, "dlpm_1": 1, "dlpm_wait120": None}
MAX_WAIT_S: dict[str, float | None] = {"dlpm_wait120": 120.0}
WEIGHTS = {"assistant": 3.0, "reports": 2.0, "translate": 2.0, "triage": 1.0, "research": 1.0}
EDITOR = "assistant"
SYSTEM_TOKENS = {"assistant": 6_000, "reports": 8_000, "translate": 5_000, "triage": 2_000, "research": 3_500}
TOOL_TOKENS = 20_000  # the editor's 63 tools, beside its 6K system prompt
TURN_TOKENS, QUESTION_TOKENS, REPORT_TOKENS = 2_000, 1_000, 60_000


@dataclass(frozen=True)
class Server:
    seats: int = 32
    pool_tokens: int = 530_000
    block_tokens: int = 1_072
    prefill_tokens_per_s: float = 8_000.0
    decode_tokens_per_s: float = 30.0
    output: int = 800  # reasoning and answer, per job
    max_new: int = 9_000  # the output limit a job reserves (thinking budget and content reserve)


@dataclass
class Job:
    client: int
    project: str
    segments: tuple[tuple[str, int], ...]  # (name, tokens): equal names are equal text
    arrived: float
    number: int

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.segments)


def block_hashes(segments: tuple[tuple[str, int], ...], block: int) -> list[int]:
    """The chained hash of every whole block of the prompt the segments spell (the simulator's
    ``block_hashes``, on segment pieces instead of token ids: equal pieces, equal tokens)."""
    out: list[int] = []
    pieces: list[tuple[str, int, int]] = []
    filled, prev = 0, 0
    for name, length in segments:
        start = 0
        while start < length:
            take = min(length - start, block - filled)
            pieces.append((name, start, start + take))
            start, filled = start + take, filled + take
            if filled == block:
                prev = hash((prev, tuple(pieces)))
                out.append(prev)
                pieces, filled = [], 0
    return out


class Client:
    """One client's jobs (module docstring)."""

    def __init__(self, number: int, project: str, rng: random.Random, turns: int) -> None:
        self.number, self.project, self.rng, self.turns = number, project, rng, turns
        self.conversation = 0
        self.history: list[tuple[str, int]] = []
        self.sent = 0

    def next_job(self, now: float) -> Job:
        self.sent += 1
        salt = f"salt-{self.project}"
        head = [(f"{salt}-system", SYSTEM_TOKENS[self.project])]
        if self.project == EDITOR:
            head = [(f"{salt}-tools", TOOL_TOKENS), *head]
        unique = f"c{self.number}-j{self.sent}"
        if self.rng.random() < 0.1:  # a report nobody sent before
            return Job(self.number, self.project, ((f"{salt}-{unique}-report", REPORT_TOKENS),), now, self.sent)
        if self.project != EDITOR:
            return Job(self.number, self.project, (*head, (f"{unique}-q", QUESTION_TOKENS)), now, self.sent)
        if len(self.history) >= 2 * self.turns:
            self.conversation += 1
            self.history = []
        self.history.append((f"c{self.number}-v{self.conversation}-t{len(self.history)}", TURN_TOKENS))
        job = Job(self.number, self.project, (*head, *self.history), now, self.sent)
        self.history.append((f"c{self.number}-v{self.conversation}-a{len(self.history)}", 800))
        return job


@dataclass
class Run:
    policy: str
    clients: float
    hit_rate: float = 0.0
    tokens_per_s: float = 0.0
    ttft_p50: float = 0.0
    ttft_p90: float = 0.0
    ttft_p99: float = 0.0
    jain: float = 1.0  # relative to fair's served tokens (filled by ``locality_bench``)
    # the largest lead of an admitted job's project over the least-served backlogged project, in
    # tokens admitted per unit of weight (what dlpm bounds by ``deficit``)
    spread: float = 0.0
    served: dict[str, float] = field(default_factory=dict)
    admissions: int = 0


class Model:
    """The server and the clients (module docstring), whatever decides the order: ``start`` a job
    at an admission, ``next_end`` / ``end`` when one finishes (its client sends the next job)."""

    def __init__(self, run: Run, admissions: int, turns: int, seed: int, server: Server) -> None:
        rng = random.Random(seed)
        total_weight = sum(WEIGHTS.values())
        count = max(len(WEIGHTS), round(server.seats * run.clients))
        names = [p for p, w in WEIGHTS.items() for _ in range(max(1, round(count * w / total_weight)))]
        self.clients = [Client(i, p, random.Random(rng.random()), turns) for i, p in enumerate(names)]
        self.cache = PrefixCache(server.pool_tokens // server.block_tokens, server.block_tokens)
        self.run, self.server, self.admissions, self.warm = run, server, admissions, admissions // 5
        self.running: list[tuple[float, int, Job, object]] = []  # (ends at, tie, job, the caller's tag)
        self._tie = itertools.count()
        self.prefill_free = self.measured_from = self.now = 0.0
        self.served: dict[str, float] = defaultdict(float)
        self.ttfts: list[float] = []
        self.queries = self.hits = self.output = 0

    def first_jobs(self) -> list[Job]:
        return [c.next_job(0.0) for c in self.clients]

    def hashes(self, job: Job) -> list[int]:
        return block_hashes(job.segments, self.server.block_tokens)

    def kv_blocks(self, job: Job) -> int:
        return -(-(job.tokens + self.server.max_new) // self.server.block_tokens)

    @property
    def done(self) -> bool:
        return self.run.admissions >= self.admissions

    def start(self, job: Job, tag: object = None) -> None:
        """Admit ``job`` now: its lookup and blocks in the cache, its prefill in line, its end."""
        s, hashes = self.server, self.hashes(job)
        hit = self.cache.lookup(hashes, job.tokens)
        self.cache.insert(hashes)
        self.prefill_free = max(self.now, self.prefill_free) + (job.tokens - hit) / s.prefill_tokens_per_s
        heapq.heappush(self.running, (self.prefill_free + s.output / s.decode_tokens_per_s, next(self._tie), job, tag))
        self.run.admissions += 1
        if self.run.admissions == self.warm:
            self.measured_from = self.now
        if self.run.admissions > self.warm:
            self.served[job.project] += job.tokens + s.output
            self.ttfts.append(self.prefill_free - job.arrived)
            self.queries, self.hits, self.output = self.queries + job.tokens, self.hits + hit, self.output + s.output

    def next_end(self) -> float:
        return self.running[0][0] if self.running else math.inf

    def end(self) -> tuple[Job, object, Job]:
        """The next job to finish: (it, its tag, the next job its client sends now)."""
        self.now, _, job, tag = heapq.heappop(self.running)
        return job, tag, self.clients[job.client].next_job(self.now)

    def result(self) -> Run:
        run, now = self.run, self.now
        run.hit_rate = self.hits / self.queries if self.queries else math.nan
        run.tokens_per_s = self.output / (now - self.measured_from) if now > self.measured_from else math.nan
        run.ttft_p50, run.ttft_p90, run.ttft_p99 = (percentile(self.ttfts, q, default=math.nan) for q in (50, 90, 99))
        run.served = dict(self.served)
        return run


class Picker:
    """The order of ``replay``'s policies (module docstring) over the jobs waiting."""

    def __init__(self, policy: str, model: Model, deficit: float) -> None:
        self.policy, self.model, self.deficit = policy, model, deficit
        self.window, self.max_wait_s = LOOKAHEAD.get(policy), MAX_WAIT_S.get(policy)
        self.vtime, self.finish = 0.0, dict.fromkeys(WEIGHTS, 0.0)  # start-time fair queuing
        self.service = dict.fromkeys(WEIGHTS, 0.0)  # tokens admitted per unit of weight (dlpm)
        self.waiting: list[Job] = []

    def arrive(self, job: Job) -> None:
        """A project coming back from idle starts at the least-served backlogged project's
        service (as start-time fair queuing pulls it up to V): no credit for time away."""
        backlogged = {j.project for j in self.waiting}
        if job.project not in backlogged and backlogged:
            self.service[job.project] = max(self.service[job.project], min(self.service[p] for p in backlogged))
        self.waiting.append(job)

    def pick(self) -> Job:
        if self.policy == "fair":
            tags = {p: start_tag(self.vtime, self.finish[p]) for p in {j.project for j in self.waiting}}
            return min(self.waiting, key=lambda j: (tags[j.project], j.arrived, j.client))
        candidates = self.waiting
        if self.policy != "oracle":
            floor = min(self.service[j.project] for j in self.waiting)
            candidates = [j for j in candidates if self.service[j.project] <= floor + self.deficit]
        if self.window is not None:  # each project's first ``window`` in line only
            seen: dict[str, int] = defaultdict(int)
            kept = []
            for j in sorted(candidates, key=lambda j: (j.arrived, j.client)):
                seen[j.project] += 1
                if seen[j.project] <= self.window:
                    kept.append(j)
            candidates = kept
        if self.max_wait_s is not None:
            overdue = [j for j in candidates if self.model.now - j.arrived >= self.max_wait_s]
            if overdue:  # waited its bound: the oldest goes, cached or not
                return min(overdue, key=lambda j: (j.arrived, j.client))
        cache, hashes = self.model.cache, self.model.hashes
        return max(candidates, key=lambda j: (cache.peek(hashes(j), j.tokens), -j.arrived, -j.client))

    def admitted(self, job: Job) -> None:
        self.waiting.remove(job)
        run = self.model.run
        if run.admissions >= self.model.warm and self.waiting:
            run.spread = max(run.spread, self.service[job.project]
                             - min(self.service[j.project] for j in self.waiting))
        cost = job.tokens + self.model.server.max_new
        self.service[job.project] += cost / WEIGHTS[job.project]
        self.vtime, self.finish[job.project] = charge(self.vtime, self.finish[job.project], WEIGHTS[job.project], cost)


def replay(policy: str, *, clients_per_seat: float = 1.5, admissions: int = 4_000, deficit: float = 40_000.0,
           turns: int = 8, seed: int = 1, server: Server = Server()) -> Run:
    """One of the replay's own policies over the workload (module docstring): a pick that does
    not fit the KV pool waits for room, no job passing it."""
    model = Model(Run(policy, clients_per_seat), admissions, turns, seed, server)
    picker = Picker(policy, model, deficit)
    for job in model.first_jobs():
        picker.arrive(job)
    seats, blocks = server.seats, server.pool_tokens // server.block_tokens
    while not model.done:
        while seats and picker.waiting:
            job = picker.pick()
            if model.kv_blocks(job) > blocks:
                break
            picker.admitted(job)
            model.start(job)
            seats, blocks = seats - 1, blocks - model.kv_blocks(job)
        if not model.running:
            break
        ended, _, following = model.end()
        seats, blocks = seats + 1, blocks + model.kv_blocks(ended)
        picker.arrive(following)
    return model.result()


def replay_fleet(*, clients_per_seat: float = 1.5, admissions: int = 4_000, turns: int = 8, seed: int = 1,
                 server: Server = Server(), locality: Locality = Locality(), policy: str = "fleet") -> Run:
    """The workload in the order the fleet's own admission gives it: the dispatcher store (its
    in-memory twin, equal to the Redis store's scripts) with the example config's limits and
    weights decides every grant (bands, long prompts first in the batch band, ``max_long``, the
    prefill pacing, the KV budget); the server model is ``replay``'s. Each job's uncached tokens
    are prep's kind of estimate: the cache as it is when the job is submitted."""
    model = Model(Run(policy, clients_per_seat), admissions, turns, seed, server)
    config = dataclasses.replace(StoreConfig.from_settings(load_settings(EXAMPLE_CONFIG, env={})), gate=False,
                                 locality=locality)
    store = MemoryStore(config, clock=lambda: model.now)  # no scrape here: the server is always up
    jobs: dict[str, Job] = {}

    def submit(job: Job) -> None:
        name = f"c{job.client}-j{job.number}"
        jobs[name] = job
        cached = model.cache.peek(model.hashes(job), job.tokens)
        store.add_pending(PendingItem(name, job.project, job.tokens, server.max_new, enqueued_at=model.now,
                                      uncached_tokens=job.tokens - cached))

    for job in model.first_jobs():
        submit(job)
    while not model.done:
        result = store.admit_next(model.now)
        while result.grant is not None:
            model.start(jobs.pop(result.grant.job_id), (result.grant.job_id, result.grant.fence))
            result = store.admit_next(model.now)
        # (at least 1 ms: a bucket hold may name a time that rounds to now, as the dispatcher pauses)
        retry_at = model.now + max(result.retry_in_s, 0.001) if result.retry_in_s is not None else math.inf
        if model.next_end() == math.inf and retry_at == math.inf:
            break
        if model.next_end() <= retry_at:
            _, tag, following = model.end()
            store.release(*tag)  # type: ignore[misc]
            submit(following)
        else:
            model.now = retry_at
    return model.result()


def locality_bench(loads: tuple[float, ...] = (1.5, 3.0), admissions: int = 4_000, deficit: float = 40_000.0,
                   seeds: tuple[int, ...] = (1, 2, 3)) -> list[Run]:
    """Every policy at every load, each over ``seeds`` (their figures averaged); Jain relative to
    ``fair`` of the same load and seed."""
    runs: list[Run] = []
    for load in loads:
        by_policy: dict[str, list[Run]] = {}
        for seed in seeds:
            fair = replay("fair", clients_per_seat=load, admissions=admissions, seed=seed)
            for policy in POLICIES:
                if policy in FLEET_LOCALITY:
                    run = replay_fleet(clients_per_seat=load, admissions=admissions, seed=seed,
                                       locality=FLEET_LOCALITY[policy], policy=policy)
                else:
                    run = fair if policy == "fair" else replay(policy, clients_per_seat=load, admissions=admissions,
                                                               deficit=deficit, seed=seed)
                run.jain = jain([run.served.get(p, 0.0) / fair.served[p] for p in fair.served])
                by_policy.setdefault(policy, []).append(run)
        for policy, done in by_policy.items():
            mean = Run(policy, load, admissions=sum(r.admissions for r in done))
            for name in ("hit_rate", "tokens_per_s", "ttft_p50", "ttft_p90", "ttft_p99", "jain"):
                setattr(mean, name, sum(getattr(r, name) for r in done) / len(done))
            mean.spread = max(r.spread for r in done)
            runs.append(mean)
    return runs


def markdown(runs: list[Run]) -> str:
    """The runs as a Markdown table, with each policy's hit rate as a share of the oracle's."""
    oracle = {r.clients: r.hit_rate for r in runs if r.policy == "oracle"}
    lines = ["| clients per seat | policy | prefix hit rate | / oracle | output tok/s | TTFT p50 / p90 / p99 s "
             "| Jain vs fair | largest lead (tokens/weight) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lead = "" if r.policy in FLEET_LOCALITY else f"{r.spread:,.0f}"
        lines.append(f"| {r.clients:g} | {r.policy} | {r.hit_rate:.3f} | {r.hit_rate / oracle[r.clients]:.2f} "
                     f"| {r.tokens_per_s:,.0f} | {r.ttft_p50:.1f} / {r.ttft_p90:.1f} / {r.ttft_p99:.1f} "
                     f"| {r.jain:.3f} | {lead} |")
    return "\n".join(lines)
