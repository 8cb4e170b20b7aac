-- RELEASE: the job is done; free its lease and forget its item (unless it is pending again).
-- KEYS[1] lease:<id>  hash    fence kv long ...
-- KEYS[2] leases      zset    in-flight job ids by lease expiry
-- KEYS[3] state       hash    in_flight kv long
-- KEYS[4] item:<id>   hash    pending ...
-- KEYS[5] wake        list    dispatchers' wake-up list
-- ARGV: id, fence
-- Returns 1 when released, 0 for a stale fence.
if redis.call('HGET', KEYS[1], 'fence') ~= ARGV[2] then return 0 end
free_lease(KEYS[3], KEYS[2], KEYS[1], ARGV[1])
if redis.call('HGET', KEYS[4], 'pending') ~= '1' then redis.call('DEL', KEYS[4]) end
wake(KEYS[5])
return 1
