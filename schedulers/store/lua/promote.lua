-- PROMOTE: continuations whose not-before time came (<= now) leave `deferred` and join their
-- queue at their original score (and their deadline comes back). The caller read the due ids
-- and their items; each is checked again here.
-- KEYS[1] deferred   zset  continuations waiting for their not-before time
-- KEYS[2] state      hash  queued
-- KEYS[3] projects   set
-- KEYS[4] deadlines  zset
-- KEYS[5] wake       list
-- then two per job j = 0, 1, ...:
-- KEYS[6+2j] item:<id>  hash;  KEYS[7+2j] pending:<project>:<band>:<size>  zset (as read)
-- ARGV: now, then (id, project, band, size) per job, in the same order as the keys.
-- Returns the ids put in line.
local now, out = tonumber(ARGV[1]), {}
for j = 0, (#KEYS - 5) / 2 - 1 do
  local a, k = 2 + 4 * j, 6 + 2 * j
  local id = ARGV[a]
  local due = redis.call('ZSCORE', KEYS[1], id)
  if due and tonumber(due) <= now then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[k], 'deferred')
    if requeue_item(KEYS[2], KEYS[k], KEYS[k + 1], KEYS[3], KEYS[4], id, ARGV[a + 1], ARGV[a + 2],
        ARGV[a + 3]) then
      table.insert(out, id)
    end
  end
end
if #out > 0 then wake(KEYS[5]) end
return out
