"""The admission store on Redis: every decision is one atomic Lua script, so any number of
dispatcher processes on any number of hosts can admit at once and never pass a limit.

Key schema (D = ``Keys(prefix).dispatch`` = ``{p}d:``; the same list is in fleet/core/keys.py):
  D pending:<project>:<band>:<size>  zset  pending job ids; band interactive|batch, size
                                           short|long; score = fairshare.pending_score (ms)
  D item:<id>      hash    project band size prompt max_new kv long enq score pending(1|0)
                           deadline (absent: none); lives while the job is pending or leased
                           (a lease needs it to requeue)
  D deadlines      zset    pending job ids that have a deadline, score = deadline (unix
                           seconds); an entry leaves at admission, cancel or expiry and comes
                           back when an expired lease requeues the job
  D projects       set     projects that may have pending work (pruned when found empty)
  D vtime          hash    project -> finish tag F_p (start-time fair queuing, tokens/weight)
  D leases         zset    in-flight job ids, score = lease expiry (unix seconds)
  D lease:<id>     hash    fence kv long expires admitted_at project owner (absent until
                           the first ``claim``; a delivery of another owner is refused)
  D state          hash    in_flight kv long (counters of live leases), bucket bucket_at
                           (prefill token bucket), last_admit, blocked_job blocked_since
                           (head-of-line reservation), vtime (V)
  D fence          string  fencing token counter (INCR; every grant gets a new, larger one)
  D wake           list    LPUSHed on submit/release/expiry, capped at 100; dispatchers BLPOP it
  D backend        hash    scraped_at hold (gate verdict) + raw figures (schedulers/scrape.py)
  D stats          hash    admissions, hold:<reason>

Admission takes two round trips. ``HEADS`` reads the head of every queue of every project (one
call, read-mostly); Python orders them with the pure policy (schedulers/policy/fairshare.py); ``ADMIT``
then, atomically, re-reads those candidates, drops any that another dispatcher took meanwhile,
applies the backend gate and every limit (the rules of schedulers/policy/limits.py, in the same order),
and grants the first that fits: pop from pending, counters, bucket, virtual times, fence, lease.
A race between dispatchers can only change who goes first, never what is allowed; when every
candidate was taken, admission reads the heads again.

``CLAIM`` (worker start), ``REQUEUE`` (a grant that could not be sent) and ``EXPIRE``
(pending deadlines, at most 200 a call) are single scripts too. ``wait_for_wake`` never blocks
longer than ``MAX_BLOCK_S`` (or 80% of the client's socket timeout, if that is shorter): redis-py
8 gives every connection a 5 s socket timeout, and a BLPOP blocking past it raises TimeoutError.

Times come from the caller (``now``), not from Redis TIME, so tests can drive a fake clock;
dispatchers on several hosts need synchronised clocks (NTP) for lease expiry to mean the same.
Keys are built inside the scripts from the prefix: this targets a standalone Redis, not Cluster.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis

from fleet.core.keys import Keys
from schedulers.policy import fairshare
from schedulers.policy.limits import kv_tokens
from schedulers.store.base import AdmitResult, Grant, PendingItem, StoreConfig, StoreSnapshot

log = logging.getLogger(__name__)

_PRELUDE = """
local D = ARGV[1]
local function k(...) return D .. table.concat({...}, ':') end
local function num(v, default) if v then return tonumber(v) end return default end
local function fmt(x) return string.format('%.17g', x) end
local function wake()
  redis.call('LPUSH', k('wake'), '1')
  redis.call('LTRIM', k('wake'), 0, 99)
end
-- Give back what a lease holds; the counters always equal the sum over live leases.
local function free_lease(id)
  local lease = k('lease', id)
  local f = redis.call('HMGET', lease, 'kv', 'long')
  if not f[1] then return false end
  redis.call('HINCRBY', k('state'), 'in_flight', -1)
  redis.call('HINCRBY', k('state'), 'kv', -tonumber(f[1]))
  if f[2] == '1' then redis.call('HINCRBY', k('state'), 'long', -1) end
  redis.call('DEL', lease)
  redis.call('ZREM', k('leases'), id)
  return true
end
-- Put a job whose lease is gone back in line at its original score (and its deadline back).
local function requeue_item(id)
  local item = k('item', id)
  local f = redis.call('HMGET', item, 'pending', 'project', 'band', 'size', 'score', 'deadline')
  if f[2] and f[1] ~= '1' then
    redis.call('ZADD', k('pending', f[2], f[3], f[4]), f[5], id)
    redis.call('HSET', item, 'pending', '1')
    redis.call('SADD', k('projects'), f[2])
    if f[6] then redis.call('ZADD', k('deadlines'), f[6], id) end
  end
end
-- Take a pending job out of line (cancel, deadline); keep its item while a lease needs it.
local function unqueue(id)
  local item = k('item', id)
  local f = redis.call('HMGET', item, 'pending', 'project', 'band', 'size')
  redis.call('ZREM', k('deadlines'), id)
  if f[1] ~= '1' then return false end
  redis.call('ZREM', k('pending', f[2], f[3], f[4]), id)
  if redis.call('EXISTS', k('lease', id)) == 1 then
    redis.call('HSET', item, 'pending', '0')
  else
    redis.call('DEL', item)
  end
  return true
end
"""

# ARGV: D, id, project, band, size, prompt, max_new, kv, long, enq, score, deadline ('' = none)
_ADD = """
local item = k('item', ARGV[2])
if redis.call('HGET', item, 'pending') == '1' then return 0 end
-- A job arriving at a drained system (nothing pending, nothing in flight) restarts fair share
-- even: V moves to the largest finish tag (fairshare.forgive).
if num(redis.call('HGET', k('state'), 'in_flight'), 0) == 0 then
  local drained = true
  for _, p in ipairs(redis.call('SMEMBERS', k('projects'))) do
    for _, q in ipairs({'interactive:short', 'interactive:long', 'batch:short', 'batch:long'}) do
      if redis.call('ZCARD', k('pending', p, q)) > 0 then drained = false end
    end
  end
  if drained then
    local V = num(redis.call('HGET', k('state'), 'vtime'), 0)
    for _, f in ipairs(redis.call('HVALS', k('vtime'))) do V = math.max(V, tonumber(f)) end
    redis.call('HSET', k('state'), 'vtime', fmt(V))
  end
end
redis.call('HSET', item, 'project', ARGV[3], 'band', ARGV[4], 'size', ARGV[5], 'prompt', ARGV[6],
  'max_new', ARGV[7], 'kv', ARGV[8], 'long', ARGV[9], 'enq', ARGV[10], 'score', ARGV[11],
  'pending', '1')
redis.call('ZADD', k('pending', ARGV[3], ARGV[4], ARGV[5]), ARGV[11], ARGV[2])
if ARGV[12] ~= '' then
  redis.call('HSET', item, 'deadline', ARGV[12])
  redis.call('ZADD', k('deadlines'), ARGV[12], ARGV[2])
else
  redis.call('HDEL', item, 'deadline')
  redis.call('ZREM', k('deadlines'), ARGV[2])
end
redis.call('SADD', k('projects'), ARGV[3])
wake()
return 1
"""

# ARGV: D. Returns {V, {project, F, {band, size, id, score, prompt, max_new, enq}...}...}
_HEADS = """
local out = {redis.call('HGET', k('state'), 'vtime') or '0'}
for _, project in ipairs(redis.call('SMEMBERS', k('projects'))) do
  local row = {project, redis.call('HGET', k('vtime'), project) or '0'}
  for _, band in ipairs({'interactive', 'batch'}) do
    for _, size in ipairs({'short', 'long'}) do
      local head = redis.call('ZRANGE', k('pending', project, band, size), 0, 0, 'WITHSCORES')
      if head[1] then
        local f = redis.call('HMGET', k('item', head[1]), 'prompt', 'max_new', 'enq')
        table.insert(row, {band, size, head[1], head[2], f[1], f[2], f[3]})
      end
    end
  end
  if #row > 2 then table.insert(out, row) else redis.call('SREM', k('projects'), project) end
end
return out
"""

# ARGV: D, now, ttl, max_seqs, kv_budget, max_long, rate, burst, spacing, bypass, gate, stale,
#       then (id, project, weight) per candidate in fair order.
# Returns {1, id, project, fence, prompt, kv, long, expires, waited} or {0, reason, retry_in}.
_ADMIT = """
local now, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
local max_seqs, kv_budget, max_long = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local rate, burst, spacing = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local bypass, gate, stale = tonumber(ARGV[10]), ARGV[11] == '1', tonumber(ARGV[12])
local st = k('state')
local function hold(reason, retry)
  redis.call('HINCRBY', k('stats'), 'hold:' .. reason, 1)
  return {0, reason, retry and fmt(retry) or ''}
end
local cands = {}
for i = 13, #ARGV, 3 do
  local id = ARGV[i]
  local f = redis.call('HMGET', k('item', id), 'pending', 'band', 'size', 'prompt', 'kv', 'long',
    'enq', 'max_new')
  if f[1] == '1' then
    table.insert(cands, {id = id, project = ARGV[i + 1], weight = tonumber(ARGV[i + 2]),
      band = f[2], size = f[3], prompt = tonumber(f[4]), kv = tonumber(f[5]), long = f[6] == '1',
      enq = tonumber(f[7]), max_new = tonumber(f[8])})
  end
end
if #cands == 0 then return {0, 'conflict', ''} end
if gate then
  local b = redis.call('HMGET', k('backend'), 'scraped_at', 'hold')
  if not b[1] or now - tonumber(b[1]) > stale then return hold('backend_stale') end
  if b[2] and b[2] ~= '' then return hold('backend_' .. b[2]) end
end
local s = redis.call('HMGET', st, 'in_flight', 'kv', 'long', 'bucket', 'bucket_at', 'last_admit',
  'blocked_job', 'blocked_since', 'vtime')
local in_flight, kv_used, long_used = num(s[1], 0), num(s[2], 0), num(s[3], 0)
if in_flight >= max_seqs then return hold('seqs') end
if s[6] and spacing > 0 then
  local wait = tonumber(s[6]) + spacing - now
  if wait > 0 then return hold('spacing', wait) end
end
local level = burst
if s[4] then level = math.min(burst, tonumber(s[4]) + math.max(0, now - tonumber(s[5])) * rate) end
local first_reason, soonest, pick = nil, nil, nil
for i, c in ipairs(cands) do
  local why, retry = nil, nil
  if kv_used + c.kv > kv_budget and in_flight > 0 then why = 'kv'
  elseif c.long and long_used >= max_long then why = 'long'
  else
    local need = math.min(c.prompt, burst)
    if level < need then why, retry = 'bucket', (need - level) / rate end
  end
  if not why then pick = i break end
  if retry and (not soonest or retry < soonest) then soonest = retry end
  if i == 1 then
    first_reason = why
    if why == 'kv' or why == 'bucket' then
      if s[7] ~= c.id then
        s[8] = fmt(now)
        redis.call('HSET', st, 'blocked_job', c.id, 'blocked_since', s[8])
      end
      if now - tonumber(s[8]) >= bypass then return hold(why, retry) end
    end
  end
end
if not pick then return hold(first_reason, soonest) end
local c, top = cands[pick], cands[1]
free_lease(c.id)
redis.call('HINCRBY', st, 'in_flight', 1)
redis.call('HINCRBY', st, 'kv', c.kv)
if c.long then redis.call('HINCRBY', st, 'long', 1) end
redis.call('HSET', st, 'bucket', fmt(level - c.prompt), 'bucket_at', fmt(now),
  'last_admit', fmt(now))
if pick == 1 then redis.call('HDEL', st, 'blocked_job', 'blocked_since') end
local V = math.max(num(s[9], 0), num(redis.call('HGET', k('vtime'), top.project), 0))
local start = math.max(V, num(redis.call('HGET', k('vtime'), c.project), 0))
redis.call('HSET', k('vtime'), c.project, fmt(start + (c.prompt + c.max_new) / c.weight))
redis.call('HSET', st, 'vtime', fmt(V))
local fence = redis.call('INCR', k('fence'))
local expires = now + ttl
redis.call('HSET', k('lease', c.id), 'fence', fence, 'kv', c.kv, 'long', c.long and '1' or '0',
  'expires', fmt(expires), 'admitted_at', fmt(now), 'project', c.project)
redis.call('ZADD', k('leases'), fmt(expires), c.id)
redis.call('ZREM', k('pending', c.project, c.band, c.size), c.id)
redis.call('ZREM', k('deadlines'), c.id)
redis.call('HSET', k('item', c.id), 'pending', '0')
redis.call('HINCRBY', k('stats'), 'admissions', 1)
return {1, c.id, c.project, fence, c.prompt, c.kv, c.long and 1 or 0, fmt(expires),
  fmt(math.max(0, now - c.enq))}
"""

# ARGV: D, id, fence, owner, now, ttl. Live lease with this fence, unclaimed or claimed by this
# owner: record the owner and renew, in one step.
_CLAIM = """
local lease = k('lease', ARGV[2])
local f = redis.call('HMGET', lease, 'fence', 'expires', 'owner')
if f[1] ~= ARGV[3] or tonumber(f[2]) < tonumber(ARGV[5]) then return 0 end
if f[3] and f[3] ~= ARGV[4] then return 0 end
local expires = fmt(tonumber(ARGV[5]) + tonumber(ARGV[6]))
redis.call('HSET', lease, 'owner', ARGV[4], 'expires', expires)
redis.call('ZADD', k('leases'), expires, ARGV[2])
return 1
"""

# ARGV: D, id, fence, now, ttl
# ARGV: D, id, fence, max_new, kv
_RESIZE = """
local lease = k('lease', ARGV[2])
local f = redis.call('HMGET', lease, 'fence', 'kv')
if f[1] ~= ARGV[3] then return 0 end
redis.call('HSET', lease, 'kv', ARGV[5])
redis.call('HINCRBY', k('state'), 'kv', tonumber(ARGV[5]) - tonumber(f[2]))
redis.call('HSET', k('item', ARGV[2]), 'max_new', ARGV[4], 'kv', ARGV[5])
return 1
"""

_RENEW = """
local f = redis.call('HMGET', k('lease', ARGV[2]), 'fence', 'expires')
if f[1] ~= ARGV[3] or tonumber(f[2]) < tonumber(ARGV[4]) then return 0 end
local expires = fmt(tonumber(ARGV[4]) + tonumber(ARGV[5]))
redis.call('HSET', k('lease', ARGV[2]), 'expires', expires)
redis.call('ZADD', k('leases'), expires, ARGV[2])
return 1
"""

# ARGV: D, id, fence
_RELEASE = """
if redis.call('HGET', k('lease', ARGV[2]), 'fence') ~= ARGV[3] then return 0 end
free_lease(ARGV[2])
if redis.call('HGET', k('item', ARGV[2]), 'pending') ~= '1' then
  redis.call('DEL', k('item', ARGV[2]))
end
wake()
return 1
"""

# ARGV: D, now. Expired leases (expiry < now): free them, requeue the job at its original score.
_REAP = """
local ids = redis.call('ZRANGEBYSCORE', k('leases'), '-inf', '(' .. ARGV[2], 'LIMIT', 0, 200)
for _, id in ipairs(ids) do
  free_lease(id)
  requeue_item(id)
end
if #ids > 0 then wake() end
return ids
"""

# ARGV: D, id, fence. Give a lease up at once and put the job back in line (a failed send).
_REQUEUE = """
if redis.call('HGET', k('lease', ARGV[2]), 'fence') ~= ARGV[3] then return 0 end
free_lease(ARGV[2])
requeue_item(ARGV[2])
wake()
return 1
"""

# ARGV: D, id
_CANCEL = """
if unqueue(ARGV[2]) then return 1 end
return 0
"""

# ARGV: D, now. Pending jobs whose deadline <= now leave the line; returns their ids. Entries
# of jobs no longer pending (none expected; kept safe) are dropped without being returned.
_EXPIRE = """
local ids = redis.call('ZRANGEBYSCORE', k('deadlines'), '-inf', ARGV[2], 'LIMIT', 0, 200)
local out = {}
for _, id in ipairs(ids) do
  if unqueue(id) then table.insert(out, id) end
end
return out
"""

_ROUNDS = 4  # admission attempts when other dispatchers keep taking our candidates
MAX_BLOCK_S = 4.0  # longest BLPOP; below redis-py 8's default 5 s socket timeout


class RedisStore:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        config: StoreConfig,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._client = client
        self._d = keys.dispatch
        self._clock = clock
        self._max_block_s = max_block_s(client)
        self._scripts = {
            name: client.register_script(_PRELUDE + body)
            for name, body in (
                ("add", _ADD),
                ("heads", _HEADS),
                ("admit", _ADMIT),
                ("claim", _CLAIM),
                ("renew", _RENEW),
                ("resize", _RESIZE),
                ("release", _RELEASE),
                ("reap", _REAP),
                ("requeue", _REQUEUE),
                ("cancel", _CANCEL),
                ("expire", _EXPIRE),
            )
        }

    def _run(self, name: str, *args: Any) -> Any:
        return self._scripts[name](args=[self._d, *args])

    # -- submit / cancel ---------------------------------------------------------------------
    def add_pending(self, item: PendingItem) -> None:
        self._run("add", *self._add_args(item))

    def add_pending_many(self, items: Iterable[PendingItem]) -> None:
        """``add_pending`` for a batch, in one pipelined round trip (each add stays atomic)."""
        pipe = self._client.pipeline(transaction=False)
        for item in items:
            self._scripts["add"](args=[self._d, *self._add_args(item)], client=pipe)
        pipe.execute()

    def _add_args(self, item: PendingItem) -> list[Any]:
        enqueued_at = item.enqueued_at or self._clock()
        limits = self.config.limits
        long = item.prompt_tokens > limits.long_prompt_tokens
        score = fairshare.pending_score(enqueued_at, item.priority, self.config.aging_s)
        return [
            item.job_id,
            item.project,
            item.band,
            "long" if long else "short",
            item.prompt_tokens,
            item.max_new_tokens,
            kv_tokens(item.prompt_tokens, item.max_new_tokens, limits.block_tokens),
            "1" if long else "0",
            repr(enqueued_at),
            repr(score),
            "" if item.deadline is None else repr(float(item.deadline)),
        ]

    def cancel_pending(self, job_id: str) -> bool:
        return bool(self._run("cancel", job_id))

    def expire_deadlines(self, now: float) -> list[str]:
        return [_text(job_id) for job_id in self._run("expire", repr(now))]

    def next_deadline(self) -> float | None:
        first = self._client.zrange(self._d + "deadlines", 0, 0, withscores=True)
        return float(first[0][1]) if first else None

    # -- admission ---------------------------------------------------------------------------
    def admit_next(self, now: float) -> AdmitResult:
        for _ in range(_ROUNDS):
            heads = self._heads(now)
            if not heads:
                self._client.hincrby(self._d + "stats", "hold:empty", 1)
                return AdmitResult(None, "empty")
            result = self._admit(heads, now)
            if result.hold_reason != "conflict":
                return result
        return AdmitResult(None, "conflict", 0.0)

    def _heads(self, now: float) -> list[fairshare.Head]:
        raw = self._run("heads")
        views = []
        for row in raw[1:]:
            project = _text(row[0])
            heads = tuple(_head(project, fields) for fields in row[2:])
            views.append(
                fairshare.ProjectView(project, self.config.weight(project), float(row[1]), heads)
            )
        snapshot = fairshare.FairSnapshot(tuple(views), float(raw[0]), now)
        return fairshare.order(snapshot, self.config.aging_s)

    def _admit(self, heads: list[fairshare.Head], now: float) -> AdmitResult:
        limits, config = self.config.limits, self.config
        args: list[Any] = [
            repr(now),
            repr(config.lease_ttl_s),
            limits.max_num_seqs,
            limits.kv_budget_tokens,
            limits.max_long,
            repr(limits.prefill_tokens_per_s),
            limits.prefill_burst_tokens,
            repr(limits.min_spacing_s),
            repr(limits.hol_bypass_s),
            "1" if config.gate else "0",
            repr(config.scrape_stale_s),
        ]
        for head in heads:
            args += [head.job_id, head.project, repr(config.weight(head.project))]
        reply = self._run("admit", *args)
        if reply[0] == 0:
            retry = _text(reply[2])
            return AdmitResult(None, _text(reply[1]), float(retry) if retry else None)
        return AdmitResult(
            Grant(
                job_id=_text(reply[1]),
                project=_text(reply[2]),
                fence=int(reply[3]),
                prompt_tokens=int(reply[4]),
                kv_tokens=int(reply[5]),
                long=bool(reply[6]),
                lease_expires_at=float(reply[7]),
                waited_s=float(reply[8]),
            )
        )

    # -- leases ------------------------------------------------------------------------------
    def claim(self, job_id: str, fence: int, owner: str, now: float) -> bool:
        ttl = repr(self.config.lease_ttl_s)
        return bool(self._run("claim", job_id, fence, owner, repr(now), ttl))

    def renew(self, job_id: str, fence: int, now: float) -> bool:
        return bool(self._run("renew", job_id, fence, repr(now), repr(self.config.lease_ttl_s)))

    def resize(self, job_id: str, fence: int, max_new_tokens: int) -> bool:
        prompt = self._client.hget(f"{self._d}item:{job_id}", "prompt")
        if prompt is None:
            return False
        kv = kv_tokens(int(prompt), max_new_tokens, self.config.limits.block_tokens)
        return bool(self._run("resize", job_id, fence, max_new_tokens, kv))

    def release(self, job_id: str, fence: int) -> bool:
        return bool(self._run("release", job_id, fence))

    def requeue(self, job_id: str, fence: int) -> bool:
        return bool(self._run("requeue", job_id, fence))

    def lease_valid(self, job_id: str, fence: int) -> bool:
        value = self._client.hget(f"{self._d}lease:{job_id}", "fence")
        return value is not None and int(value) == fence

    def reap_expired(self, now: float) -> list[str]:
        expired = [_text(job_id) for job_id in self._run("reap", repr(now))]
        if expired:
            log.warning("leases expired, jobs back in line: %s", ", ".join(expired))
        return expired

    def next_expiry(self) -> float | None:
        first = self._client.zrange(self._d + "leases", 0, 0, withscores=True)
        return float(first[0][1]) if first else None

    # -- backend gate, wakes, observation ----------------------------------------------------
    def record_backend(self, scraped_at: float, hold: str, figures: dict[str, str]) -> None:
        mapping: dict[Any, Any] = {**figures, "scraped_at": repr(scraped_at), "hold": hold}
        self._client.hset(self._d + "backend", mapping=mapping)

    def backend(self) -> dict[str, str]:
        return _texts(self._client.hgetall(self._d + "backend"))

    def wake(self) -> None:
        pipe = self._client.pipeline()
        pipe.lpush(self._d + "wake", "1")
        pipe.ltrim(self._d + "wake", 0, 99)
        pipe.execute()

    def wait_for_wake(self, timeout_s: float) -> bool:
        """Block on the wake list; never longer than the client's socket timeout allows."""
        timeout_s = min(max(timeout_s, 0.001), self._max_block_s)
        return self._client.blpop([self._d + "wake"], timeout=timeout_s) is not None

    def snapshot(self) -> StoreSnapshot:
        projects = sorted(_text(p) for p in self._client.smembers(self._d + "projects"))
        pipe = self._client.pipeline(transaction=False)
        for project in projects:
            for band in fairshare.BANDS:
                for size in fairshare.SIZES:
                    pipe.zcard(f"{self._d}pending:{project}:{band}:{size}")
        pipe.hgetall(self._d + "state")
        pipe.hgetall(self._d + "stats")
        *counts, state, stats = pipe.execute()
        pending: dict[str, dict[str, int]] = {}
        for index, project in enumerate(projects):
            for b, band in enumerate(fairshare.BANDS):
                n = counts[index * 4 + b * 2] + counts[index * 4 + b * 2 + 1]
                if n:
                    pending.setdefault(project, {})[band] = n
        state, stats = _texts(state), _texts(stats)
        holds = {k[5:]: int(v) for k, v in stats.items() if k.startswith("hold:")}
        return StoreSnapshot(
            pending=pending,
            in_flight=int(state.get("in_flight", 0)),
            reserved_kv_tokens=int(state.get("kv", 0)),
            long_in_flight=int(state.get("long", 0)),
            admissions=int(stats.get("admissions", 0)),
            holds=holds,
        )

    def lease_fences(self) -> dict[str, int]:
        """Live leases (job id -> fence), for invariant checks and ``fleet queues``."""
        ids = [_text(i) for i in self._client.zrange(self._d + "leases", 0, -1)]
        pipe = self._client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(f"{self._d}lease:{job_id}", "fence")
        return {job_id: int(f) for job_id, f in zip(ids, pipe.execute(), strict=True)}

    def pending_ids(self) -> set[str]:
        ids: set[str] = set()
        for key in self._client.scan_iter(match=f"{self._d}pending:*", count=500):
            ids.update(_text(i) for i in self._client.zrange(key, 0, -1))
        return ids


def max_block_s(client: redis.Redis) -> float:
    """The longest BLPOP ``client`` survives: ``MAX_BLOCK_S``, or 80% of a shorter socket timeout.

    redis-py 8 connections default to a 5 s socket timeout (not in ``connection_kwargs`` when
    the client was made with ``from_url``); ``None`` means no timeout at all.
    """
    socket_timeout_s = client.connection_pool.connection_kwargs.get("socket_timeout", 5.0)
    if socket_timeout_s is None:
        return MAX_BLOCK_S
    return max(0.01, min(MAX_BLOCK_S, 0.8 * float(socket_timeout_s)))


def _text(value: Any) -> str:
    """Redis replies as str whether or not the client was made with decode_responses."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _texts(mapping: Any) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in mapping.items()}


def _head(project: str, fields: list[Any]) -> fairshare.Head:
    band, size, job_id, score, prompt, max_new, enq = (_text(f) for f in fields)
    return fairshare.Head(
        job_id=job_id,
        project=project,
        band=band,
        prompt_tokens=int(prompt),
        max_new_tokens=int(max_new),
        enqueued_at=float(enq),
        score=float(score),
        long=size == "long",
    )
