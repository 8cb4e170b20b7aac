"""Never over the cap, and a crash loses nothing (docs/failures.md), through the REAL fleet: two
dispatcher processes, two Celery worker processes, ``fleet sim`` and the test Redis (a private key
prefix).

The fleet's cap is small (``backend.max_num_seqs`` = 4) while the simulator keeps its own 32, so
the simulator only observes: its ``max_running_seen`` is the number of requests the fleet had in
flight at the backend at any one moment, counted by the backend itself.

The same fleet also shows at the backend: the long-prompt limit (``max_long`` 1, the simulator's
``max_long_running_seen``), the KV budget (8-block reservations, two at a time), fair share and
the interactive band (a 30-job flood does not delay a small project's jobs), and a ``kill -9``
of one of the two dispatchers mid-burst.

Crash: every job's first request stalls for good (``[sim:stall=.../1]``, the ``/1`` makes only the
first request of each job stall), so a ``kill -9`` of the worker that runs some of them cannot
race the stream's end. The victim's leases then expire (``lease_ttl_s`` 3 s) and its jobs are
admitted again; the survivor's stalled streams hit the idle timeout (``timeouts.idle_s`` 4 s) and
retry. Either way the second request does not stall, so every job ends OK, exactly once, with two
requests at the simulator.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from fleet.core.codes import Code
from fleet.local.embedded import free_port
from fleet.worker.queues import INFER_TASK
from tests.support.fleet_harness import FleetProbe, Harness, make_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CAP = 4
LEASE_TTL_S = 3
LONG_TOKENS = 400  # the fleet's long_prompt_tokens and the simulator's --long-threshold
MAX_LONG = 1
# KV budget (pool x overcommit 1.0, 1,072-token blocks): four jobs of thinking budget 2,000 fit
# (3 blocks each), only two of thinking budget 8,000 (8 blocks each).
KV_POOL_TOKENS = 20_000
SIM_ARGS = ["--think-min-tokens", "100", "--think-max-tokens", "300",
            "--answer-min-tokens", "10", "--answer-max-tokens", "40",
            "--long-threshold", str(LONG_TOKENS)]


METRICS_PORT = free_port()  # dispatcher-0's Prometheus endpoint (the others have none)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    config = make_config(
        tmp_path_factory.mktemp("fleet-invariants"),
        backend={"max_num_seqs": CAP, "long_prompt_tokens": LONG_TOKENS, "max_long": MAX_LONG,
                 "kv_pool_tokens": KV_POOL_TOKENS},
        admission={"lease_ttl_s": LEASE_TTL_S, "kv_overcommit": 1.0, "metrics_port": METRICS_PORT},
        timeouts={"idle_s": 4},
        retry={"backoff_base_s": 0.2, "backoff_max_s": 0.5},
    )
    with Harness(config, sim_speed=100, sim_args=SIM_ARGS, workers=2, dispatchers=2) as harness:
        yield harness


@pytest.fixture
def probe(fleet: Harness) -> FleetProbe:
    return FleetProbe(fleet)


def ask(project: str, text: str, thinking_budget: int = 2000) -> dict:
    return {"project": project, "messages": [{"role": "user", "content": text}],
            "thinking_budget": thinking_budget, "content_reserve": 256}


def long_text(n: int) -> str:
    """About 750 tokens of distinct sentences (above LONG_TOKENS)."""
    return " ".join(f"Ledger {n} line {i} records {i * 37 % 101} crates of pears shipped north."
                    for i in range(60))


def test_cap_holds_and_every_job_ends_exactly_once(fleet: Harness, probe: FleetProbe) -> None:
    probe.sim_reset()
    admitted_before = probe.snapshot().admissions
    projects = sorted(fleet.settings.projects)
    ids = [fleet.client.submit(ask(projects[n % len(projects)],
                                   f"job {n}: [sim:think=1000] [sim:answer=20]"))
           for n in range(40)]
    envelopes = {job_id: fleet.client.result(job_id, timeout=120) for job_id in ids}

    assert {job_id: env.code if env else None for job_id, env in envelopes.items()} == \
        dict.fromkeys(ids, Code.OK)
    stats = probe.sim_stats()
    # The backend's own count: never over-full, and jobs did run side by side. (Whether the cap is
    # reached exactly depends on how fast a loaded machine submits; that is a benchmark's question.)
    assert 2 <= stats["max_running_seen"] <= CAP
    assert stats["total_requests"] == 40 and stats["running"] == 0
    # One request per job, one admission per job, one envelope per job.
    request_ids = Counter(b["request_id"] for b in probe.sim_requests())
    assert request_ids == Counter({f"{job_id}-1": 1 for job_id in ids})
    snap = probe.snapshot()
    assert snap.admissions - admitted_before == 40
    assert snap.in_flight == 0 and snap.reserved_kv_tokens == 0
    counts = probe.envelope_counts()
    assert {job_id: counts[job_id] for job_id in ids} == dict.fromkeys(ids, 1)
    assert fleet.fleet.check() == []


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        sample, _, rest = key.partition("{")
        found = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if sample == name and found == wanted:
            return float(value)
    raise AssertionError(f"no sample {name}{{{wanted}}} in /metrics")


def test_dispatcher_metrics_show_the_whole_fleet(fleet: Harness, probe: FleetProbe) -> None:
    """Run after the 40 jobs above: the gauges read the shared store, so one dispatcher's
    /metrics shows what both admitted; its queue-wait histogram counts its own admissions."""
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    snap = probe.snapshot()
    assert metric(text, "fleet_dispatch_admissions_total") == snap.admissions >= 40
    assert metric(text, "fleet_dispatch_in_flight") == 0
    assert metric(text, "fleet_dispatch_reserved_kv_tokens") == 0
    waits = sum(metric(text, "fleet_dispatch_queue_wait_seconds_count", project=p)
                for p in fleet.settings.projects
                if f'fleet_dispatch_queue_wait_seconds_count{{project="{p}"}}' in text)
    assert 0 < waits <= snap.admissions
    assert metric(text, "fleet_results_total", project="reports", code="OK") >= 8


def test_a_flood_does_not_starve_a_small_project_or_the_interactive_band(
        fleet: Harness, probe: FleetProbe) -> None:
    """While four stalled jobs hold every slot, 30 batch jobs of one project queue up, then
    three jobs of another project and one interactive job of the flooding project. When the
    slots free, FIFO would serve the late four 31st to 34th; fair queuing and the band serve
    them among the first."""
    probe.sim_reset()
    blockers = [fleet.client.submit(ask("research", f"blocker {n}: [sim:stall=1000000]"))
                for n in range(CAP)]
    wait_until(lambda: probe.sim_stats()["running"] == CAP, 60, "the blockers to hold every slot")
    flood = [fleet.client.submit(ask("reports", f"flood {n}: [sim:think=300] [sim:answer=10]"))
             for n in range(30)]
    small = [fleet.client.submit(ask("triage", f"small {n}: [sim:think=300] [sim:answer=10]"))
             for n in range(3)]
    urgent = fleet.client.submit(ask("reports", "urgent: [sim:think=300] [sim:answer=10]")
                                 | {"band": "interactive"})
    late = [*small, urgent]
    wait_until(lambda: all(probe.state(j) == "pending" for j in [*flood, *late]), 60,
               "every job to wait for a slot")
    for job_id in blockers:
        fleet.client.cancel(job_id)
    envelopes = [fleet.client.result(j, timeout=120) for j in [*blockers, *flood, *late]]
    assert [e.code if e else None for e in envelopes] == [Code.E_CANCELLED] * CAP + [Code.OK] * 34
    order = [b["request_id"].rsplit("-", 1)[0] for b in probe.sim_requests()]
    order = [j for j in order if j not in blockers]
    assert sorted(order) == sorted([*flood, *late])
    # Counted at the backend: how many jobs were served before each of the late ones.
    served_before = {j: order.index(j) for j in late}
    assert served_before[urgent] < CAP, served_before
    assert max(served_before.values()) < 12, served_before


def test_long_prompts_never_exceed_max_long(fleet: Harness, probe: FleetProbe) -> None:
    probe.sim_reset()
    projects = sorted(fleet.settings.projects)
    long_ids = [fleet.client.submit(ask(projects[n], f"{long_text(n)} [sim:think=800] [sim:answer=10]"))
                for n in range(4)]
    short_ids = [fleet.client.submit(ask(projects[n % 5], f"short {n} [sim:think=300] [sim:answer=10]"))
                 for n in range(12)]
    envelopes = {j: fleet.client.result(j, timeout=120) for j in long_ids + short_ids}
    assert {j: e.code if e else None for j, e in envelopes.items()} == \
        dict.fromkeys(long_ids + short_ids, Code.OK)
    assert all(envelopes[j].usage.prompt_tokens > LONG_TOKENS for j in long_ids)
    assert all(envelopes[j].usage.prompt_tokens < LONG_TOKENS for j in short_ids)
    stats = probe.sim_stats()
    # The simulator's own count of long prompts running at once, and of all requests.
    assert stats["max_long_running_seen"] == MAX_LONG
    assert stats["max_running_seen"] <= CAP
    snap = probe.snapshot()
    assert snap.long_in_flight == 0 and snap.in_flight == 0


def test_kv_budget_bounds_concurrency(fleet: Harness, probe: FleetProbe) -> None:
    probe.sim_reset()
    ids = [fleet.client.submit(ask(p, f"big budget {p} {n} [sim:think=1500] [sim:answer=10]",
                                   thinking_budget=8000))
           for n in range(2) for p in ("reports", "triage", "research")]
    envelopes = [fleet.client.result(j, timeout=120) for j in ids]
    assert [e.code if e else None for e in envelopes] == [Code.OK] * len(ids)
    assert [b["max_completion_tokens"] for b in probe.sim_requests()] == [8256] * len(ids)
    # 8 blocks of 1,072 tokens each: two fit the 20,000-token budget, a third does not.
    assert probe.sim_stats()["max_running_seen"] == 2
    snap = probe.snapshot()
    assert snap.reserved_kv_tokens == 0 and snap.holds.get("kv", 0) > 0


def _active_infer_jobs(probe: FleetProbe) -> dict[int, set[str]]:
    """Worker index -> job ids of the fleet.infer tasks it is running (Celery remote control;
    a worker shows a task's arguments as "project=<project> job=<id>", fleet/worker/app.py)."""
    found: dict[int, set[str]] = {}
    for hostname, tasks in (probe.active_tasks() or {}).items():
        index = int(hostname.split("@")[0].split("-")[1])  # fleet-<n>-<pid>@host
        found[index] = {t["kwargs"].split(" job=", 1)[1] for t in tasks if t["name"] == INFER_TASK}
    return found


def test_kill_9_of_a_streaming_worker_loses_nothing(fleet: Harness, probe: FleetProbe) -> None:
    probe.sim_reset()
    admitted_before = probe.snapshot().admissions
    ids = [fleet.client.submit(ask(p, f"crash {p}: [sim:stall=1000000/1] [sim:think=400] "
                                      "[sim:answer=20]"))
           for p in ("reports", "triage", "research", "translate")]
    wait_until(lambda: probe.sim_stats()["running"] == CAP, 60, "every job streaming")
    active = wait_until(
        lambda: (found := _active_infer_jobs(probe)) and sum(map(len, found.values())) == CAP
        and found, 60, "the workers to report their streams")
    victim_index, victim_jobs = max(active.items(), key=lambda item: len(item[1]))
    assert victim_jobs, active
    victim = next(p for name, p in fleet.fleet.children if name == f"worker-{victim_index}")
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    fleet.fleet.spawn("worker-9", ["worker", "--concurrency", "40", "--hostname",
                                   f"fleet-9-{os.getpid()}@%h", "--log-level", "WARNING"])

    envelopes = {job_id: fleet.client.result(job_id, timeout=120) for job_id in ids}
    assert {job_id: env.code if env else None for job_id, env in envelopes.items()} == \
        dict.fromkeys(ids, Code.OK)
    counts = probe.envelope_counts()
    assert {job_id: counts[job_id] for job_id in ids} == dict.fromkeys(ids, 1)
    for job_id in ids:
        request_ids = [b["request_id"] for b in probe.sim_requests(job_id)]
        if job_id in victim_jobs:
            # The killed stream, then the re-admitted job's attempt (today the killed one leaves
            # no record, so its number is 1 again).
            assert len(request_ids) == 2 and request_ids[0] == f"{job_id}-1", job_id
            assert envelopes[job_id].attempts[-1].code == Code.OK
        else:
            # Stalled stream cut by the idle timeout, then the retry.
            assert request_ids == [f"{job_id}-1", f"{job_id}-2"], job_id
            assert [a.code for a in envelopes[job_id].attempts] == [Code.E_STREAM_STALLED, Code.OK]
    # No capacity leak: every lease is gone, the killed ones included.
    snap = probe.snapshot()
    # Every model turn is an admission: the first ones, the killed jobs' again after their
    # leases expired, and the stalled jobs' retries (continuations re-enter admission).
    assert snap.admissions - admitted_before == len(ids) + len(victim_jobs) + (len(ids) - len(victim_jobs))
    assert snap.in_flight == 0 and snap.reserved_kv_tokens == 0
    assert probe.sim_stats()["running"] == 0
    queues = probe.cli("queues")
    assert queues.returncode == 0, queues.stderr
    assert f"in flight 0/{CAP}" in queues.stdout
    assert set(probe.live_workers()) == {f"worker-{1 - victim_index}", "worker-9"}


def test_kill_9_of_a_dispatcher_mid_burst(fleet: Harness, probe: FleetProbe) -> None:
    probe.sim_reset()
    admitted_before = probe.snapshot().admissions
    projects = sorted(fleet.settings.projects)
    ids = [fleet.client.submit(ask(projects[n % 5], f"burst {n}: [sim:think=800] [sim:answer=10]"))
           for n in range(20)]
    wait_until(lambda: probe.snapshot().admissions - admitted_before >= CAP, 60, "the burst to start")
    victim = next(p for name, p in fleet.fleet.children if name == "dispatcher-0")
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)

    envelopes = {j: fleet.client.result(j, timeout=120) for j in ids}
    assert {j: e.code if e else None for j, e in envelopes.items()} == dict.fromkeys(ids, Code.OK)
    counts = probe.envelope_counts()
    assert {j: counts[j] for j in ids} == dict.fromkeys(ids, 1)
    stats = probe.sim_stats()
    assert stats["max_running_seen"] <= CAP and stats["running"] == 0
    snap = probe.snapshot()
    assert snap.in_flight == 0 and snap.reserved_kv_tokens == 0
    # A grant whose task the killed dispatcher never sent is admitted once more after its
    # lease expires; nothing else is admitted twice.
    assert snap.admissions - admitted_before >= len(ids)
    assert all(len(probe.sim_requests(j)) == 1 for j in ids)
