-- RENEW: the claim's keeper extends its claim and moves the watchdog's next look on. Owner
-- checked: a worker whose claim lapsed must not touch its successor's.
-- KEYS[1] {prep}:claim:<ref>  string  the owner (a worker) preparing the job; TTL prep lease
-- KEYS[2] {prep}:prepping:<project>  zset    jobs not yet handed over, score = next watchdog look
-- ARGV: owner, ttl ms, ref, next look (unix s)
-- Returns 1 when renewed, 0 when the claim is no longer this owner's.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
return 1
