-- KEYQUOTA: reserve one gateway request's worst case against its API key's quota
-- (schedulers/store/keyquota.py, docs/usage.md "Quotas per API key"), or say which limit holds
-- it: one atomic check-and-add, so any number of gateways never reserve past a key's quota.
-- The reservation is settled by SETTLE (settle.lua) with the same four keys.
-- KEYS[1] kquota:{<project>}:<key>:m:<minute>  hash    t (cost held), r (requests); TTL 180 s
-- KEYS[2] kquota:{<project>}:<key>:d:<day>     string  cost held; TTL 3 days
-- KEYS[3] kquota:{<project>}:<key>:mo:<month>  string  cost held; TTL 33 days
-- KEYS[4] kquota:{<project>}:res               hash    request ref -> "<key> 0 cost minute day
--                                                      month flags"
-- ARGV: ref, key label, cost, tokens_per_minute, requests_per_minute, tokens_per_day,
--       tokens_per_month (0: none), now, minute, minute_end, day, day_end, month, month_end
-- Returns {'ok'} when reserved, else {'held', limit name, limit, seconds until its window ends}.
local ref, label, cost = ARGV[1], ARGV[2], tonumber(ARGV[3])
local tpm, rpm, tpd, tpmo = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local now = tonumber(ARGV[8])
local minute_end, day_end, month_end = tonumber(ARGV[10]), tonumber(ARGV[12]), tonumber(ARGV[14])
local m = redis.call('HMGET', KEYS[1], 't', 'r')
local t_min, r_min = tonumber(m[1] or '0'), tonumber(m[2] or '0')
local t_day, t_month = tonumber(redis.call('GET', KEYS[2]) or '0'), tonumber(redis.call('GET', KEYS[3]) or '0')
local function held(name, limit, ends) return {'held', name, tostring(limit), string.format('%.17g', ends - now)} end
if rpm > 0 and r_min + 1 > rpm then return held('requests_per_minute', rpm, minute_end) end
if tpm > 0 and t_min + cost > tpm then return held('tokens_per_minute', tpm, minute_end) end
if tpd > 0 and t_day + cost > tpd then return held('tokens_per_day', tpd, day_end) end
if tpmo > 0 and t_month + cost > tpmo then return held('tokens_per_month', tpmo, month_end) end
local function add(key, field, n, ttl)
  local v
  if field then v = redis.call('HINCRBY', key, field, n) else v = redis.call('INCRBY', key, n) end
  if v == n and redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ttl) end
end
if tpm > 0 then add(KEYS[1], 't', cost, 180) end
if rpm > 0 then add(KEYS[1], 'r', 1, 180) end
if tpd > 0 then add(KEYS[2], nil, cost, 3 * 86400) end
if tpmo > 0 then add(KEYS[3], nil, cost, 33 * 86400) end
local flags = (tpm > 0 and 't' or '') .. (tpd > 0 and 'd' or '') .. (tpmo > 0 and 'm' or '')
if flags ~= '' then
  redis.call('HSET', KEYS[4], ref, table.concat({label, '0', cost, ARGV[9], ARGV[11], ARGV[13], flags}, ' '))
  -- the reservations of turns whose worker died are never settled: the hash goes once the
  -- project's keys reserved nothing for as long as the longest window
  redis.call('EXPIRE', KEYS[4], 33 * 86400)
end
return {'ok'}
