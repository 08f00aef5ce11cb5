"""The Lua scripts of the cluster jobs (kilolined/cluster/jobs.py): each write of a job, and the
claim of a lost gateway's jobs, is one script, so no reader sees half of it and exactly one
gateway adopts each job.

Keys under the prefix P (beside those of kilolined/cluster/scripts.py):
  P j:<id>     hash    owner (instance), tid, st (JSON state), spec (JSON request), body,
                       cancel, r_status, r_ctype, r_body, r_files (the result)
  P je:<id>    stream  the job's events: id 0-<event id>, fields e (name), f (SSE frame)
  P jg:<inst>  set     the active jobs an instance owns
  P jgs        set     instances that own active jobs
  P jres       zset    jobs holding a result -> finish time (ms), for max_results_mb
  P jsz        hash    job -> result bytes;  P jbytes: their sum
  P jw:<id>    string  the gateway that sends the job's webhook (SET NX)
  P jwo:<id>   hash    that webhook until it is delivered (or given up): url, body, msg (its webhook-id)
  P jwp:<inst> set     the webhooks an instance claimed and has not delivered yet: another gateway
                       sends them when that instance is found dead (CLAIM)
  P jwh        set     instances with such webhooks
  P jmark:<inst> string set by each gateway: missing, Redis came back empty
"""

from __future__ import annotations

from kilolined.cluster import scripts

#: ARGV: P, ME, id, tid, state, spec, body -> 1
SAVE = r"""
local P, ME, id, tid = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
redis.call('HSET', P..'j:'..id, 'owner', ME, 'tid', tid, 'st', ARGV[5], 'spec', ARGV[6], 'body', ARGV[7])
redis.call('SADD', P..'jg:'..ME, id)
redis.call('SADD', P..'jgs', ME)
if tid ~= '' and redis.call('EXISTS', P..'t:'..tid) == 1 then redis.call('HSET', P..'t:'..tid, 'job', id) end
return 1
"""

#: ARGV: P, ME, id, event id, name, frame, state, evicted event id ('' none)
#: -> 1 | 0 (job unknown) | -1 (another gateway carries it on now: this copy is not mirrored)
EVENT = r"""
local P, ME, id = ARGV[1], ARGV[2], ARGV[3]
local j = P..'j:'..id
local owner = redis.call('HGET', j, 'owner')
if not owner then return 0 end
if owner ~= ME then return -1 end
redis.call('XADD', P..'je:'..id, '0-'..ARGV[4], 'e', ARGV[5], 'f', ARGV[6])
if ARGV[8] ~= '' then redis.call('XDEL', P..'je:'..id, '0-'..ARGV[8]) end
redis.call('HSET', j, 'st', ARGV[7])
return 1
"""

#: ARGV: P, id, tid -> 1: a job carried on with a new ticket names it (its place is kept from now on)
FLAG = r"""
local P, id, tid = ARGV[1], ARGV[2], ARGV[3]
if redis.call('EXISTS', P..'j:'..id) == 0 then return 0 end
redis.call('HSET', P..'j:'..id, 'tid', tid)
if redis.call('EXISTS', P..'t:'..tid) == 1 then redis.call('HSET', P..'t:'..tid, 'job', id) end
return 1
"""

#: ARGV: P, ME, id, ttl_sec (what is left of result_ttl_sec), cap_bytes, has_result (1|0), status,
#:       content type, body, files (JSON), finished at (Unix ms, the gateway's clock)
#: -> 1 | 0 (job unknown) | -1 (another gateway owns it)
FINISH = r"""
local P, ME, id, ttl, cap = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local j = P..'j:'..id
local owner = redis.call('HGET', j, 'owner')
if not owner then return 0 end
if owner ~= ME then return -1 end
redis.call('SREM', P..'jg:'..ME, id)
redis.call('HDEL', j, 'spec', 'body')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[6] == '1' then
  -- Written again (RESYNC after Redis was lost): counted once.
  redis.call('DECRBY', P..'jbytes', tonumber(redis.call('HGET', P..'jsz', id) or '0'))
  redis.call('HSET', j, 'r_status', ARGV[7], 'r_ctype', ARGV[8], 'r_body', ARGV[9], 'r_files', ARGV[10])
  redis.call('ZADD', P..'jres', tonumber(ARGV[11]) or now, id)
  redis.call('HSET', P..'jsz', id, #ARGV[9])
  redis.call('INCRBY', P..'jbytes', #ARGV[9])
end
redis.call('EXPIRE', j, ttl)
redis.call('EXPIRE', P..'je:'..id, ttl)
local function forget(old)
  redis.call('DECRBY', P..'jbytes', tonumber(redis.call('HGET', P..'jsz', old) or '0'))
  redis.call('HDEL', P..'jsz', old)
  redis.call('ZREM', P..'jres', old)
end
for _, old in ipairs(redis.call('ZRANGEBYSCORE', P..'jres', '-inf', now - ttl * 1000)) do forget(old) end
while tonumber(redis.call('GET', P..'jbytes') or '0') > cap do
  local oldest = redis.call('ZRANGE', P..'jres', 0, 0)[1]
  if not oldest then break end
  redis.call('HDEL', P..'j:'..oldest, 'r_status', 'r_ctype', 'r_body', 'r_files')
  forget(oldest)
end
return 1
"""

#: ARGV: P, ME, hold (ms: webhook_timeout_sec) -> {id, how ('w' waiting ticket kept | 'l' it holds a lease |
#: 'n' none), tid, lid, node, ...; then 'hook', id per webhook to send again; then 'grant', g ...}
#: Takes over the active jobs of every instance whose lease heartbeat is gone (reap() decides that).
CLAIM = scripts.COMMON + r"""
reap()
local out = {}
for _, inst in ipairs(redis.call('SMEMBERS', P..'jgs')) do
  if inst ~= ME and not redis.call('ZSCORE', P..'gw', inst) then
    for _, id in ipairs(redis.call('SMEMBERS', P..'jg:'..inst)) do
      local j = P..'j:'..id
      if redis.call('HGET', j, 'owner') == inst then
        redis.call('HSET', j, 'owner', ME)
        redis.call('SADD', P..'jg:'..ME, id)
        redis.call('SADD', P..'jgs', ME)
        local tid = redis.call('HGET', j, 'tid') or ''
        local how, lid, node = 'n', '', ''
        local t = redis.call('HMGET', P..'t:'..tid, 'state', 'lease', 'node', 'gw')
        if tid ~= '' and t[4] == inst then
          redis.call('HSET', P..'t:'..tid, 'gw', ME)
          if t[1] == 'w' then
            redis.call('SREM', P..'gt:'..inst, tid)
            redis.call('SADD', P..'gt:'..ME, tid)
            how = 'w'
          elseif t[1] == 'l' then
            -- granted to the kept ticket after its gateway was reaped: the lease comes along
            redis.call('HSET', P..'l:'..t[2], 'gw', ME)
            redis.call('SREM', P..'gl:'..inst, t[2])
            redis.call('SADD', P..'gl:'..ME, t[2])
            how, lid, node = 'l', t[2], t[3]
          end
        end
        for _, v in ipairs({id, how, tid, lid, node}) do out[#out + 1] = v end
      end
    end
    -- Anything else granted to the lost instance since it was reaped goes back.
    for _, lid in ipairs(redis.call('SMEMBERS', P..'gl:'..inst)) do drop_lease(lid) end
    redis.call('DEL', P..'jg:'..inst, P..'gl:'..inst, P..'gt:'..inst)
    redis.call('SREM', P..'jgs', inst)
  end
end
-- The webhooks a lost instance claimed and never said delivered, once its attempt in flight has
-- had its time (ARGV[3], ms: a gateway only cut off from Redis delivered it meanwhile, and says so
-- when it is back): this gateway sends them.
local hold, now = tonumber(ARGV[3]) or 0, now_ms()
for _, inst in ipairs(redis.call('SMEMBERS', P..'jwh')) do
  if inst ~= ME and not redis.call('ZSCORE', P..'gw', inst) then
    for _, id in ipairs(redis.call('SMEMBERS', P..'jwp:'..inst)) do
      local at = tonumber(redis.call('HGET', P..'jwo:'..id, 'at') or '')
      if not at then
        redis.call('SREM', P..'jwp:'..inst, id)
      elseif now - at >= hold then
        redis.call('SREM', P..'jwp:'..inst, id)
        redis.call('SADD', P..'jwp:'..ME, id)
        redis.call('SADD', P..'jwh', ME)
        out[#out + 1] = 'hook'
        out[#out + 1] = id
      end
    end
    if redis.call('SCARD', P..'jwp:'..inst) == 0 then redis.call('SREM', P..'jwh', inst) end
  end
end
dispatch_all()
for _, g in ipairs(grants) do out[#out + 1] = 'grant'; out[#out + 1] = g end
return out
"""

#: ARGV: P, ME, id, tid, state, spec, body, then (event id, name, frame) per event held
#: -> 1 | -1 (another gateway owns it)
#: After Redis was lost: a job this gateway runs (or ended meanwhile) is the cluster's again. A
#: Redis that came back empty gets it whole; one that kept it gets the events it missed.
RESYNC = r"""
local P, ME, id, tid = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local j = P..'j:'..id
local owner = redis.call('HGET', j, 'owner')
if owner and owner ~= ME then return -1 end
redis.call('HSET', j, 'owner', ME, 'tid', tid, 'st', ARGV[5], 'spec', ARGV[6], 'body', ARGV[7])
redis.call('SADD', P..'jg:'..ME, id)
redis.call('SADD', P..'jgs', ME)
if tid ~= '' and redis.call('EXISTS', P..'t:'..tid) == 1 then redis.call('HSET', P..'t:'..tid, 'job', id) end
local s = P..'je:'..id
local last = 0
local top = redis.call('XREVRANGE', s, '+', '-', 'COUNT', 1)[1]
if top then last = tonumber(string.match(top[1], '-(%d+)$')) end
for i = 8, #ARGV, 3 do
  if tonumber(ARGV[i]) > last then redis.call('XADD', s, '0-'..ARGV[i], 'e', ARGV[i + 1], 'f', ARGV[i + 2]) end
end
return 1
"""

#: ARGV: P, ME, id, ttl_sec, url, body, webhook-id -> 1 (this gateway sends the webhook) | 0
#: (another one does: it sent it, or it carries the job on now — a copy that ran out here after a
#: freeze sends nothing). Asked again by the same gateway (its first call ran, but its answer was
#: lost to a timeout): 1. A webhook claimed is kept until WEBHOOK_DONE, for another gateway to send
#: should this one die first.
WEBHOOK = r"""
local P, ME, id, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local owner = redis.call('HGET', P..'j:'..id, 'owner')
if owner and owner ~= ME then return 0 end
if not redis.call('SET', P..'jw:'..id, ME, 'NX', 'EX', ttl) and redis.call('GET', P..'jw:'..id) ~= ME then
  return 0
end
local t = redis.call('TIME')
redis.call('HSET', P..'jwo:'..id, 'url', ARGV[5], 'body', ARGV[6], 'msg', ARGV[7],
           'at', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('EXPIRE', P..'jwo:'..id, ttl)
redis.call('SADD', P..'jwp:'..ME, id)
redis.call('SADD', P..'jwh', ME)
return 1
"""

#: ARGV: P, ME, id -> 1: the webhook was delivered (or its attempts ran out): nothing to send again
WEBHOOK_DONE = r"""
local P, ME, id = ARGV[1], ARGV[2], ARGV[3]
redis.call('SREM', P..'jwp:'..ME, id)
redis.call('DEL', P..'jwo:'..id)
return 1
"""
