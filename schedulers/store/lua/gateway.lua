-- GATEWAY: a gateway request's way in, in one call: ADD its item, one ADMIT round as a
-- dispatcher's, and CLAIM its own lease when that round granted it. ADD, ADMIT and CLAIM are the
-- scripts of this folder, unchanged (the loader puts them in front as local functions).
-- While the worker gate is on and no inference worker is live (no entry of `workers` lapses after
-- now by Redis's clock, the one the heartbeats are stamped with: a gateway host's clock may be off
-- by any amount), the round grants gateway requests only: a queued job would go to inference
-- workers nobody runs, so it is passed over ('no_workers') and keeps its place in line. A gateway
-- request is admitted past queued jobs then: the head of a queue, for that round, is its first gateway
-- request in line (the queued jobs ahead of it are passed over anyway), or its first member
-- (refused) when it holds none. Fair share, the cap and every limit apply to those heads as to any.
-- KEYS[1..8]   ADD's keys: items, the item's queue, deadlines, projects, state, vtime, wake, lease
-- KEYS[9..11]  CLAIM's keys: lease, leases, state
-- KEYS[12]     workers  zset  live inference workers, score = when the entry lapses (unix s by
--                             Redis's clock)
-- KEYS[13]     gateway  zset  gateway requests that may be pending, score = their deadline by
--                             Redis's clock (the caller's deadline - now, added to Redis TIME:
--                             gateways on hosts whose clocks differ never prune each other's
--                             live entries); an entry is pruned once that passed: the job can
--                             be pending no more
-- KEYS[14..]   ADMIT's keys
-- ARGV: owner, now, worker_gate (1|0), ADD's 12 arguments (the deadline is required), then
--       ADMIT's arguments (max_grants 0: no round)
-- Returns {fence of the own claimed lease or 0, ADMIT's reply...}; with max_grants 0 the reply
-- is {'ok', '', ''}.
local function slice(t, from, to)
  local out = {}
  for i = from, to or #t do out[#out + 1] = t[i] end
  return out
end

local function redis_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local owner, now, worker_gate = ARGV[1], ARGV[2], ARGV[3] == '1'
local add_argv, admit_argv = slice(ARGV, 4, 15), slice(ARGV, 16)
local id = add_argv[1]
local rnow = redis_now()
redis.call('ZREMRANGEBYSCORE', KEYS[13], '-inf', rnow)
redis.call('ZADD', KEYS[13], rnow + (tonumber(add_argv[11]) - tonumber(now)), id)
ADD(slice(KEYS, 1, 8), add_argv)
if tonumber(admit_argv[13]) == 0 then return {0, 'ok', '', ''} end

-- The gateway requests still in line, grouped by their queue ('project band size').
local function gateway_requests_by_queue()
  local by_queue = {}
  for _, g in ipairs(redis.call('ZRANGE', KEYS[13], 0, -1)) do
    local f = item_get(KEYS[1], g)
    if f and f.pending == '1' then
      local queue = f.project .. ' ' .. f.band .. ' ' .. f.size
      by_queue[queue] = by_queue[queue] or {}
      table.insert(by_queue[queue], g)
    end
  end
  return by_queue
end

local function workers_live()
  return redis.call('ZCOUNT', KEYS[12], '(' .. rnow, '+inf') > 0
end

if worker_gate and not workers_live() then
  admit_only = function(c) return redis.call('ZSCORE', KEYS[13], c.id) ~= false end
  local by_queue = gateway_requests_by_queue()
  admit_head = function(queue, project, band, size)
    local best, best_score = nil, nil
    for _, g in ipairs(by_queue[project .. ' ' .. band .. ' ' .. size] or {}) do
      local score = redis.call('ZSCORE', queue, g)  -- false once granted in this round
      if score then
        score = tonumber(score)
        if not best or score < best_score or (score == best_score and g < best) then
          best, best_score = g, score
        end
      end
    end
    if best then return {best, best_score} end
    return redis.call('ZRANGE', queue, 0, 0, 'WITHSCORES')
  end
end
local reply = ADMIT(slice(KEYS, 14), admit_argv)
local claimed = 0
if reply[1] == 'ok' then
  for i = 4, #reply, 8 do
    if reply[i] == id then
      local fence = tostring(reply[i + 2])
      if CLAIM(slice(KEYS, 9, 11), {id, fence, owner, now, admit_argv[2]}) == 1 then
        claimed = reply[i + 2]
      end
    end
  end
end
table.insert(reply, 1, claimed)
return reply
