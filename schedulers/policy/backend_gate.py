"""The backend saturation gate: from one vLLM ``/metrics`` + ``/health`` snapshot, hold or not.

Pure: schedulers/scrape.py does the HTTP and stores the verdict in Redis (``{p}{d}:backend``: scraped_at,
hold, and the raw figures for ``fleet queues``); the admission script reads it on every decision,
so all dispatchers see one gate. Hold reasons:

``health``       ``/health`` did not answer 200 (engine dead or restarting);
``waiting``      ``vllm:num_requests_waiting > 0`` in this scrape and the previous one (when
                 ``hold_on_waiting``): vLLM is queueing inside, so more requests would only add
                 latency for everyone. One scrape alone does not hold: at the instant a slot
                 changes hands the engine may briefly count the newcomer as waiting, and a false
                 hold would idle a freed slot for a whole scrape interval;
``kv_usage``     ``vllm:kv_cache_usage_perc`` above ``kv_usage_hold``: near preemption;
``preemptions``  ``vllm:num_preemptions_total`` rose since the previous scrape;
``stale``        (decided at admission time) the last scrape is older than ``scrape_stale_s`` -
                 the dispatcher cannot see the backend, so it does not feed it blind.

With several engines (data parallel) counts are summed and KV usage is the maximum.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleet.core.config import AdmissionSettings

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+-?\d+)?\s*$")
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
# the server's own prefix cache counters, in tokens (shown per backend, never a hold reason)
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"


@dataclass(frozen=True)
class BackendSample:
    scraped_at: float
    healthy: bool
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    preemptions: float | None = None
    error: str = ""
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None


def parse_metrics(text: str) -> dict[str, list[float]]:
    """Every sample value of the exposition text, by metric name (label sets in file order).

    Lines end at LF only, as the exposition format says; a label value may hold U+2028 and other
    characters ``str.splitlines`` would break on."""
    values: dict[str, list[float]] = {}
    for line in text.split("\n"):
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if not match:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        values.setdefault(match.group(1), []).append(value)
    return values


def sample_from(text: str, healthy: bool, scraped_at: float) -> BackendSample:
    values = parse_metrics(text)

    def total(name: str) -> float | None:
        return sum(values[name]) if name in values else None

    return BackendSample(
        scraped_at=scraped_at,
        healthy=healthy,
        running=total(RUNNING),
        waiting=total(WAITING),
        kv_usage=max(values[KV_USAGE]) if KV_USAGE in values else None,
        preemptions=total(PREEMPTIONS),
        prefix_cache_queries=total(PREFIX_QUERIES),
        prefix_cache_hits=total(PREFIX_HITS),
    )


def decide(
    sample: BackendSample,
    previous_preemptions: float | None,
    admission: AdmissionSettings,
    previous_waiting: float | None = None,
) -> str | None:
    """The hold reason of one scrape, or None when the backend can take more."""
    if not sample.healthy:
        return "health"
    if admission.hold_on_waiting and (sample.waiting or 0) > 0 and (previous_waiting or 0) > 0:
        return "waiting"
    if sample.kv_usage is not None and sample.kv_usage > admission.kv_usage_hold:
        return "kv_usage"
    rising = sample.preemptions is not None and previous_preemptions is not None
    if rising and sample.preemptions > previous_preemptions:  # type: ignore[operator]
        return "preemptions"
    return None


def gate_reason(scraped_at: float | None, hold: str, now: float, stale_s: float) -> str | None:
    """The admission-time verdict (the Lua script has the same three lines)."""
    if scraped_at is None or now - scraped_at > stale_s:
        return "backend_stale"
    if hold:
        return f"backend_{hold}"
    return None
