"""The idle scenario: one tiny job at a time through ``fleet.Client`` on an idle fleet. Figures:
the time of each hop (``IDLE_HOPS``) and the latency the fleet adds to the backend's own."""

from __future__ import annotations

import itertools
import time
import uuid

import httpx

from fleet.bench.fleet.harness import FleetBench
from fleet.bench.fleet.render import Row, fmt, pct, verdict
from fleet.bench.fleet.workload import Spec, job_of

IDLE_HOPS = (
    "submit -> prepared (broker push, prep pick-up, verify, token count, store write)",
    "prepared -> admitted at the worker (dispatcher wake, admission, send, broker, pick-up, claim)",
    "admitted -> request at the backend (attempt set-up, HTTP)",
    "request at the backend -> envelope (backend time, validation)",
    "envelope -> Client.result returns (publish, XREAD wake)",
)


def idle_latency(fb: FleetBench, n: int) -> list[Row]:
    """One tiny job at a time through ``fleet.Client`` on an idle fleet (after one warm-up job):
    the time of each hop, from the client's clock at submit, the job's events (``prepared``,
    ``admitted``), the sim's request log (``received_at``), the envelope's ``finished_at`` and
    ``Client.result`` returning; added latency = submit -> result minus request at the backend
    -> envelope."""
    fb.wait_idle()
    fb.reset_sim()
    name = fb.start_dispatcher()
    hops: list[list[float]] = [[] for _ in IDLE_HOPS]
    added: list[float] = []
    spec = Spec("triage", think=1, answer=1)
    try:
        for i in range(n + 1):  # the first job warms the workers up and is not counted
            marks = _timed_job(fb, spec)
            if i == 0:
                continue
            for hop, (a, b) in zip(hops, itertools.pairwise(marks), strict=True):
                hop.append(b - a)
            started, received, finished, returned = marks[0], marks[3], marks[4], marks[5]
            added.append((returned - started) - (finished - received))
    finally:
        fb.stop(name)
    return _rows(n, hops, added)


def _timed_job(fb: FleetBench, spec: Spec) -> list[float]:
    """Submit one job and wait for it: the instants submit, prepared, admitted, request at the
    backend, envelope finished, ``Client.result`` returned."""
    job = job_of(spec, None)
    job["id"] = uuid.uuid4().hex
    started = time.time()
    job_id = fb.client.submit(job)
    envelope = fb.client.result(job_id, timeout=120)
    returned = time.time()
    assert envelope is not None and envelope.ok, envelope
    events = {e["type"]: e["ts"] for e in fb.client.events(job_id, follow=False)}
    log_ = httpx.get(fb.base_url + "/sim/requests", params={"limit": 1}, timeout=10).json()
    received = float(log_["requests"][-1]["received_at"])
    return [started, events["prepared"], events["admitted"], received, envelope.finished_at, returned]


def _rows(n: int, hops: list[list[float]], added: list[float]) -> list[Row]:
    scenario = f"idle fleet, {n} jobs one at a time through fleet.Client"
    rows: list[Row] = [
        (scenario, f"{hop} p50 / p99 ms",
         f"{fmt(1000 * pct(v, 50), 1)} / {fmt(1000 * pct(v, 99), 1)}", "", "")
        for hop, v in zip(IDLE_HOPS, hops, strict=True)
    ]
    p50, p99 = 1000 * pct(added, 50), 1000 * pct(added, 99)
    rows.append((scenario, "added latency p50 / p99 ms", f"{fmt(p50, 1)} / {fmt(p99, 1)}", "<= 8 / 25 ms",
                 verdict(p50 <= 8 and p99 <= 25, f"{fmt(p50, 1)} / {fmt(p99, 1)} ms")))
    return rows
