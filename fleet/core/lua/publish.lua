-- PUBLISH: write a job's one final envelope. SET NX on the result key decides; only the winner
-- appends to the streams, sets the job's state and TTLs and counts the code.
-- KEYS[1] result:{<ref>}       string  the final Envelope JSON (SET NX, TTL result ttl)
-- KEYS[2] events:{<ref>}       stream  the job's events; gets the `final` event
-- KEYS[3] job:{<ref>}          hash    the job record: state code finished_at
-- KEYS[4] stats:codes          hash    final results counted by "<project>|<code>"
-- KEYS[5] results:<project>    stream  (only when given) the project's final envelopes, or
--                                      gwresults:<project> for a gateway request's
-- ARGV: envelope json, result ttl s, stream maxlen, events ttl s, now, code, events maxlen,
--       counter field (project|code)
-- Returns 1 when this call wrote the result, 0 when the job already had one.
--
-- Cluster: KEYS[1..3] share the job ref's hash tag, one slot. KEYS[4] and KEYS[5] are shared by
-- many jobs and cannot carry it, so on a Redis Cluster this script would fail with CROSSSLOT.
-- A Cluster move splits it: this script keeps KEYS[1..3] (the SET NX still decides alone), and
-- the winner then appends to the project stream and counts the code in a second step; a worker
-- lost between the two leaves the envelope out of the stream (ResultFollower also reads result
-- keys directly, so it is still delivered) and the code uncounted.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) == false then
  return 0
end
if KEYS[5] then
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[3], '*', 'envelope', ARGV[1])
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', 'type', 'final', 'ts', ARGV[5],
           'data', cjson.encode({code = ARGV[6]}))
redis.call('EXPIRE', KEYS[2], ARGV[4])
redis.call('HSET', KEYS[3], 'state', 'final', 'code', ARGV[6], 'finished_at', ARGV[5])
redis.call('EXPIRE', KEYS[3], ARGV[2])
redis.call('HINCRBY', KEYS[4], ARGV[8], 1)
return 1
