-- GWADMIT: one ADMIT round under the worker gate. ADMIT is the script of this folder, unchanged
-- (the loader puts it in front as a local function); GATEWAY calls this after its ADD, and a
-- dispatcher whose worker gate holds calls it alone (``RedisStore.admit_gateway_only``), so a
-- gateway request that found the fleet full is admitted when a slot frees, not only by the next
-- gateway request's round.
-- While the worker gate is on and no inference worker is live (no entry of `workers` lapses after
-- now by Redis's clock, the one the heartbeats are stamped with: a gateway or dispatcher host's
-- clock may be off by any amount), the round grants gateway requests only: a queued job would go
-- to inference workers nobody runs, so it is passed over ('no_workers') and keeps its place in
-- line. A gateway request is admitted past queued jobs then: the head of a queue, for that round,
-- is its first gateway request in line (the queued jobs ahead of it are passed over anyway), or
-- its first member (refused) when it holds none. Fair share, the cap and every limit apply to
-- those heads as to any. With an inference worker live (or the gate off) it is ADMIT's round.
-- KEYS[1]      workers  zset  live inference workers, score = when the entry lapses (unix s by
--                             Redis's clock)
-- KEYS[2]      gateway  zset  gateway requests that may be pending (GATEWAY adds and prunes them;
--                             an entry whose item is no longer pending is ignored)
-- KEYS[3..]    ADMIT's keys
-- ARGV: worker_gate (1|0), then ADMIT's arguments
-- Returns ADMIT's reply.
local admit_keys, admit_argv = slice(KEYS, 3), slice(ARGV, 2)
local items = admit_keys[9]

-- The gateway requests still in line, grouped by their queue ('project band size elig').
local function gateway_requests_by_queue()
  local by_queue = {}
  for _, g in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    local f = item_get(items, g)
    if f and f.pending == '1' then
      local queue = f.project .. ' ' .. f.band .. ' ' .. f.size .. ' ' .. f.elig
      by_queue[queue] = by_queue[queue] or {}
      table.insert(by_queue[queue], g)
    end
  end
  return by_queue
end

local function workers_live()
  return redis.call('ZCOUNT', KEYS[1], '(' .. redis_now(), '+inf') > 0
end

if ARGV[1] == '1' and not workers_live() then
  admit_only = function(c) return redis.call('ZSCORE', KEYS[2], c.id) ~= false end
  local by_queue = gateway_requests_by_queue()
  admit_head = function(queue, project, band, size, elig)
    local best, best_score = nil, nil
    for _, g in ipairs(by_queue[project .. ' ' .. band .. ' ' .. size .. ' ' .. elig] or {}) do
      local score = redis.call('ZSCORE', queue, g)  -- false once granted in this round
      if score then
        score = tonumber(score)
        if not best or score < best_score or (score == best_score and g < best) then
          best, best_score = g, score
        end
      end
    end
    if best then return {best, best_score} end
    return redis.call('ZRANGE', queue, 0, 0, 'WITHSCORES')
  end
end
return ADMIT(admit_keys, admit_argv)
