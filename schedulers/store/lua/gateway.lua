-- GATEWAY: a gateway request's way in, in one call: ADD its item, one GWADMIT round (ADMIT as a
-- dispatcher's, restricted to gateway requests while the worker gate holds: gwadmit.lua), and
-- CLAIM its own lease when that round granted it. ADD, ADMIT, GWADMIT and CLAIM are the scripts
-- of this folder, unchanged (the loader puts them in front as local functions).
-- KEYS[1..8]   ADD's keys: items, the item's queue, deadlines, projects, state, vtime, wake, lease
-- KEYS[9..11]  CLAIM's keys: lease, leases, state (and the bstate key of each backend b = 1, 2,
--              ...: ADMIT's, here KEYS[22+2b])
-- KEYS[12]     workers  zset  live inference workers (GWADMIT's KEYS[1])
-- KEYS[13]     gateway  zset  gateway requests that may be pending, score = their deadline by
--                             Redis's clock (the caller's deadline - now, added to Redis TIME:
--                             gateways on hosts whose clocks differ never prune each other's
--                             live entries); an entry is pruned once that passed: the job can
--                             be pending no more (GWADMIT's KEYS[2])
-- KEYS[14..]   ADMIT's keys (GWADMIT's KEYS[3..])
-- ARGV: owner, now, worker_gate (1|0), ADD's 16 arguments (the deadline is required, not_before
--       is ''), then
--       ADMIT's arguments as its caller sends them (admit.lua; max_grants 0: no round)
-- Returns {fence of the own claimed lease or 0, ADMIT's reply...}; with max_grants 0 the reply
-- is {'ok', '', ''}.
local owner, now = ARGV[1], ARGV[2]
local add_argv, admit_argv = slice(ARGV, 4, 19), slice(ARGV, 20)
local id = add_argv[1]
local rnow = redis_now()
redis.call('ZREMRANGEBYSCORE', KEYS[13], '-inf', rnow)
redis.call('ZADD', KEYS[13], rnow + (tonumber(add_argv[11]) - tonumber(now)), id)
ADD(slice(KEYS, 1, 8), add_argv)
if tonumber(admit_argv[2]) == 0 then return {0, 'ok', '', ''} end
local admitting = admit_layout(admit_argv)  -- (ADMIT's ttl and m, for the claim)

local reply = GWADMIT(slice(KEYS, 12), {ARGV[3], unpack(admit_argv)})
local claimed = 0
if reply[1] == 'ok' then
  local claim_keys = slice(KEYS, 9, 11)
  for b = 1, tonumber(admitting[19]) do claim_keys[3 + b] = KEYS[22 + 2 * b] end
  for i = 4, #reply, 9 do
    if reply[i] == id then
      local fence = tostring(reply[i + 2])
      if CLAIM(claim_keys, {id, fence, owner, now, admitting[2]}) ~= 0 then
        claimed = reply[i + 2]
      end
    end
  end
end
table.insert(reply, 1, claimed)
return reply
