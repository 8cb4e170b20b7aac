"""Several real dispatcher processes on one Redis never admit past the cap, and admit every job
exactly once.

Each child runs ``run_dispatcher`` with a ``send`` that plays the inference worker: it counts
itself in (INCR, recording the value it saw), holds the slot for a short random time in a thread,
counts itself out and releases the lease. The count is kept outside the store, so an admission
past the cap would show as a value above it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import redis

from fleet.core.config import Settings
from schedulers.store import make_store
from schedulers.store.base import PendingItem
from tests.support.testenv import TEST_REDIS_URL

ROOT = Path(__file__).resolve().parents[2]
CAP = 4
JOBS = 150
DISPATCHERS = 3

CHILD = """
import os, random, sys, threading, time
import redis
from fleet.core.config import Settings
from schedulers.dispatcher import run_dispatcher
from schedulers.store import make_store

url, prefix, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
settings = Settings(key_prefix=prefix, backend={"max_num_seqs": cap},
                    admission={"backend_gate": False, "metrics_port": 0, "lease_ttl_s": 60})
client = redis.Redis.from_url(url)
store = make_store(settings, client)
stop = threading.Event()
rng = random.Random()
t = prefix + "test:"

def finish(grant):
    time.sleep(rng.uniform(0.005, 0.02))  # the simulated request: long enough for all to take part
    client.decr(t + "observed")
    if not store.release(grant.job_id, grant.fence):
        client.rpush(t + "errors", "release failed " + grant.job_id)

def send(grant):
    client.rpush(t + "seen", client.incr(t + "observed"))
    client.rpush(t + "grants", grant.job_id + " " + str(os.getpid()))
    threading.Thread(target=finish, args=(grant,)).start()

def watch():
    redis.Redis.from_url(url).blpop([t + "stop"])
    stop.set()
    store.wake()

threading.Thread(target=watch, daemon=True).start()
client.rpush(t + "ready", os.getpid())  # the test adds its jobs once every child got this far
run_dispatcher(settings, client, send, stop)
"""


def test_many_dispatchers_hold_the_cap(key_prefix: str, redis_client: redis.Redis) -> None:
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, TEST_REDIS_URL, key_prefix, str(CAP)], cwd=ROOT
        )
        for _ in range(DISPATCHERS)
    ]
    settings = Settings(key_prefix=key_prefix, backend={"max_num_seqs": CAP})
    store = make_store(settings, redis_client)
    t = key_prefix + "test:"
    try:
        # the jobs come once every child is about to dispatch: a child that a loaded machine
        # started a second late would otherwise find them all granted by the others
        for _ in range(600):
            if redis_client.llen(t + "ready") >= DISPATCHERS:
                break
            threading.Event().wait(0.05)
        for i in range(JOBS):
            store.add_pending(PendingItem(f"j{i:03d}", f"p{i % 3}", 100 + i, 100))
        done = threading.Event()
        for _ in range(1200):  # wait (up to 60 s) until every job was granted
            if redis_client.llen(t + "grants") >= JOBS:
                done.set()
                break
            done.wait(0.05)
        assert done.is_set(), f"only {redis_client.llen(t + 'grants')} grants"
    finally:
        redis_client.rpush(t + "stop", *["stop"] * DISPATCHERS)
        for child in children:
            child.wait(timeout=30)
    assert [child.returncode for child in children] == [0] * DISPATCHERS
    grants = [g.decode().split() for g in redis_client.lrange(t + "grants", 0, -1)]
    seen = [int(v) for v in redis_client.lrange(t + "seen", 0, -1)]
    assert sorted(job for job, _ in grants) == [f"j{i:03d}" for i in range(JOBS)]  # once each
    assert max(seen) <= CAP
    assert max(seen) == CAP  # the cap was reached, so the check above had something to catch
    assert len({pid for _, pid in grants}) >= 2  # several dispatchers really took part
    assert redis_client.lrange(t + "errors", 0, -1) == []
    snap = store.snapshot()
    assert (snap.in_flight, snap.reserved_kv_tokens, snap.pending) == (0, 0, {})
