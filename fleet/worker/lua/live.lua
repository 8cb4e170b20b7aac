-- LIVE: the inference workers whose heartbeat has not lapsed, by Redis's own clock (the one
-- beat.lua stamps with), so no host's clock decides.
-- KEYS[1] workers  zset  instance id -> when its entry lapses (unix s by Redis's clock)
-- ARGV: none
-- Returns the live instance ids.
local now = redis.call('TIME')
local seconds = tonumber(now[1]) + tonumber(now[2]) / 1000000
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. seconds, '+inf')
