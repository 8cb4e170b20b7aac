-- CLAIM: a worker starts a granted job. A live lease with this fence, unclaimed or claimed by
-- this owner: record the owner and renew, in one step.
-- KEYS[1] lease   hash  job id -> lease (prelude)
-- KEYS[2] leases  zset  in-flight job ids by lease expiry
-- KEYS[3] state   hash  backend 0's claimed (live leases with an owner)
-- KEYS[4..] bstate:<name>  hash  backends 1, 2, ...'s claimed (prelude: backend_states)
-- ARGV: id, fence, owner, now, ttl
-- Returns 1 + the index of the backend the lease was granted on when claimed (the worker streams
-- to that backend, whatever its task says), 0 otherwise (stale fence, expired, another owner's).
local f = lease_get(KEYS[1], ARGV[1])
if not f or f.fence ~= ARGV[2] or tonumber(f.expires) < tonumber(ARGV[4]) then return 0 end
if f.owner and f.owner ~= ARGV[3] then return 0 end
if not f.owner then
  local state = backend_states(KEYS[3], KEYS, 4, #KEYS)[tonumber(f.backend)]
  if state then redis.call('HINCRBY', state, 'claimed', 1) end
end
f.owner, f.expires = ARGV[3], fmt(tonumber(ARGV[4]) + tonumber(ARGV[5]))
lease_put(KEYS[1], ARGV[1], f)
redis.call('ZADD', KEYS[2], f.expires, ARGV[1])
return 1 + (tonumber(f.backend) or 0)
