-- USAGE: count one model turn in the usage ledger, once. SET NX on the turn's marker decides;
-- only the call that set it adds the turn's figures to the project's hourly hash.
-- KEYS[1] usage:{<project>}:h:<YYYYMMDDHH>         hash    "<key>|<model>|<metric>" -> count
-- KEYS[2] usage:{<project>}:t:<job>:<fence>:<turn> string  the turn's marker (TTL ARGV[2])
-- ARGV: hash ttl s, marker ttl s, then field, increment pairs (increments are integers > 0)
-- Returns 1 when this call counted the turn, 0 when it was counted before.
--
-- Cluster: both keys carry the project's hash tag, one slot.
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[2]) == false then
  return 0
end
for i = 3, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
