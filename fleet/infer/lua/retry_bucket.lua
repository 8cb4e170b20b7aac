-- RETRY_BUCKET: credit and/or spend the project's retry token bucket in one step.
-- KEYS[1] retry_budget:<project>  hash  tokens, ts (unix s of the last update); TTL one day
-- ARGV: now (unix s), credit (tokens to add, 0 for a spend), capacity, reserve_per_s,
--       spend (1 to take a token, 0 to only credit or read)
-- Returns {granted (1|0), tokens after (a string: Lua numbers become integers in replies)}.
local key = KEYS[1]
local now = tonumber(ARGV[1])
local credit = tonumber(ARGV[2])
local capacity = tonumber(ARGV[3])
local reserve_per_s = tonumber(ARGV[4])
local spend = tonumber(ARGV[5])
local tokens = tonumber(redis.call('HGET', key, 'tokens') or ARGV[3])
local ts = tonumber(redis.call('HGET', key, 'ts') or ARGV[1])
if now > ts then tokens = tokens + (now - ts) * reserve_per_s end
tokens = math.min(capacity, tokens + credit)
local granted = 0
if spend > 0 and tokens >= spend then
  tokens = tokens - spend
  granted = 1
end
redis.call('HSET', key, 'tokens', tostring(tokens), 'ts', tostring(math.max(now, ts)))
redis.call('EXPIRE', key, 86400)
return {granted, tostring(tokens)}
