-- TAKE_DUE: a watchdog takes a due entry; only one watchdog (of several dispatchers) wins it.
-- KEYS[1] {prep}:prepping:<project>  zset  jobs not yet handed over, score = next watchdog look
-- ARGV: ref, now (unix s), next look (unix s)
-- Returns 1 when this call took the entry (its next look moved on), 0 when it was not due.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1
