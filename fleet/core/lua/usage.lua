-- USAGE: count one model turn in the usage ledger, once. SET NX on the turn's marker decides;
-- only the call that set it adds the turn's figures to the project's hourly hash. The turn's
-- progress entry (written while it streamed) goes, if it is this fence's, whether or not this
-- call counted.
-- KEYS[1] usage:{<project>}:h:<YYYYMMDDHH>         hash    "<key>|<model>|<metric>" -> count
-- KEYS[2] usage:{<project>}:t:<job>:<fence>:<turn> string  the turn's marker (TTL ARGV[2])
-- KEYS[3] usage:{<project>}:open:<job>            string  the job's progress JSON {"fence": ...}
-- ARGV: hash ttl s, marker ttl s, fence, then field, increment pairs (integers > 0)
-- Returns 1 when this call counted the turn, 0 when it was counted before.
--
-- Cluster: every key carries the project's hash tag, one slot.
local open = redis.call('GET', KEYS[3])
if open then
  local ok, entry = pcall(cjson.decode, open)  -- an unreadable entry goes too
  if not ok or type(entry) ~= 'table' or entry['fence'] == tonumber(ARGV[3]) then
    redis.call('DEL', KEYS[3])
  end
end
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[2]) == false then
  return 0
end
for i = 4, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
