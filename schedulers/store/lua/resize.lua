-- RESIZE: a retry grew the job's max tokens; its KV reservation follows (lease, counter, item).
-- KEYS[1] lease  hash  job id -> lease (prelude)
-- KEYS[2] state  hash  kv (sum over live leases)
-- KEYS[3] items  hash  job id -> admission facts: max_new kv (for a re-admission)
-- ARGV: id, fence, max_new, kv
-- Returns 1 when resized, 0 for a stale fence.
local id = ARGV[1]
local f = lease_get(KEYS[1], id)
if not f or f.fence ~= ARGV[2] then return 0 end
redis.call('HINCRBY', KEYS[2], 'kv', tonumber(ARGV[4]) - tonumber(f.kv))
f.kv = ARGV[4]
lease_put(KEYS[1], id, f)
local item = item_get(KEYS[3], id)
if item then
  item.max_new, item.kv = ARGV[3], ARGV[4]
  item_put(KEYS[3], id, item)
end
return 1
