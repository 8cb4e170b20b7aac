-- CLAIM: a worker starts a granted job. A live lease with this fence, unclaimed or claimed by
-- this owner: record the owner and renew, in one step.
-- KEYS[1] lease:<id>  hash  fence expires owner ...
-- KEYS[2] leases      zset  in-flight job ids by lease expiry
-- ARGV: id, fence, owner, now, ttl
-- Returns 1 when claimed, 0 otherwise (stale fence, expired, another owner's).
local f = redis.call('HMGET', KEYS[1], 'fence', 'expires', 'owner')
if f[1] ~= ARGV[2] or tonumber(f[2]) < tonumber(ARGV[4]) then return 0 end
if f[3] and f[3] ~= ARGV[3] then return 0 end
local expires = fmt(tonumber(ARGV[4]) + tonumber(ARGV[5]))
redis.call('HSET', KEYS[1], 'owner', ARGV[3], 'expires', expires)
redis.call('ZADD', KEYS[2], expires, ARGV[1])
return 1
