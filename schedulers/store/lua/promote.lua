-- PROMOTE: continuations whose not-before time came (<= now) leave `deferred` and join their
-- queue at their original score (and their deadline comes back). The caller read the due ids
-- and their items; each is checked again here.
-- KEYS[1] deferred   zset  continuations waiting for their not-before time
-- KEYS[2] state      hash  queued
-- KEYS[3] projects   set
-- KEYS[4] deadlines  zset
-- KEYS[5] wake       list
-- KEYS[6] items      hash  job id -> admission facts (prelude)
-- then one per job j = 0, 1, ...:
-- KEYS[7+j] pending:<project>:<band>:<size>[:<elig>]  zset  (the job's queue, as the caller read
--                                                    the item)
-- ARGV: now, then (id, project, band, size, elig) per job, in the same order as the keys.
-- A job whose item no longer names that queue (a GROW changed its size or class after the
-- caller read it) stays in `deferred`: the next call reads its item again.
-- Returns the ids put in line.
local now, out = tonumber(ARGV[1]), {}
for j = 0, #KEYS - 7 do
  local a = 2 + 5 * j
  local id = ARGV[a]
  local due = redis.call('ZSCORE', KEYS[1], id)
  local f = item_get(KEYS[6], id)
  local moved = f and f.pending ~= '1' and not in_queue(f, ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4])
  if due and tonumber(due) <= now and not moved then
    redis.call('ZREM', KEYS[1], id)
    if requeue_item(KEYS[2], KEYS[6], KEYS[7 + j], KEYS[3], KEYS[4], id, ARGV[a + 1], ARGV[a + 2],
        ARGV[a + 3], ARGV[a + 4]) then
      table.insert(out, id)
    end
  end
end
if #out > 0 then wake(KEYS[5]) end
return out
