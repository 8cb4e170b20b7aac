-- RENEW: extend a live lease that carries this fence.
-- KEYS[1] lease   hash  job id -> lease (prelude)
-- KEYS[2] leases  zset  in-flight job ids by lease expiry
-- ARGV: id, fence, now, ttl
-- Returns 1 when renewed, 0 for a stale fence or an expired lease.
local f = lease_get(KEYS[1], ARGV[1])
if not f or f.fence ~= ARGV[2] or tonumber(f.expires) < tonumber(ARGV[3]) then return 0 end
f.expires = fmt(tonumber(ARGV[3]) + tonumber(ARGV[4]))
lease_put(KEYS[1], ARGV[1], f)
redis.call('ZADD', KEYS[2], f.expires, ARGV[1])
return 1
