-- RCACHE_PUT: store one answer in a project's exact-repeat cache (fleet/core/repeatcache.py) and
-- keep the cache within its bounds: entries past their expiry go first, then the oldest while
-- more than max_entries are held. Both keys carry the project's hash tag: one Cluster slot.
-- KEYS[1] rcache:{<project>}:e  hash  digest -> entry JSON
-- KEYS[2] rcache:{<project>}:x  zset  digest -> the entry's expiry (unix s)
-- KEYS[3] rcache:{<project>}:s  hash  stats: stores, evictions (hits, misses, waits are the
--                                     readers')
-- ARGV: digest, entry, expires_at, now, max_entries, key ttl s (the keys go once nothing is left
--       to expire: an idle project's cache leaves nothing behind)
-- Returns the number of entries evicted (expired or over the bound).
local digest, expires_at, now = ARGV[1], ARGV[3], tonumber(ARGV[4])
local max_entries = tonumber(ARGV[5])
local evicted = 0
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('HDEL', KEYS[1], old)
  redis.call('ZREM', KEYS[2], old)
  evicted = evicted + 1
end
redis.call('HSET', KEYS[1], digest, ARGV[2])
redis.call('ZADD', KEYS[2], expires_at, digest)
while redis.call('ZCARD', KEYS[2]) > max_entries do
  local oldest = redis.call('ZPOPMIN', KEYS[2])
  redis.call('HDEL', KEYS[1], oldest[1])
  evicted = evicted + 1
end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[6])
redis.call('HINCRBY', KEYS[3], 'stores', 1)
if evicted > 0 then redis.call('HINCRBY', KEYS[3], 'evictions', evicted) end
return evicted
