"""The in-bench direct clients: the same request bodies sent straight at the simulator with
httpx, streaming, no fleet in between (the ideal closed loop of ``cap`` streams, a FIFO drained
by 32 threads, five independent projects of 16 each): the baselines every fleet figure is set
against."""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from fleet.bench.fleet.workload import Spec
from fleet.infer.sse import iter_events


@dataclass
class DirectRecord:
    project: str
    long: bool
    sent: float
    done: float
    tokens: int
    ok: bool


def stream_once(http: httpx.Client, body: dict[str, Any]) -> tuple[int, bool]:
    tokens, ok = 0, False
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return 0, False
        for event in iter_events(response.iter_bytes()):
            if event.is_done:
                ok = True
            elif event.data is not None and '"usage"' in event.data:
                usage = json.loads(event.data).get("usage") or {}
                tokens = int(usage.get("completion_tokens") or tokens)
    return tokens, ok


def run_direct(
    base_url: str, groups: dict[str, tuple[int, list[dict[str, Any]]]], specs: dict[str, list[Spec]]
) -> tuple[list[DirectRecord], float, float, float]:
    """Each group: ``concurrency`` threads popping its own FIFO of bodies straight at the sim.
    Returns the records, the start, the last send and the end (unix s)."""
    records: list[DirectRecord] = []
    lock = threading.Lock()
    last_sent = [0.0]
    threads = []
    total = sum(c for c, _ in groups.values())
    http = httpx.Client(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=total + 8))
    start = time.time()
    for name, (concurrency, bodies) in groups.items():
        fifo: queue.SimpleQueue[tuple[dict[str, Any], Spec]] = queue.SimpleQueue()
        for body, spec in zip(bodies, specs[name], strict=True):
            fifo.put((body, spec))

        def drain(fifo: queue.SimpleQueue = fifo) -> None:  # type: ignore[type-arg]
            while True:
                try:
                    body, spec = fifo.get_nowait()
                except queue.Empty:
                    return
                sent = time.time()
                with lock:
                    last_sent[0] = max(last_sent[0], sent)
                try:
                    tokens, ok = stream_once(http, body)
                except httpx.HTTPError:
                    tokens, ok = 0, False
                with lock:
                    records.append(DirectRecord(spec.project, spec.long, sent, time.time(), tokens, ok))

        threads += [threading.Thread(target=drain, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    http.close()
    return records, start, last_sent[0], time.time()



def direct_latencies(records: list[DirectRecord], start: float, long: bool | None = None) -> dict[str, list[float]]:
    """Service (sent -> final) and e2e (``start`` -> final) latencies of the records, all of them
    or only the long (``long=True``) or short ones."""
    chosen = [r for r in records if long is None or r.long == long]
    return {"service": [r.done - r.sent for r in chosen], "e2e": [r.done - start for r in chosen]}
