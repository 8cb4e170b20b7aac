"""The exact-repeat cache of one project (docs/usage.md, "Exact-repeat cache"): a gateway chat
request identical to an earlier one is answered from that answer, before admission: no slot, no
quota, no model turn. Queue jobs use the same entries and stats with runs and waiters of their
own (``take_run``, ``add_waiter``, ``end_run``; the flow is in fleet/worker/repeats.py).

Identity. The key is a digest of what the gateway would send to vLLM (``request_digest``): the
model name and the request body (messages after the project's system prompt and untrusted-content
fencing, tools, response format, sampling, seed, token budgets, the project's cache salt), with
the two fields that differ for every request left out: ``request_id`` and the random fence tag
that marks untrusted content (replaced by a fixed word before hashing). So two requests share an
entry only when vLLM would have been asked the same thing. Entries live under the project's own
keys (``{p}rcache:{<project>}:...``): a digest is never looked up in another project's cache, so
no request can be answered with another project's answer, whatever it sends.

What is served. Only requests that ask for a repeatable answer: temperature 0 or a fixed seed,
unless the project's ``repeat_cache.sampled`` says any repeat may be served. Only answers that
ended ``OK`` are kept (never a truncated or failed one), at most ``max_entry_bytes`` each, at most
``max_entries`` per project (the oldest go first) for ``ttl_s`` seconds.

No stampede. A request that finds no entry tries to become the one computing it: a redis-py
``Lock`` on ``rcache:{<project>}:run:<digest>`` (30 s, renewed while it runs). The others wait for
the entry to appear (polling, 20 ms growing to 250 ms) up to ``repeat_cache.wait_s``; when the
lock goes without an entry (the first request failed, its gateway died: the lock lapses), the
next waiter takes it; past ``wait_s`` a waiter runs itself, uncached. So N identical requests
arriving together make one model turn.

Trust. No project user may read or write the rcache keys (fleet/cli/acl.py grants none): only
the gateways, on the fleet's service user. A project can fill only its own cache, with its own
requests, bounded by ``max_entries``.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from redis.lock import Lock

from fleet.core.config import RepeatCacheSettings
from fleet.core.keys import Keys
from fleet.core.lua import Scripts

LOCK_S = 30.0  # the computing request's lock; renewed every LOCK_S / 3 while it runs
FIRST_POLL_S, LAST_POLL_S = 0.02, 0.25
UNSAID = ("request_id",)  # body fields that differ for every request


def request_digest(model: str, body: dict[str, Any], fence_tag: str | None) -> str:
    """The cache key of a request: sha256 over the model and the body as vLLM would get it, but
    its request id, with the fence tag replaced by a fixed word."""
    kept = {k: v for k, v in body.items() if k not in UNSAID}
    text = json.dumps({"model": model, "body": kept}, sort_keys=True, separators=(",", ":"))
    if fence_tag:
        text = text.replace(fence_tag, "FENCE")
    return hashlib.sha256(text.encode()).hexdigest()


def repeatable(settings: RepeatCacheSettings, temperature: float | None, seed: int | None) -> bool:
    """May a repeat of this request be answered from the cache?"""
    return settings.enabled and (settings.sampled or seed is not None or temperature == 0)


@dataclass
class Entry:
    """A kept answer: what the client got, and when it was made."""

    content: str
    reasoning: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    usage: dict[str, Any]
    backend: str
    created_at: float
    expires_at: float
    extra: dict[str, Any] = field(default_factory=dict)


class RepeatCache:
    """One project's cache on one client (module docstring)."""

    def __init__(self, client: redis.Redis, keys: Keys, project: str, settings: RepeatCacheSettings,
                 clock: Any = time.time) -> None:
        self.client, self.keys, self.project, self.settings, self.clock = client, keys, project, settings, clock
        scripts = Scripts(client, "fleet.core", ("rcache_put", "rcache_end"))
        self._put, self._end = scripts["rcache_put"], scripts["rcache_end"]

    def _key(self, part: str) -> str:
        return self.keys.rcache(self.project, part)

    def get(self, digest: str, *, count: bool = True) -> Entry | None:
        raw = self.client.hget(self._key("e"), digest)
        entry = None
        if raw is not None:
            try:
                found = Entry(**json.loads(raw))
            except (ValueError, TypeError):  # another version's format: a miss, never a failure
                found = None
            entry = found if found is not None and found.expires_at > self.clock() else None
        if count:
            self.client.hincrby(self._key("s"), "hits" if entry else "misses", 1)
        return entry

    def count(self, what: str) -> None:
        """One more of a stats counter (hits, misses, waits)."""
        self.client.hincrby(self._key("s"), what, 1)

    def lock(self, digest: str) -> Lock:
        """The lock of the request computing ``digest`` (not yet acquired)."""
        # thread_local off: the gateway acquires, renews and releases it on different pool threads
        return self.client.lock(self._key(f"run:{digest}"), timeout=LOCK_S, blocking=False, thread_local=False)

    def put(self, digest: str, entry: Entry) -> bool:
        """Keep ``entry`` (False: over ``max_entry_bytes``, not kept)."""
        raw = json.dumps(asdict(entry), separators=(",", ":"))
        if len(raw.encode()) > self.settings.max_entry_bytes:
            return False
        self._put(keys=[self._key("e"), self._key("x"), self._key("s")],
                  args=[digest, raw, repr(entry.expires_at), repr(self.clock()), self.settings.max_entries,
                        int(self.settings.ttl_s) + 60])
        return True

    # -- queue jobs (fleet/worker/repeats.py): one job computes, the others wait in the store ----
    def take_run(self, digest: str, ref: str) -> str | None:
        """Make job ``ref`` the one computing ``digest`` (for ``wait_s``); None when it is (or
        already was: a second delivery of its prep), else the ref of the job computing it."""
        key = self._key(f"jrun:{digest}")
        for _ in range(3):  # a run that lapsed between the SET and the GET: take it again
            if self.client.set(key, ref, nx=True, px=self._run_ms()):
                return None
            runner = self.client.get(key)
            if runner is not None:
                found = runner.decode() if isinstance(runner, bytes) else str(runner)
                return None if found == ref else found
        return None

    def add_waiter(self, digest: str, ref: str) -> None:
        """Job ``ref`` waits for the job computing ``digest``."""
        key = self._key(f"jwait:{digest}")
        pipe = self.client.pipeline(transaction=True)
        pipe.sadd(key, ref)
        pipe.pexpire(key, self._run_ms() + 60_000)
        pipe.hincrby(self._key("s"), "waits", 1)
        pipe.execute()

    def leave(self, digest: str, ref: str) -> None:
        """Job ``ref`` waits for ``digest`` no more (it runs itself)."""
        self.client.srem(self._key(f"jwait:{digest}"), ref)

    def end_run(self, digest: str, ref: str, kept: bool) -> list[str]:
        """Job ``ref``'s turn at ``digest`` ended, its answer ``kept`` or not: the waiters to serve
        the kept answer, or the one waiter that computes it now (rcache_end.lua)."""
        found = self._end(keys=[self._key(f"jrun:{digest}"), self._key(f"jwait:{digest}")],
                          args=[ref, "kept" if kept else "lost", self._run_ms()])
        return [w.decode() if isinstance(w, bytes) else str(w) for w in found]

    def _run_ms(self) -> int:
        return max(1000, int(self.settings.wait_s * 1000))

    def stats(self) -> dict[str, int]:
        """hits, misses, waits, stores, evictions, and the entries and bytes held now."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self._key("s"))
        pipe.zcount(self._key("x"), self.clock(), "+inf")
        pipe.memory_usage(self._key("e"))
        counters, live, size = pipe.execute()
        out = {name: 0 for name in ("hits", "misses", "waits", "stores", "evictions")}
        out.update({(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in counters.items()})
        out["entries"] = int(live)
        out["bytes"] = int(size or 0)
        return out

    def clear(self) -> int:
        """Forget every answer (the stats stay); the number of entries dropped."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hlen(self._key("e"))
        pipe.delete(self._key("e"), self._key("x"))
        dropped, _ = pipe.execute()
        return int(dropped)
