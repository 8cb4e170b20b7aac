-- RECOUNT: set the lease counters of each backend's state hash to the sums over the live leases
-- of that backend (prelude's free_lease keeps them equal; a release by a process of another
-- version, one that reads a lease's fields differently, could leave one off for good: a `long`
-- never given back holds every long prompt). At most the backends' max_num_seqs together are
-- read, so it is cheap; the dispatcher runs it every RECOUNT_S (schedulers/store/redis_store.py).
-- KEYS[1] state   hash    backend 0's in_flight kv long inter claimed
-- KEYS[2] lease   hash    job id -> lease (prelude)
-- KEYS[3..] bstate:<name>  hash  backends 1, 2, ...'s (prelude: backend_states)
-- ARGV: none
-- Returns {field, was, now, ...} for each counter that was off (and is now put right); the field
-- is `<b>:<name>` for backend b > 0, the plain name for backend 0. A lease of a backend without a
-- hash here (one no longer in the settings) counts nowhere.
local FIELDS = {'in_flight', 'kv', 'long', 'inter', 'claimed'}
local states = backend_states(KEYS[1], KEYS, 3, #KEYS)
local sums = {}
for b = 0, #KEYS - 2 do sums[b] = {in_flight = 0, kv = 0, long = 0, inter = 0, claimed = 0} end
for _, id in ipairs(redis.call('HKEYS', KEYS[2])) do
  local f = lease_get(KEYS[2], id)
  local sum = f and sums[tonumber(f.backend)]
  if sum then
    sum.in_flight = sum.in_flight + 1
    sum.kv = sum.kv + tonumber(f.kv)
    if f.long:sub(1, 1) == '1' then sum.long = sum.long + 1 end
    if f.long:sub(2) == 'i' then sum.inter = sum.inter + 1 end
    if f.owner then sum.claimed = sum.claimed + 1 end
  end
end
local off = {}
for b = 0, #KEYS - 2 do
  for _, field in ipairs(FIELDS) do
    local was = tonumber(redis.call('HGET', states[b], field) or '0')
    if was ~= sums[b][field] then
      redis.call('HSET', states[b], field, sums[b][field])
      table.insert(off, b == 0 and field or (b .. ':' .. field))
      table.insert(off, tostring(was))
      table.insert(off, tostring(sums[b][field]))
    end
  end
end
return off
