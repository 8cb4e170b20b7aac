"""The saturation scenario: N short jobs through the fleet, then the same jobs from the ideal
closed loop of ``cap`` streams and from five independent clients x 16, both straight at the
simulator. Figures: mean in-flight / cap over the busy period, the simulator's peaks, output
tokens per second against the ideal loop's, latencies and CPU."""

from __future__ import annotations

from typing import Any

from fleet.bench.charts import Charts
from fleet.bench.fleet.direct import DirectRecord, direct_latencies
from fleet.bench.fleet.harness import FleetBench, FleetRun, codes, fleet_latencies
from fleet.bench.fleet.render import Row, cpu_cell, fmt, latency_cell, verdict
from fleet.bench.fleet.sampler import Sampler, stats_max
from fleet.bench.fleet.workload import PROJECTS, Spec, short_mix

BASELINE = "baseline: saturation, 5 clients x 16"


def saturation(fb: FleetBench, n: int, think: int, answer: int, charts: Charts | None = None) -> list[Row]:
    cap, samplers = fb.cap, []  # type: ignore[var-annotated]
    specs = short_mix(n, think, answer)
    run, ids = fb.run_fleet(specs, None, samplers)
    prep = fb.prep_figures
    fleet_w = samplers[-1].window(run.first_admit, run.last_admit, cap)
    fleet_max = stats_max(samplers[-1])
    records, start, last_sent, end, cpu_i = fb.run_direct({"ideal": (cap, specs)}, None, samplers)
    ideal_w = samplers[-1].window(start, last_sent, cap)
    baseline = _baseline_rows(fb, specs, samplers, charts)
    if charts is not None:
        charts.cap = cap
        # from the fleet's first admission, as the direct runs count from their first request
        charts.inflight["fleet"] = _series(samplers[0].samples, run.first_admit)
        charts.inflight["ideal closed loop"] = _series(samplers[1].samples, start)
        charts.latencies["fleet"] = [FleetRun.finished_at(e) - run.first_admit for e in run.envelopes]
        charts.latencies["ideal closed loop"] = direct_latencies(records, start)["e2e"]
    sc = f"saturation ({n} short jobs)"
    return [
            *_fleet_rows(sc, n, cap, run, fleet_w, ideal_w, fleet_max, prep),
            *_versus_ideal_rows(sc, run, ids, fleet_w, ideal_w, (records, start, cpu_i)),
            *baseline,
    ]


def _fleet_rows(sc: str, n: int, cap: int, run: FleetRun, fleet_w: dict[str, float], ideal_w: dict[str, float],
                fleet_max: dict[str, Any], prep: tuple[int, float, float]) -> list[Row]:
    return [
        (
            sc,
            "jobs finished / codes",
            f"{len(run.envelopes)} / {codes(run.envelopes)}",
            f"{n} OK",
            verdict(run.missing == 0 and all(e.ok for e in run.envelopes)),
        ),
        (sc, "busy period (first..last admission) s", fmt(run.last_admit - run.first_admit), "", ""),
        (
            sc,
            "mean in-flight / cap, busy period (sim running_seconds)",
            fmt(fleet_w["mean in-flight / cap"], 3),
            ">= 0.97",
            verdict(fleet_w["mean in-flight / cap"] >= 0.97, f"{fmt(fleet_w['mean in-flight / cap'], 3)}"),
        ),
        (sc, "ideal closed loop: mean in-flight / cap", fmt(ideal_w["mean in-flight / cap"], 3), "", ""),
        (
            sc,
            "max in-flight at the backend (sim max_running_seen)",
            str(fleet_max["max_running_seen"]),
            f"<= {cap}",
            verdict(fleet_max["max_running_seen"] <= cap),
        ),
        (
            sc,
            "sim max_waiting_seen (fleet)",
            str(fleet_max["max_waiting_seen"]),
            "<= 1 (the sim counts every arrival once before admitting it)",
            verdict(fleet_max["max_waiting_seen"] <= 1),
        ),
        (
            sc,
            "submit / all prepared and pending (before the dispatcher starts)",
            f"{prep[0]} jobs: submitted in {fmt(prep[1])} s, pending after {fmt(prep[2])} s "
            f"({fmt(prep[0] / prep[2], 0)} jobs/s)",
            "",
            "",
        ),
    ]


def _versus_ideal_rows(sc: str, run: FleetRun, ids: dict[str, Spec], fleet_w: dict[str, float],
                       ideal_w: dict[str, float], ideal: tuple[list[DirectRecord], float, dict]) -> list[Row]:
    records, start, cpu_i = ideal
    ratio = fleet_w["output tok/s"] / ideal_w["output tok/s"]
    return [
        (
            sc,
            "output tok/s fleet / ideal closed loop",
            f"{fmt(fleet_w['output tok/s'], 0)} / {fmt(ideal_w['output tok/s'], 0)} = {fmt(ratio, 3)}",
            ">= 0.97",
            verdict(ratio >= 0.97, f"{fmt(100 * (1 - ratio), 1)}% below ideal"),
        ),
        (sc, "latency fleet", latency_cell(fleet_latencies(run, ids)), "", ""),
        (sc, "latency ideal closed loop", latency_cell(direct_latencies(records, start)), "", ""),
        (sc, "CPU during fleet run", cpu_cell(run.cpu), "", ""),
        (sc, "CPU during ideal run", cpu_cell(cpu_i), "", ""),
    ]


def _series(samples: list[dict[str, Any]], start: float) -> list[tuple[float, int, int | None]]:
    return [(s["t"] - start, int(s["running"]), s.get("leases"))
            for s in samples if s["t"] >= start and "running" in s]


def _baseline_rows(fb: FleetBench, specs: list[Spec], samplers: list[Sampler],
                   charts: Charts | None = None) -> list[Row]:
    """Five independent clients x 16 straight at the simulator, the same jobs."""
    cap = fb.cap
    groups = {p: (16, [s for s in specs if s.project == p]) for p in PROJECTS}
    b_records, b_start, b_last, b_end, cpu_b = fb.run_direct(groups, None, samplers)
    if charts is not None:
        charts.inflight["5 clients x 16"] = _series(samplers[-1].samples, b_start)
        charts.latencies["5 clients x 16"] = direct_latencies(b_records, b_start)["e2e"]
    base_w = samplers[-1].window(b_start, b_last, cap)
    base_all = samplers[-1].window(b_start, b_end, cap)
    base_max = stats_max(samplers[-1])
    return [
        (
            BASELINE,
            "sim max_running / max_waiting_seen",
            f"{base_max['max_running_seen']} / {base_max['max_waiting_seen']}",
            "",
            "",
        ),
        (
            BASELINE,
            "mean / max waiting in vLLM's queue (whole run)",
            f"{fmt(base_all['mean waiting'], 1)} / {base_all['max waiting']}",
            "",
            "",
        ),
        (BASELINE, "output tok/s", fmt(base_w["output tok/s"], 0), "", ""),
        (BASELINE, "latency", latency_cell(direct_latencies(b_records, b_start)), "", ""),
        (BASELINE, "CPU", cpu_cell(cpu_b), "", ""),
    ]
