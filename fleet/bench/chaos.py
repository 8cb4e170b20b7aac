"""``fleet bench chaos``: the faults an operator meets, one round each, every round on a fleet of
its own, reporting the fleet's invariants rather than its speed.

Rounds (``ROUNDS``; ``--rounds`` picks some):
  storm             kill -9 of dispatchers, inference workers and the prep worker in turn, each
                    started again at once (a supervisor's restart policy)
  redis-aof-clean   Redis with AOF (everysec) stopped with SHUTDOWN, started again on its port
  redis-aof-kill9   the same Redis killed with kill -9 (up to a second of writes may be lost)
  redis-none-clean  Redis without persistence stopped cleanly: every key is gone
  redis-none-kill9  the same with kill -9
  sentinel          master, replica and three Sentinels; kill -9 of the master
  backend-faults    ``fleet sim --fault-rate`` (500, 503, dropped streams, error events)
  backend-dead      one job carries ``[sim:dead=S/1]``: the engine dies for S seconds, every
                    stream in flight fails, /health answers 503
  backends-storm    two backends (one ``fleet sim`` each, ``cap`` sequences each): kill -9 of the
                    second simulator, the kill storm while it is down, the simulator started
                    again on its port; every simulator's peak is checked against its own cap.
                    ``fleet gateway`` runs beside the fleet with streaming clients
                    (fleet/bench/chaosgateway.py) and ``routing.continue_cut_turns = "continue"``:
                    the streams the kill cuts fail over to the survivor mid-reasoning

What runs per round: its own Redis (fleet/local/topology.py: a ``RedisNode`` on a free loopback
port, or a ``SentinelGroup``), ``fleet sim``, two dispatchers, two inference workers
(``--role infer``) and one prep worker (``--role prep``) as processes (fleet/local/processes.py),
configured by a generated fleet.toml with secrets of its own. The bench submits all jobs, waits
until a fifth have their envelope, injects the fault, then waits until every job has an envelope
or nothing has finished for ``stall_s``. A supervisor thread restarts any process that exits on its
own and counts it: an exit is a failure of the fleet (processes are meant to ride out faults), the
restart only keeps the round going.

What it reports (``RoundResult``):
  jobs, envelopes     jobs submitted / jobs with at least one envelope
  missing             jobs without one at the end: ``lost`` (no job record left: the fault took the
                      submission) and ``stuck`` (a record that never reached its final state)
  doubled             jobs with more than one envelope (distinct results-stream entries, collected
                      as they appear, so a Redis that forgets its streams does not hide them)
  max in flight       the simulator's own peak of running requests, against the cap (with several
                      backends the highest of their peaks, each against its own cap, which is
                      the same; "fault -> full" then watches the first backend)
  fault -> full       seconds from the end of each fault (Redis answering again, the new master
                      promoted, the engine alive, the process restarted) until the simulator runs
                      ``min(full, jobs still open)`` requests again, ``full`` being the median it ran
                      over the 2 s before the fault; ``never`` if it does not. Jobs a Redis without
                      persistence lost are not open: they never run again
  fault -> all final  seconds from the end of each fault until the last job open then (not lost)
                      had its envelope: the longest a job waited after the fault ended (queued
                      work counts: a backlog takes its time to drain); ``never`` if one never did
  exited              processes that exited by themselves (restarted by the supervisor)
  RSS                 each process's resident memory (VmRSS) sampled every second from the first
                      envelopes on (imports done, work under way): first, max, last; a process
                      restarted during the round keeps its row (its last figure is the new process's)
  gateway             (rounds with gateway clients) requests, their codes as the clients saw
                      them, requests moved by a failover, streams without an end, envelopes
                      missing or disagreeing, entries left in the dispatcher store
Verdict: ``ok`` when nothing is missing or doubled, the cap held and no process exited; ``loss``
when only jobs of a Redis without persistence are missing (what that configuration promises);
``FAIL`` naming what broke otherwise; ``error`` when the round itself could not run.

Nothing is asserted on timings (tests/bench/test_bench_chaos.py runs a tiny round and checks the
invariants). Every process and Redis the bench starts is stopped at the end of its round; a round
cut short by a stop signal (fleet/bench/__init__.py) keeps no logs.
"""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
import tempfile
import threading
import time
import tomllib
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import tomli_w

from fleet.bench.chaosgateway import GatewayAccount, GatewayClients
from fleet.bench.fleet.sampler import Sampler
from fleet.bench.fleet.workload import PROJECTS, Spec, job_of, short_mix
from fleet.client import Client
from fleet.core.apikeys import mint
from fleet.core.config import EXAMPLE_CONFIG, Settings, load_settings
from fleet.core.models import Envelope
from fleet.core.redisconn import redis_client
from fleet.local.embedded import free_port
from fleet.local.processes import LocalFleet
from fleet.local.topology import MASTER_NAME, RedisNode, SentinelGroup

log = logging.getLogger(__name__)

AOF = ["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
NO_PERSISTENCE = ["--appendonly", "no", "--save", ""]
ROUNDS = ("storm", "redis-aof-clean", "redis-aof-kill9", "redis-none-clean", "redis-none-kill9",
          "sentinel", "backend-faults", "backend-dead", "backends-storm")
OUTAGE_S = 1.0  # how long Redis stays down in the restart rounds
DEAD_S = 3.0  # how long the engine stays dead in backend-dead
GATEWAY_CLIENTS = 4  # streaming clients of a round with a gateway


@dataclass
class RoundResult:
    name: str
    fault: str
    jobs: int = 0
    envelopes: int = 0
    lost: list[str] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)
    stuck_states: Counter[str] = field(default_factory=Counter)  # the state their records show
    doubled: list[str] = field(default_factory=list)
    max_running: int = 0
    cap: int = 0
    full_level: int = 0  # running requests counted as a full backend (the level before the fault)
    recoveries: list[float | None] = field(default_factory=list)
    all_final: list[float | None] = field(default_factory=list)  # fault end -> last open job final
    exited: Counter[str] = field(default_factory=Counter)
    submit_failures: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    rss_mb: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # first, max, last
    gateway: GatewayAccount | None = None  # rounds with gateway clients
    seconds: float = 0.0
    error: str = ""
    logs: str = ""  # the processes' logs, kept when the round did not end ok

    @property
    def missing(self) -> int:
        return len(self.lost) + len(self.stuck)

    def verdict(self) -> str:
        if self.error:
            return f"error: {self.error}"
        broken = []
        if self.stuck or (self.lost and "none" not in self.name):
            states = ", ".join(f"{s} {n}" for s, n in sorted(self.stuck_states.items()))
            broken.append(f"{self.missing} missing" + (f" (stuck: {states})" if states else ""))
        if self.doubled:
            broken.append(f"{len(self.doubled)} doubled")
        if self.max_running > self.cap:
            broken.append(f"cap {self.cap} exceeded")
        if self.exited:
            broken.append(f"{sum(self.exited.values())} process exits")
        if self.submit_failures:
            broken.append(f"{self.submit_failures} submissions failed")
        if self.gateway is not None:
            broken += self.gateway.broken()
        if broken:
            expected = f"; {len(self.lost)} lost (no persistence)" if self.lost and "none" in self.name else ""
            return "FAIL: " + ", ".join(broken) + expected
        return "loss (no persistence)" if self.lost else "ok"


class Broker:
    """The round's Redis: one node (restartable) or a Sentinel group."""

    def __init__(self, node_args: list[str] | None = None, sentinel: bool = False) -> None:
        self.node = RedisNode(node_args) if node_args is not None else None
        self.group = SentinelGroup() if sentinel else None

    def start(self) -> Broker:
        if self.node is not None:
            self.node.start()
        if self.group is not None:
            self.group.start()
        return self

    @property
    def url(self) -> str:
        if self.group is not None:
            return self.group.url
        assert self.node is not None
        return self.node.url

    def pids(self) -> dict[str, int]:
        nodes = [("redis", self.node)] if self.node is not None else []
        if self.group is not None:
            nodes += [(f"redis-{n}", node) for n, node in enumerate(self.group.nodes)]
        return {name: node.process.pid for name, node in nodes if node.process is not None and node.alive()}

    def close(self) -> None:
        if self.node is not None:
            self.node.close()
        if self.group is not None:
            self.group.close()


class ChaosFleet:
    """One round's fleet, its observers and its supervisor."""

    def __init__(self, broker: Broker, jobs: int, cap: int, speed: float, sim_args: list[str],
                 lease_ttl_s: float, backends: int = 1, sections: dict[str, dict[str, Any]] | None = None,
                 gateway: bool = False, gateway_project: str | None = None) -> None:
        self.broker, self.jobs, self.cap = broker, jobs, cap
        self.tmp = Path(tempfile.mkdtemp(prefix="fleet-chaos-"))
        data = tomllib.loads(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
        data.update(broker_url=broker.url, key_prefix=f"chaos-{uuid.uuid4().hex[:8]}:")
        data["redis"] = {"master_name": MASTER_NAME}
        for project in data["projects"].values():
            project["secret"] = f"chaos-{uuid.uuid4().hex}"
        # the gateway's clients call as one project (the first by default), with a key of the round's own
        self.gateway_project = gateway_project or next(iter(data["projects"]))
        self.gateway_key, entry = mint()
        data["projects"][self.gateway_project]["api_keys"] = [entry]
        data["backend"]["max_num_seqs"] = cap
        if backends > 1:  # replicas of the example's server, each with the round's cap
            entry = data.pop("backend")
            data["backends"] = [{**entry, "name": f"gpu-{chr(97 + i)}",
                                 "served_model_names": [entry.get("model", "local")]} for i in range(backends)]
        data.setdefault("admission", {}).update(metrics_port=0, lease_ttl_s=lease_ttl_s)
        data.setdefault("retry", {}).update(backoff_base_s=0.2, backoff_max_s=1.0)
        # a killed prep worker's jobs come back after these (the defaults, 60 s and 600 s, suit a
        # deployment, not a round of a minute)
        data.update(prep_lease_s=5.0, prep_unclaimed_s=15.0)
        for section, values in (sections or {}).items():  # a bench's own settings
            data.setdefault(section, {}).update(values)
        (self.tmp / "fleet.toml").write_text(tomli_w.dumps(data), encoding="utf-8")
        self.settings: Settings = load_settings(self.tmp / "fleet.toml", env={})
        self.fleet = LocalFleet(self.settings, sim_speed=speed, workers=0, dispatchers=2,
                                sim_args=["--max-num-seqs", str(max(cap, 32)), *sim_args],
                                config_path=str(self.tmp / "fleet.toml"), log_dir=str(self.tmp),
                                inherit_env=False, gateway_port=free_port() if gateway else None)
        self.lock = threading.Lock()  # the supervisor and the bench's own kills
        self.clients: GatewayClients | None = None  # a round's gateway clients
        self.exited: Counter[str] = Counter()
        # (stream, entry id) -> job id, code, when first seen; entry ids repeat across streams
        self.seen: dict[tuple[str, bytes], tuple[str, str, float]] = {}
        self.rss: dict[str, list[float]] = {}
        self.warm = threading.Event()  # set once the first envelopes are out: RSS is sampled from then
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> ChaosFleet:
        self.fleet.start()
        for name, role, threads in (("infer-0", "infer", 16), ("infer-1", "infer", 16), ("prep-0", "prep", 8)):
            self.fleet.spawn(name, ["worker", "--role", role, "--concurrency", str(threads),
                                    "--hostname", f"{name}-{uuid.uuid4().hex[:6]}@%h", "--log-level", "WARNING"])
        self.urls = self.fleet.backend_urls()  # backend name -> its simulator
        self.base_url = next(iter(self.urls.values()))
        entries = [e.model_copy(update={"url": self.urls[e.name]}) for e in self.settings.backends]
        self.settings = self.settings.model_copy(update={"backends": entries, "backend": entries[0]})
        self.client = Client(self.settings)
        self.reader = redis_client(self.settings, socket_timeout=2, socket_connect_timeout=2)
        for target in (self._supervise, self._collect, self._measure_rss):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    # -- observers -------------------------------------------------------------------------------
    def _supervise(self) -> None:
        while not self._stop.wait(0.2):
            with self.lock:
                self.exited.update(self.fleet.restart_exited())

    def _collect(self) -> None:
        """Every results-stream entry as it appears (deduplicated by entry id)."""
        cursors = {self.client.keys.results(p): "0-0" for p in self.settings.projects}
        while not self._stop.wait(0.2):
            self.collect_once(cursors)

    def collect_once(self, cursors: dict[str, str]) -> None:
        for key in cursors:
            try:
                entries: Any = self.reader.xrange(key, min=cursors[key], count=1000)
            except redis.RedisError as exc:
                log.info("collecting %s: %s", key, exc)
                continue
            for entry_id, fields in entries:
                envelope = Envelope.model_validate_json(fields[b"envelope"])
                self.seen.setdefault((key, entry_id), (envelope.job_id, envelope.code.value, time.time()))
                cursors[key] = "(" + entry_id.decode()

    def _measure_rss(self) -> None:
        while not self._stop.wait(1.0):
            if not self.warm.is_set():
                continue
            pids = {name: p.pid for name, p in list(self.fleet.children) if p.poll() is None}
            pids.update(self.broker.pids())
            for name, pid in pids.items():
                mb = _rss_mb(pid)
                if mb is not None:
                    self.rss.setdefault(name, []).append(mb)

    def envelope_counts(self) -> Counter[str]:
        return Counter(job_id for job_id, _code, _at in self.seen.values())

    # -- actions -----------------------------------------------------------------------------------
    def kill_and_restart(self, name: str) -> None:
        with self.lock:
            self.fleet.restart(name)

    def kill(self, name: str) -> None:
        """kill -9 of ``name``, which stays down (the supervisor does not see it) until
        ``start_again``."""
        with self.lock:
            self.fleet.kill(name)

    def start_again(self, name: str) -> None:
        with self.lock:
            self.fleet.start_again(name)

    def submit(self, specs: list[Spec]) -> tuple[list[str], int]:
        """Submit each job, retrying a broker error for up to 30 s; (ids, submissions given up)."""
        ids, failed = [], 0
        for spec in specs:
            deadline = time.monotonic() + 30
            while True:
                try:
                    ids.append(self.client.submit(job_of(spec, None)))
                    break
                except redis.RedisError:
                    if time.monotonic() > deadline:
                        failed += 1
                        break
                    time.sleep(0.5)
        return ids, failed

    def open_jobs(self, ids: list[str], at: float | None = None) -> int:
        """Jobs without an envelope (seen before ``at``, if given)."""
        done = {job_id for job_id, _code, seen in list(self.seen.values()) if at is None or seen <= at}
        return sum(1 for j in ids if j not in done)

    def last_final(self, ids: list[str], after: float) -> float | None:
        """Seconds from ``after`` to the first envelope of the last of ``ids`` open then (0 when
        none was open); None when one of them never had one."""
        first: dict[str, float] = {}
        for job_id, _code, seen in list(self.seen.values()):
            first[job_id] = min(seen, first.get(job_id, seen))
        still_open = [j for j in ids if j not in first or first[j] > after]
        if any(j not in first for j in still_open):
            return None
        return max((first[j] - after for j in still_open), default=0.0)

    def gateway_clients(self, think: int, answer: int) -> GatewayClients:
        assert self.fleet.gateway_port is not None
        self.clients = GatewayClients(f"http://127.0.0.1:{self.fleet.gateway_port}", self.gateway_key,
                                      GATEWAY_CLIENTS, think, answer)
        return self.clients

    def account_gateway(self, clients: GatewayClients, settle_s: float = 15.0) -> GatewayAccount:
        """The gateway clients' account, once every request has its envelope (the gateway
        publishes it after the answer went out) and the store's leases, items and quota
        reservations are gone (an expired lease of a killed process goes at the dispatcher's next
        sweep), or after ``settle_s`` with what is still wrong."""
        store = self.client.keys.dispatch
        hashes = [f"{store}{name}" for name in ("lease", "items", "qres")]
        stream = self.client.keys.gateway_results(self.gateway_project)
        deadline = time.monotonic() + settle_s
        while True:
            account = clients.account(self.reader, stream, hashes)
            if not (account.left or account.unmatched) or time.monotonic() > deadline:
                if account.mismatched:
                    log.warning("gateway envelopes: %s", "; ".join(account.mismatched[:10]))
                return account
            time.sleep(0.5)

    def close(self, keep_logs: bool = False) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        with contextlib.suppress(Exception):
            self.client.close()
            self.reader.close()
        self.fleet.close(grace_s=5)
        if not keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# -- faults: each returns the instants its faults ended -------------------------------------------
def _storm(cf: ChaosFleet, kills: int) -> list[float]:
    victims = ["dispatcher-0", "infer-0", "prep-0", "dispatcher-1", "infer-1"]
    ends = []
    for n in range(kills):
        time.sleep(random.uniform(0.5, 1.5))
        cf.kill_and_restart(victims[n % len(victims)])
        ends.append(time.time())
    return ends


def _restart_redis(cf: ChaosFleet, clean: bool) -> list[float]:
    node = cf.broker.node
    assert node is not None
    node.shutdown() if clean else node.kill()
    time.sleep(OUTAGE_S)
    node.start()
    return [time.time()]


def _backends_storm(cf: ChaosFleet, kills: int) -> list[float]:
    """The second simulator killed (with gateway clients: once one of their streams is thinking
    on it, for up to 30 s, so the kill cuts a reasoning the gateway fails over), the storm while
    it is down, the simulator back."""
    second = cf.settings.backends[1].name
    if cf.clients is not None:
        clients = cf.clients
        deadline = time.monotonic() + 30
        while not clients.thinking_on(second) and time.monotonic() < deadline:
            time.sleep(0.02)
    name = f"sim-{second}"
    cf.kill(name)
    ends = _storm(cf, kills)
    cf.start_again(name)
    with httpx.Client(timeout=2) as http:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if http.get(f"{cf.urls[cf.settings.backends[1].name]}/health").status_code == 200:
                    break
            time.sleep(0.1)
    return [*ends, time.time()]


def _failover(cf: ChaosFleet) -> list[float]:
    assert cf.broker.group is not None
    cf.broker.group.kill_master()
    return [time.time()]


def _engine_death(cf: ChaosFleet, specs_project: str) -> list[float]:
    """Submit the job that kills the engine, wait for /health to fail and come back."""
    cf.client.submit({"project": specs_project, "thinking_budget": 200, "content_reserve": 64,
                      "messages": [{"role": "user", "content": f"[sim:dead={DEAD_S:g}/1] [sim:think=50]"}]})
    with httpx.Client(base_url=cf.base_url, timeout=5) as http:
        for want_ok in (False, True):
            deadline = time.monotonic() + 120
            while (http.get("/health").status_code == 200) != want_ok:
                if time.monotonic() > deadline:
                    raise TimeoutError("the engine did not " + ("come back" if want_ok else "die"))
                time.sleep(0.05)
    return [time.time()]


@dataclass
class RoundPlan:
    fault: str
    broker: Callable[[], Broker]
    inject: Callable[[ChaosFleet], list[float]]
    sim_args: list[str] = field(default_factory=list)
    backends: int = 1
    gateway: bool = False  # fleet gateway and its streaming clients beside the queue jobs
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)  # settings of the round


def plans(kills: int) -> dict[str, RoundPlan]:
    return {
        "storm": RoundPlan(f"{kills} x kill -9 (dispatchers, infer, prep), each restarted",
                           lambda: Broker(AOF), lambda cf: _storm(cf, kills)),
        "redis-aof-clean": RoundPlan(f"Redis (AOF everysec) SHUTDOWN, {OUTAGE_S:g} s down",
                                     lambda: Broker(AOF), lambda cf: _restart_redis(cf, clean=True)),
        "redis-aof-kill9": RoundPlan(f"Redis (AOF everysec) kill -9, {OUTAGE_S:g} s down",
                                     lambda: Broker(AOF), lambda cf: _restart_redis(cf, clean=False)),
        "redis-none-clean": RoundPlan(f"Redis (no persistence) SHUTDOWN, {OUTAGE_S:g} s down",
                                      lambda: Broker(NO_PERSISTENCE), lambda cf: _restart_redis(cf, clean=True)),
        "redis-none-kill9": RoundPlan(f"Redis (no persistence) kill -9, {OUTAGE_S:g} s down",
                                      lambda: Broker(NO_PERSISTENCE), lambda cf: _restart_redis(cf, clean=False)),
        "sentinel": RoundPlan("Sentinel: kill -9 of the master, replica promoted",
                              lambda: Broker(sentinel=True), _failover),
        "backend-faults": RoundPlan("fleet sim --fault-rate 0.2 (500/503/drop/error event)",
                                    lambda: Broker(AOF), lambda cf: [], sim_args=["--fault-rate", "0.2"]),
        "backend-dead": RoundPlan(f"[sim:dead={DEAD_S:g}/1]: the engine dies for {DEAD_S:g} s",
                                  lambda: Broker(AOF), lambda cf: _engine_death(cf, PROJECTS[0])),
        "backends-storm": RoundPlan(f"2 backends: kill -9 of one, {kills} x kill -9 while it is down, it returns",
                                    lambda: Broker(AOF), lambda cf: _backends_storm(cf, kills), backends=2,
                                    gateway=True, sections={"routing": {"continue_cut_turns": "continue"}}),
    }


def run_round(name: str, plan: RoundPlan, jobs: int, cap: int, speed: float, think: int, answer: int,
              stall_s: float, lease_ttl_s: float) -> RoundResult:
    result = RoundResult(name, plan.fault, cap=cap)
    started = time.monotonic()
    broker: Broker | None = None
    cf: ChaosFleet | None = None
    ended = False  # False while the round is cut short (a stop signal): its logs are not kept
    try:
        broker = plan.broker()  # named before it starts: the finally below stops what it started
        broker.start()
        cf = ChaosFleet(broker, jobs, cap, speed, plan.sim_args, lease_ttl_s, plan.backends, plan.sections,
                        plan.gateway)
        cf.start()
        clients = cf.gateway_clients(think, answer) if plan.gateway else None
        others = [Sampler(url, interval_s=0.1) for url in list(cf.urls.values())[1:]]
        with Sampler(cf.base_url, interval_s=0.1) as sampler, contextlib.ExitStack() as stack:
            for other in others:
                stack.enter_context(other)
            ids, result.submit_failures = cf.submit(short_mix(jobs, think, answer))
            _wait(lambda: sum(1 for c in cf.envelope_counts().values() if c) >= max(1, jobs // 5), 300)
            cf.warm.set()
            if clients is not None:
                clients.start()
            full = _steady_level(sampler, cap)
            ends = plan.inject(cf)
            if clients is not None:
                clients.stop(timeout_s=clients.read_timeout_s + 30)
            _settle(cf, ids, stall_s)
            _account(result, cf, ids)
            if clients is not None:
                result.gateway = cf.account_gateway(clients)
            result.full_level = full
            lost = set(result.lost)  # gone with the Redis that held them: never to run again
            targets = [min(full, cf.open_jobs([j for j in ids if j not in lost], end)) for end in ends]
            result.recoveries = [_back_to_full(sampler, end, target) for end, target in zip(ends, targets, strict=True)]
            result.all_final = [cf.last_final([j for j in ids if j not in lost], end) for end in ends]
            result.max_running = max((s["max_running_seen"] for each in (sampler, *others) for s in each.samples),
                                     default=0)
        ended = True
    except Exception as exc:  # a round that cannot run is reported, never the end of the bench
        ended = True
        log.exception("chaos round %s", name)
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if cf is not None:
            result.exited = cf.exited
            result.rss_mb = {n: (v[0], max(v), v[-1]) for n, v in cf.rss.items() if v}
            kept = ended and result.verdict() not in ("ok", "loss (no persistence)")
            result.logs = str(cf.tmp) if kept else ""
            cf.close(keep_logs=bool(result.logs))
        if broker is not None:
            broker.close()
        result.seconds = time.monotonic() - started
    return result


def _wait(predicate: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing finished within {timeout_s:.0f} s")
        time.sleep(0.1)


def _settle(cf: ChaosFleet, ids: list[str], stall_s: float) -> None:
    """Until every job has an envelope, or none arrives for ``stall_s``."""
    last, since = -1, time.monotonic()
    while True:
        done = len(ids) - cf.open_jobs(ids)
        if done == len(ids):
            return
        if done != last:
            last, since = done, time.monotonic()
        elif time.monotonic() - since > stall_s:
            return
        time.sleep(0.2)


def _steady_level(sampler: Sampler, cap: int, window_s: float = 2.0) -> int:
    """What "a full backend" means for this round: the median number of running requests over the
    ``window_s`` before the fault (short jobs turn over, so a sample rarely shows every slot taken
    even when the fleet keeps the backend as full as it can); the cap if nothing was sampled."""
    now = time.time()
    running = sorted(s["running"] for s in sampler.samples if s["t"] > now - window_s)
    return min(cap, running[len(running) // 2]) if running else cap


def _back_to_full(sampler: Sampler, after: float, target: int) -> float | None:
    for s in list(sampler.samples):
        if s["t"] > after and s["running"] >= target:
            return s["t"] - after
    return None


def _account(result: RoundResult, cf: ChaosFleet, ids: list[str]) -> None:
    before = cf.envelope_counts()
    cf.collect_once({cf.client.keys.results(p): "0-0" for p in cf.settings.projects})  # a last full pass
    counts = cf.envelope_counts()
    if sum(counts.values()) != sum(before.values()):
        log.warning("the last pass found %d envelopes the follower had not seen",
                    sum(counts.values()) - sum(before.values()))
    result.jobs = len(ids)
    result.envelopes = sum(1 for j in ids if counts[j])
    result.doubled = [j for j in ids if counts[j] > 1]
    for job_id in (j for j in ids if counts[j] == 0):
        try:
            record = cf.client.results.job_record(cf.client.ref(job_id))
        except redis.RedisError:
            record = {}
        (result.stuck if record else result.lost).append(job_id)
        if record:
            result.stuck_states[record.get("state", "?")] += 1
    wanted = set(ids)
    result.codes = Counter(code for job_id, code, _at in cf.seen.values() if job_id in wanted)


def chaos_bench(rounds: list[str], jobs: int = 80, cap: int = 8, speed: float = 20.0, think: int = 300,
                answer: int = 30, kills: int = 6, stall_s: float = 30.0, lease_ttl_s: float = 3.0,
                on_result: Callable[[RoundResult], None] | None = None) -> list[RoundResult]:
    table = plans(kills)
    unknown = [r for r in rounds if r not in table]
    if unknown:
        raise ValueError(f"unknown rounds {unknown}; known: {', '.join(ROUNDS)}")
    results = []
    for name in rounds:
        result = run_round(name, table[name], jobs, cap, speed, think, answer, stall_s, lease_ttl_s)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


# -- reporting -------------------------------------------------------------------------------------
COLUMNS = ("round", "fault", "jobs", "envelopes", "missing (lost/stuck)", "doubled", "max in flight / cap",
           "fault -> full backend (level), s", "fault -> all final, s", "exited", "verdict")


def row_of(r: RoundResult) -> list[str]:
    recoveries = ", ".join("never" if x is None else f"{x:.1f}" for x in r.recoveries)
    recoveries = f"{recoveries} ({r.full_level})" if recoveries else "-"
    finals = ", ".join("never" if x is None else f"{x:.1f}" for x in r.all_final) or "-"
    exited = ", ".join(f"{n} x{c}" for n, c in sorted(r.exited.items())) or "0"
    return [r.name, r.fault, str(r.jobs), str(r.envelopes), f"{r.missing} ({len(r.lost)}/{len(r.stuck)})",
            str(len(r.doubled)), f"{r.max_running} / {r.cap}", recoveries, finals, exited, r.verdict()]


def rss_rows(results: list[RoundResult]) -> list[list[str]]:
    """Per round and process: RSS first / max / last, MB."""
    return [[r.name, name, f"{first:.0f} / {peak:.0f} / {last:.0f}"]
            for r in results for name, (first, peak, last) in sorted(r.rss_mb.items())]


GATEWAY_COLUMNS = ("round", "gateway streams", "codes as the clients saw them", "with a tool call",
                   "moved by a failover",
                   "without an end", "envelopes missing / doubled / other code", "left in the store")


def gateway_rows(results: list[RoundResult]) -> list[list[str]]:
    rows = []
    for r in results:
        g = r.gateway
        if g is None:
            continue
        codes = ", ".join(f"{code} {n}" for code, n in sorted(g.codes.items())) or "-"
        rows.append([r.name, str(g.requests), codes, str(g.tool_calls), str(g.failovers), str(g.unended),
                     str(g.unmatched), str(g.left)])
    return rows


def markdown(results: list[RoundResult]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row_of(r)) + " |" for r in results]
    gateway = gateway_rows(results)
    if gateway:
        lines += ["", "| " + " | ".join(GATEWAY_COLUMNS) + " |", "|" + "---|" * len(GATEWAY_COLUMNS)]
        lines += ["| " + " | ".join(row) + " |" for row in gateway]
    lines += ["", "| round | process | RSS MB first / max / last |", "|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rss_rows(results)]
    return "\n".join(lines) + "\n"
