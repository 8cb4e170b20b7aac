-- PRUNE: drop a project from the projects set when all four of its queues are empty. Admission
-- reads the heads without a script (a pipelined read: which queues and items it reads depends on
-- what it finds) and calls this for a project that showed no head; the check is repeated here,
-- atomically, so a job added meanwhile keeps its project in the set.
-- KEYS[1] projects                               set
-- KEYS[2..5] pending:<project>:<band>:<size>     zset  the project's four queues
-- ARGV: project
-- Returns 1 when the project was removed, 0 when one of its queues has a job.
for i = 2, 5 do
  if redis.call('ZCARD', KEYS[i]) > 0 then return 0 end
end
redis.call('SREM', KEYS[1], ARGV[1])
return 1
