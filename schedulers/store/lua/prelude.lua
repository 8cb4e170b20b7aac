-- Helpers shared by the dispatcher scripts. The loader (fleet/core/lua.py) puts this file in
-- front of every script of schedulers/store/lua/ (so line numbers in Redis errors count from
-- here). The helpers touch only keys their caller passes in, each of them one of the caller's KEYS.
--
-- Field `queued` of the state hash counts pending jobs (every pending zset together), so a
-- script can tell "nothing pending" without reading queues it did not declare.

local function num(v, default) if v then return tonumber(v) end return default end
local function fmt(x) return string.format('%.17g', x) end

local function wake(wake_key)
  redis.call('LPUSH', wake_key, '1')
  redis.call('LTRIM', wake_key, 0, 99)
end

-- Give back what a lease holds; the counters always equal the sum over live leases.
local function free_lease(state, leases, lease, id)
  local f = redis.call('HMGET', lease, 'kv', 'long')
  if not f[1] then return false end
  redis.call('HINCRBY', state, 'in_flight', -1)
  redis.call('HINCRBY', state, 'kv', -tonumber(f[1]))
  if f[2] == '1' then redis.call('HINCRBY', state, 'long', -1) end
  redis.call('DEL', lease)
  redis.call('ZREM', leases, id)
  return true
end

-- Put a job whose lease is gone back in line at its original score (and its deadline back).
-- `pending` is the queue the caller read from the item (project, band, size); only ADD rewrites
-- those fields and it marks the item pending, so a job that is not pending still has them.
local function requeue_item(state, item, pending, projects, deadlines, id, project, band, size)
  local f = redis.call('HMGET', item, 'pending', 'project', 'band', 'size', 'score', 'deadline')
  if not f[2] or f[1] == '1' then return false end
  if f[2] ~= project or f[3] ~= band or f[4] ~= size then return false end
  redis.call('ZADD', pending, f[5], id)
  redis.call('HSET', item, 'pending', '1')
  redis.call('HINCRBY', state, 'queued', 1)
  redis.call('SADD', projects, f[2])
  if f[6] then redis.call('ZADD', deadlines, f[6], id) end
  return true
end

-- Take a pending job out of line (cancel, deadline); keep its item while a lease needs it.
-- A pending item whose queue is not the one the caller read (it was added again in between)
-- is left alone: the caller's view is stale, nothing is removed.
local function unqueue(state, item, lease, pending, deadlines, id, project, band, size)
  local f = redis.call('HMGET', item, 'pending', 'project', 'band', 'size')
  if f[1] == '1' and (f[2] ~= project or f[3] ~= band or f[4] ~= size) then return false end
  redis.call('ZREM', deadlines, id)
  if f[1] ~= '1' then return false end
  redis.call('ZREM', pending, id)
  redis.call('HINCRBY', state, 'queued', -1)
  if redis.call('EXISTS', lease) == 1 then
    redis.call('HSET', item, 'pending', '0')
  else
    redis.call('DEL', item)
  end
  return true
end
