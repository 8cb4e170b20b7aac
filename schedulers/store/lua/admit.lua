-- ADMIT: up to max_grants grants in one call. Each grant reads the head of every queue of every
-- project (one ZRANGE 0 0 each: O(log n) in the backlog; with locality its first `lookahead`, of
-- which it offers the one with the most cached tokens still expected in the server's cache:
-- choose), orders them with the fair policy
-- (schedulers/policy/fairshare.py ``order``, the same keys), tries each candidate on the backends
-- of its eligibility mask with the backend gate and every limit of each (schedulers/policy/
-- placement.py ``place``, applying limits.py's rules in the same order) and grants the first
-- that one of them can take, on the least loaded of those: pop from pending, that backend's
-- counters and bucket, virtual times, fence, lease. It stops at the first hold.
-- KEYS[1]  state      hash    backend 0's in_flight kv long bucket bucket_at last_admit blocked_job
--                             blocked_since prefill_until prefill_longs inter (interactive leases)
--                             claimed; the fleet's queued and vtime (V)
-- KEYS[2]  stats      hash    admissions, hold:<reason>
-- KEYS[3]  backend    hash    backend 0's scrape: scraped_at, hold (the gate's verdict), outside
--                             (sequences outside clients hold at the server, schedulers/scrape.py)
-- KEYS[4]  vtime      hash    project -> finish tag
-- KEYS[5]  fences     hash    project -> its fencing token counter (a project's own sequence:
--                             its grants' numbers say nothing of other projects' admissions)
-- KEYS[6]  leases     zset    in-flight job ids by lease expiry
-- KEYS[7]  deadlines  zset    pending jobs with a deadline
-- KEYS[8]  projects   set     (project, class) groups that may have pending work (prelude;
--                             pruned here when empty)
-- KEYS[9]  items      hash    job id -> admission facts (prelude)
-- KEYS[10] lease      hash    job id -> lease (prelude)
-- then two per backend b = 1 .. m (ARGV[19]; none with one backend):
-- KEYS[9+2b]  bstate:<name>   hash  backend b's counters, as backend 0's in KEYS[1]
-- KEYS[10+2b] backend:<name>  hash  backend b's scrape, as backend 0's in KEYS[3]
-- then four per group g = 0, 1, ... (a project and an eligibility class: the caller's list, in
-- ARGV):
-- KEYS[11+2m+4g .. 14+2m+4g] pending:<project>:<band>:<size>[:<elig>]  zset  interactive short,
--                             interactive long, batch short, batch long
-- ARGV, as the caller sends it: now, max_grants, the settings (one JSON array of strings: the
-- layout below with '' for now, max_grants and the quota windows; the same for every call until
-- the settings change, so one argument instead of some 16 per backend, which the client encodes
-- one by one), the quota windows of `now` (6, as below), then (group, weight) per group.
-- prelude.admit_layout rebuilds the layout below from them, and ADMIT reads that:
-- ARGV: now, ttl, then backend 0's max_seqs, kv_budget, max_long, rate, burst, spacing, bypass,
--       then gate (1|0), stale, aging, max_grants, then backend 0's prefill_rate (the server's; 0:
--       no quiet long prefills), beside (short sequences in flight at most when a long prefill
--       goes), long_prefills (long prefills one window may take), long_threshold, short_job_s
--       (what a drain waits for; 0: always drain), then m (ARGV[19]: backends beside backend 0),
--       then 13 per backend b = 1 .. m: max_seqs, kv_budget, max_long, rate, burst, spacing,
--       bypass, prefill_rate, beside, long_prefills, long_threshold, short_job_s, block_tokens;
--       then the routing policy (fleet | least_loaded | round_robin), balance_abs_seqs,
--       balance_rel (placement.Routing); then each backend's charge_per_token (b = 0 .. m: the
--       fair-share tokens one of its tokens counts for); then the locality
--       (schedulers/policy/locality.py): lookahead, max_wait_s, each backend's cache_tokens
--       (b = 0 .. m); then each backend's queue_tokens_per_s (b = 0 .. m: the first_token
--       policy's prefill rate, placement.first_token_s); then the quotas (schedulers/policy/
--       quota.py): nq (projects with one), the windows of `now` (minute, its end, day YYYYMMDD,
--       its end, month YYYYMM, its end), and 9 per such project: its name, tokens_per_minute,
--       requests_per_minute, tokens_per_day, tokens_per_month, max_in_flight (0: no limit),
--       cost_prompt, cost_cached, cost_output; then (group, weight) per group, in the same order
--       as the keys: the group is the projects set's member (`<project>` or `<project>:<elig>`),
--       the weight its project's.
-- then, after the groups' keys, when nq > 0: qres (hash: job id -> its grant's reservation,
-- "project fence cost minute day month flags", flags naming the windows it wrote: t d m), and three per quota project, in the ARGV's order:
-- quota:<project>:m:<minute> (hash t: cost held, r: requests), quota:<project>:d:<day> and
-- quota:<project>:mo:<month> (strings: cost held). A candidate over its project's quota is passed
-- over (reason 'quota', lifting when the window that holds it ends) before any backend is tried;
-- a grant adds its reservation to all three.
-- A candidate the prelude's `admit_only` refuses (when a calling script set it) is passed over with
-- the reason 'no_workers'; a queue's head is the prelude's `admit_head` (when set) instead of its
-- first member.
-- A candidate's KV reservation and size on backend 0 are its item's (ADD computed them with
-- backend 0's block and long threshold); on backend b they follow from its prompt and output
-- limit with b's block_tokens and long_threshold. Its uncached tokens are the item's on its hint
-- backend (or everywhere when it has no hint), its whole prompt elsewhere (placement.uncached_on);
-- a long prefill is a candidate whose uncached tokens there are above the backend's long
-- threshold. Among the backends that can take it, `pick` chooses by the routing policy (the
-- round robin's position is the state's `rr`, written only under that policy). Quiet windows hold only
-- while an interactive lease lives on the backend or an interactive candidate may run on it,
-- and a drain only when it pays (limits.drain_pays).
-- Returns {'stale', members} when the projects set holds a group the caller did not name
-- (nothing was decided; call again with them), else {'ok', reason, retry_in, grant fields...}:
-- reason '' when max_grants were granted, else the hold that stopped it; each grant is 9 fields:
-- id, project, fence, prompt, kv, long (1|0), expires, waited, backend (its number). A named
-- group whose queues are all empty leaves the set; the caller may keep naming it (it costs four
-- empty reads).
local ARGV = admit_layout(ARGV)
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local gate, stale = ARGV[10] == '1', tonumber(ARGV[11])
local aging, max_grants = tonumber(ARGV[12]), tonumber(ARGV[13])
local m = tonumber(ARGV[19])
local st, stats, vtime, items, lease_info = KEYS[1], KEYS[2], KEYS[4], KEYS[9], KEYS[10]
local BANDS, SIZES = {'interactive', 'batch'}, {'short', 'long'}

-- backends[b]: its limits and keys (b = 0 .. m, the settings' order); states: its counters' hash.
local backends = {[0] = {index = 0, st = st, scrape = KEYS[3], max_seqs = tonumber(ARGV[3]),
  kv_budget = tonumber(ARGV[4]), max_long = tonumber(ARGV[5]), rate = tonumber(ARGV[6]),
  burst = tonumber(ARGV[7]), spacing = tonumber(ARGV[8]), bypass = tonumber(ARGV[9]),
  prefill_rate = tonumber(ARGV[14]), beside = tonumber(ARGV[15]), long_prefills = tonumber(ARGV[16]),
  long_threshold = tonumber(ARGV[17]), short_job_s = tonumber(ARGV[18])}}
local states = {[0] = st}
for b = 1, m do
  local a = 20 + 13 * (b - 1)
  backends[b] = {index = b, st = KEYS[9 + 2 * b], scrape = KEYS[10 + 2 * b],
    max_seqs = tonumber(ARGV[a]), kv_budget = tonumber(ARGV[a + 1]), max_long = tonumber(ARGV[a + 2]),
    rate = tonumber(ARGV[a + 3]), burst = tonumber(ARGV[a + 4]), spacing = tonumber(ARGV[a + 5]),
    bypass = tonumber(ARGV[a + 6]), prefill_rate = tonumber(ARGV[a + 7]), beside = tonumber(ARGV[a + 8]),
    long_prefills = tonumber(ARGV[a + 9]), long_threshold = tonumber(ARGV[a + 10]),
    short_job_s = tonumber(ARGV[a + 11]), block = tonumber(ARGV[a + 12])}
  states[b] = backends[b].st
end
local policy = ARGV[20 + 13 * m]
local balance_abs, balance_rel = tonumber(ARGV[21 + 13 * m]), tonumber(ARGV[22 + 13 * m])
for b = 0, m do backends[b].charge = tonumber(ARGV[23 + 13 * m + b]) end
-- locality (schedulers/policy/locality.py): how many of each queue's first jobs it looks at (1:
-- its first only), the wait after which the first goes anyway (0: none), each backend's cache
-- room; with it, each backend's `filled` count (the state's `filled`, `filled:<b>`)
local lookahead, max_wait = tonumber(ARGV[24 + 14 * m]), tonumber(ARGV[25 + 14 * m])
local filled = {}
for b = 0, m do
  backends[b].cache = tonumber(ARGV[26 + 14 * m + b])
  backends[b].queue_rate = tonumber(ARGV[27 + 15 * m + b])  -- placement.first_token_s's rate
end
if lookahead > 1 then
  local fields = {'filled'}
  for b = 1, m do fields[#fields + 1] = 'filled:' .. b end
  local got = redis.call('HMGET', st, unpack(fields))
  for b = 0, m do filled[b] = num(got[b + 1], 0) end
end
local rr_last = -1
if policy == 'round_robin' then rr_last = num(redis.call('HGET', st, 'rr'), -1) end

-- quotas: by project, with their window keys (schedulers/policy/quota.py)
local q0 = 28 + 16 * m
local nq = tonumber(ARGV[q0])
local win = {minute = ARGV[q0 + 1], minute_end = tonumber(ARGV[q0 + 2]), day = ARGV[q0 + 3],
  day_end = tonumber(ARGV[q0 + 4]), month = ARGV[q0 + 5], month_end = tonumber(ARGV[q0 + 6])}
local quotas = {}

-- projects: each with its groups (one per eligibility class), in the caller's order.
local projects, by_name, named = {}, {}, {}
local first_arg, first_key = q0 + 7 + 9 * nq, 11 + 2 * m
local ngroups = (#ARGV - first_arg + 1) / 2
for g = 0, ngroups - 1 do
  local member = ARGV[first_arg + 2 * g]
  local name, elig = string.match(member, '^([^:]+):?(%d*)$')
  if elig == '' then elig = '1' end
  local pr = by_name[name]
  if not pr then
    pr = {name = name, weight = tonumber(ARGV[first_arg + 2 * g + 1]), groups = {}}
    by_name[name] = pr
    projects[#projects + 1] = pr
  end
  table.insert(pr.groups, {member = member, elig = elig, mask = tonumber(elig), k = first_key + 4 * g})
  named[member] = true
end
local qres = KEYS[first_key + 4 * ngroups]
local counts_flight = false
for i = 0, nq - 1 do
  local a, k = q0 + 7 + 9 * i, first_key + 4 * ngroups + 1 + 3 * i
  local q = {tpm = tonumber(ARGV[a + 1]), rpm = tonumber(ARGV[a + 2]), tpd = tonumber(ARGV[a + 3]),
    tpmo = tonumber(ARGV[a + 4]), flight = tonumber(ARGV[a + 5]), cost_prompt = tonumber(ARGV[a + 6]),
    cost_cached = tonumber(ARGV[a + 7]), cost_output = tonumber(ARGV[a + 8]),
    kmin = KEYS[k], kday = KEYS[k + 1], kmonth = KEYS[k + 2]}
  local mh = redis.call('HMGET', q.kmin, 't', 'r')
  q.tokens_minute, q.requests_minute = num(mh[1], 0), num(mh[2], 0)
  q.tokens_day = num(redis.call('GET', q.kday), 0)
  q.tokens_month = num(redis.call('GET', q.kmonth), 0)
  q.in_flight = 0
  if q.flight > 0 then counts_flight = true end
  quotas[ARGV[a]] = q
end
if counts_flight then  -- the projects' live leases (at most every backend's max_num_seqs)
  for _, s in ipairs(redis.call('HVALS', lease_info)) do
    local project = string.match(s, '^%S+ %S+ %S+ %S+ %S+ (%S+)')
    if quotas[project] then quotas[project].in_flight = quotas[project].in_flight + 1 end
  end
end

-- quota.Quota.reserve: a turn's worst case
local function reserve_cost(q, c)
  return math.ceil(c.prompt * math.max(q.cost_prompt, q.cost_cached) + c.max_new * q.cost_output - 1e-9)
end

-- quota.check: why c's project's quota holds it and when that lifts (nil: no time), or nil
local function quota_verdict(q, c)
  local cost = reserve_cost(q, c)
  if q.flight > 0 and q.in_flight + 1 > q.flight then return 'quota', nil end
  if q.rpm > 0 and q.requests_minute + 1 > q.rpm then return 'quota', win.minute_end - now end
  if q.tpm > 0 and q.tokens_minute + cost > q.tpm then return 'quota', win.minute_end - now end
  if q.tpd > 0 and q.tokens_day + cost > q.tpd then return 'quota', win.day_end - now end
  if q.tpmo > 0 and q.tokens_month + cost > q.tpmo then return 'quota', win.month_end - now end
  return nil
end

-- over_quota: quota_verdict of c's project (nil without a quota); a project held counts once per
-- call in stats' quota_held:<project> (fleet queues, fleet top)
local held_projects = {}
local function over_quota(c)
  local q = quotas[c.project]
  if not q then return nil end
  local why, retry = quota_verdict(q, c)
  if why and not held_projects[c.project] then
    held_projects[c.project] = true
    redis.call('HINCRBY', stats, 'quota_held:' .. c.project, 1)
  end
  return why, retry
end

-- Add n to a window counter (a hash field, or the string when field is nil); a counter this
-- write created gets its TTL (a settle never creates one: it gives back only where one exists).
local function add_to(key, field, n, ttl)
  local now_held
  if field then now_held = redis.call('HINCRBY', key, field, n) else now_held = redis.call('INCRBY', key, n) end
  if now_held == n and redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ttl) end
end

-- quota.take, in Redis: the grant's reservation in the windows its quota limits, and in qres
-- when it holds tokens there (what SETTLE gives back)
local function reserve(c, fence)
  local q = quotas[c.project]
  if not q then return end
  local cost = reserve_cost(q, c)
  q.tokens_minute, q.requests_minute = q.tokens_minute + cost, q.requests_minute + 1
  q.tokens_day, q.tokens_month, q.in_flight = q.tokens_day + cost, q.tokens_month + cost, q.in_flight + 1
  if q.tpm > 0 then add_to(q.kmin, 't', cost, 180) end
  if q.rpm > 0 then add_to(q.kmin, 'r', 1, 180) end
  if q.tpd > 0 then add_to(q.kday, nil, cost, 3 * 86400) end
  if q.tpmo > 0 then add_to(q.kmonth, nil, cost, 33 * 86400) end
  local flags = (q.tpm > 0 and 't' or '') .. (q.tpd > 0 and 'd' or '') .. (q.tpmo > 0 and 'm' or '')
  if flags ~= '' then
    redis.call('HSET', qres, c.id, table.concat({c.project, fence, cost, win.minute, win.day, win.month, flags}, ' '))
  end
end

local members = redis.call('SMEMBERS', KEYS[8])
for _, member in ipairs(members) do
  if not named[member] then return {'stale', members} end
end

-- Is backend b in the mask?
local function on(mask, b) return bit.band(bit.rshift(mask, b), 1) == 1 end

-- A queue member's admission facts as a candidate.
local function member(id, score, queue, band, size, g, pr)
  local f = item_get(items, id)
  return {id = id, score = tonumber(score), queue = queue, band = band, long = size == 'long',
    prompt = tonumber(f.prompt), max_new = tonumber(f.max_new), uncached = tonumber(f.uncached),
    hint = tonumber(f.hint), mask = g.mask, kv = tonumber(f.kv), enq = tonumber(f.enq),
    fill = num(f.fill, 0), project = pr.name, weight = pr.weight}
end

-- locality.fresh_cached of candidate c on its cache backend (locality.cache_backend: its hint,
-- else its mask's lowest backend)
local function fresh_cached(c)
  local b = c.hint
  if b == nil then
    b = 0
    while b < 32 and not on(c.mask, b) do b = b + 1 end
  end
  local B = backends[b]
  local cached = math.max(0, c.prompt - c.uncached)
  if B and B.cache > 0 and filled[b] - c.fill >= B.cache then return 0 end
  return cached
end

-- locality: candidate c's fresh_cached, and a prefix evicted since it was queued made a whole
-- prompt to compute again (for the quiet long prefills, the prefill bucket and first_token
-- alike); checked at every choice, since an earlier grant of this call may have evicted it
local function fresh(c)
  local cached = fresh_cached(c)
  if cached == 0 then c.uncached = c.prompt end
  return cached
end

-- locality.choose: the one of a queue's first jobs it offers (line: them in line order); it
-- keeps the first's score and enqueue time as its queue's place and age (fairshare.Head). The
-- first goes once it has waited max_wait or the aging time (a line's age is its first job's).
local function choose(line)
  local first = line[1]
  first.line_enq, first.line_score = first.enq, first.score
  if lookahead == 1 then return first end
  local best, best_cached = first, fresh(first)
  for i = 2, #line do
    local cached = fresh(line[i])
    if cached > best_cached then best, best_cached = line[i], cached end
  end
  local waited = now - first.enq
  if (max_wait > 0 and waited >= max_wait) or (aging > 0 and waited >= aging) then return first end
  best.line_enq, best.line_score = first.enq, first.score
  return best
end

-- The first jobs of each of a project's queues (one; with locality `lookahead`), as g.lines.
local function read_heads(pr)
  for _, g in ipairs(pr.groups) do
    g.any, g.lines = false, {}
    for b, band in ipairs(BANDS) do
      for z, size in ipairs(SIZES) do
        local queue = KEYS[g.k + 2 * (b - 1) + (z - 1)]
        local top
        if admit_head then top = admit_head(queue, pr.name, band, size, g.elig)
        else top = redis.call('ZRANGE', queue, 0, lookahead - 1, 'WITHSCORES') end
        local line = {}
        for i = 1, #top, 2 do
          line[#line + 1] = member(top[i], top[i + 1], queue, band, size, g, pr)
        end
        g.lines[2 * (b - 1) + z] = line
        if line[1] then g.any = true end
      end
    end
  end
end

-- The heads a project's queues offer: {band = {{short = head, long = head}, ...}}, a pair per
-- group (pr.heads; nil when every queue is empty).
local function choose_heads(pr)
  local heads, any = {}, false
  for b, band in ipairs(BANDS) do
    heads[band] = {}
    for _, g in ipairs(pr.groups) do
      local pair = {}
      for z, size in ipairs(SIZES) do
        local line = g.lines[2 * (b - 1) + z]
        if line[1] then pair[size], any = choose(line), true end
      end
      table.insert(heads[band], pair)
    end
  end
  pr.heads = any and heads or nil
end

-- fairshare._line_key: a band's line order (by its queue's place, then id; in the batch band
-- longs first).
local function line_before(x, y, band)
  local xs, ys = band == 'batch' and not x.long, band == 'batch' and not y.long
  if xs ~= ys then return ys end
  if x.line_score ~= y.line_score then return x.line_score < y.line_score end
  return x.id < y.id
end

-- fairshare.project_candidates: per band and class the head in line and, behind a long head, the
-- short one; a band's candidates of every class together in line order.
local function candidates(pr)
  local out = {}
  for _, band in ipairs(BANDS) do
    local in_band = {}
    for _, pair in ipairs(pr.heads[band]) do
      local s, l = pair.short, pair.long
      local first = s
      if l and (not s or line_before(l, s, band)) then first = l end
      if first then
        table.insert(in_band, first)
        if first.long and s then table.insert(in_band, s) end
      end
    end
    table.sort(in_band, function(x, y) return line_before(x, y, band) end)
    for _, c in ipairs(in_band) do table.insert(out, c) end
  end
  return out
end

local tags = {}
local in_set = {}
for _, member in ipairs(members) do in_set[member] = true end
for _, pr in ipairs(projects) do
  tags[pr.name] = num(redis.call('HGET', vtime, pr.name), 0)
  read_heads(pr)
  choose_heads(pr)
  for _, g in ipairs(pr.groups) do
    if not g.any and in_set[g.member] then redis.call('SREM', KEYS[8], g.member) end
  end
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
    for _, c in ipairs(r.c) do oldest = math.min(oldest, c.enq, c.line_enq) end
    r.tier = 0
    if banded and r.c[1].band ~= 'interactive' and now - oldest < aging then r.tier = 1 end
  end
  table.sort(ranked, function(x, y)
    if x.tier ~= y.tier then return x.tier < y.tier end
    if x.start ~= y.start then return x.start < y.start end
    if x.c[1].line_score ~= y.c[1].line_score then return x.c[1].line_score < y.c[1].line_score end
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
local function drains(B, shorts, uncached)
  local drained = shorts - B.beside
  return drained * drained * B.short_job_s * B.prefill_rate <= 2.0 * shorts * shorts * uncached
end

-- placement.uncached_on: c's uncached tokens on backend B.
local function uncached_on(B, c)
  if c.hint == nil or c.hint == B.index then return c.uncached end
  return c.prompt
end

-- A candidate's KV reservation, long flag, long-prefill flag and uncached tokens on backend B
-- (limits.cost_of).
local function cost(B, c)
  local uncached = uncached_on(B, c)
  local long_prefill = uncached > B.long_threshold
  if B.index == 0 then return c.kv, c.long, long_prefill, uncached end
  local kv = math.max(1, math.ceil((c.prompt + c.max_new) / B.block)) * B.block
  return kv, c.prompt > B.long_threshold, long_prefill, uncached
end

-- placement.load: max(in flight / max_num_seqs, reserved KV / KV budget).
local function load(B)
  local kv = 0
  if B.kv_budget > 0 then kv = B.kv_used / B.kv_budget end
  return math.max(B.in_flight / B.max_seqs, kv)
end

-- placement.pick: by the routing policy among `usable` (in the settings' order): round robin's
-- next; else the least loaded (then the settings' order), or under `fleet` c's hint unless it is
-- loaded past both imbalance thresholds against the least loaded (placement.imbalanced).
local function pick(usable, c)
  if policy == 'round_robin' then
    for _, b in ipairs(usable) do
      if b > rr_last then return b end
    end
    return usable[1]
  end
  local least, least_load = nil, nil
  for _, b in ipairs(usable) do
    local l = load(backends[b])
    if not least or l < least_load then least, least_load = b, l end
  end
  if policy == 'first_token' then  -- placement.first_token_s, when every usable backend has a rate
    local timed = true
    for _, b in ipairs(usable) do timed = timed and backends[b].queue_rate > 0 end
    if timed then
      local soonest, soonest_key = nil, nil
      for _, b in ipairs(usable) do
        local B = backends[b]
        local _, _, _, uncached = cost(B, c)
        local key = {math.max(0, B.queue_until - now) + uncached / B.queue_rate, load(B), b}
        if not soonest or key[1] < soonest_key[1] or (key[1] == soonest_key[1] and (key[2] < soonest_key[2]
            or (key[2] == soonest_key[2] and key[3] < soonest_key[3]))) then
          soonest, soonest_key = b, key
        end
      end
      if soonest == least then return least end
      local S, L = backends[soonest], backends[least]
      if S.in_flight - L.in_flight > balance_abs and load(S) > balance_rel * least_load then return least end
      return soonest
    end
  end
  if (policy ~= 'fleet' and policy ~= 'first_token') or c.hint == nil or c.hint == least then return least end
  local H = nil
  for _, b in ipairs(usable) do
    if b == c.hint then H = backends[b] end
  end
  if not H then return least end
  local L = backends[least]
  if H.in_flight - L.in_flight > balance_abs and load(H) > balance_rel * least_load then return least end
  return c.hint
end

-- placement.best: the backend whose reason a passed-over candidate reports (and may reserve):
-- the least loaded whose gate passes, else the least loaded, then the settings' order.
local function best(tried)
  local best_b, best_key1, best_load = nil, nil, nil
  for _, b in ipairs(tried) do
    local B = backends[b]
    local k1, l = B.gated and 1 or 0, load(B)
    if not best_b or k1 < best_key1 or (k1 == best_key1 and l < best_load) then
      best_b, best_key1, best_load = b, k1, l
    end
  end
  return best_b
end

-- Backend B's gate and counters, read once per call: later decisions of the call see them as this
-- call's own writes left them (grant, reserves and decide keep the copy), so with many backends a
-- call reads each backend's two hashes once, not once per grant. A grant that freed another lease
-- (free_lease: any backend's counters) makes every backend read again.
local function read_backend(B)
  B.gate_why, B.outside = nil, 0
  if gate then
    local g = redis.call('HMGET', B.scrape, 'scraped_at', 'hold', 'outside')
    if not g[1] or now - tonumber(g[1]) > stale then B.gate_why = 'backend_stale'
    elseif g[2] and g[2] ~= '' then B.gate_why = 'backend_' .. g[2] end
    B.outside = num(g[3], 0)
  end
  local s = redis.call('HMGET', B.st, 'in_flight', 'kv', 'long', 'bucket', 'bucket_at', 'last_admit',
    'blocked_job', 'blocked_since', 'prefill_until', 'prefill_longs', 'inter', 'queue_until')
  B.in_flight, B.kv_used, B.long_used = num(s[1], 0), num(s[2], 0), num(s[3], 0)
  B.bucket, B.bucket_at, B.last_admit = num(s[4], nil), num(s[5], nil), num(s[6], nil)
  B.blocked_job, B.blocked_since = s[7], num(s[8], 0)
  B.prefill_until, B.prefill_longs = num(s[9], 0), num(s[10], 0)
  B.inter = num(s[11], 0)
  B.queue_until = num(s[12], 0)
  B.read = true
end

-- Backend B as this decision sees it: its gate and counters (placement._global: the gate, then
-- limits.check_global) and whether its quiet windows protect anything (an interactive lease on
-- it, or an interactive candidate that may run on it).
local function view(B, inter_mask)
  if not B.read then read_backend(B) end
  B.why, B.retry, B.gated = B.gate_why, nil, B.gate_why ~= nil
  if not B.why then
    if B.in_flight >= B.max_seqs then B.why = 'seqs'
    elseif B.in_flight + B.outside >= B.max_seqs then B.why = 'outside'
    elseif B.last_admit and B.spacing > 0 then
      local wait = B.last_admit + B.spacing - now
      if wait > 0 then B.why, B.retry = 'spacing', wait end
    end
  end
  B.quiet = (B.inter > 0 or on(inter_mask, B.index)) and B.prefill_rate > 0
  B.level = B.burst
  if B.bucket then B.level = math.min(B.burst, B.bucket + math.max(0, now - B.bucket_at) * B.rate) end
end

-- limits.check_job on backend B: the reason candidate c does not fit (and when it lifts), or nil.
local function check_job(B, c)
  local kv, long, long_prefill, uncached = cost(B, c)
  if B.quiet and now < B.prefill_until and (not long_prefill or B.prefill_longs >= B.long_prefills) then
    return 'prefill', B.prefill_until - now
  elseif B.kv_used + kv > B.kv_budget and B.in_flight > 0 then return 'kv'
  elseif long and B.long_used >= B.max_long then return 'long'
  elseif long_prefill and B.quiet and B.in_flight - B.long_used > B.beside
    and drains(B, B.in_flight - B.long_used, uncached) then return 'prefill'
  end
  local need = math.min(uncached, B.burst)
  if B.level < need then return 'bucket', (need - B.level) / B.rate end
  return nil
end

-- placement._reserves: does c, blocked on B by `why`, close B to the candidates behind it?
local function reserves(B, c, why)
  if not (why == 'kv' or why == 'bucket' or (why == 'prefill' and not (B.prefill_until > now))) then
    return false  -- a window hold lifts by itself: nothing to reserve
  end
  if B.blocked_job ~= c.id then
    B.blocked_job, B.blocked_since = c.id, now
    redis.call('HSET', B.st, 'blocked_job', c.id, 'blocked_since', fmt(now))
  end
  return now - B.blocked_since >= B.bypass
end

-- One decision (placement.place): the candidate to grant and its backend, or the hold reason and
-- when it lifts.
local function decide(cands)
  if #cands == 0 then return nil, hold('empty') end
  local inter_mask = 0  -- the backends an interactive candidate may run on
  for _, c in ipairs(cands) do
    if c.band == 'interactive' then inter_mask = bit.bor(inter_mask, c.mask) end
  end
  for b = 0, m do view(backends[b], inter_mask) end
  local headed, closed, open = {}, {}, m + 1
  local first_reason, soonest = nil, nil
  for i, c in ipairs(cands) do
    local tried = {}
    local qwhy, qretry = over_quota(c)
    if qwhy then
      if i == 1 then first_reason = qwhy end
      if qretry and (not soonest or qretry < soonest) then soonest = qretry end
    else
      for b = 0, m do
        if on(c.mask, b) and not closed[b] then tried[#tried + 1] = b end
      end
    end
    if qwhy then  -- passed over: nothing tried, nothing reserved
    elseif #tried == 0 then
      if i == 1 then first_reason = 'no_backend' end
    else
      local refused = nil  -- admit_only's answer, asked once a backend's global limits pass
      local whys, retries = {}, {}
      local function verdict(b)  -- c's verdict on backend b (every verdict is pure: any order)
        local B = backends[b]
        local why, retry = B.why, B.retry
        if not why then
          if refused == nil then refused = admit_only ~= nil and not admit_only(c) end
          if refused then why = 'no_workers' else why, retry = check_job(B, c) end
        end
        whys[b], retries[b] = why or false, retry
        return not why
      end
      local chosen = nil
      if policy == 'round_robin' or policy == 'first_token' then
        local usable = {}
        for _, b in ipairs(tried) do
          if verdict(b) then usable[#usable + 1] = b end
        end
        if #usable > 0 then chosen = pick(usable, c) end
      else
        -- pick's answer without a verdict on every backend: the least loaded usable one (by load,
        -- then the settings' order) is the first usable in that order; under `fleet` the hint
        -- instead when it is usable and not loaded past the thresholds against it
        -- (the least loaded by one scan, as it is usually usable; the rest sorted only if not)
        local least, least_load = nil, nil
        for _, b in ipairs(tried) do  -- (tried is in the settings' order: ties go to the first)
          local l = load(backends[b])
          if not least or l < least_load then least, least_load = b, l end
        end
        if verdict(least) then chosen = least
        elseif #tried > 1 then
          local by_load = {}
          for _, b in ipairs(tried) do
            if b ~= least then by_load[#by_load + 1] = {b = b, load = load(backends[b])} end
          end
          table.sort(by_load, function(x, y)
            if x.load ~= y.load then return x.load < y.load end
            return x.b < y.b
          end)
          for _, e in ipairs(by_load) do
            if verdict(e.b) then chosen = e.b break end
          end
        end
        if chosen and policy == 'fleet' and c.hint ~= nil and c.hint ~= chosen then
          local listed = false
          for _, b in ipairs(tried) do listed = listed or b == c.hint end
          if listed and (whys[c.hint] == nil and verdict(c.hint) or whys[c.hint] == false) then
            chosen = pick({chosen, c.hint}, c)
          end
        end
      end
      if chosen then
        for _, b in ipairs(tried) do
          if not headed[b] and backends[b].blocked_job then  -- (no write when nothing is held)
            redis.call('HDEL', backends[b].st, 'blocked_job', 'blocked_since')
            backends[b].blocked_job, backends[b].blocked_since = false, 0
          end
        end
        return {c = c, b = chosen}
      end
      for _, b in ipairs(tried) do
        local retry = retries[b]
        if retry and (not soonest or retry < soonest) then soonest = retry end
      end
      local target = best(tried)
      local why = whys[target]
      if i == 1 then first_reason = why end
      if not headed[target] and reserves(backends[target], c, why) then
        closed[target], open = true, open - 1
      end
      for _, b in ipairs(tried) do headed[b] = true end
      if open == 0 then break end
    end
  end
  return nil, hold(first_reason, soonest)
end

local function grant(c, top, b)
  local B = backends[b]
  local kv, long, long_prefill, uncached = cost(B, c)
  local freed = free_lease(states, KEYS[6], lease_info, c.id)
  redis.call('HINCRBY', B.st, 'in_flight', 1)
  redis.call('HINCRBY', B.st, 'kv', kv)
  if long then redis.call('HINCRBY', B.st, 'long', 1) end
  if c.band == 'interactive' then redis.call('HINCRBY', B.st, 'inter', 1) end
  local prefill_until, prefill_longs = B.prefill_until, B.prefill_longs
  if long_prefill and B.prefill_rate > 0 then
    if now >= B.prefill_until then prefill_longs = 0 end
    prefill_until, prefill_longs = math.max(now, B.prefill_until) + uncached / B.prefill_rate, prefill_longs + 1
    redis.call('HSET', B.st, 'prefill_until', fmt(prefill_until), 'prefill_longs', prefill_longs)
  end
  redis.call('HINCRBY', st, 'queued', -1)
  if lookahead > 1 then  -- locality: the tokens this backend's cache takes in
    redis.call('HINCRBY', st, b == 0 and 'filled' or 'filled:' .. b, uncached)
    filled[b] = filled[b] + uncached
  end
  redis.call('HSET', B.st, 'bucket', fmt(B.level - uncached), 'bucket_at', fmt(now),
    'last_admit', fmt(now))
  if freed then  -- another lease's counters went down somewhere: read every backend again
    for i = 0, m do backends[i].read = false end
  else  -- the copy as these writes left the hash
    B.in_flight, B.kv_used = B.in_flight + 1, B.kv_used + kv
    if long then B.long_used = B.long_used + 1 end
    if c.band == 'interactive' then B.inter = B.inter + 1 end
    B.prefill_until, B.prefill_longs = prefill_until, prefill_longs
    B.bucket, B.bucket_at, B.last_admit = B.level - uncached, now, now
  end
  if policy == 'round_robin' then
    rr_last = b
    redis.call('HSET', st, 'rr', b)
  end
  if policy == 'first_token' and B.queue_rate > 0 then  -- limits.admit's queue_until
    B.queue_until = math.max(now, B.queue_until) + uncached / B.queue_rate
    redis.call('HSET', B.st, 'queue_until', fmt(B.queue_until))
  end
  local V = math.max(num(redis.call('HGET', st, 'vtime'), 0), tags[top.project])
  local start = math.max(V, tags[c.project])
  tags[c.project] = start + (c.prompt + c.max_new) * B.charge / c.weight
  redis.call('HSET', vtime, c.project, fmt(tags[c.project]))
  redis.call('HSET', st, 'vtime', fmt(V))
  local fence = redis.call('HINCRBY', KEYS[5], c.project, 1)
  local expires = now + ttl
  lease_put(lease_info, c.id, {fence = fence, kv = kv,
    long = (long and '1' or '0') .. (c.band == 'interactive' and 'i' or ''),
    expires = fmt(expires), admitted_at = fmt(now), project = c.project, backend = b})
  redis.call('ZADD', KEYS[6], fmt(expires), c.id)
  redis.call('ZREM', c.queue, c.id)
  redis.call('ZREM', KEYS[7], c.id)
  local f = item_get(items, c.id)
  f.pending = '0'
  item_put(items, c.id, f)
  redis.call('HINCRBY', stats, 'admissions', 1)
  reserve(c, fence)
  return {c.id, c.project, fence, c.prompt, kv, long and 1 or 0, fmt(expires),
    fmt(math.max(0, now - c.enq)), b}
end

local out = {'ok', '', ''}
local granted = 0
while granted < max_grants do
  local cands = order(num(redis.call('HGET', st, 'vtime'), 0))
  local pick_, reason, retry = decide(cands)
  if not pick_ then
    out[2], out[3] = reason, retry
    break
  end
  for _, field in ipairs(grant(pick_.c, cands[1], pick_.b)) do table.insert(out, field) end
  granted = granted + 1
  for _, pr in ipairs(projects) do  -- (with locality another project's choice may change too)
    if pr.name == pick_.c.project then
      read_heads(pr)
      choose_heads(pr)
    elseif lookahead > 1 and pr.heads then choose_heads(pr) end
  end
end
return out
