-- READMIT: a job that needs another model turn gives its lease up and re-enters admission as a
-- continuation: with its new plan's size, at its original place in line (it keeps its score, so
-- it is ahead of its project's newer work and still inside fair share), and not before
-- `not_before` (a backoff): until then it waits in `deferred`, and PROMOTE puts it in line.
-- Its hint becomes the backend its lease was on (where the turn's prompt is now cached).
-- The next turn's prompt (grown by the conversation of its tool rounds) replaces the item's,
-- its growth is added to the uncached tokens, and `cont` records the turn's number: the
-- inference worker runs only the saved turn that carries it (fleet/worker/jobs/common.py).
-- KEYS[1]  lease                            hash  job id -> lease (prelude)
-- KEYS[2]  leases                           zset  in-flight job ids by lease expiry
-- KEYS[3]  state                            hash  backend 0's in_flight kv long inter claimed;
--                                                 queued
-- KEYS[4]  items                            hash  job id -> admission facts (prelude)
-- KEYS[5]  pending:<project>:<band>:<size>[:<elig>]  zset  the job's queue for its new prompt's
--                                                 size
-- KEYS[6]  projects                         set
-- KEYS[7]  deadlines                        zset
-- KEYS[8]  wake                             list
-- KEYS[9]  deferred                         zset  continuations waiting for their not-before time
-- KEYS[10] continuations                    set   ids of jobs that were readmitted (a hint list)
-- KEYS[11..] bstate:<name>                    hash  backends 1, 2, ...'s counters (prelude:
--                                                 backend_states): the lease frees its backend's
-- ARGV: id, fence, project, band, size (of the new prompt), max_new, kv, not_before, now,
--       prompt, uncached, turn, elig (the backends it may run on now: the item's, or the one its
--       grown prompt fits), then '1' with locality on: the item's `fill` becomes its cache
--       backend's `filled` count (the state's `filled[:<b>]`; schedulers/policy/locality.py)
-- Returns 1 when the job was readmitted, 0 for a stale fence or a job without its item.
local id = ARGV[1]
local lease = lease_get(KEYS[1], id)
local f = item_get(KEYS[4], id)
if not lease or lease.fence ~= ARGV[2] or not f then return 0 end
free_lease(backend_states(KEYS[3], KEYS, 11, #KEYS), KEYS[2], KEYS[1], id)
f.max_new, f.kv, f.cont = ARGV[6], ARGV[7], ARGV[12]
f.size, f.prompt, f.uncached = ARGV[5], ARGV[10], ARGV[11]
f.long = ARGV[5] == 'long' and '1' or '0'
f.elig = ARGV[13]
-- the next turn's prompt starts with this one's, now cached on the lease's backend: its hint
-- when the job may run on several (placement.py), none otherwise
local mask, bit = tonumber(f.elig), 1
while bit < mask do bit = bit * 2 end
if bit ~= mask then f.hint = lease.backend else f.hint = nil end
if ARGV[14] == '1' then  -- locality.cache_backend: the hint, else the mask's lowest backend
  local b = 0
  if f.hint then b = tonumber(f.hint) else
    while mask > 0 and mask % 2 == 0 do mask, b = mask / 2, b + 1 end
  end
  f.fill = num(redis.call('HGET', KEYS[3], b == 0 and 'filled' or 'filled:' .. b), 0)
end
redis.call('SADD', KEYS[10], id)
if tonumber(ARGV[8]) > tonumber(ARGV[9]) then
  f.deferred = ARGV[8]
  item_put(KEYS[4], id, f)
  redis.call('ZADD', KEYS[9], ARGV[8], id)
else
  item_put(KEYS[4], id, f)
  requeue_item(KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], id, ARGV[3], ARGV[4], ARGV[5], ARGV[13])
end
wake(KEYS[8])
return 1
