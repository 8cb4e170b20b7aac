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
-- end, on both sides. An item's `elig` and a lease's `backend` are written only when they are not
-- backend 0's, an item's `hint` only when it has one, with `elig` before it (records.py says why
-- and how a lease's backend is told from its owner), its `fill` only with locality on, after
-- `elig` and `hint` (`-`: none). `item_get` ignores fields after `fill` (a later version's); the
-- versions before `hint` existed read an item that has one as no item at all, so dispatchers and
-- workers are upgraded before the writers of hints (docs/backends.md).
--
-- Backends: backend 0's lease counters are in `state` (with the fleet-wide `queued` and `vtime`),
-- backend b's in `bstate:<name>`; a script that frees or claims leases gets them all as a table
-- `states` indexed by the backend's number (0, 1, ...: `backend_states`), and a lease names its
-- backend. A job's queue is `pending:<project>:<band>:<size>`, and `...:<size>:<elig>` for an
-- eligibility class other than 1; the projects set names each (project, class) with a queue that
-- may hold work: `<project>`, or `<project>:<elig>` (`group_of`).

-- ADMIT grants only candidates this predicate accepts, when a script that calls ADMIT sets it
-- (GWADMIT: only gateway requests while no inference worker is live); nil: every candidate.
local admit_only = nil
-- ADMIT reads the head of a queue with this function, when a script that calls ADMIT sets it:
-- admit_head(queue, project, band, size, elig) -> {id, score} or {} (GWADMIT, while no inference worker
-- is live: the first gateway request in that queue, which may wait behind queued jobs); nil: the
-- queue's first member.
local admit_head = nil

-- ADMIT's arguments in the layout it reads (admit.lua's header) from the ones its caller sends:
-- now, max_grants, the settings (a JSON array of strings: that layout up to the groups, '' for
-- the values of the call), the 6 quota-window values, then the (group, weight) pairs.
local function admit_layout(argv)
  local a = cjson.decode(argv[3])
  a[1], a[13] = argv[1], argv[2]
  local q0 = 28 + 16 * tonumber(a[19])
  for i = 1, 6 do a[q0 + i] = argv[3 + i] end
  local first = q0 + 7 + 9 * tonumber(a[q0])
  for i = 10, #argv do a[first + i - 10] = argv[i] end
  return a
end

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
    uncached, elig, hint, fill = string.match(s,
      '^(%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) ?(%S*) ?(%S*) ?(%S*) ?(%S*).*$')
  return {project = project, band = band, size = size, prompt = prompt, max_new = max_new, kv = kv,
    long = long, enq = enq, score = score, pending = pending,
    deadline = deadline ~= '-' and deadline or nil, cont = cont,
    deferred = deferred ~= '-' and deferred or nil,
    uncached = uncached ~= '' and uncached or prompt, elig = elig ~= '' and elig or '1',
    hint = hint ~= '' and hint ~= '-' and hint or nil, fill = fill ~= '' and fill or nil}
end

local function item_put(items, id, f)
  local fields = {f.project, f.band, f.size, f.prompt, f.max_new, f.kv, f.long, f.enq, f.score,
    f.pending, f.deadline or '-', f.cont or '0', f.deferred or '-', f.uncached or f.prompt}
  if f.fill then  -- (locality: schedulers/policy/locality.py) elig and hint ('-': none) before it
    fields[#fields + 1] = f.elig or '1'
    fields[#fields + 1] = f.hint or '-'
    fields[#fields + 1] = f.fill
  elseif f.hint then
    fields[#fields + 1] = f.elig or '1'
    fields[#fields + 1] = f.hint
  elseif f.elig and f.elig ~= '1' then fields[#fields + 1] = f.elig end
  redis.call('HSET', items, id, table.concat(fields, ' '))
end

local function lease_get(leases_info, id)
  local s = redis.call('HGET', leases_info, id)
  if not s then return nil end
  local fence, kv, long, expires, admitted_at, project, rest =
    string.match(s, '^(%S+) (%S+) (%S+) (%S+) (%S+) (%S+) ?(.*)$')
  local backend, owner = string.match(rest, '^(%d+) (.*)$')
  if not backend then
    backend = string.match(rest, '^(%d+)$')
    owner = backend and '' or rest
  end
  return {fence = fence, kv = kv, long = long, expires = expires, admitted_at = admitted_at,
    project = project, backend = backend or '0', owner = owner ~= '' and owner or nil}
end

local function lease_put(leases_info, id, f)
  local fields = {f.fence, f.kv, f.long, f.expires, f.admitted_at, f.project}
  local backend, owner = tostring(f.backend or '0'), f.owner or ''
  if backend ~= '0' or string.match(owner, '^%d+ ') or string.match(owner, '^%d+$') then
    fields[#fields + 1] = backend
  end
  fields[#fields + 1] = owner
  redis.call('HSET', leases_info, id, table.concat(fields, ' '))
end

-- The projects set's member for a (project, eligibility class): its queues' common name part.
local function group_of(project, elig)
  if elig == '1' then return project end
  return project .. ':' .. elig
end

-- The lease counters' hashes by backend number: `state` (backend 0), then keys[from .. to]
-- (backends 1, 2, ...: the caller's bstate keys, in the settings' order).
local function backend_states(state, keys, from, to)
  local states = {[0] = state}
  for i = from, to do states[i - from + 1] = keys[i] end
  return states
end

-- Give back what a lease holds to the counters of its backend (`states`: backend_states); the
-- counters always equal the sum over the live leases of their backend. A lease of a backend
-- the caller has no hash for (one no longer in the settings) only goes.
local function free_lease(states, leases, leases_info, id)
  local f = lease_get(leases_info, id)
  if not f then return false end
  local state = states[tonumber(f.backend)]
  if state then
    redis.call('HINCRBY', state, 'in_flight', -1)
    redis.call('HINCRBY', state, 'kv', -tonumber(f.kv))
    if f.long:sub(1, 1) == '1' then redis.call('HINCRBY', state, 'long', -1) end
    if f.long:sub(2) == 'i' then redis.call('HINCRBY', state, 'inter', -1) end
    if f.owner then redis.call('HINCRBY', state, 'claimed', -1) end
  end
  redis.call('HDEL', leases_info, id)
  redis.call('ZREM', leases, id)
  return true
end

-- Is the item in the queue the caller read from it (project, band, size, elig)?
local function in_queue(f, project, band, size, elig)
  return f.project == project and f.band == band and f.size == size and f.elig == elig
end

-- Put a job whose lease is gone (or a continuation whose not-before time came) back in line at
-- its original score (and its deadline back). `pending` is the queue the caller read from the
-- item (project, band, size, elig); only ADD rewrites those fields and it marks the item pending,
-- so a job that is not pending still has them. `state` is the one with `queued` (backend 0's).
local function requeue_item(state, items, pending, projects, deadlines, id, project, band, size, elig)
  local f = item_get(items, id)
  if not f or f.pending == '1' then return false end
  if not in_queue(f, project, band, size, elig) then return false end
  redis.call('ZADD', pending, f.score, id)
  f.pending, f.deferred = '1', nil
  item_put(items, id, f)
  redis.call('HINCRBY', state, 'queued', 1)
  redis.call('SADD', projects, group_of(f.project, f.elig))
  if f.deadline then redis.call('ZADD', deadlines, f.deadline, id) end
  return true
end

-- Take a pending job out of line (cancel, deadline); keep its item while a lease needs it.
-- A pending item whose queue is not the one the caller read (it was added again in between)
-- is left alone: the caller's view is stale, nothing is removed.
local function unqueue(state, items, leases_info, pending, deadlines, id, project, band, size, elig)
  local f = item_get(items, id)
  if f and f.pending == '1' and not in_queue(f, project, band, size, elig) then
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
