-- GATEWAY: a gateway request's way in, in one call: ADD its item, one ADMIT round as a
-- dispatcher's, and CLAIM its own lease when that round granted it. ADD, ADMIT and CLAIM are the
-- scripts of this folder, unchanged (the loader puts them in front as local functions).
-- While the worker gate is on and no inference worker is live (no entry of `workers` lapses after
-- now), the round grants gateway requests only: a queued job would go to inference workers nobody
-- runs, so it is passed over ('no_workers') and keeps its place in line.
-- KEYS[1..8]   ADD's keys: items, the item's queue, deadlines, projects, state, vtime, wake, lease
-- KEYS[9..11]  CLAIM's keys: lease, leases, state
-- KEYS[12]     workers  zset  live inference workers, score = when the entry lapses
-- KEYS[13]     gateway  zset  gateway requests that may be pending, score = their deadline (an
--                             entry is pruned once its deadline passed: the job can be pending
--                             no more)
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

local owner, now, worker_gate = ARGV[1], ARGV[2], ARGV[3] == '1'
local add_argv, admit_argv = slice(ARGV, 4, 15), slice(ARGV, 16)
local id = add_argv[1]
redis.call('ZREMRANGEBYSCORE', KEYS[13], '-inf', now)
redis.call('ZADD', KEYS[13], add_argv[11], id)
ADD(slice(KEYS, 1, 8), add_argv)
if tonumber(admit_argv[13]) == 0 then return {0, 'ok', '', ''} end

if worker_gate and redis.call('ZCOUNT', KEYS[12], now, '+inf') == 0 then
  admit_only = function(c) return redis.call('ZSCORE', KEYS[13], c.id) ~= false end
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
