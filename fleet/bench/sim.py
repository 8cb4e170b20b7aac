"""``fleet bench sim``: does the simulator reproduce the deployment's decode throughput curve?

For each concurrency (1, 4, 8, 16, 24, 32) the benchmark keeps that many streaming requests open
against a fresh ``fleet sim`` process (closed loop: a finished request is replaced at once; the
requests are long - ``[sim:think=...]`` far beyond the window - so the steady state dominates),
waits until every stream has its first token, then counts the output tokens delivered during a
window of ``duration_s`` real seconds. Two figures per row:

- ``client``: tokens received by the clients (counted with the simulator's tokenizer on the
  reasoning/content deltas) / window / speed - what a caller sees, in simulated tok/s;
- ``server``: the engine's ``generation_tokens`` divided by its simulated clock over the same
  window (``/sim/stats``), which is exact whatever the tick quantisation.

Both are shown next to the deployment's measured figure (docs/deployment.md) with their ratio.
Run at ``--speed 1`` (a short window) and at the requested speed, the ratios should agree within a
few percent.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
from rich.console import Console
from rich.table import Table

from fleet.infer.sse import SseParser
from fleet.sim.profiles import DEPLOYMENT_DECODE_POINTS, DecodeCurve
from fleet.sim.server import SimProcess, start_sim_process
from fleet.sim.tokenizer import split_pieces

CONCURRENCIES = (1, 4, 8, 16, 24, 32)


@dataclass
class BenchRow:
    speed: float
    concurrency: int
    deployment_tok_s: float
    client_tok_s: float
    server_tok_s: float

    @property
    def client_ratio(self) -> float:
        return self.client_tok_s / self.deployment_tok_s

    @property
    def server_ratio(self) -> float:
        return self.server_tok_s / self.deployment_tok_s


class _Counter:
    def __init__(self) -> None:
        self.tokens = 0
        self.started: set[int] = set()


async def _one_stream(client: httpx.AsyncClient, index: int, counter: _Counter,
                      stop: asyncio.Event) -> None:
    body = {"model": "local", "stream": True, "messages": [
        {"role": "user", "content": f"[sim:think=1000000] benchmark stream {index}"}]}
    while not stop.is_set():
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            parser = SseParser()
            async for raw in resp.aiter_bytes():
                if stop.is_set():
                    return
                for event in parser.feed(raw):
                    _count(event.data, index, counter)


def _count(data: str | None, index: int, counter: _Counter) -> None:
    if not data or not data.startswith("{"):
        return
    for choice in json.loads(data).get("choices", []):
        delta = choice.get("delta", {})
        text = (delta.get("reasoning") or "") + (delta.get("content") or "")
        if text:
            counter.tokens += len(split_pieces(text))
            counter.started.add(index)


async def _stats(client: httpx.AsyncClient) -> dict[str, float]:
    return (await client.get("/sim/stats")).json()


async def _measure(base_url: str, concurrency: int, speed: float, duration_s: float,
                   warmup_s: float) -> BenchRow:
    counter, stop = _Counter(), asyncio.Event()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        tasks = [asyncio.create_task(_one_stream(client, i, counter, stop))
                 for i in range(concurrency)]
        while len(counter.started) < concurrency:
            await asyncio.sleep(0.02)
        await asyncio.sleep(warmup_s)
        s0, c0, t0 = await _stats(client), counter.tokens, time.monotonic()
        await asyncio.sleep(duration_s)
        s1, c1, t1 = await _stats(client), counter.tokens, time.monotonic()
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    server = (s1["generation_tokens"] - s0["generation_tokens"]) / (
        s1["engine_time"] - s0["engine_time"])
    client_rate = (c1 - c0) / (t1 - t0) / speed
    return BenchRow(speed, concurrency, DecodeCurve().aggregate(concurrency), client_rate, server)


def _run_speed(speed: float, duration_s: float, concurrencies: tuple[int, ...]) -> list[BenchRow]:
    proc: SimProcess = start_sim_process(speed=speed, seed=1, log_level="warning")
    try:
        return [asyncio.run(_measure(proc.base_url, c, speed, duration_s, min(1.0, duration_s)))
                for c in concurrencies]
    finally:
        proc.stop()


def render_table(rows: list[BenchRow]) -> Table:
    measured = dict(DEPLOYMENT_DECODE_POINTS)
    table = Table(title="fleet sim: aggregate decode tok/s (simulated) vs the deployment")
    for col in ("speed", "concurrency", "deployment", "client tok/s", "ratio", "server tok/s",
                "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        ref = f"{r.deployment_tok_s:.0f}" + ("" if r.concurrency in measured else " (extrap.)")
        table.add_row(f"{r.speed:g}", str(r.concurrency), ref, f"{r.client_tok_s:.1f}",
                      f"{r.client_ratio:.3f}", f"{r.server_tok_s:.1f}", f"{r.server_ratio:.3f}")
    return table


def bench_sim(speed: float = 20.0, duration_s: float = 3.0, with_speed_1: bool = True,
              speed_1_duration_s: float = 4.0,
              concurrencies: tuple[int, ...] = CONCURRENCIES,
              console: Console | None = None) -> list[BenchRow]:
    """Measure the simulator's throughput curve at ``speed`` (and at speed 1); print a table."""
    rows: list[BenchRow] = []
    if with_speed_1 and speed != 1.0:
        rows += _run_speed(1.0, speed_1_duration_s, concurrencies)
    rows += _run_speed(speed, duration_s, concurrencies)
    (console or Console()).print(render_table(rows))
    return rows
