"""The long-prompt scenario: 10% of the jobs carry a real ~60K-token prompt. Figures: long
requests in flight at the backend against ``max_long``, the short jobs' p95 with and without the
long ones, for the settings as given, the rule before when the server takes several long
prefills at once, and a paced prefill bucket; then the same jobs from a 32-thread FIFO and from
five clients x 16 straight at the simulator. Every job is interactive: quiet windows protect
interactive work only (one band keeps the fair order of the runs before; batch work alone and
the bands side by side are the mix scenario, fleet/bench/fleet/mix.py); admission.short_job_s is
the short jobs' service p50 in the run without long ones, as there."""

from __future__ import annotations

from dataclasses import replace

from fleet.bench.fleet.direct import direct_latencies
from fleet.bench.fleet.harness import FleetBench, FleetRun, codes, fleet_latencies
from fleet.bench.fleet.render import Row, cpu_cell, fmt, latency_cell, pct, verdict
from fleet.bench.fleet.sampler import Sampler, stats_max
from fleet.bench.fleet.workload import PROJECTS, LongText, Spec, short_mix, with_long
from schedulers.policy.limits import long_prefills_at_once


def long_runs(fb: FleetBench, paced: dict[str, str], paced_label: str) -> list[tuple[str, dict[str, str] | None]]:
    """The fleet runs of the long-prompt scenario: the settings as given; with several long
    prefills per quiet window, also the rule before (one per window) on the same server; the
    paced bucket unless its rate is 0."""
    runs: list[tuple[str, dict[str, str] | None]] = [("default settings", None)]
    if long_prefills_at_once(fb.settings) > 1:
        runs.append(("one long prefill per quiet window (the rule before)",
                     {"FLEET_BACKEND_MAX_LONG_PARTIAL_PREFILLS": "1"}))
    if paced:
        runs.append((paced_label, paced))
    return runs


def paced_env(fb: FleetBench, prefill_tokens_per_s: float, burst_tokens: int, hol_bypass_s: float) -> dict[str, str]:
    """Dispatcher settings for the paced long-prompt run (rates x speed, times / speed)."""
    return {
        "FLEET_ADMISSION_PREFILL_TOKENS_PER_S": str(prefill_tokens_per_s * fb.speed),
        "FLEET_ADMISSION_PREFILL_BURST_TOKENS": str(burst_tokens),
        "FLEET_ADMISSION_HOL_BYPASS_S": str(hol_bypass_s / fb.speed),
    }


def long_prompts(
    fb: FleetBench, n: int, think: int, answer: int, long_tokens: int, paced_tokens_per_s: float = 1500.0
) -> list[Row]:
    samplers: list[Sampler] = []
    long_text = LongText(fb.base_url, long_tokens)
    specs = [replace(s, band="interactive") for s in with_long(short_mix(n, think, answer), 0.1)]
    shorts = [s for s in specs if not s.long]
    run0, ids0 = fb.run_fleet(shorts, None, samplers)
    lat0 = fleet_latencies(run0, ids0, long=False)
    rows: list[Row] = []
    sc = f"long prompts ({n} jobs, {sum(s.long for s in specs)} of {long_text.tokens:,} tokens)"
    paced = paced_env(fb, paced_tokens_per_s, long_tokens + 4096, 120.0) if paced_tokens_per_s > 0 else {}
    paced_label = (f"paced: prefill {paced_tokens_per_s:,.0f} tok/s, burst {long_tokens + 4096:,}, "
                   f"hol_bypass 120 s (sim time)")
    job_s = {"FLEET_ADMISSION_SHORT_JOB_S": repr(pct(lat0["service"], 50))}  # what a drain waits for
    for label, env in long_runs(fb, paced, paced_label):
        run, ids = fb.run_fleet(specs, long_text, samplers, dispatcher_env={**job_s, **(env or {})})
        rows += _fleet_rows(fb, f"{sc}, fleet, {label}", n, samplers[-1], (run, ids), (run0, lat0))
    rows += _fifo_rows(fb, sc, specs, long_text, samplers, pct(lat0["service"], 95))
    return rows + _baseline_rows(fb, sc, specs, long_text, samplers)


def _fleet_rows(fb: FleetBench, name: str, n: int, sampler: Sampler, fleet: tuple[FleetRun, dict[str, Spec]],
                without: tuple[FleetRun, dict[str, list[float]]]) -> list[Row]:
    """One fleet run with the long jobs, against the run without them (``without``: that run and
    its short-job latencies)."""
    cap, max_long = fb.cap, fb.settings.backend.max_long
    run = fleet[0]
    mx = stats_max(sampler)
    return [
        (
            name,
            "jobs finished / codes",
            f"{len(run.envelopes)} / {codes(run.envelopes)}",
            f"{n} OK",
            verdict(run.missing == 0 and all(e.ok for e in run.envelopes)),
        ),
        (
            name,
            "long in-flight at the backend (sim max_long_running_seen)",
            str(mx["max_long_running_seen"]),
            f"<= max_long {max_long}",
            verdict(mx["max_long_running_seen"] <= max_long),
        ),
        (
            name,
            "max in-flight / max waiting (sim)",
            f"{mx['max_running_seen']} / {mx['max_waiting_seen']}",
            f"<= {cap} / <= 1",
            verdict(mx["max_running_seen"] <= cap and mx["max_waiting_seen"] <= 1),
        ),
    ] + _latency_rows(name, cap, sampler, fleet, without)


def _latency_rows(name: str, cap: int, sampler: Sampler, fleet: tuple[FleetRun, dict[str, Spec]],
                  without: tuple[FleetRun, dict[str, list[float]]]) -> list[Row]:
    """Latencies, occupancy, makespan and CPU of one fleet run with the long jobs, against the
    run without them."""
    (run, ids), (run0, lat0) = fleet, without
    p95_0 = pct(lat0["service"], 95)
    w = sampler.window(run.first_admit, run.last_admit, cap)
    lat = fleet_latencies(run, ids, long=False)
    lat_long = fleet_latencies(run, ids, long=True)
    p95, e95 = pct(lat["service"], 95), pct(lat["e2e"], 95)
    return [
        (
            name,
            "short-job service p95 (admitted -> final) with / without long jobs",
            f"{fmt(p95)} / {fmt(p95_0)} s = {fmt(p95 / p95_0)}x",
            "<= 1.3x",
            verdict(p95 / p95_0 <= 1.3, f"{fmt(p95 / p95_0)}x"),
        ),
        (
            name,
            "short-job e2e p95 (dispatcher start -> final) with / without long jobs",
            f"{fmt(e95)} / {fmt(pct(lat0['e2e'], 95))} s",
            "",
            "",
        ),
        (
            name,
            "long-job service p50 / p95; long-job e2e p95",
            f"{fmt(pct(lat_long['service'], 50))} / {fmt(pct(lat_long['service'], 95))} s; "
            f"{fmt(pct(lat_long['e2e'], 95))} s",
            "",
            "",
        ),
        (
            name,
            "mean in-flight / cap, output tok/s (busy period)",
            f"{fmt(w['mean in-flight / cap'], 3)}, {fmt(w['output tok/s'], 0)}",
            "",
            "",
        ),
        (
            name,
            "makespan (without long jobs)",
            f"{fmt(run.end - run.start)} s ({fmt(run0.end - run0.start)} s)",
            "",
            "",
        ),
        (name, "CPU", cpu_cell(run.cpu), "", ""),
    ]


def _fifo_rows(fb: FleetBench, sc: str, specs: list[Spec], long_text: LongText, samplers: list[Sampler],
               p95_0: float) -> list[Row]:
    """The same jobs from 32 threads popping one FIFO, straight at the sim."""
    cap, max_long = fb.cap, fb.settings.backend.max_long
    f_rec, f_start, f_last, f_end, cpu_f = fb.run_direct({"fifo": (32, specs)}, long_text, samplers)
    f_max = stats_max(samplers[-1])
    f_w = samplers[-1].window(f_start, f_last, cap)
    f_lat = direct_latencies(f_rec, f_start, long=False)
    f95 = pct(f_lat["service"], 95)
    fifo = f"{sc}, FIFO: 32 threads popping one queue, straight to the sim"
    return [
        (
            fifo,
            "long in-flight (sim max_long_running_seen)",
            str(f_max["max_long_running_seen"]),
            f"(fleet: <= {max_long})",
            "",
        ),
        (
            fifo,
            "short-job service p95 vs the fleet run without long jobs",
            f"{fmt(f95)} / {fmt(p95_0)} s = {fmt(f95 / p95_0)}x",
            "",
            "",
        ),
        (fifo, "short-job latency", latency_cell(f_lat), "", ""),
        (
            fifo,
            "mean in-flight / cap, output tok/s",
            f"{fmt(f_w['mean in-flight / cap'], 3)}, {fmt(f_w['output tok/s'], 0)}",
            "",
            "",
        ),
        (fifo, "makespan, failed requests", f"{fmt(f_end - f_start)} s, {sum(not r.ok for r in f_rec)}", "", ""),
        (fifo, "CPU", cpu_cell(cpu_f), "", ""),
    ]


def _baseline_rows(fb: FleetBench, sc: str, specs: list[Spec], long_text: LongText,
                   samplers: list[Sampler]) -> list[Row]:
    """The same jobs from five independent clients x 16, straight at the sim."""
    groups = {p: (16, [s for s in specs if s.project == p]) for p in PROJECTS}
    b_rec, b_start, b_last, b_end, _cpu_b = fb.run_direct(groups, long_text, samplers)
    b_max = stats_max(samplers[-1])
    b_w = samplers[-1].window(b_start, b_end, fb.cap)
    base = f"baseline: {sc}, 5 clients x 16 straight to the sim"
    return [
        (
            base,
            "sim max_running / max_waiting / max_long_running",
            f"{b_max['max_running_seen']} / {b_max['max_waiting_seen']} / {b_max['max_long_running_seen']}",
            "",
            "",
        ),
        (
            base,
            "mean / max waiting in vLLM's queue (whole run)",
            f"{fmt(b_w['mean waiting'], 1)} / {b_w['max waiting']}",
            "",
            "",
        ),
        (base, "short-job latency", latency_cell(direct_latencies(b_rec, b_start, long=False)), "", ""),
        (base, "makespan", fmt(b_end - b_start) + " s", "", ""),
    ]
