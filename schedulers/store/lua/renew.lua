-- RENEW: extend a live lease that carries this fence.
-- KEYS[1] lease:<id>  hash  fence expires ...
-- KEYS[2] leases      zset  in-flight job ids by lease expiry
-- ARGV: id, fence, now, ttl
-- Returns 1 when renewed, 0 for a stale fence or an expired lease.
local f = redis.call('HMGET', KEYS[1], 'fence', 'expires')
if f[1] ~= ARGV[2] or tonumber(f[2]) < tonumber(ARGV[3]) then return 0 end
local expires = fmt(tonumber(ARGV[3]) + tonumber(ARGV[4]))
redis.call('HSET', KEYS[1], 'expires', expires)
redis.call('ZADD', KEYS[2], expires, ARGV[1])
return 1
