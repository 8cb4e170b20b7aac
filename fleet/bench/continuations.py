"""``fleet bench continuations``: what re-entering admission between model turns buys, every
figure next to its baseline measured in the same run (one fleet: ``fleet sim``, Celery workers, a
dispatcher per phase; fleet/bench/fleet/harness.py's FleetBench).

Scenarios:
  retries  N short jobs, a backlog at cap; 20% of them fail twice with 503 before succeeding
           (``[sim:http503/2]``). Baseline: the same jobs without faults. Figures: mean in-flight
           / cap over the busy period (the simulator's own time integral), and the slot-seconds
           held while no sequence ran (the integral of the store's leases minus the simulator's
           running count, sampled every 50 ms): with retries inside the lease every backoff
           second would add a slot-second; the baseline shows the admission overhead alone.
  fair3    five projects backlogged, one of them (``reports``) needs 3 attempts for every job
           (2 x 503 first). Every attempt is an admission charged to its project: its token share
           (all attempts counted, prompt + max tokens per admission, while all five were
           backlogged) against its weight's share.
  tools    K jobs of a 3-round tool loop (``[sim:tool=bench_sleep/3]``) whose tool sleeps 2 s
           (fleet/bench/tooltasks.py). Figures: slot-seconds held while no sequence ran (0: the
           slot is given up during each tool run), the simulator's running count the tool saw,
           and job latency / (model time + tool time).

The machine is whatever runs it; on a shared 2-core host the absolute times move, the ratios
within one run much less.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

from fleet.bench.fleet.harness import FleetBench, codes
from fleet.bench.fleet.render import Row, fmt, verdict
from fleet.bench.fleet.sampler import Sampler
from fleet.bench.fleet.workload import PROJECTS, Spec, short_mix
from fleet.local.processes import TOOL_PROCESSES

SCENARIOS = ("retries", "fair3", "tools")
TOOL = {"type": "function", "function": {"name": "bench_sleep", "parameters": {"type": "object"}}}


def configure(data: dict[str, Any]) -> None:
    """The bench fleet's config: the assistant project runs the sleeping tool; short backoffs."""
    data["tool_imports"] = ["fleet.bench.tooltasks"]
    data.setdefault("retry", {}).update(backoff_base_s=0.5, backoff_max_s=2.0)
    assistant = data["projects"]["assistant"]
    assistant["allowed_tools"] = [*assistant.get("allowed_tools", []), "bench_sleep"]
    assistant.update(tools="run", tool_registry={"bench_sleep": {
        "task": "fleet.bench.sleep_tool", "timeout_s": 60, "untrusted": False}})


def idle_slot_seconds(sampler: Sampler, t0: float, t1: float) -> float:
    """Integral of (leases - sequences the simulator runs)+ over [t0, t1]: slots held idle."""
    inside = sampler.between(t0, t1)
    total = 0.0
    for a, b in zip(inside, inside[1:], strict=False):
        total += max(0, a.get("leases", 0) - a["running"]) * (b["t"] - a["t"])
    return total


def backlog_end(sampler: Sampler, start: float) -> float:
    """The last sample with jobs pending at the dispatcher: the backlog lasted until then (a job
    waiting out its backoff is not pending; the tail of a run without a backlog is not counted)."""
    return max((s["t"] for s in sampler.samples if s["t"] >= start and s.get("pending", 0) > 0),
               default=start)


def retries(fb: FleetBench, n: int, think: int, answer: int) -> list[Row]:
    samplers: list[Sampler] = []
    rng = random.Random(11)
    base = short_mix(n, think, answer)
    faulty = set(rng.sample(range(n), n // 5))
    specs = [Spec(s.project, s.think, s.answer, tag=s.tag + "r",
                  extra="[sim:http503/2]" if i in faulty else "") for i, s in enumerate(base)]
    run, _ids = fb.run_fleet(specs, None, samplers)
    end = backlog_end(samplers[-1], run.first_admit)
    w = samplers[-1].window(run.first_admit, end, fb.cap)
    idle = idle_slot_seconds(samplers[-1], run.first_admit, run.end)
    run0, _ = fb.run_fleet(base, None, samplers)
    end0 = backlog_end(samplers[-1], run0.first_admit)
    w0 = samplers[-1].window(run0.first_admit, end0, fb.cap)
    idle0 = idle_slot_seconds(samplers[-1], run0.first_admit, run0.end)
    failed = sum(1 for e in run.envelopes for a in e.attempts if not a.code.ok)
    backoff = sum(b.started_at - (a.started_at + a.duration_s) for e in run.envelopes
                  for a, b in zip(e.attempts, e.attempts[1:], strict=False))
    sc = f"retries ({n} jobs, {len(faulty)} fail twice with 503)"
    ratio = w["mean in-flight / cap"] / w0["mean in-flight / cap"]
    return [
        (sc, "jobs finished / codes", f"{len(run.envelopes)} / {codes(run.envelopes)}", f"{n} OK",
         verdict(run.missing == 0 and all(e.ok for e in run.envelopes))),
        (sc, "failed attempts / time between a job's attempts (s, summed)",
         f"{failed} / {fmt(backoff, 1)}", f"{2 * len(faulty)} / -", ""),
        (sc, "backlog (first admission .. last sample with jobs pending), s: faults / baseline",
         f"{fmt(end - run.first_admit)} / {fmt(end0 - run0.first_admit)}", "", ""),
        (sc, "mean in-flight / cap under the backlog: with faults / baseline without",
         f"{fmt(w['mean in-flight / cap'], 3)} / {fmt(w0['mean in-flight / cap'], 3)} = {fmt(ratio, 3)}",
         ">= 0.97", verdict(w["mean in-flight / cap"] >= 0.97, fmt(w["mean in-flight / cap"], 3))),
        (sc, "slot-seconds held with no sequence running, whole run: with faults / baseline",
         f"{fmt(idle, 1)} / {fmt(idle0, 1)}; retries in the lease would add the {fmt(backoff, 1)} s "
         "of backoff", "extra << the backoff (it waits outside)",
         verdict(idle - idle0 <= 0.2 * backoff,
                  f"{fmt(idle - idle0, 1)} s more = {fmt((idle - idle0) / max(failed, 1), 3)} s per failed attempt")),
    ]


def fair3(fb: FleetBench, n: int, heavy: str = "reports") -> list[Row]:
    samplers: list[Sampler] = []
    weights = {p: fb.settings.projects[p].weight for p in PROJECTS}
    rng = random.Random(5)
    specs = [Spec(p, int(150 * rng.uniform(0.8, 1.2)), 40, tag=f"f{p}{i}",
                  extra="[sim:http503/2]" if p == heavy else "")
             for i in range(n) for p in PROJECTS]
    run, ids = fb.run_fleet(specs, None, samplers)
    starts: dict[str, list[float]] = defaultdict(list)
    for e in run.envelopes:
        starts[e.project] += [a.started_at for a in e.attempts]
    end = min(max(s) for s in starts.values())
    cost: dict[str, float] = defaultdict(float)
    attempts: dict[str, int] = defaultdict(int)
    for e in run.envelopes:
        prompt = max(a.usage.prompt_tokens for a in e.attempts)
        for a in e.attempts:
            if a.started_at < end:
                cost[e.project] += prompt + (a.max_tokens or 0)
                attempts[e.project] += 1
    total, total_w = sum(cost.values()), sum(weights.values())
    sc = f"fair3 (five projects x {n}; every {heavy} job needs 3 attempts)"
    rows: list[Row] = [
        (sc, "jobs finished / codes", f"{len(run.envelopes)} / {codes(run.envelopes)}",
         f"{len(specs)} OK", verdict(run.missing == 0 and all(e.ok for e in run.envelopes))),
        (sc, "window with all five backlogged (s)", fmt(end - run.first_admit), "", ""),
    ]
    for p in PROJECTS:
        share, want = cost[p] / total, weights[p] / total_w
        target = "within 5% of weight" if p == heavy else ""
        outcome = verdict(abs(share / want - 1) <= 0.05, f"{fmt(100 * (share / want - 1), 1)}%")
        rows.append((sc, f"token share {p} (weight {weights[p]:g}), {attempts[p]} admissions",
                     f"{fmt(100 * share, 1)}% vs {fmt(100 * want, 1)}% -> {fmt(share / want, 3)}",
                     target, outcome if p == heavy else ""))
    return rows


def tools(fb: FleetBench, k: int) -> list[Row]:
    samplers: list[Sampler] = []
    specs = [Spec("assistant", 150, 40, tag=f"t{i}", extra="[sim:tool=bench_sleep/3]")
             for i in range(k)]
    run, _ids = fb.run_fleet(specs, None, samplers, job_extra={"tools": [TOOL], "tool_choice": "auto"})
    idle = idle_slot_seconds(samplers[-1], run.start, run.end)
    leased = sum(a.get("leases", 0) * (b["t"] - a["t"]) for a, b in
                 zip(samplers[-1].samples, samplers[-1].samples[1:], strict=False))
    rounds = [r for e in run.envelopes for r in e.tool_rounds]
    results = [c["result"] for r in rounds for c in r["calls"] if c.get("result")]
    tool_s = [r["duration_s"] for r in results]
    inside = [s for r in results
              for s in samplers[-1].between(r["started_at"], r["started_at"] + r["duration_s"])]
    held = sum(1 for s in inside if s.get("leases", 0) > 0)
    seen = sorted({int(str(c["result"].get("content", "")).count('"sim_running_after": 0') > 0)
                   for r in rounds for c in r["calls"] if c.get("result")})
    ratios = []
    for e in run.envelopes:
        model = sum(a.duration_s for a in e.attempts)
        tool = sum(c["result"]["duration_s"] for r in e.tool_rounds for c in r["calls"] if c.get("result"))
        # from its first admission (the bench starts the dispatcher once every job is prepared)
        ratios.append(((e.timings.total_s or 0.0) - (e.timings.queued_s or 0.0)) / (model + tool))
    sc = f"tools ({k} jobs x 3 rounds, a {fmt(max(tool_s, default=0), 1)} s tool)"
    return [
        (sc, "jobs finished / codes / rounds", f"{len(run.envelopes)} / {codes(run.envelopes)} / "
         f"{len(rounds)}", f"{k} OK / {3 * k}", verdict(run.missing == 0 and len(rounds) == 3 * k
                                                       and all(e.ok for e in run.envelopes))),
        (sc, "samples (every 50 ms) during the tool runs with a slot held",
         f"{held} of {len(inside)} ({fmt(sum(tool_s), 1)} s of tool runs)",
         "0: slot-seconds in tool execution = 0", verdict(held == 0 and len(inside) > 0, str(held))),
        (sc, "slot-seconds held with no sequence running / all slot-seconds, whole run",
         f"{fmt(idle, 2)} / {fmt(leased, 2)}", "admission overhead of the 4 turns only", ""),
        (sc, "tool runs that saw the simulator idle (jobs at once: k)",
         "all" if seen == [1] else "not all", "all when k = 1", ""),
        (sc, "job latency from first admission / (model time + tool time), mean and max",
         f"{fmt(sum(ratios) / len(ratios), 2)} / {fmt(max(ratios), 2)}", "~1 (admission overhead only)",
         ""),
    ]


def continuation_bench(redis_url: str, speed: float = 5.0, jobs: int = 300, think: int = 200,
                       answer: int = 50, fair_n: int = 40, tool_jobs: int = 1,
                       only: tuple[str, ...] = SCENARIOS) -> list[Row]:
    rows: list[Row] = []
    with FleetBench(redis_url, speed, configure=configure) as fb:
        rows.append(("setup", "fleet", f"sim --speed {speed:g}, 2 Celery workers, 1 tool worker "
                     f"(prefork, {TOOL_PROCESSES} processes), 1 dispatcher, cap {fb.cap}, "
                     f"backoff U(0, 0.5 s x 2^n) up to 2 s", "", ""))
        for name in only:
            if name == "retries":
                rows += retries(fb, jobs, think, answer)
            elif name == "fair3":
                rows += fair3(fb, fair_n)
            elif name == "tools":
                rows += tools(fb, tool_jobs)
    return rows

