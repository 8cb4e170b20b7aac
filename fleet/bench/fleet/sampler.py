"""The simulator seen from outside during a whole-fleet run: ``Sampler`` reads ``/sim/stats``
(plus the dispatcher store's in-flight and pending) every 50 ms in a thread; a window between
two instants gives the simulator's own figures (mean in-flight over its time integral, output
tokens per second over real time); ``stats_max`` the peaks it saw."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import httpx
import redis

log = logging.getLogger(__name__)


class Sampler:
    """Samples ``/sim/stats`` (plus the dispatcher store's in-flight and pending) every
    ``interval_s`` in a thread; ``window`` turns two instants into the simulator's own figures."""

    def __init__(self, base_url: str, store: Any = None, interval_s: float = 0.05) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=10)
        self.store, self.interval_s = store, interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.http.close()

    def _run(self) -> None:
        missed = 0  # samples missed in a row: a simulator or Redis killed by a round is one line
        while not self._stop.is_set():
            try:
                stats = self.http.get("/sim/stats").json()
                if self.store is not None:
                    snap = self.store.snapshot()
                    stats["leases"] = snap.in_flight
                    stats["pending"] = sum(sum(b.values()) for b in snap.pending.values())
                stats["t"] = time.time()
                self.samples.append(stats)
                if missed:
                    log.warning("sampler: back after %d samples missed", missed)
                missed = 0
            except (httpx.HTTPError, redis.RedisError) as exc:
                if not missed:
                    log.warning("sampler: %s (no more lines until it answers again)", exc)
                missed += 1
            self._stop.wait(self.interval_s)

    def between(self, t0: float, t1: float) -> list[dict[str, Any]]:
        return [s for s in self.samples if t0 <= s["t"] <= t1]

    def window(self, t0: float, t1: float, cap: int) -> dict[str, float]:
        inside = self.between(t0, t1)
        if len(inside) < 2:
            return {
                "mean in-flight / cap": float("nan"),
                "output tok/s": float("nan"),
                "mean waiting": float("nan"),
                "max waiting": float("nan"),
            }
        a, b = inside[0], inside[-1]
        sim_dt = b["sim_time"] - a["sim_time"]
        return {
            "mean in-flight / cap": (b["running_seconds"] - a["running_seconds"]) / sim_dt / cap,
            "output tok/s": (b["generation_tokens"] - a["generation_tokens"]) / (b["t"] - a["t"]),
            "mean waiting": sum(s["waiting"] for s in inside) / len(inside),
            "max waiting": max(s["waiting"] for s in inside),
            "window s": b["t"] - a["t"],
        }


def stats_max(sampler: Sampler) -> dict[str, Any]:
    last = sampler.samples[-1] if sampler.samples else {}
    return {k: last.get(k) for k in ("max_running_seen", "max_waiting_seen", "max_long_running_seen", "preemptions")}

