-- BEAT: write one inference worker's heartbeat, stamped by Redis's own clock (never the worker
-- host's, which may be off by any amount), and drop the entries that lapsed.
-- KEYS[1] workers  zset  instance id -> when its entry lapses (unix s by Redis's clock)
-- ARGV: instance id, lapse (s after now)
-- Returns the number of entries dropped as lapsed.
local now = redis.call('TIME')
local seconds = tonumber(now[1]) + tonumber(now[2]) / 1000000
redis.call('ZADD', KEYS[1], seconds + tonumber(ARGV[2]), ARGV[1])
return redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', seconds)
