-- REQUEUE: give a lease up at once and put the job back in line (a grant that could not be sent).
-- KEYS[1] lease                            hash  job id -> lease (prelude)
-- KEYS[2] leases                           zset  in-flight job ids by lease expiry
-- KEYS[3] state                            hash  backend 0's in_flight kv long inter claimed;
--                                                queued
-- KEYS[4] items                            hash  job id -> admission facts
-- KEYS[5] pending:<project>:<band>:<size>[:<elig>]  zset  the job's queue, as the caller read the
--                                                item
-- KEYS[6] projects                         set
-- KEYS[7] deadlines                        zset
-- KEYS[8] wake                             list
-- KEYS[9..] bstate:<name>                    hash  backends 1, 2, ...'s counters (prelude:
--                                                backend_states): the lease frees its backend's
-- ARGV: id, fence, project, band, size, elig (of the item as read; '' when it had none),
--       unclaimed only (1: give the lease up only while no worker has claimed it)
-- Returns 1 when the lease was given up, 0 for a stale fence (or a claimed lease, with ARGV[7]).
local f = lease_get(KEYS[1], ARGV[1])
if not f or f.fence ~= ARGV[2] then return 0 end
if ARGV[7] == '1' and f.owner then return 0 end
free_lease(backend_states(KEYS[3], KEYS, 9, #KEYS), KEYS[2], KEYS[1], ARGV[1])
requeue_item(KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], ARGV[1], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
wake(KEYS[8])
return 1
