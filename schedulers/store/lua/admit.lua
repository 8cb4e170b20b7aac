-- ADMIT: up to max_grants grants in one call. Each grant reads the head of every queue of every
-- project (one ZRANGE 0 0 each: O(log n) in the backlog), orders them with the fair policy
-- (schedulers/policy/fairshare.py ``order``, the same keys), applies the backend gate and every
-- limit (schedulers/policy/limits.py, same order) and grants the first that fits: pop from
-- pending, counters, bucket, virtual times, fence, lease. It stops at the first hold.
-- KEYS[1]  state      hash    in_flight kv long queued bucket bucket_at last_admit blocked_job
--                             blocked_since vtime prefill_until prefill_longs inter (interactive
--                             leases)
-- KEYS[2]  stats      hash    admissions, hold:<reason>
-- KEYS[3]  backend    hash    scraped_at, hold (the gate's verdict), outside (sequences outside
--                             clients hold at the server, schedulers/scrape.py)
-- KEYS[4]  vtime      hash    project -> finish tag
-- KEYS[5]  fences     hash    project -> its fencing token counter (a project's own sequence:
--                             its grants' numbers say nothing of other projects' admissions)
-- KEYS[6]  leases     zset    in-flight job ids by lease expiry
-- KEYS[7]  deadlines  zset    pending jobs with a deadline
-- KEYS[8]  projects   set     projects that may have pending work (pruned here when empty)
-- KEYS[9]  items      hash    job id -> admission facts (prelude)
-- KEYS[10] lease      hash    job id -> lease (prelude)
-- then four per project p = 0, 1, ... (the caller's list of projects, in ARGV):
-- KEYS[11+4p .. 14+4p] pending:<project>:<band>:<size>  zset  interactive short, interactive
--                             long, batch short, batch long
-- ARGV: now, ttl, max_seqs, kv_budget, max_long, rate, burst, spacing, bypass, gate (1|0), stale,
--       aging, max_grants, prefill_rate (the server's; 0: no quiet long prefills), beside (short
--       sequences in flight at most when a long prefill goes), long_prefills (long prefills one
--       window may take), long_threshold, short_job_s (what a drain waits for; 0: always drain),
--       then (project, weight) per project, in the same order as the keys.
-- A candidate the prelude's `admit_only` refuses (when a calling script set it) is passed over with
-- the reason 'no_workers'; a queue's head is the prelude's `admit_head` (when set) instead of its
-- first member.
-- A long prefill is a head whose uncached tokens (the item's last field) are above the long
-- threshold (`long_threshold`, ARGV[17]). Quiet windows hold only while an interactive lease
-- lives or an interactive head is a candidate, and a drain only when it pays (limits.drain_pays).
-- Returns {'stale', members} when the projects set holds a project the caller did not name
-- (nothing was decided; call again with them), else {'ok', reason, retry_in, grant fields...}:
-- reason '' when max_grants were granted, else the hold that stopped it; each grant is 8 fields:
-- id, project, fence, prompt, kv, long (1|0), expires, waited. A named project whose queues are
-- all empty leaves the set; the caller may keep naming it (it costs four empty reads).
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local max_seqs, kv_budget, max_long = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local rate, burst, spacing = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local bypass, gate, stale = tonumber(ARGV[9]), ARGV[10] == '1', tonumber(ARGV[11])
local aging, max_grants = tonumber(ARGV[12]), tonumber(ARGV[13])
local prefill_rate, beside, long_prefills = tonumber(ARGV[14]), tonumber(ARGV[15]), tonumber(ARGV[16])
local long_threshold, short_job_s = tonumber(ARGV[17]), tonumber(ARGV[18])
local st, stats, vtime, items, lease_info = KEYS[1], KEYS[2], KEYS[4], KEYS[9], KEYS[10]
local BANDS, SIZES = {'interactive', 'batch'}, {'short', 'long'}

local projects, named = {}, {}
for p = 0, (#ARGV - 18) / 2 - 1 do
  local name = ARGV[19 + 2 * p]
  projects[p + 1] = {name = name, weight = tonumber(ARGV[20 + 2 * p]), k = 11 + 4 * p}
  named[name] = true
end
local members = redis.call('SMEMBERS', KEYS[8])
for _, m in ipairs(members) do
  if not named[m] then return {'stale', members} end
end

-- The head of each of a project's queues: {band = {short = head, long = head}}.
local function read_heads(pr)
  local heads, any = {}, false
  for b, band in ipairs(BANDS) do
    heads[band] = {}
    for z, size in ipairs(SIZES) do
      local queue = KEYS[pr.k + 2 * (b - 1) + (z - 1)]
      local top
      if admit_head then top = admit_head(queue, pr.name, band, size)
      else top = redis.call('ZRANGE', queue, 0, 0, 'WITHSCORES') end
      if top[1] then
        local f = item_get(items, top[1])
        local uncached = tonumber(f.uncached)
        heads[band][size] = {id = top[1], score = tonumber(top[2]), queue = queue, band = band,
          long = size == 'long', prompt = tonumber(f.prompt), max_new = tonumber(f.max_new),
          uncached = uncached, long_prefill = uncached > long_threshold,
          kv = tonumber(f.kv), enq = tonumber(f.enq), project = pr.name, weight = pr.weight}
        any = true
      end
    end
  end
  pr.heads = any and heads or nil
end

-- fairshare.project_candidates: per band the head in line and, behind a long head, the short one;
-- in the batch band the long head first.
local function candidates(pr)
  local out = {}
  for _, band in ipairs(BANDS) do
    local s, l = pr.heads[band].short, pr.heads[band].long
    local first = s
    if l and (not s or band == 'batch' or l.score < s.score or (l.score == s.score and l.id < s.id)) then
      first = l
    end
    if first then
      table.insert(out, first)
      if first.long and s then table.insert(out, s) end
    end
  end
  return out
end

local tags = {}
local in_set = {}
for _, m in ipairs(members) do in_set[m] = true end
for _, pr in ipairs(projects) do
  tags[pr.name] = num(redis.call('HGET', vtime, pr.name), 0)
  read_heads(pr)
  if not pr.heads and in_set[pr.name] then redis.call('SREM', KEYS[8], pr.name) end
end

-- fairshare.order: (tier, start tag, first candidate's score, project), candidates flattened.
local function order(V)
  local ranked, banded = {}, false
  for _, pr in ipairs(projects) do
    if pr.heads then
      local c = candidates(pr)
      table.insert(ranked, {c = c, name = pr.name, start = math.max(V, tags[pr.name])})
      if c[1].band == 'interactive' then banded = true end
    end
  end
  for _, r in ipairs(ranked) do  -- fairshare.tier: the oldest candidate's age counts
    local oldest = r.c[1].enq
    for _, c in ipairs(r.c) do oldest = math.min(oldest, c.enq) end
    r.tier = 0
    if banded and r.c[1].band ~= 'interactive' and now - oldest < aging then r.tier = 1 end
  end
  table.sort(ranked, function(x, y)
    if x.tier ~= y.tier then return x.tier < y.tier end
    if x.start ~= y.start then return x.start < y.start end
    if x.c[1].score ~= y.c[1].score then return x.c[1].score < y.c[1].score end
    return x.name < y.name
  end)
  local out = {}
  for _, r in ipairs(ranked) do
    for _, c in ipairs(r.c) do table.insert(out, c) end
  end
  return out
end

local function hold(reason, retry)
  redis.call('HINCRBY', stats, 'hold:' .. reason, 1)
  return reason, retry and fmt(retry) or ''
end

-- limits.drain_pays: (S - b)^2 x short_job_s / 2S idle slot-seconds against S x U / rate.
local function drains(shorts, uncached)
  local drained = shorts - beside
  return drained * drained * short_job_s * prefill_rate <= 2.0 * shorts * shorts * uncached
end

-- One decision: the candidate to grant, or the hold reason and when it lifts.
local function decide(cands)
  if #cands == 0 then return nil, hold('empty') end
  local outside = 0
  if gate then
    local b = redis.call('HMGET', KEYS[3], 'scraped_at', 'hold', 'outside')
    if not b[1] or now - tonumber(b[1]) > stale then return nil, hold('backend_stale') end
    if b[2] and b[2] ~= '' then return nil, hold('backend_' .. b[2]) end
    outside = num(b[3], 0)
  end
  local s = redis.call('HMGET', st, 'in_flight', 'kv', 'long', 'bucket', 'bucket_at', 'last_admit',
    'blocked_job', 'blocked_since', 'prefill_until', 'prefill_longs', 'inter')
  local in_flight, kv_used, long_used = num(s[1], 0), num(s[2], 0), num(s[3], 0)
  if in_flight >= max_seqs then return nil, hold('seqs') end
  if in_flight + outside >= max_seqs then return nil, hold('outside') end
  if s[6] and spacing > 0 then
    local wait = tonumber(s[6]) + spacing - now
    if wait > 0 then return nil, hold('spacing', wait) end
  end
  local prefill_until, prefill_longs = num(s[9], 0), num(s[10], 0)
  local quiet = num(s[11], 0) > 0  -- limits.protects: an interactive lease, or a candidate below
  for _, c in ipairs(cands) do quiet = quiet or c.band == 'interactive' end
  quiet = quiet and prefill_rate > 0
  local level = burst
  if s[4] then level = math.min(burst, tonumber(s[4]) + math.max(0, now - tonumber(s[5])) * rate) end
  local first_reason, soonest = nil, nil
  for i, c in ipairs(cands) do
    local why, retry = nil, nil
    if admit_only and not admit_only(c) then why = 'no_workers'
    elseif quiet and now < prefill_until and (not c.long_prefill or prefill_longs >= long_prefills) then
      why, retry = 'prefill', prefill_until - now
    elseif kv_used + c.kv > kv_budget and in_flight > 0 then why = 'kv'
    elseif c.long and long_used >= max_long then why = 'long'
    elseif c.long_prefill and quiet and in_flight - long_used > beside
      and drains(in_flight - long_used, c.uncached) then why = 'prefill'
    else
      local need = math.min(c.uncached, burst)
      if level < need then why, retry = 'bucket', (need - level) / rate end
    end
    if not why then
      if i == 1 then redis.call('HDEL', st, 'blocked_job', 'blocked_since') end
      return {c = c, level = level, prefill_until = prefill_until, prefill_longs = prefill_longs}
    end
    if retry and (not soonest or retry < soonest) then soonest = retry end
    if i == 1 then
      first_reason = why
      -- a window hold lifts by itself: nothing to reserve (limits._may_bypass)
      if why == 'kv' or why == 'bucket' or (why == 'prefill' and not (prefill_until > now)) then
        if s[7] ~= c.id then
          s[8] = fmt(now)
          redis.call('HSET', st, 'blocked_job', c.id, 'blocked_since', s[8])
        end
        if now - tonumber(s[8]) >= bypass then return nil, hold(why, retry) end
      end
    end
  end
  return nil, hold(first_reason, soonest)
end

local function grant(c, top, level, prefill_until, prefill_longs)
  free_lease(st, KEYS[6], lease_info, c.id)
  redis.call('HINCRBY', st, 'in_flight', 1)
  redis.call('HINCRBY', st, 'kv', c.kv)
  if c.long then redis.call('HINCRBY', st, 'long', 1) end
  if c.band == 'interactive' then redis.call('HINCRBY', st, 'inter', 1) end
  if c.long_prefill and prefill_rate > 0 then
    if now >= prefill_until then prefill_longs = 0 end
    redis.call('HSET', st, 'prefill_until', fmt(math.max(now, prefill_until) + c.uncached / prefill_rate),
      'prefill_longs', prefill_longs + 1)
  end
  redis.call('HINCRBY', st, 'queued', -1)
  redis.call('HSET', st, 'bucket', fmt(level - c.uncached), 'bucket_at', fmt(now),
    'last_admit', fmt(now))
  local V = math.max(num(redis.call('HGET', st, 'vtime'), 0), tags[top.project])
  local start = math.max(V, tags[c.project])
  tags[c.project] = start + (c.prompt + c.max_new) / c.weight
  redis.call('HSET', vtime, c.project, fmt(tags[c.project]))
  redis.call('HSET', st, 'vtime', fmt(V))
  local fence = redis.call('HINCRBY', KEYS[5], c.project, 1)
  local expires = now + ttl
  lease_put(lease_info, c.id, {fence = fence, kv = c.kv,
    long = (c.long and '1' or '0') .. (c.band == 'interactive' and 'i' or ''),
    expires = fmt(expires), admitted_at = fmt(now), project = c.project})
  redis.call('ZADD', KEYS[6], fmt(expires), c.id)
  redis.call('ZREM', c.queue, c.id)
  redis.call('ZREM', KEYS[7], c.id)
  local f = item_get(items, c.id)
  f.pending = '0'
  item_put(items, c.id, f)
  redis.call('HINCRBY', stats, 'admissions', 1)
  return {c.id, c.project, fence, c.prompt, c.kv, c.long and 1 or 0, fmt(expires),
    fmt(math.max(0, now - c.enq))}
end

local out = {'ok', '', ''}
local granted = 0
while granted < max_grants do
  local cands = order(num(redis.call('HGET', st, 'vtime'), 0))
  local pick, reason, retry = decide(cands)
  if not pick then
    out[2], out[3] = reason, retry
    break
  end
  for _, field in ipairs(grant(pick.c, cands[1], pick.level, pick.prefill_until, pick.prefill_longs)) do table.insert(out, field) end
  granted = granted + 1
  for _, pr in ipairs(projects) do
    if pr.name == pick.c.project then read_heads(pr) end
  end
end
return out
