"""The mix scenario: full and fast together. The same 10%-long-prompt jobs (every tenth job of each
project a real ~60K-token document, all of them batch work; every project backlogged) run through
the fleet three times, with the short jobs' band changed: (a) batch only, (b) interactive beside
batch (the short jobs of two of the five projects interactive), (c) the deployment's mix (the
coding assistant's short jobs interactive, the rest batch). Each run is set against one 32-thread
FIFO of the same jobs straight at the simulator (a FIFO knows no bands): the backend's mean
in-flight / cap and output tok/s from the first admission (FIFO: the first request) to the last job's
end, and the makespan (the whole run, not the busy period to the last admission: with the long
prompts last, most of their decoding comes after it); and the short jobs' service p95 (the
interactive ones where there are any) against a run of the short jobs alone (none long).

The drain rule needs a short job's time at the backend (``admission.short_job_s``): the bench
measures it in the none-long run (the short jobs' service p50) and gives it to the dispatcher of
the three runs, so the rule weighs the drain with what the simulator's short jobs really take.
"""

from __future__ import annotations

from dataclasses import replace

from fleet.bench.fleet.harness import FleetBench, FleetRun
from fleet.bench.fleet.render import Row, fmt, pct, verdict
from fleet.bench.fleet.sampler import Sampler
from fleet.bench.fleet.workload import LongText, Spec, short_mix, with_long_each

MIXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("(a) batch only", ()),
    ("(b) interactive beside batch", ("assistant", "triage")),
    ("(c) the deployment's mix", ("assistant",)),
)
# The same jobs under the rule before (quiet windows whatever the band, every drain): every job
# interactive (one band: the same fair order as batch only) and short_job_s 0.
BEFORE = "(a') batch only under the rule before (every job protected, every drain)"
# The targets: (utilization, tok/s ratio) for (a); (p95 ratio, tok/s ratio) for (b).
BATCH_UTIL, BATCH_TOKS = 0.95, 0.99
INTERACTIVE_P95, INTERACTIVE_TOKS = 1.15, 0.97


def banded(specs: list[Spec], interactive: tuple[str, ...]) -> list[Spec]:
    """The short jobs of the ``interactive`` projects in the interactive band; the rest batch."""
    return [replace(s, band="interactive" if s.project in interactive and not s.long else "batch")
            for s in specs]


def service(run: FleetRun, ids: dict[str, Spec], band: str | None) -> list[float]:
    """Service times (admitted -> final) of the run's short jobs, of one band or all."""
    return [FleetRun.finished_at(e) - FleetRun.admitted_at(e) for e in run.envelopes
            if (spec := ids.get(e.job_id)) is not None and not spec.long
            and (band is None or spec.band == band)]


def mix(fb: FleetBench, n: int, think: int, answer: int, long_tokens: int) -> list[Row]:
    samplers: list[Sampler] = []
    long_text = LongText(fb.base_url, long_tokens)
    specs = with_long_each(short_mix(n, think, answer), 0.1)
    run0, ids0 = fb.run_fleet([s for s in specs if not s.long], None, samplers)
    p95_0, short_job_s = pct(service(run0, ids0, None), 95), pct(service(run0, ids0, None), 50)
    records, start, _last_sent, end, _cpu = fb.run_direct({"fifo": (32, specs)}, long_text, samplers)
    fifo = samplers[-1].window(start, end, fb.cap)
    fifo_p95 = pct([r.done - r.sent for r in records if not r.long], 95)
    sc = f"mix ({n} jobs, {sum(s.long for s in specs)} batch of {long_text.tokens:,} tokens)"
    rows: list[Row] = [
        (sc, "none long: short-job service p50 / p95 (p50 = admission.short_job_s of the runs)",
         f"{fmt(short_job_s)} / {fmt(p95_0)} s", "", ""),
        (sc, "FIFO (32 threads straight to the sim): in-flight / cap, output tok/s, makespan",
         f"{fmt(fifo['mean in-flight / cap'], 3)}, {fmt(fifo['output tok/s'], 0)}, {fmt(end - start)} s", "", ""),
        (sc, "FIFO: short-job service p95 / none long; the tail (last short sent -> last end)",
         f"{fmt(fifo_p95 / p95_0)}x; {fmt(end - max(r.sent for r in records if not r.long))} s", "", ""),
    ]
    runs = [(label, banded(specs, interactive), repr(short_job_s), "interactive" if interactive else "batch")
            for label, interactive in MIXES]
    runs.append((BEFORE, [replace(s, band="interactive") for s in specs], "0", ""))
    for label, jobs, job_s, kind in runs:
        holds0 = fb.store.snapshot().holds.get("prefill", 0)
        run, ids = fb.run_fleet(jobs, long_text, samplers, dispatcher_env={"FLEET_ADMISSION_SHORT_JOB_S": job_s})
        holds = fb.store.snapshot().holds.get("prefill", 0) - holds0
        rows += _mix_rows(f"{sc}, {label}", fb.cap, samplers[-1], (run, ids), fifo, (end - start, p95_0),
                          kind, holds)
    return rows


def _mix_rows(name: str, cap: int, sampler: Sampler, fleet: tuple[FleetRun, dict[str, Spec]],
              fifo: dict[str, float], reference: tuple[float, float], kind: str, holds: int) -> list[Row]:
    """One fleet run of the mix against the FIFO (``reference``: its makespan, and the none-long
    short-job p95); ``kind``: whose targets apply (batch, interactive, none: "")."""
    (run, ids), (fifo_makespan, p95_0) = fleet, reference
    w = sampler.window(run.first_admit, run.end, cap)
    util, toks = w["mean in-flight / cap"], w["output tok/s"] / fifo["output tok/s"]
    interactive = kind == "interactive"
    p95 = pct(service(run, ids, "interactive" if interactive else None), 95)
    makespan = run.end - run.start
    missing = run.missing + sum(not e.ok for e in run.envelopes)
    toks_target = INTERACTIVE_TOKS if interactive else BATCH_TOKS
    last_short = max((FleetRun.admitted_at(e) for e in run.envelopes if not ids[e.job_id].long), default=run.end)
    late = sum(FleetRun.admitted_at(e) > last_short for e in run.envelopes if ids[e.job_id].long)
    util_row: Row = (name, "mean in-flight / cap (first admission to last end)",
                     f"{fmt(util, 3)} (FIFO {fmt(fifo['mean in-flight / cap'], 3)})", "", "")
    if kind == "batch":
        util_row = (*util_row[:3], f">= {BATCH_UTIL}", verdict(util >= BATCH_UTIL, fmt(util, 3)))
    p95_row: Row = (name, "short-job service p95 / none long", f"{fmt(p95)} / {fmt(p95_0)} s = {fmt(p95 / p95_0)}x",
                    "", "")
    if interactive:
        p95_row = (name, "interactive short-job service p95 / none long", p95_row[2], f"<= {INTERACTIVE_P95}x",
                   verdict(p95 / p95_0 <= INTERACTIVE_P95, f"{fmt(p95 / p95_0)}x"))
    return [
        (name, "jobs not OK", str(missing), "0", verdict(missing == 0)),
        util_row,
        (name, "output tok/s (first admission to last end) / FIFO's",
         f"{fmt(w['output tok/s'], 0)} / {fmt(fifo['output tok/s'], 0)} = {fmt(toks, 3)}",
         f">= {toks_target}" if kind else "", verdict(toks >= toks_target, fmt(toks, 3)) if kind else ""),
        (name, "makespan / FIFO's", f"{fmt(makespan)} / {fmt(fifo_makespan)} s = {fmt(makespan / fifo_makespan, 3)}",
         "", ""),
        p95_row,
        (name, "the tail: last short admission -> last end; long prompts admitted after it",
         f"{fmt(run.end - last_short)} s of {fmt(makespan)} s; {late}", "", ""),
        (name, "admission rounds that ended on a 'prefill' hold (drain or window)", str(holds), "", ""),
    ]
