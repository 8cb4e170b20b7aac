"""Quotas per API key (docs/usage.md, "Quotas per API key"): what one gateway key of a project may
spend, beside the project's own quota.

A project's quota is decided inside admission (schedulers/store/lua/admit.lua), because it binds
queue jobs and gateway requests alike. A key's quota binds the gateway requests sent with that
key, so the gateway decides it, before admission, in one atomic script of its own (KEYQUOTA):
check every limit of the key's windows and add the request's worst case (the same
``Quota.reserve``), or say which limit holds it. Any number of gateways share the counters in
Redis, so together they never reserve past a key's quota. When the request ends, its worst case
is settled to what it spent (SETTLE, the script the project quota uses, on the key's keys); a
request that was never admitted settles at 0.

Keys (each under the project's hash tag, one Cluster slot): ``kquota:{<project>}:<key>:m:<minute>``
(hash t, r), ``...:d:<YYYYMMDD>``, ``...:mo:<YYYYMM>`` and ``kquota:{<project>}:res`` (ref ->
reservation). ``<key>`` is the key's ledger label, ``sha256:<8 hex>``. No project user may read or
write them (fleet/cli/acl.py grants none).

Jobs the gateway enqueues for a key (``/v1/tasks``, ``/v1/batches`` lines) reserve with the same
script at each turn's claim, in the inference worker (fleet/worker/keyquotas.py). Not covered:
``max_in_flight`` per key (a key's requests in flight are its project's).
"""

from __future__ import annotations

import redis

from fleet.core.keys import Keys
from fleet.core.lua import Scripts
from schedulers.policy.quota import Quota, Windows


class KeyQuotas:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client, self.keys = client, keys
        scripts = Scripts(client, "schedulers.store", ("keyquota", "settle"), prelude="prelude")
        self._reserve, self._settle = scripts["keyquota"], scripts["settle"]

    def _windows(self, project: str, label: str, windows: Windows) -> list[str]:
        base = f"{self.keys.prefix}kquota:{{{project}}}:{label}"
        return [f"{base}:m:{windows.minute}", f"{base}:d:{windows.day}", f"{base}:mo:{windows.month}"]

    def _res(self, project: str) -> str:
        return f"{self.keys.prefix}kquota:{{{project}}}:res"

    def reserve(self, project: str, label: str, quota: Quota, ref: str, prompt_tokens: int,
                max_new_tokens: int, now: float) -> tuple[str, int, float] | None:
        """Reserve the request's worst case; None when reserved, else (limit, its value, seconds
        until its window ends)."""
        w = Windows.at(now)
        reply = self._reserve(
            keys=[*self._windows(project, label, w), self._res(project)],
            args=[ref, label, quota.reserve(prompt_tokens, max_new_tokens), quota.tokens_per_minute,
                  quota.requests_per_minute, quota.tokens_per_day, quota.tokens_per_month, repr(now),
                  w.minute, repr(w.minute_end), w.day, repr(w.day_end), w.month, repr(w.month_end)])
        words = [r.decode() if isinstance(r, bytes) else str(r) for r in reply]
        if words[0] == "ok":
            return None
        return words[1], int(words[2]), float(words[3])

    def settle(self, project: str, ref: str, spent: int) -> bool:
        """The request's reservation meets what it spent (0: it was never admitted)."""
        raw = self.client.hget(self._res(project), ref)
        if raw is None:
            return False
        held = raw.decode() if isinstance(raw, bytes) else str(raw)
        label, _fence, _cost, minute, day, month, *_flags = held.split(" ")
        base = f"{self.keys.prefix}kquota:{{{project}}}:{label}"
        keys = [self._res(project), f"{base}:m:{minute}", f"{base}:d:{day}", f"{base}:mo:{month}"]
        return bool(self._settle(keys=keys, args=[ref, held, spent]))

    def used(self, project: str, label: str, now: float) -> tuple[int, int, int, int]:
        """(tokens this minute, requests this minute, tokens today, tokens this month)."""
        minute, day, month = self._windows(project, label, Windows.at(now))
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(minute, "t", "r")
        pipe.get(day)
        pipe.get(month)
        (t, r), d, mo = pipe.execute()
        return int(t or 0), int(r or 0), int(d or 0), int(mo or 0)
