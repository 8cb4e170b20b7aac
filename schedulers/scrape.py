"""Scraping the backend for the saturation gate: ``GET /health`` and ``GET /metrics`` about once
a second (``admission.scrape_interval_s``), parsed and judged by schedulers/policy/backend_gate.py, and
written to ``{p}{d}:backend`` so every dispatcher's admission script sees the same verdict.

Failure cases: a connection error or timeout counts as a failing ``/health`` (hold "health");
a scraper that stops writing (process gone, Redis unreachable from it) makes the verdict stale,
and admission holds ("backend_stale") until a fresh scrape arrives - the fleet never feeds a
backend it cannot see. When a scrape finds no reason to hold, it wakes one dispatcher, so a hold
lifts within one scrape interval without anyone polling. Several dispatchers each run a scraper;
the last write wins, which is fine for a once-a-second gauge reading.

Outside clients: the scrape also records ``outside``, the backend's running count beyond the
fleet's claimed leases (tools run by hand, clients that do not go through the fleet); admission
counts it against ``max_num_seqs`` (hold ``outside``), so the server's own total stays at its
ceiling, and ``fleet_backend_outside_sequences`` exports it. A fleet request claimed a moment
before the server counted it makes one estimate too low, so the figure is the largest estimate of
the last ``outside_window(interval)`` seconds (at least one second and two scrapes, kept as
``outside_seen``), and each estimate subtracts the smaller of the claimed counts read just before
and just after the scrape: a late request must be missed in every scrape of the window to open a
slot that is not there.

On its first healthy scrape, and the first after every unhealthy one, the scraper also compares
the server's own block size, pool and max_model_len with ``[backend]`` (schedulers/serverinfo.py);
with ``admission.on_server_mismatch = "refuse"`` a disagreement holds ("server_mismatch").

The scraper thread must never die silently (a dead scraper holds every admission as "stale"
with nothing in the log to say why): any error in one round is logged with its traceback and
the next round goes on.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import httpx
import redis

from fleet.core.config import AdmissionSettings, Settings
from schedulers.policy.backend_gate import BackendSample, decide, sample_from
from schedulers.serverinfo import ServerCheck
from schedulers.store.base import AdmissionStore

log = logging.getLogger(__name__)


def scrape_once(http: httpx.Client, now: float) -> BackendSample:
    """One look at the backend. ``http`` has the backend's base URL (and auth) configured."""
    try:
        healthy = http.get("/health").status_code == 200
        metrics = http.get("/metrics")
        metrics.raise_for_status()
    except httpx.HTTPError as exc:
        return BackendSample(scraped_at=now, healthy=False, error=type(exc).__name__)
    return sample_from(metrics.text, healthy, now)


def figures(sample: BackendSample) -> dict[str, str]:
    """The raw numbers kept beside the verdict, for ``fleet queues`` and the next scrape."""
    fields = {
        "running": sample.running,
        "waiting": sample.waiting,
        "kv_usage": sample.kv_usage,
        "preemptions": sample.preemptions,
        "prefix_cache_queries": sample.prefix_cache_queries,
        "prefix_cache_hits": sample.prefix_cache_hits,
    }
    out = {name: repr(value) for name, value in fields.items() if value is not None}
    out["healthy"] = "1" if sample.healthy else "0"
    out["error"] = sample.error
    return out


def outside(running: float, claimed: int) -> float:
    """Sequences at the backend that are not the fleet's: its running count beyond the fleet's
    claimed leases (a worker claims its lease just before it sends the request). Admitted but
    not yet claimed leases are not subtracted: they are not at the backend yet, and admission
    counts them in its own in-flight figure."""
    return max(0.0, running - claimed)


def outside_window(interval_s: float) -> float:
    """How long an outside estimate stands: two scrapes, and never less than a second (a loaded
    host can take longer than a short interval to get a claimed request onto the server)."""
    return max(1.0, 2.0 * interval_s)


def outside_peak(previous: str, estimate: float, now: float, window_s: float) -> tuple[float, str]:
    """The largest of ``estimate`` and the estimates of ``previous`` (``outside_seen``: JSON
    pairs of time and estimate) younger than ``window_s``; returns it and the pairs to keep."""
    try:
        seen = [(float(t), float(v)) for t, v in json.loads(previous or "[]")]
    except (ValueError, TypeError):
        seen = []
    kept = [(t, v) for t, v in seen if now - window_s <= t <= now] + [(now, estimate)]
    return max(v for _, v in kept), json.dumps(kept[-32:])


def claimed_on(store: AdmissionStore, backend: str | None) -> int:
    """The fleet's claimed leases on ``backend`` (None: the first)."""
    snap = store.snapshot()
    if backend is None or backend not in snap.backends:
        return snap.claimed if len(snap.backends) <= 1 else next(iter(snap.backends.values())).claimed
    return snap.backends[backend].claimed


def record(
    store: AdmissionStore,
    sample: BackendSample,
    admission: AdmissionSettings,
    server_hold: str = "",
    claimed_before: int | None = None,
    backend: str | None = None,
) -> str:
    """Judge ``sample`` against the previous scrape and store the verdict; returns the hold.

    ``server_hold`` (schedulers/serverinfo.py) holds when the sample alone would not;
    ``claimed_before`` is the fleet's claimed count read just before the scrape (module
    docstring: the smaller of it and the count read now is subtracted)."""
    previous = store.backend(backend)
    preemptions, waiting = previous.get("preemptions"), previous.get("waiting")
    hold = decide(
        sample,
        float(preemptions) if preemptions else None,
        admission,
        previous_waiting=float(waiting) if waiting else None,
    )
    hold = hold or server_hold
    found = figures(sample)
    if sample.running is not None:
        claimed = claimed_on(store, backend)
        if claimed_before is not None:
            claimed = min(claimed, claimed_before)
        estimate = outside(sample.running, claimed)
        peak, found["outside_seen"] = outside_peak(
            previous.get("outside_seen", ""), estimate, sample.scraped_at,
            outside_window(admission.scrape_interval_s))
        found["outside_now"] = repr(estimate)
        found["outside"] = repr(peak)
    store.record_backend(sample.scraped_at, hold, found, backend)
    if not hold:
        store.wake()
    return hold


def make_http(settings: Settings) -> httpx.Client:
    headers = (
        {"Authorization": f"Bearer {settings.backend.api_key}"} if settings.backend.api_key else {}
    )
    timeout_s = max(0.2, settings.admission.scrape_interval_s)
    return httpx.Client(base_url=settings.backend.url, headers=headers, timeout=timeout_s)


def run_scraper(
    settings: Settings,
    store: AdmissionStore,
    http: httpx.Client,
    stop: threading.Event,
    clock: Callable[[], float] = time.time,
    check: ServerCheck | None = None,
    backend: str | None = None,
) -> None:
    """Scrape until ``stop`` is set. Logs when the verdict changes, not on every scrape.

    ``settings.backend`` is the backend scraped (``Settings.on_backend``), recorded as
    ``backend`` (None: the first). ``check`` compares the server's own figures with that entry on
    the first healthy scrape and on the first after every unhealthy one."""
    who = "backend" if len(settings.backends) == 1 or not backend else f"backend {backend}"
    last_hold: str | None = None
    while not stop.is_set():
        try:
            claimed_before = claimed_on(store, backend)
            sample = scrape_once(http, clock())
            server_hold = check.after_scrape(sample.healthy, http) if check is not None else ""
            hold = record(store, sample, settings.admission, server_hold, claimed_before, backend)
        except (redis.RedisError, ValueError):  # keep scraping: a dead scraper means "stale"
            log.exception("recording the %s scrape failed", who)
            hold = "error"
        except Exception:  # a bug must not end the thread either (module docstring)
            log.exception("%s scrape round failed", who)
            hold = "error"
        if hold != last_hold:
            log.info("%s gate: %s", who, hold or "open")
            last_hold = hold
        stop.wait(settings.admission.scrape_interval_s)
