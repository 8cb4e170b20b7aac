-- GROW: a continuation waiting for its tool round's results counts each result in its next
-- turn's prompt as it comes in: the item's prompt becomes `prompt` (never smaller: two tool
-- workers may report out of order), its uncached tokens grow by as much, its KV reservation
-- and size follow. Only while the job waits in `deferred` (out of every queue): a result that
-- comes in after its round's timeout, with the job already in line, is not counted.
-- KEYS[1] deferred  zset  continuations waiting for their not-before time
-- KEYS[2] items     hash  job id -> admission facts (prelude)
-- No cap: an item whose KV reservation passes the whole KV budget is admitted alone, when
-- nothing else is in flight (admit.lua), exactly like a new job of that size.
-- ARGV: id, prompt, block_tokens, long_prompt_tokens, elig (the backends the grown prompt fits;
--       '': unchanged). PROMOTE puts it in the queue of that class.
-- Returns 1 when the item grew, 0 otherwise.
local id, prompt = ARGV[1], tonumber(ARGV[2])
if not redis.call('ZSCORE', KEYS[1], id) then return 0 end
local f = item_get(KEYS[2], id)
if not f or tonumber(f.prompt) >= prompt then return 0 end
local block = tonumber(ARGV[3])
local kv = math.max(1, math.ceil((prompt + tonumber(f.max_new)) / block)) * block
f.uncached = fmt(tonumber(f.uncached) + prompt - tonumber(f.prompt))
f.prompt = fmt(prompt)
f.kv = fmt(kv)
f.size = prompt > tonumber(ARGV[4]) and 'long' or 'short'
f.long = f.size == 'long' and '1' or '0'
if ARGV[5] and ARGV[5] ~= '' then f.elig = ARGV[5] end
item_put(KEYS[2], id, f)
return 1
