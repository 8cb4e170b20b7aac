-- RELEASE: preparation ended (whatever the outcome): drop the claim and the watchdog's entry.
-- Owner checked: a worker whose claim lapsed must not touch its successor's.
-- KEYS[1] {prep}:claim:<ref>  string  the owner preparing the job
-- KEYS[2] {prep}:prepping:<project>  zset    jobs not yet handed over
-- ARGV: owner, ref
-- Returns 1 when released, 0 when the claim is no longer this owner's.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
