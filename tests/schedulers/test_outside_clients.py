"""Headroom beside clients the fleet does not control: outside clients hold sequences on
``fleet sim`` (cap 8) while a dispatcher (thread, real Redis, backend gate on) admits jobs that
in-test workers claim, stream and release, as inference workers do. The server's own total
must stay at its ceiling (its waiting queue never used), the fleet's share is what the outsiders
left, and once they are gone the fleet uses the whole cap and finishes every job."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from fleet.core.config import Settings
from fleet.sim.server import start_sim_process
from schedulers.dispatcher import run_dispatcher
from schedulers.metrics import StoreCollector
from schedulers.store import make_store
from schedulers.store.base import Grant, PendingItem

CAP = 8
OUTSIDERS = 6


def _chat(http: httpx.Client, text: str, tokens: int) -> None:
    body = {"model": "local", "stream": True, "max_tokens": tokens + 64,
            "messages": [{"role": "user", "content": text}]}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        for _ in response.iter_bytes():
            pass


def _running(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.split("\n"):
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_fleet_admits_only_into_the_headroom_outsiders_leave(redis_url: str, key_prefix: str) -> None:
    sim = start_sim_process(speed=20.0, max_num_seqs=CAP, log_level="warning")
    client = redis.Redis.from_url(redis_url)
    settings = Settings.model_validate({
        "key_prefix": key_prefix,
        "backend": {"url": sim.base_url, "max_num_seqs": CAP},
        "admission": {"backend_gate": True, "metrics_port": 0, "lease_ttl_s": 60,
                      "scrape_interval_s": 0.1},
    })
    store = make_store(settings, client)
    http = httpx.Client(base_url=sim.base_url, timeout=120, limits=httpx.Limits(max_connections=32))
    pool = ThreadPoolExecutor(max_workers=2 * CAP + OUTSIDERS)
    stop, lock = threading.Event(), threading.Lock()
    in_flight: list[int] = [0]
    sent: list[int] = []  # the fleet's in-flight count at each send
    finished = threading.Semaphore(0)

    def work(grant: Grant) -> None:
        assert store.claim(grant.job_id, grant.fence, "w", time.time())
        try:
            _chat(http, f"{grant.job_id} [sim:think=300] [sim:answer=20]", 320)
        finally:
            with lock:
                in_flight[0] -= 1
            store.release(grant.job_id, grant.fence)
            finished.release()

    def send(grant: Grant) -> None:
        with lock:
            in_flight[0] += 1
            sent.append(in_flight[0])
        pool.submit(work, grant)

    try:
        outside = [pool.submit(_chat, http, f"outside {n} [sim:think=3000] [sim:answer=10]", 3010)
                   for n in range(OUTSIDERS)]
        while _running(http) < OUTSIDERS:
            stop.wait(0.02)
        store.add_pending_many(PendingItem(f"p/j{n}", "p", 300, 400) for n in range(24))
        dispatcher = threading.Thread(target=run_dispatcher, args=(settings, client, send, stop))
        dispatcher.start()
        for future in outside:
            future.result(timeout=120)
        for _ in range(24):
            assert finished.acquire(timeout=120)
        stats = http.get("/sim/stats").json()
        holds = store.snapshot().holds
        exported = {m.name: m for m in StoreCollector(store).collect()}
    finally:
        stop.set()
        store.wake()
        pool.shutdown(wait=True)
        http.close()
        sim.stop()
        client.close()
    assert stats["max_waiting_seen"] == 0  # the server's own total never passed its ceiling
    assert stats["max_running_seen"] == CAP  # and once the outsiders left, the fleet filled it
    # The first ten grants run (two at a time, 320 tokens each) well inside the outsiders'
    # 3,010 tokens: the fleet took only the headroom they left.
    assert max(sent[:10]) == CAP - OUTSIDERS
    assert holds.get("outside", 0) > 0
    assert "fleet_backend_outside_sequences" in exported
