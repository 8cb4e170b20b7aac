-- EXPIRE: pending jobs whose deadline <= now leave the line. The caller read the due ids and
-- their items; each is checked again here. Entries of jobs no longer pending (none expected;
-- kept safe) are dropped without being returned.
-- KEYS[1] deadlines  zset  pending jobs with a deadline
-- KEYS[2] state      hash  queued
-- KEYS[3] items      hash  job id -> admission facts (prelude)
-- KEYS[4] lease      hash  job id -> lease
-- then one per job j = 0, 1, ...:
-- KEYS[5+j] pending:<project>:<band>:<size>[:<elig>]  zset  (the job's queue, as the caller read
--                                                    the item)
-- ARGV: now, then (id, project, band, size, elig) per job, in the same order as the keys.
-- Returns the ids that left the line.
local now, out = tonumber(ARGV[1]), {}
for j = 0, #KEYS - 5 do
  local a = 2 + 5 * j
  local id = ARGV[a]
  local deadline = redis.call('ZSCORE', KEYS[1], id)
  if deadline and tonumber(deadline) <= now
      and unqueue(KEYS[2], KEYS[3], KEYS[4], KEYS[5 + j], KEYS[1], id, ARGV[a + 1], ARGV[a + 2],
        ARGV[a + 3], ARGV[a + 4]) then
    table.insert(out, id)
  end
end
return out
