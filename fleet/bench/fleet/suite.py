"""``fleet_bench``: the whole-fleet scenarios named in ``only``, in that order, on one
``FleetBench``, after a row describing the setup."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from fleet.bench.charts import Charts
from fleet.bench.fleet.crash import crash
from fleet.bench.fleet.fairness import fairness
from fleet.bench.fleet.harness import FleetBench
from fleet.bench.fleet.idle import idle_latency
from fleet.bench.fleet.long_prompts import long_prompts
from fleet.bench.fleet.mix import mix
from fleet.bench.fleet.render import Row
from fleet.bench.fleet.saturation import saturation

log = logging.getLogger(__name__)

SCENARIOS = ("fairness", "saturation", "long", "mix", "crash", "idle")


def fleet_bench(
    redis_url: str,
    speed: float = 5.0,
    jobs: int = 2000,
    think: int = 200,
    answer: int = 50,
    long_jobs: int = 200,
    long_tokens: int = 60_000,
    fair_n: int = 100,
    crash_jobs: int = 400,
    only: tuple[str, ...] = SCENARIOS,
    workers: int = 2,
    concurrency: int = 32,
    lease_ttl_s: float = 5.0,
    paced_tokens_per_s: float = 1500.0,
    idle_jobs: int = 100,
    partial_prefills: tuple[int, int] = (1, 1),
    charts: Charts | None = None,
) -> list[Row]:
    """``partial_prefills``: the server's --max-num-partial-prefills and
    --max-long-partial-prefills, in fleet.toml and on the simulator alike; ``charts`` keeps the
    series the saturation and fairness scenarios measure (fleet/bench/charts.py)."""
    rows: list[Row] = []

    def configure(data: dict[str, Any]) -> None:
        data["backend"]["max_num_partial_prefills"], data["backend"]["max_long_partial_prefills"] = partial_prefills

    with FleetBench(redis_url, speed, workers=workers, concurrency=concurrency, lease_ttl_s=lease_ttl_s,
                    configure=configure) as fb:
        rows.append(_setup_row(fb, speed, workers, concurrency, lease_ttl_s))
        for name in only:
            started = time.monotonic()
            if name == "saturation":
                rows += saturation(fb, jobs, think, answer, charts)
            elif name == "long":
                rows += long_prompts(fb, long_jobs, think, answer, long_tokens, paced_tokens_per_s)
            elif name == "mix":
                rows += mix(fb, long_jobs, think, answer, long_tokens)
            elif name == "fairness":
                rows += fairness(fb, fair_n, charts=charts)
            elif name == "crash":
                rows += crash(fb, crash_jobs, think * 3, answer * 2)
            elif name == "idle":
                rows += idle_latency(fb, idle_jobs)
            log.warning("bench %s took %.0f s", name, time.monotonic() - started)
    return rows


def _setup_row(fb: FleetBench, speed: float, workers: int, concurrency: int, lease_ttl_s: float) -> Row:
    return (
        "setup",
        "fleet",
        f"sim --speed {speed:g}, {workers} Celery workers x {concurrency} threads "
        f"(prep + infer), 1 dispatcher, cap {fb.cap}, max_long {fb.settings.backend.max_long}, "
        f"long threshold {fb.settings.backend.long_prompt_tokens}, lease TTL {lease_ttl_s:g} s, "
        f"prefill bucket {fb.settings.admission.prefill_tokens_per_s:,.0f} tok/s (60K x speed), "
        f"{os.cpu_count()} CPUs",
        "",
        "",
    )
