-- REAP: leases that expired (expiry < now) are freed and their jobs requeued at their original
-- score. The caller read the expired ids and their items; each is checked again here.
-- KEYS[1] leases     zset  in-flight job ids by lease expiry
-- KEYS[2] state      hash  backend 0's in_flight kv long inter claimed; queued
-- KEYS[3] projects   set
-- KEYS[4] deadlines  zset
-- KEYS[5] wake       list
-- KEYS[6] lease      hash  job id -> lease (prelude)
-- KEYS[7] items      hash  job id -> admission facts
-- then one per job j = 0, 1, ...:
-- KEYS[8+j] pending:<project>:<band>:<size>[:<elig>]  zset  (the job's queue, as the caller read
--                                                    the item)
-- then KEYS[8+J..] bstate:<name>  hash  backends 1, 2, ...'s counters (prelude: backend_states;
--                                      J: the number of jobs)
-- ARGV: now, then (id, project, band, size, elig) per job, in the same order as the keys.
-- Returns the ids whose lease was freed here (each frees its own backend's counters).
local now, out = tonumber(ARGV[1]), {}
local jobs = (#ARGV - 1) / 5
local states = backend_states(KEYS[2], KEYS, 8 + jobs, #KEYS)
for j = 0, jobs - 1 do
  local a = 2 + 5 * j
  local id = ARGV[a]
  local expires = redis.call('ZSCORE', KEYS[1], id)
  if expires and tonumber(expires) < now and free_lease(states, KEYS[1], KEYS[6], id) then
    requeue_item(KEYS[2], KEYS[7], KEYS[8 + j], KEYS[3], KEYS[4], id, ARGV[a + 1], ARGV[a + 2],
      ARGV[a + 3], ARGV[a + 4])
    table.insert(out, id)
  end
end
if #out > 0 then wake(KEYS[5]) end
return out
