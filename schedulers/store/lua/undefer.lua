-- UNDEFER: take a continuation that waits for its not-before time out (cancel, deadline).
-- KEYS[1] deferred   zset  continuations waiting for their not-before time
-- KEYS[2] item:<id>  hash  the job's admission facts
-- KEYS[3] lease:<id> hash  its lease, if any (keeps the item alive)
-- ARGV: id
-- Returns 1 when the job was waiting and left, 0 otherwise.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('HDEL', KEYS[2], 'deferred')
else
  redis.call('DEL', KEYS[2])
end
return 1
