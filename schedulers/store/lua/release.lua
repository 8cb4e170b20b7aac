-- RELEASE: the job is done; free its lease and forget its item (unless it is pending again).
-- KEYS[1] lease   hash    job id -> lease (prelude)
-- KEYS[2] leases  zset    in-flight job ids by lease expiry
-- KEYS[3] state   hash    backend 0's in_flight kv long inter claimed
-- KEYS[4] items   hash    job id -> admission facts
-- KEYS[5] wake    list    dispatchers' wake-up list
-- KEYS[6] continuations  set  ids of jobs that were readmitted (the job leaves it with its item)
-- KEYS[7..] bstate:<name>  hash  backends 1, 2, ...'s counters (prelude: backend_states): the
--                                lease frees its backend's
-- ARGV: id, fence
-- Returns 1 when released, 0 for a stale fence.
local id = ARGV[1]
local f = lease_get(KEYS[1], id)
if not f or f.fence ~= ARGV[2] then return 0 end
free_lease(backend_states(KEYS[3], KEYS, 7, #KEYS), KEYS[2], KEYS[1], id)
local item = item_get(KEYS[4], id)
if item and item.pending ~= '1' then
  redis.call('HDEL', KEYS[4], id)
  redis.call('SREM', KEYS[6], id)
end
wake(KEYS[5])
return 1
