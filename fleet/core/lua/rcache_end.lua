-- RCACHE_END: the queue job computing an answer of a project's exact-repeat cache ended
-- (fleet/worker/repeats.py). Both keys carry the project's hash tag: one Cluster slot.
-- KEYS[1] rcache:{<project>}:jrun:<digest>   string  the job computing it (its ref)
-- KEYS[2] rcache:{<project>}:jwait:<digest>  set     the jobs waiting for it
-- ARGV: ref (the job that ended), how ('kept': its answer was kept; 'lost': it ended without
--       one), ttl ms (of the next runner's key)
-- kept: the run ends (if it is still this job's) and every waiter is returned and forgotten: the
--       caller serves each the kept answer.
-- lost: one waiter, if any, becomes the runner and is returned (the caller puts it in line at
--       once); the others wait on. A run that is no longer this job's is left alone.
-- Returns the refs the caller acts on.
-- The job that ended waits no more, whatever it was (a waiter cancelled, or past its deadline).
redis.call('SREM', KEYS[2], ARGV[1])
local runner = redis.call('GET', KEYS[1])
if ARGV[2] == 'kept' then
  if runner == ARGV[1] then redis.call('DEL', KEYS[1]) end
  local waiting = redis.call('SMEMBERS', KEYS[2])
  redis.call('DEL', KEYS[2])
  return waiting
end
if runner and runner ~= ARGV[1] then return {} end
local next = redis.call('SPOP', KEYS[2])
if not next then
  redis.call('DEL', KEYS[1])
  return {}
end
redis.call('SET', KEYS[1], next, 'PX', ARGV[3])
return {next}
