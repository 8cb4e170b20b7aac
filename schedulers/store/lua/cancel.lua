-- CANCEL: take a pending job out of line.
-- KEYS[1] items                            hash  job id -> admission facts (prelude)
-- KEYS[2] lease                            hash  job id -> lease (a lease keeps the item alive)
-- KEYS[3] pending:<project>:<band>:<size>[:<elig>]  zset  the job's queue, as the caller read the item
-- KEYS[4] deadlines                        zset
-- KEYS[5] state                            hash  queued
-- ARGV: id, project, band, size, elig (of the item as read; '' when it had none)
-- Returns 1 when the job left the line, 0 when it was not pending.
if unqueue(KEYS[5], KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[2], ARGV[3], ARGV[4],
    ARGV[5]) then
  return 1
end
return 0
