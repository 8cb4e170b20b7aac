-- CREATE: a producer records a new job, once. A job hash that exists already (a second submit of
-- the same id in the same project) is never overwritten: the caller treats it as a duplicate.
-- KEYS[1] job:{<ref>}                hash  the job record
-- KEYS[2] {prep}:prepping:<project>  zset  the project's jobs not yet handed over
-- ARGV: ttl s, ref, watchdog look (unix s), then field, value pairs
-- Returns 1 when the record was created, 0 when it existed.
-- Cluster: KEYS[2] is in the {prep} slot, not the job's; a Cluster move writes it in a second step.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
return 1
