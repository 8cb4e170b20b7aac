-- RECOUNT: set the lease counters of the state hash to the sums over the live leases (prelude's
-- free_lease keeps them equal; a release by a process of another version, one that reads a
-- lease's fields differently, could leave one off for good: a `long` never given back holds
-- every long prompt). At most max_num_seqs leases are read, so it is cheap; the dispatcher
-- runs it every RECOUNT_S (schedulers/store/redis_store.py).
-- KEYS[1] state   hash    in_flight kv long inter claimed
-- KEYS[2] lease   hash    job id -> lease (prelude)
-- ARGV: none
-- Returns {field, was, now, ...} for each counter that was off (and is now put right).
local sums = {in_flight = 0, kv = 0, long = 0, inter = 0, claimed = 0}
for _, id in ipairs(redis.call('HKEYS', KEYS[2])) do
  local f = lease_get(KEYS[2], id)
  if f then
    sums.in_flight = sums.in_flight + 1
    sums.kv = sums.kv + tonumber(f.kv)
    if f.long:sub(1, 1) == '1' then sums.long = sums.long + 1 end
    if f.long:sub(2) == 'i' then sums.inter = sums.inter + 1 end
    if f.owner then sums.claimed = sums.claimed + 1 end
  end
end
local off = {}
for _, field in ipairs({'in_flight', 'kv', 'long', 'inter', 'claimed'}) do
  local was = tonumber(redis.call('HGET', KEYS[1], field) or '0')
  if was ~= sums[field] then
    redis.call('HSET', KEYS[1], field, sums[field])
    table.insert(off, field)
    table.insert(off, tostring(was))
    table.insert(off, tostring(sums[field]))
  end
end
return off
