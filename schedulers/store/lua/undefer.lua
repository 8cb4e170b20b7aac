-- UNDEFER: take a continuation that waits for its not-before time out (cancel).
-- KEYS[1] deferred  zset  continuations waiting for their not-before time
-- KEYS[2] items     hash  job id -> admission facts (prelude)
-- KEYS[3] lease     hash  job id -> lease (a lease keeps the item alive)
-- ARGV: id
-- Returns 1 when the job was waiting and left, 0 otherwise.
local id = ARGV[1]
if redis.call('ZREM', KEYS[1], id) == 0 then return 0 end
local f = item_get(KEYS[2], id)
if f and redis.call('HEXISTS', KEYS[3], id) == 1 then
  f.deferred = nil
  item_put(KEYS[2], id, f)
else
  redis.call('HDEL', KEYS[2], id)
end
return 1
