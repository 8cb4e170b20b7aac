-- ADMIT: re-read the candidates (fair order, from the caller), drop any another dispatcher took
-- meanwhile, apply the backend gate and every limit (schedulers/policy/limits.py, same order)
-- and grant the first that fits: pop from pending, counters, bucket, virtual times, fence, lease.
-- KEYS[1] state       hash    in_flight kv long queued bucket bucket_at last_admit blocked_job
--                             blocked_since vtime
-- KEYS[2] stats       hash    admissions, hold:<reason>
-- KEYS[3] backend     hash    scraped_at, hold (the gate's verdict)
-- KEYS[4] vtime       hash    project -> finish tag
-- KEYS[5] fence       string  fencing token counter
-- KEYS[6] leases      zset    in-flight job ids by lease expiry
-- KEYS[7] deadlines   zset    pending jobs with a deadline
-- then three per candidate c = 0, 1, ...:
-- KEYS[8+3c]  item:<id>                        hash  the candidate's admission facts
-- KEYS[9+3c]  lease:<id>                       hash  its lease (absent until granted)
-- KEYS[10+3c] pending:<project>:<band>:<size>  zset  its queue, as the caller read it
-- ARGV: now, ttl, max_seqs, kv_budget, max_long, rate, burst, spacing, bypass, gate (1|0), stale,
--       then (id, project, weight, band, size) per candidate, in the same order as the keys.
-- Returns {1, id, project, fence, prompt, kv, long, expires, waited} or {0, reason, retry_in}
-- (reason 'conflict': every candidate was taken or moved; the caller reads the heads again).
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local max_seqs, kv_budget, max_long = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local rate, burst, spacing = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local bypass, gate, stale = tonumber(ARGV[9]), ARGV[10] == '1', tonumber(ARGV[11])
local st, stats, vtime = KEYS[1], KEYS[2], KEYS[4]
local function hold(reason, retry)
  redis.call('HINCRBY', stats, 'hold:' .. reason, 1)
  return {0, reason, retry and fmt(retry) or ''}
end
local cands = {}
for c = 0, (#KEYS - 7) / 3 - 1 do
  local a, k = 12 + 5 * c, 8 + 3 * c
  local f = redis.call('HMGET', KEYS[k], 'pending', 'band', 'size', 'prompt', 'kv', 'long', 'enq',
    'max_new', 'project')
  if f[1] == '1' and f[9] == ARGV[a + 1] and f[2] == ARGV[a + 3] and f[3] == ARGV[a + 4] then
    table.insert(cands, {id = ARGV[a], project = ARGV[a + 1], weight = tonumber(ARGV[a + 2]),
      item = KEYS[k], lease = KEYS[k + 1], pending = KEYS[k + 2],
      prompt = tonumber(f[4]), kv = tonumber(f[5]), long = f[6] == '1',
      enq = tonumber(f[7]), max_new = tonumber(f[8])})
  end
end
if #cands == 0 then return {0, 'conflict', ''} end
if gate then
  local b = redis.call('HMGET', KEYS[3], 'scraped_at', 'hold')
  if not b[1] or now - tonumber(b[1]) > stale then return hold('backend_stale') end
  if b[2] and b[2] ~= '' then return hold('backend_' .. b[2]) end
end
local s = redis.call('HMGET', st, 'in_flight', 'kv', 'long', 'bucket', 'bucket_at', 'last_admit',
  'blocked_job', 'blocked_since', 'vtime')
local in_flight, kv_used, long_used = num(s[1], 0), num(s[2], 0), num(s[3], 0)
if in_flight >= max_seqs then return hold('seqs') end
if s[6] and spacing > 0 then
  local wait = tonumber(s[6]) + spacing - now
  if wait > 0 then return hold('spacing', wait) end
end
local level = burst
if s[4] then level = math.min(burst, tonumber(s[4]) + math.max(0, now - tonumber(s[5])) * rate) end
local first_reason, soonest, pick = nil, nil, nil
for i, c in ipairs(cands) do
  local why, retry = nil, nil
  if kv_used + c.kv > kv_budget and in_flight > 0 then why = 'kv'
  elseif c.long and long_used >= max_long then why = 'long'
  else
    local need = math.min(c.prompt, burst)
    if level < need then why, retry = 'bucket', (need - level) / rate end
  end
  if not why then pick = i break end
  if retry and (not soonest or retry < soonest) then soonest = retry end
  if i == 1 then
    first_reason = why
    if why == 'kv' or why == 'bucket' then
      if s[7] ~= c.id then
        s[8] = fmt(now)
        redis.call('HSET', st, 'blocked_job', c.id, 'blocked_since', s[8])
      end
      if now - tonumber(s[8]) >= bypass then return hold(why, retry) end
    end
  end
end
if not pick then return hold(first_reason, soonest) end
local c, top = cands[pick], cands[1]
free_lease(st, KEYS[6], c.lease, c.id)
redis.call('HINCRBY', st, 'in_flight', 1)
redis.call('HINCRBY', st, 'kv', c.kv)
if c.long then redis.call('HINCRBY', st, 'long', 1) end
redis.call('HINCRBY', st, 'queued', -1)
redis.call('HSET', st, 'bucket', fmt(level - c.prompt), 'bucket_at', fmt(now),
  'last_admit', fmt(now))
if pick == 1 then redis.call('HDEL', st, 'blocked_job', 'blocked_since') end
local V = math.max(num(s[9], 0), num(redis.call('HGET', vtime, top.project), 0))
local start = math.max(V, num(redis.call('HGET', vtime, c.project), 0))
redis.call('HSET', vtime, c.project, fmt(start + (c.prompt + c.max_new) / c.weight))
redis.call('HSET', st, 'vtime', fmt(V))
local fence = redis.call('INCR', KEYS[5])
local expires = now + ttl
redis.call('HSET', c.lease, 'fence', fence, 'kv', c.kv, 'long', c.long and '1' or '0',
  'expires', fmt(expires), 'admitted_at', fmt(now), 'project', c.project)
redis.call('ZADD', KEYS[6], fmt(expires), c.id)
redis.call('ZREM', c.pending, c.id)
redis.call('ZREM', KEYS[7], c.id)
redis.call('HSET', c.item, 'pending', '0')
redis.call('HINCRBY', stats, 'admissions', 1)
return {1, c.id, c.project, fence, c.prompt, c.kv, c.long and 1 or 0, fmt(expires),
  fmt(math.max(0, now - c.enq))}
