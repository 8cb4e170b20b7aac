"""Measurement shared by every bench and ``fleet demo``: percentiles, Jain's index, CPU time.

Percentiles follow one rule everywhere, so every p50 / p95 / p99 the benches, the demo, the README
and docs/performance.md print means the same thing: **linear interpolation between the closest
ranks**, numpy's default (``method="linear"``, Hyndman and Fan's type 7). For ``n`` sorted values
the q-th percentile sits at position ``h = (n - 1) * q / 100``: the value at ``floor(h)`` plus
the fraction ``h - floor(h)`` of the step to the next one. p0 is the minimum, p100 the maximum,
p50 the median (``statistics.median``).

CPU: a process's user + system seconds from ``/proc/<pid>/stat``, the machine's busy share from
``/proc/stat`` (Linux only, like the benches' process groups).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float, *, default: float | None = None) -> float:
    """The ``q``-th percentile (0 <= q <= 100) of ``values`` by linear interpolation.

    No values raises ``ValueError`` unless ``default`` is given; then that is returned (a bench
    row whose run produced no samples shows ``nan`` instead of losing the whole table)."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    if not values:
        if default is None:
            raise ValueError("percentile of no values")
        return default
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all values are equal, 1/n when one value takes everything."""
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if values else float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``OSError`` once it is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces: split after it
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[float, float]:
    """The whole machine's busy and total clock ticks since boot (idle and iowait are not busy)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, float(sum(values))


class CpuMeter:
    """CPU seconds of given processes and the machine's busy share between ``start`` and ``stop``."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before = self._read()

    @staticmethod
    def _proc(pid: int) -> float:
        try:
            return cpu_seconds(pid)
        except OSError:
            return 0.0

    def _read(self) -> dict[str, Any]:
        return {
            "t": time.time(),
            "self": time.process_time(),
            "machine": machine_ticks(),
            **{name: self._proc(pid) for name, pid in self.pids.items()},
        }

    def stop(self) -> dict[str, float]:
        after = self._read()
        wall = after["t"] - self.before["t"]
        busy = (after["machine"][0] - self.before["machine"][0]) / max(
            1.0, after["machine"][1] - self.before["machine"][1]
        )
        figures = {
            "machine busy %": 100 * busy,
            "bench process CPU %": 100 * (after["self"] - self.before["self"]) / wall,
        }
        for name in self.pids:
            figures[f"{name} CPU %"] = 100 * (after[name] - self.before[name]) / wall
        return figures
