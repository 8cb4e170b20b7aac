"""Reading a ``fleet sim`` process from a test: its counters (/sim/stats), its Prometheus figures
(/metrics), and a user message."""

from __future__ import annotations

from typing import Any

import httpx

from fleet.sim.server import SimProcess
from tests.support.waiting import wait_until


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def stats(sim: SimProcess) -> dict[str, Any]:
    return httpx.get(sim.base_url + "/sim/stats", timeout=5).json()


def metric(sim: SimProcess, name: str) -> float:
    for line in httpx.get(sim.base_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for(sim: SimProcess, predicate: Any, timeout_s: float = 20.0) -> dict[str, Any]:
    """Poll /sim/stats until ``predicate(stats)`` and return those stats; the deadline only guards
    against hangs (its failure shows the last stats read)."""
    last: list[dict[str, Any]] = [{}]

    def matching() -> dict[str, Any] | None:
        last[0] = stats(sim)
        return last[0] if predicate(last[0]) else None

    try:
        return wait_until(matching, timeout_s, "the simulator's stats to match", every_s=0.02)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last stats: {last[0]}") from None
