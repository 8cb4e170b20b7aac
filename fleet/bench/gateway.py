"""``fleet bench gateway``: what the gateway adds to a request, next to the same requests sent
straight to ``fleet sim`` in the same run.

One fleet (``fleet sim``, one dispatcher, ``fleet gateway``; no Celery worker: nothing is queued)
on a private key prefix. Two parts:

1. Added latency on an idle fleet: ``requests`` streaming requests one at a time, alternating
   between the simulator and the gateway so both see the same machine load. Per request: time to
   first token (the first reasoning or content delta, not the role chunk, which the gateway could
   send before vLLM answered) and end to end (``[DONE]`` read). Reported: p50 and p99 of each path
   and of the difference of the percentiles.
   With ``litellm`` (the path of a ``litellm`` executable installed apart, e.g. in its own venv:
   it is not a dependency of the fleet), LiteLLM's proxy in front of the same simulator is a third
   path in the same alternation: the peer a user would otherwise put there.
2. Disconnects: ``disconnects`` streaming requests that think for long, each closed by its client
   (a raw socket, so no pool keeps it open) once the first reasoning arrived; the time from the
   close until the store's in-flight count is back to 0 (the slot is free), polled every
   millisecond.
3. ``clients`` concurrent streaming clients through the gateway at the configured cap: the most
   sequences the simulator ever ran and the most it ever had waiting (both from ``/sim/stats``),
   requests that ended well, and the gateway process's CPU time per 1,000 streamed tokens
   (``/proc/<pid>/stat`` user + system before and after).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import tomli_w
from rich.table import Table

from fleet.bench.measure import cpu_seconds, percentile
from fleet.core.apikeys import mint
from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.redisconn import redis_client
from fleet.infer.sse import SseParser
from fleet.local.embedded import free_port
from fleet.local.processes import LocalFleet, os_env, wait_http
from schedulers.store import make_store

PROMPT = "[sim:think={think}] [sim:answer={answer}] bench {n}"
LITELLM_CONFIG = """model_list:
  - model_name: local
    litellm_params:
      model: openai/local
      api_base: {api_base}
      api_key: none
"""


@dataclass
class Timing:
    ttft_s: float
    total_s: float


async def _stream(client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict[str, Any]
                  ) -> tuple[Timing, int]:
    """One streaming request: its timing and the number of deltas with text."""
    started = time.perf_counter()
    first: float | None = None
    deltas = 0
    async with client.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        parser = SseParser()
        async for raw in response.aiter_bytes():
            for event in parser.feed(raw):
                if _has_text(event.data):
                    deltas += 1
                    if first is None:
                        first = time.perf_counter()
    end = time.perf_counter()
    return Timing((first or end) - started, end - started), deltas


def _has_text(data: str | None) -> bool:
    if not data or not data.startswith("{"):
        return False
    choices = json.loads(data).get("choices") or [{}]
    delta = choices[0].get("delta") or {}
    return bool(delta.get("reasoning") or delta.get("content"))


class GatewayBench:
    def __init__(self, redis_url: str, speed: float, cap: int, exact_count: bool = True,
                 litellm: str | None = None) -> None:
        self.litellm = litellm
        self.litellm_key = f"sk-bench-{secrets.token_hex(16)}"
        self.litellm_process: subprocess.Popen[bytes] | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="fleet-bench-gw-"))
        self.key, entry = mint()
        data = tomllib.loads(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
        data.update(broker_url=redis_url, key_prefix=f"gwbench-{uuid.uuid4().hex[:8]}:")
        data["backend"]["max_num_seqs"] = cap
        data.setdefault("admission", {}).update(metrics_port=0, backend_gate=False,
                                                 worker_gate=False)  # a gateway-only fleet
        data["gateway"] = {"port": free_port(), "max_queue_wait_s": 600}
        if not exact_count:
            data["gateway"]["exact_prompt_count"] = False
        data["projects"]["assistant"]["api_keys"] = [entry]
        for project in data["projects"].values():  # the gateway refuses the example's public secrets
            project["secret"] = secrets.token_urlsafe(24)
        (self.tmp / "fleet.toml").write_text(tomli_w.dumps(data), encoding="utf-8")
        self.settings = load_settings(self.tmp / "fleet.toml", env={})
        self.fleet = LocalFleet(self.settings, sim_speed=speed, workers=0, dispatchers=1,
                                config_path=str(self.tmp / "fleet.toml"), log_dir=str(self.tmp),
                                sim_args=["--max-num-seqs", str(4 * cap)],
                                gateway_port=self.settings.gateway.port, inherit_env=False)

    def __enter__(self) -> GatewayBench:
        self.fleet.start()
        self.sim_url = self.fleet.env["FLEET_BACKEND_URL"]
        self.gateway_url = f"http://127.0.0.1:{self.settings.gateway.port}"
        self.gateway_pid = next(p.pid for name, p in self.fleet.children if name == "gateway")
        if self.litellm:
            self._start_litellm(self.litellm)
        return self

    def _start_litellm(self, executable: str) -> None:
        port = free_port()
        config = self.tmp / "litellm.yaml"
        config.write_text(LITELLM_CONFIG.format(api_base=f"{self.sim_url}/v1"), encoding="utf-8")
        env = {**os_env(), "LITELLM_MASTER_KEY": self.litellm_key, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        with (self.tmp / "litellm.log").open("wb") as out:
            self.litellm_process = subprocess.Popen(
                [executable, "--config", str(config), "--port", str(port), "--num_workers", "1"],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        self.litellm_url = f"http://127.0.0.1:{port}"
        process = self.litellm_process
        wait_http(f"{self.litellm_url}/health/liveliness", timeout_s=300, alive=lambda: process.poll() is None)
        if process.poll() is not None:
            raise RuntimeError(f"litellm exited: {(self.tmp / 'litellm.log').read_text()[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.litellm_process is not None:
            os.killpg(self.litellm_process.pid, signal.SIGTERM)
            try:
                self.litellm_process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.litellm_process.pid, signal.SIGKILL)
                self.litellm_process.wait()
        self.fleet.close(grace_s=5)
        client = redis_client(self.settings)
        for key in client.scan_iter(match=f"{self.settings.key_prefix}*", count=1000):
            client.delete(key)
        client.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def body(self, n: int, think: int, answer: int) -> dict[str, Any]:
        return {"model": "local", "stream": True, "messages": [
            {"role": "user", "content": PROMPT.format(think=think, answer=answer, n=n)}]}

    async def latency(self, requests: int, think: int, answer: int) -> dict[str, list[Timing]]:
        auth = {"Authorization": f"Bearer {self.key}"}
        paths = {"sim": (f"{self.sim_url}/v1/chat/completions", {}),
                 "gateway": (f"{self.gateway_url}/v1/chat/completions", auth)}
        if self.litellm_process is not None:
            paths["litellm"] = (f"{self.litellm_url}/v1/chat/completions",
                                {"Authorization": f"Bearer {self.litellm_key}"})
        found: dict[str, list[Timing]] = {name: [] for name in paths}
        async with httpx.AsyncClient(timeout=120) as client:
            for n in range(requests + 2):
                for name, (url, headers) in paths.items():
                    timing, _ = await _stream(client, url, headers, self.body(n, think, answer))
                    if n >= 2:  # the first two warm connections and caches
                        found[name].append(timing)
        return found

    def disconnects(self, count: int) -> list[float]:
        """Seconds from a streaming client's close until its slot is free, ``count`` times."""
        store = make_store(self.settings, redis_client(self.settings))
        body = json.dumps({"model": "local", "stream": True, "thinking_token_budget": 100_000,
                           "messages": [{"role": "user", "content": "Think long. [sim:think=100000]"}]})
        freed = []
        for _ in range(count):
            with socket.create_connection(("127.0.0.1", self.settings.gateway.port), timeout=60) as sock:
                sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
                              f"Authorization: Bearer {self.key}\r\nContent-Type: application/json\r\n"
                              f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
                received = b""
                while b'"reasoning"' not in received:
                    received += sock.recv(65536)
                closed = time.perf_counter()
            while store.snapshot().in_flight:
                time.sleep(0.001)
            freed.append(time.perf_counter() - closed)
        return freed

    async def crowd(self, clients: int, think: int, answer: int) -> dict[str, float]:
        httpx.post(f"{self.sim_url}/sim/reset", timeout=10).raise_for_status()
        auth = {"Authorization": f"Bearer {self.key}"}
        url = f"{self.gateway_url}/v1/chat/completions"
        cpu0 = cpu_seconds(self.gateway_pid)
        limits = httpx.Limits(max_connections=clients + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            results = await asyncio.gather(
                *(_stream(client, url, auth, self.body(n, think, answer)) for n in range(clients)),
                return_exceptions=True)
        cpu = cpu_seconds(self.gateway_pid) - cpu0
        stats = httpx.get(f"{self.sim_url}/sim/stats", timeout=10).json()
        tokens = stats["generation_tokens"]
        return {"clients": clients, "ok": sum(1 for r in results if not isinstance(r, BaseException)),
                "max_running": stats["max_running_seen"], "max_waiting": stats["max_waiting_seen"],
                "tokens": tokens, "cpu_ms_per_1000_tokens": 1000 * cpu / max(tokens, 1) * 1000}


def latency_table(found: dict[str, list[Timing]]) -> Table:
    table = Table(title="the gateway (and peers) vs straight to fleet sim, idle fleet, ms")
    for col in ("path", "figure", "sim p50", "path p50", "added p50", "sim p99", "path p99", "added p99"):
        table.add_column(col, justify="right")
    medians = []
    for name in (n for n in found if n != "sim"):
        for label, attr in (("first token", "ttft_s"), ("end to end", "total_s")):
            sim = [getattr(t, attr) * 1000 for t in found["sim"]]
            path = [getattr(t, attr) * 1000 for t in found[name]]
            row = [name, label]
            for q in (50, 99):
                a, b = percentile(sim, q), percentile(path, q)
                row += [f"{a:.1f}", f"{b:.1f}", f"{b - a:+.1f}"]
            table.add_row(*row)
        pairs = zip(found["sim"], found[name], strict=True)
        medians.append(f"{name} {percentile([b.total_s - a.total_s for a, b in pairs], 50) * 1000:+.1f} ms")
    table.caption = (f"{len(found['sim'])} requests per path, alternating; median of the per-pair "
                     f"end-to-end differences: {', '.join(medians)}")
    return table


def bench_gateway(redis_url: str, requests: int, clients: int, cap: int, speed: float,
                  think: int, answer: int, *, disconnects: int = 20, exact_count: bool = True,
                  litellm: str | None = None) -> tuple[Table, dict[str, float]]:
    with GatewayBench(redis_url, speed, cap, exact_count, litellm) as bench:
        found = asyncio.run(bench.latency(requests, think, answer))
        freed = bench.disconnects(disconnects) if disconnects else []
        crowd = asyncio.run(bench.crowd(clients, think, answer))
    if freed:
        crowd.update(disconnects=len(freed), freed_ms_p50=1000 * percentile(freed, 50),
                     freed_ms_max=1000 * max(freed))
    return latency_table(found), crowd
