"""The fairness scenario: one project submits 10x the others, every project backlogged from the
start. Figures: each project's token share against its weight while all five are backlogged,
Jain's index, and a small project's p95 wait with the big project against the same run without
it, beside what exact weighted fair share prescribes for the same jobs (``fluid_wait``)."""

from __future__ import annotations

import random
from collections import defaultdict

from fleet.bench.charts import Charts
from fleet.bench.fleet.harness import FleetBench, FleetRun, by_project, codes
from fleet.bench.fleet.render import Row, fmt, pct, verdict
from fleet.bench.fleet.sampler import Sampler
from fleet.bench.fleet.workload import PROJECTS, Spec
from fleet.bench.measure import jain
from fleet.core.models import Envelope

FAIR_THINK = {"assistant": 160, "reports": 320, "translate": 240, "triage": 200, "research": 280}


def fluid_wait(costs: dict[str, list[float]], weights: dict[str, float], project: str, q: float) -> float:
    """Backend tokens served before ``project``'s ``q``-quantile job starts (the job at index
    ``int(q * n)`` of its ``n``: the model needs a whole job, so it takes the nearest rank at or
    above the quantile rather than interpolating) under exact weighted fair share (fluid
    start-time fair queuing), every project backlogged from the start with ``costs`` (its jobs'
    costs, in its order).

    All backlogged projects advance in virtual time together; reaching virtual time v takes
    sum over p of min(W_p, w_p * v) tokens (W_p: p's whole work), and the job starts at v = the
    project's earlier jobs' cost / its weight. The ratio of two such waits (with and without a
    big project) is what the policy itself prescribes, before job sizes and slots add their own."""
    own = costs[project]
    start = sum(own[: min(len(own) - 1, int(q * len(own)))]) / weights[project]
    return sum(min(sum(c), weights[p] * start) for p, c in costs.items())


def fairness(fb: FleetBench, n: int, heavy: str = "research", small: str = "triage",
             charts: Charts | None = None) -> list[Row]:
    samplers: list[Sampler] = []
    weights = {p: fb.settings.projects[p].weight for p in PROJECTS}
    heavy_specs, others = _fair_specs(n, heavy)
    run, ids = fb.run_fleet(heavy_specs + others, None, samplers)
    run0, ids0 = fb.run_fleet([s for s in others], None, samplers)
    if charts is not None:
        charts.weights = weights
        for e in sorted(run.envelopes, key=FleetRun.admitted_at):
            charts.shares.setdefault(e.project, []).append(
                (FleetRun.admitted_at(e) - run.start, _job_cost(e, ids[e.job_id])))
    sc = f"fairness ({heavy} submits {10 * n} first, the others {n} each)"
    return _share_rows(sc, run, ids, weights) + _wait_rows(sc, (run, run0), ids, weights, heavy, small)


def _fair_specs(n: int, heavy: str) -> tuple[list[Spec], list[Spec]]:
    """``10 * n`` jobs of ``heavy``, and ``n`` of each other project interleaved (seeded lengths)."""
    rng = random.Random(3)

    def specs_for(project: str, count: int) -> list[Spec]:
        return [
            Spec(project, int(FAIR_THINK[project] * rng.uniform(0.8, 1.2)), 40, tag=f"{project}{i}")
            for i in range(count)
        ]

    heavy_specs = specs_for(heavy, 10 * n)
    others = [s for group in zip(*(specs_for(p, n) for p in PROJECTS if p != heavy), strict=True) for s in group]
    return heavy_specs, others


def _job_cost(e: Envelope, spec: Spec) -> float:
    return e.usage.prompt_tokens + spec.thinking_budget + spec.content_reserve


def _share_rows(sc: str, run: FleetRun, ids: dict[str, Spec], weights: dict[str, float]) -> list[Row]:
    """The run's codes, the window with all five backlogged, and the token shares in it."""
    # Shares while every project is backlogged: up to the first project's last admission.
    groups = by_project(run.envelopes)
    end = min(max(FleetRun.admitted_at(e) for e in es) for es in groups.values())
    cost: dict[str, float] = defaultdict(float)
    for e in run.envelopes:
        if FleetRun.admitted_at(e) < end:
            cost[e.project] += _job_cost(e, ids[e.job_id])
    total_cost, total_weight = sum(cost.values()), sum(weights.values())
    normalised = {p: (cost[p] / total_cost) / (weights[p] / total_weight) for p in PROJECTS}
    worst = max(normalised, key=lambda p: abs(normalised[p] - 1))
    j = jain(list(normalised.values()))
    rows: list[Row] = [
        (
            sc,
            "jobs finished / codes",
            f"{len(run.envelopes)} / {codes(run.envelopes)}",
            "all OK",
            verdict(run.missing == 0 and all(e.ok for e in run.envelopes)),
        ),
        (
            sc,
            "window with all five backlogged (s, admissions)",
            f"{fmt(end - run.first_admit)} s, {sum(FleetRun.admitted_at(e) < end for e in run.envelopes)}",
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
                f"{fmt(100 * share, 1)}% vs {fmt(100 * weights[p] / total_weight, 1)}% -> {fmt(normalised[p], 3)}",
                "within 5% of weight",
                verdict(abs(normalised[p] - 1) <= 0.05, f"{fmt(100 * (normalised[p] - 1), 1)}%"),
            )
        )
    rows += [
        (sc, "Jain's index on weight-normalised shares", fmt(j, 4), ">= 0.98", verdict(j >= 0.98)),
        (sc, f"worst share error ({worst})", f"{fmt(100 * (normalised[worst] - 1), 1)}%", "<= 5%", ""),
    ]
    return rows


def _wait_rows(sc: str, runs: tuple[FleetRun, FleetRun], ids: dict[str, Spec], weights: dict[str, float],
               heavy: str, small: str) -> list[Row]:
    """The small project's p95 wait with the heavy one / without, and the fluid model's ratio."""
    run, run0 = runs

    def wait_p95(r: FleetRun, project: str) -> float:
        return pct([FleetRun.admitted_at(e) - r.start for e in r.envelopes if e.project == project], 95)

    w, w0 = wait_p95(run, small), wait_p95(run0, small)
    job_costs: dict[str, list[float]] = defaultdict(list)
    for e in sorted(run.envelopes, key=FleetRun.submitted_at):
        job_costs[e.project].append(_job_cost(e, ids[e.job_id]))
    without = {p: c for p, c in job_costs.items() if p != heavy}
    fluid = fluid_wait(job_costs, weights, small, 0.95) / fluid_wait(without, weights, small, 0.95)
    return [
        (
            sc,
            f"{small} p95 wait (dispatcher start -> admitted) with {heavy} / without",
            f"{fmt(w)} / {fmt(w0)} s = {fmt(w / w0)}x",
            "<= 1.2x",
            verdict(w / w0 <= 1.2, f"{fmt(w / w0)}x"),
        ),
        (sc, "the same ratio under exact weighted fair share (fluid model, these jobs' costs)",
         f"{fmt(fluid)}x", "", ""),
    ]
