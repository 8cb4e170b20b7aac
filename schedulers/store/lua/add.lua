-- ADD: a job joins its queue (submit). A job already pending, in flight (its lease puts it
-- back at its own place if it expires) or waiting as a continuation is left as it is.
-- KEYS[1] items            hash    job id -> admission facts (prelude)
-- KEYS[2] pending:<project>:<band>:<size>[:<elig>]  zset  the job's queue (prelude)
-- KEYS[3] deadlines        zset    pending jobs with a deadline
-- KEYS[4] projects         set     (project, class) groups that may have pending work (prelude)
-- KEYS[5] state            hash    queued, vtime (V), filled[:<b>] (locality)
-- KEYS[6] vtime            hash    project -> finish tag
-- KEYS[7] wake             list    dispatchers' wake-up list
-- KEYS[8] lease            hash    job id -> lease (prelude)
-- KEYS[9] deferred         zset    jobs waiting for their not-before time
-- ARGV: id, project, band, size, prompt, max_new, kv, long (1|0), enq, score, deadline ('' = none),
--       uncached (prompt tokens expected to miss the prefix cache), elig (the bit mask of the
--       backends it may run on), hint (the backend expected to hold its cached prefix; '': none),
--       not_before ('' or not after now: in line at once; later: it waits in `deferred` until then,
--       as a continuation does, and PROMOTE puts it in line at its score: a job waiting for an
--       identical one's answer, fleet/worker/repeats.py), then, with locality on, the backend
--       whose `filled` count the item records as its `fill` ('' or absent: none;
--       schedulers/policy/locality.py: the state's `filled` for backend 0, `filled:<b>` else)
-- Returns 1 when added, 0 when the job was already pending, in flight or waiting.
local items, id = KEYS[1], ARGV[1]
local old = item_get(items, id)
if (old and old.pending == '1') or redis.call('HEXISTS', KEYS[8], id) == 1 then return 0 end
-- A continuation waiting for its not-before time (READMIT, `deferred`) comes back by itself.
if old and old.deferred then return 0 end
-- A job arriving at a drained system (nothing pending, no lease on any backend) restarts fair
-- share even: V moves to the largest finish tag (fairshare.forgive).
if num(redis.call('HGET', KEYS[5], 'queued'), 0) == 0 and redis.call('HLEN', KEYS[8]) == 0 then
  local V = num(redis.call('HGET', KEYS[5], 'vtime'), 0)
  for _, f in ipairs(redis.call('HVALS', KEYS[6])) do V = math.max(V, tonumber(f)) end
  redis.call('HSET', KEYS[5], 'vtime', fmt(V))
end
local deadline = ARGV[11] ~= '' and ARGV[11] or nil
local later = ARGV[15] ~= nil and ARGV[15] ~= '' and tonumber(ARGV[15]) > tonumber(ARGV[9])
local fill = nil
if ARGV[16] ~= nil and ARGV[16] ~= '' then
  fill = num(redis.call('HGET', KEYS[5], ARGV[16] == '0' and 'filled' or 'filled:' .. ARGV[16]), 0)
end
item_put(items, id, {project = ARGV[2], band = ARGV[3], size = ARGV[4], prompt = ARGV[5],
  max_new = ARGV[6], kv = ARGV[7], long = ARGV[8], enq = ARGV[9], score = ARGV[10],
  pending = later and '0' or '1', deferred = later and ARGV[15] or nil,
  deadline = deadline, uncached = ARGV[12], elig = ARGV[13],
  hint = ARGV[14] ~= '' and ARGV[14] or nil, fill = fill})
if later then
  redis.call('ZADD', KEYS[9], ARGV[15], id)
  wake(KEYS[7])
  return 1
end
redis.call('ZADD', KEYS[2], ARGV[10], id)
redis.call('HINCRBY', KEYS[5], 'queued', 1)
if deadline then
  redis.call('ZADD', KEYS[3], deadline, id)
else
  redis.call('ZREM', KEYS[3], id)
end
redis.call('SADD', KEYS[4], group_of(ARGV[2], ARGV[13]))
wake(KEYS[7])
return 1
