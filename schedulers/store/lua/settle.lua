-- SETTLE: a turn's quota reservation meets what the turn spent (schedulers/policy/quota.py). The
-- caller read the grant's reservation from qres and names the windows it was made in; the
-- script changes only the windows the reservation wrote to (its flags: t the minute's tokens,
-- d the day, m the month), and only where the window still exists (a minute that lapsed
-- meanwhile is not brought back): what the reservation held beyond `spent` goes back, and what
-- the turn spent beyond it (a prompt the fleet counted short) is added; then the reservation
-- is forgotten, once: a second call, or one with another grant's reservation, changes nothing.
-- KEYS[1] qres                        hash    job id -> "project fence cost minute day month flags"
-- KEYS[2] quota:<project>:m:<minute>  hash    t (cost held), r (requests)
-- KEYS[3] quota:<project>:d:<day>     string  cost held
-- KEYS[4] quota:<project>:mo:<month>  string  cost held
-- ARGV: id, the reservation as read, spent (the turn's cost)
-- Returns 1 when settled, 0 when the reservation is not the one read (settled, or replaced by a
-- later grant of the job).
local id = ARGV[1]
local held = redis.call('HGET', KEYS[1], id)
if held ~= ARGV[2] then return 0 end
local cost, flags = string.match(held, '^%S+ %S+ (%S+) %S+ %S+ %S+ ?(%S*)$')
local change = math.max(0, tonumber(ARGV[3])) - tonumber(cost)
if change ~= 0 then
  if string.find(flags, 't', 1, true) and redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('HINCRBY', KEYS[2], 't', change)
  end
  if string.find(flags, 'd', 1, true) and redis.call('EXISTS', KEYS[3]) == 1 then
    redis.call('INCRBY', KEYS[3], change)
  end
  if string.find(flags, 'm', 1, true) and redis.call('EXISTS', KEYS[4]) == 1 then
    redis.call('INCRBY', KEYS[4], change)
  end
end
redis.call('HDEL', KEYS[1], id)
return 1
