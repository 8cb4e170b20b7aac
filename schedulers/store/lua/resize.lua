-- RESIZE: a retry grew the job's max tokens; its KV reservation follows (lease, counter, item).
-- KEYS[1] lease:<id>  hash  fence kv ...
-- KEYS[2] state       hash  kv (sum over live leases)
-- KEYS[3] item:<id>   hash  max_new kv (for a re-admission)
-- ARGV: fence, max_new, kv
-- Returns 1 when resized, 0 for a stale fence.
local f = redis.call('HMGET', KEYS[1], 'fence', 'kv')
if f[1] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'kv', ARGV[3])
redis.call('HINCRBY', KEYS[2], 'kv', tonumber(ARGV[3]) - tonumber(f[2]))
redis.call('HSET', KEYS[3], 'max_new', ARGV[2], 'kv', ARGV[3])
return 1
