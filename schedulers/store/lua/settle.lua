-- SETTLE: a turn's quota reservation meets what the turn spent (schedulers/policy/quota.py). The
-- caller read the grant's reservation from qres and names the windows it was made in; the
-- script gives back what the reservation held beyond `spent` to each window that still exists
-- (a minute that lapsed meanwhile is not brought back) and forgets the reservation, once: a
-- second call, or one with another grant's reservation, changes nothing.
-- KEYS[1] qres                        hash    job id -> "project fence cost minute day month"
-- KEYS[2] quota:<project>:m:<minute>  hash    t (cost held), r (requests)
-- KEYS[3] quota:<project>:d:<day>     string  cost held
-- KEYS[4] quota:<project>:mo:<month>  string  cost held
-- ARGV: id, the reservation as read, spent (the turn's cost; never more is given back than held)
-- Returns 1 when settled, 0 when the reservation is not the one read (settled, or replaced by a
-- later grant of the job).
local id = ARGV[1]
local held = redis.call('HGET', KEYS[1], id)
if held ~= ARGV[2] then return 0 end
local cost = tonumber(string.match(held, '^%S+ %S+ (%S+)'))
local back = cost - math.max(0, tonumber(ARGV[3]))
if back > 0 then
  if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('HINCRBY', KEYS[2], 't', -back) end
  if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('DECRBY', KEYS[3], back) end
  if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('DECRBY', KEYS[4], back) end
end
redis.call('HDEL', KEYS[1], id)
return 1
