"""The crash scenario: ``kill -9`` of one of two workers five times while a backlog runs (a
replacement started each time). Figures: exactly one Envelope per job in the results streams,
the time from each kill to the backend back at cap against the lease TTL."""

from __future__ import annotations

import signal
import time
from collections import Counter
from typing import Any

from fleet.bench.fleet.harness import FleetBench, codes
from fleet.bench.fleet.render import Row, verdict
from fleet.bench.fleet.sampler import Sampler, stats_max
from fleet.bench.fleet.workload import PROJECTS, Spec, short_mix
from fleet.core.models import Envelope


def crash(fb: FleetBench, n: int, think: int, answer: int, kills: int = 5) -> list[Row]:
    cap, ttl = fb.cap, fb.settings.admission.lease_ttl_s
    samplers: list[Sampler] = []
    recoveries: list[float] = []
    notes: list[str] = []

    def killer(start: float) -> None:
        _kill_workers(fb, samplers, kills, recoveries, notes)

    specs = short_mix(n, think, answer)
    run, ids = fb.run_fleet(specs, None, samplers, during=killer)
    counts = _envelope_counts(fb, ids)
    missing = [j for j in ids if counts[j] == 0]
    doubled = [j for j in ids if counts[j] > 1]
    retried = sum(len(e.attempts) > 1 for e in run.envelopes)
    mx = stats_max(samplers[-1])
    sc = f"crash ({kills} x kill -9 of one of 2 workers, {n} jobs, lease TTL {ttl:g} s)"
    worst = max(recoveries) if recoveries else float("nan")
    return [
        (sc, "kills done", str(len(recoveries)), str(kills), verdict(len(recoveries) == kills)),
        (
            sc,
            "jobs with exactly one Envelope (results streams) / none / more than one",
            f"{sum(c == 1 for c in counts.values())} / {len(missing)} / {len(doubled)}",
            f"{n} / 0 / 0",
            verdict(not missing and not doubled and len(counts) == n),
        ),
        (sc, "codes; jobs with more than one attempt", f"{codes(run.envelopes)}; {retried}", "", ""),
        (
            sc,
            "kill -> sim running back at cap, s (each kill)",
            ", ".join(f"{r:.2f}" for r in recoveries),
            f"<= lease TTL {ttl:g}",
            verdict(bool(recoveries) and worst <= ttl, f"worst {worst:.2f} s"),
        ),
        (
            sc,
            "max in-flight (sim max_running_seen)",
            str(mx["max_running_seen"]),
            f"<= {cap}",
            verdict(mx["max_running_seen"] <= cap),
        ),
        *[(sc, "detail", note, "", "") for note in notes],
    ]



def _kill_workers(fb: FleetBench, samplers: list[Sampler], kills: int, recoveries: list[float],
                  notes: list[str]) -> None:
    """``kills`` times: wait for the backend at cap, ``kill -9`` a worker, start a replacement,
    and record the time until the backend is back at cap (in ``recoveries``, a line in ``notes``)."""
    cap = fb.cap
    try:
        for _ in range(kills):
            sampler = samplers[-1]
            time.sleep(1.0)
            _first_after(sampler, time.time(), cap, full=True, timeout_s=60)
            victim = next(name for name, _p in fb.fleet.children if name.startswith("worker"))
            t_kill = time.time()
            fb.stop(victim, signal.SIGKILL)
            fb.start_worker()
            dropped = _first_after(sampler, t_kill, cap, full=False, timeout_s=10)
            back = _first_after(sampler, dropped, cap, full=True, timeout_s=60)
            low = min(s["running"] for s in sampler.samples if t_kill < s["t"] < back)
            recoveries.append(back - t_kill)
            notes.append(f"{victim}: running fell to {low}, back at {cap} after {back - t_kill:.2f} s")
    except TimeoutError as exc:
        notes.append(f"killer stopped: {exc}")


def _first_after(
    sampler: Sampler, after: float, cap: int, *, full: bool, hold_s: float = 0.0, timeout_s: float
) -> float:
    """Time of the first sample after ``after`` with running at cap (``full``) or below it; with
    ``hold_s``, the first such sample that stays so for ``hold_s`` (polls the sampler)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        since = None
        for s in list(sampler.samples):
            if s["t"] <= after:
                continue
            if (s["running"] >= cap) == full:
                since = s["t"] if since is None else since
                if s["t"] - since >= hold_s:
                    return since
            else:
                since = None
        time.sleep(0.02)
    raise TimeoutError(f"running {'at' if full else 'below'} cap {cap} not seen within {timeout_s:.0f} s")


def _envelope_counts(fb: FleetBench, ids: dict[str, Spec]) -> Counter[str]:
    """How many envelopes each of the run's jobs has in the projects' results streams."""
    counts: Counter[str] = Counter()
    for p in PROJECTS:
        entries: Any = fb.redis.xrange(fb.client.keys.results(p))
        for _id, fields in entries:
            job_id = Envelope.model_validate_json(fields[b"envelope"]).job_id
            if job_id in ids:
                counts[job_id] += 1
    return counts
