-- Helpers shared by the dispatcher scripts. The loader (fleet/core/lua.py) puts this file in
-- front of every script of schedulers/store/lua/ (so line numbers in Redis errors count from
-- here). The helpers touch only keys their caller passes in, each of them one of the caller's KEYS.
--
-- Key layout: fleet/core/keys.py. A job's admission facts are one packed string in the `items`
-- hash and its lease one in the `lease` hash, not a hash per job: every script then touches a fixed
-- set of keys plus the queues of the projects the caller names, so ADMIT can pick and grant several
-- jobs in one call. item_get/item_put and lease_get/lease_put below are the only Lua that knows
-- their field order, the same as schedulers/store/records.py (what each field means is there;
-- tests/test_store_records.py runs these accessors against it). A field added later goes at the
-- end, on both sides.

-- ADMIT grants only candidates this predicate accepts, when a script that calls ADMIT sets it
-- (GWADMIT: only gateway requests while no inference worker is live); nil: every candidate.
local admit_only = nil
-- ADMIT reads the head of a queue with this function, when a script that calls ADMIT sets it:
-- admit_head(queue, project, band, size) -> {id, score} or {} (GWADMIT, while no inference worker
-- is live: the first gateway request in that queue, which may wait behind queued jobs); nil: the
-- queue's first member.
local admit_head = nil

-- t[from .. to] (to: the end) as a new table: a composing script's share of its KEYS or ARGV.
local function slice(t, from, to)
  local out = {}
  for i = from, to or #t do out[#out + 1] = t[i] end
  return out
end

-- Redis's clock (unix seconds): what heartbeats and the gateway zset are stamped with.
local function redis_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function num(v, default) if v then return tonumber(v) end return default end
local function fmt(x) return string.format('%.17g', x) end

local function wake(wake_key)
  redis.call('LPUSH', wake_key, '1')
  redis.call('LTRIM', wake_key, 0, 99)
end

local function item_get(items, id)
  local s = redis.call('HGET', items, id)
  if not s then return nil end
  local project, band, size, prompt, max_new, kv, long, enq, score, pending, deadline, cont, deferred,
    uncached = string.match(s,
      '^(%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) ?(%S*)$')
  return {project = project, band = band, size = size, prompt = prompt, max_new = max_new, kv = kv,
    long = long, enq = enq, score = score, pending = pending,
    deadline = deadline ~= '-' and deadline or nil, cont = cont,
    deferred = deferred ~= '-' and deferred or nil,
    uncached = uncached ~= '' and uncached or prompt}
end

local function item_put(items, id, f)
  redis.call('HSET', items, id, table.concat({f.project, f.band, f.size, f.prompt, f.max_new, f.kv,
    f.long, f.enq, f.score, f.pending, f.deadline or '-', f.cont or '0', f.deferred or '-',
    f.uncached or f.prompt}, ' '))
end

local function lease_get(leases_info, id)
  local s = redis.call('HGET', leases_info, id)
  if not s then return nil end
  local fence, kv, long, expires, admitted_at, project, owner =
    string.match(s, '^(%S+) (%S+) (%S+) (%S+) (%S+) (%S+) ?(.*)$')
  return {fence = fence, kv = kv, long = long, expires = expires, admitted_at = admitted_at,
    project = project, owner = owner ~= '' and owner or nil}
end

local function lease_put(leases_info, id, f)
  redis.call('HSET', leases_info, id, table.concat({f.fence, f.kv, f.long, f.expires, f.admitted_at,
    f.project, f.owner or ''}, ' '))
end

-- Give back what a lease holds; the counters always equal the sum over live leases.
local function free_lease(state, leases, leases_info, id)
  local f = lease_get(leases_info, id)
  if not f then return false end
  redis.call('HINCRBY', state, 'in_flight', -1)
  redis.call('HINCRBY', state, 'kv', -tonumber(f.kv))
  if f.long:sub(1, 1) == '1' then redis.call('HINCRBY', state, 'long', -1) end
  if f.long:sub(2) == 'i' then redis.call('HINCRBY', state, 'inter', -1) end
  if f.owner then redis.call('HINCRBY', state, 'claimed', -1) end
  redis.call('HDEL', leases_info, id)
  redis.call('ZREM', leases, id)
  return true
end

-- Put a job whose lease is gone (or a continuation whose not-before time came) back in line at
-- its original score (and its deadline back). `pending` is the queue the caller read from the
-- item (project, band, size); only ADD rewrites those fields and it marks the item pending, so a
-- job that is not pending still has them.
local function requeue_item(state, items, pending, projects, deadlines, id, project, band, size)
  local f = item_get(items, id)
  if not f or f.pending == '1' then return false end
  if f.project ~= project or f.band ~= band or f.size ~= size then return false end
  redis.call('ZADD', pending, f.score, id)
  f.pending, f.deferred = '1', nil
  item_put(items, id, f)
  redis.call('HINCRBY', state, 'queued', 1)
  redis.call('SADD', projects, f.project)
  if f.deadline then redis.call('ZADD', deadlines, f.deadline, id) end
  return true
end

-- Take a pending job out of line (cancel, deadline); keep its item while a lease needs it.
-- A pending item whose queue is not the one the caller read (it was added again in between)
-- is left alone: the caller's view is stale, nothing is removed.
local function unqueue(state, items, leases_info, pending, deadlines, id, project, band, size)
  local f = item_get(items, id)
  if f and f.pending == '1' and (f.project ~= project or f.band ~= band or f.size ~= size) then
    return false
  end
  redis.call('ZREM', deadlines, id)
  if not f or f.pending ~= '1' then return false end
  redis.call('ZREM', pending, id)
  redis.call('HINCRBY', state, 'queued', -1)
  if redis.call('HEXISTS', leases_info, id) == 1 then
    f.pending = '0'
    item_put(items, id, f)
  else
    redis.call('HDEL', items, id)
  end
  return true
end
