"""The Lua scripts that carry out every cluster-wide lease decision atomically inside Redis.

They hold no scheduling policy: which node may take a ticket and in which order the rest rank
are the gateway's rules (kilolined/scheduling/rules.py), written as data into the route's view
(each node's limits) and the ticket's plan (its candidates and their rank columns). The scripts
count, keep the queues, check counts against caps and pick the lowest columns.

One script per decision, one round trip each: admit, release, requeue, cancel, and the
heartbeat (renewal, reaping of dead gateways, the sweep that replaces a lost wake-up). Every
script starts by reaping the gateways whose heartbeat expired, so a dead gateway's slots come
back at the first decision after ``lease_ttl_sec``, whoever makes it. Time is Redis' own
(``TIME``), one clock for every gateway.

Keys, all under the prefix P (a single Redis primary; Redis Cluster sharding is not supported):
  P gw            zset   gateway instance -> heartbeat expiry (ms)
  P gi:<inst>     hash   id, version, seen (ms) of a gateway instance
  P gt:<inst>     set    the instance's waiting ticket ids
  P gl:<inst>     set    the instance's lease ids
  P t:<tid>       hash   route, m (its member of o:), rd (its fair round), ck (the client's key), gw, plan (JSON,
                         rules.Plan.wire: {"t": tiers [{"n": [[node, columns, columns when no
                         free candidate is held ([]: the same), held 1|0]...], "w": nodes that
                         stop the search while one is up}], "h": nodes that could hold it}),
                         at (ms), cost, by (times passed over while the head: backfill),
                         state (w waiting | l leased | x dropped), lease, node,
                         job (its sse/async job)
  P o:<route>     zset   the route's waiting tickets in the strategy's order (scheduling/order.py):
                         score the place the gateway computed (+ the ticket's fair round), member
                         its arrival (wseq, 15 digits: ties go to the earlier) then its tid
  P fr:<route>    hash   client key -> its last fair round (fifo_fair_lease)
  P fc:<route>    string the route's current fair round (the highest a head was granted in)
  P w:<route>     zset   the route's waiting tickets by arrival (the oldest: drop_oldest's victim)
  P n:<route>     string waiting tickets of the route
  P nk:<route>    hash   client key -> waiting tickets
  P v:<route>     string the route's view (JSON): {"n": {node: {"u": up 1|0, "s": slowed 1|0, "l":
                         its limits [[count, field, cap (-1 none), per lease, per cost, alone,
                         reserve kind, reserve name, scale]...] (rules.Limit.wire)}}, "c": costs
                         can hold tickets back (backfill), "b": max_bypass, "t": request_timeout_sec (ms)}
  P in:<route>    hash   node -> leases of the route
  P nin           hash   node -> leases on the node (every route)
  P ncost         hash   node -> the costs of its leases (every route)
  P cin, P ccost  hash   card -> leases on its nodes, their costs
  P l:<lid>       hash   route, node, gw, tid, cost, at (its grant, ms), k (JSON: what its grant
                         added to each count, taken back at its end), d (1: in doubt), g and i
                         (in doubt: the gateway id and instance it was granted to)
  P gs:<gid>      string a gateway's share (JSON {"r": {route: slots per node}, "n": {node or "card:"card: slots},
                         "c": its part of a capacity}): what it would run alone if it lost Redis now,
                         written at each heartbeat
  P lost          hash   gateway id -> when its heartbeat lapsed (ms): its share is reserved (counted
                         in use) until it registers again, deregisters or is forgotten
  P d:<node>      zset   the node's leases in doubt (reaped; their request may still run there)
                         -> when request_timeout_sec would have ended it (ms)
  P dn            set    nodes with leases in doubt
  P routes        set    routes seen
  P seq           string lease id counter
  P b:<subj>|<r>  hash   a token bucket: tokens, ts
  P bu:<key>:<d>  hash   a key's budget spent in window d (UTC day or month): requests, tokens, gpu
  P br:<key>      hash   gateway instance -> tokens it holds reserved for the key
Grants for another gateway are published on ``P grant:<inst>`` as "tid lid node"; the caller's
own grants come back in the script's answer. A ticket dropped by ``drop_oldest`` travels the
same way as "tid ! drop" (and the sweep finds it, state x, for a message that was lost).
"""

from __future__ import annotations

COMMON = r"""
local P = ARGV[1]
local ME = ARGV[2]
local KNOWN = KEYS[1]  -- the epoch the calling gateway knows (nil: a script that does not check it)
local grants = {}

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The caller's view of the leases is from another epoch (Redis came back empty since): it must
-- register what it holds again (REGISTER) before it decides anything here.
local function stale()
  return KNOWN ~= nil and redis.call('GET', P..'epoch') ~= KNOWN
end

-- The fence: no slot is granted while it stands, because leases still running are not counted
-- here yet (Redis came back empty, or answers again after a stall). It falls when every gateway
-- it waits for has registered (fence:want within fence:have), or at its time, one lease TTL.
local function fenced()
  local f = tonumber(redis.call('GET', P..'fence') or '0') or 0
  if f == 0 then return false end
  local lift = now_ms() >= f
  if not lift and redis.call('SCARD', P..'fence:want') > 0 then
    lift = #redis.call('SDIFF', P..'fence:want', P..'fence:have') == 0
  end
  if lift then redis.call('DEL', P..'fence', P..'fence:want', P..'fence:have') end
  return not lift
end

local function fence(until_ms, want)
  redis.call('SET', P..'fence', until_ms)
  redis.call('DEL', P..'fence:want', P..'fence:have')
  for _, id in ipairs(want) do redis.call('SADD', P..'fence:want', id) end
end

-- A gateway whose leases are all counted here (it registered them, or never lost Redis).
local function counted(gid)
  if redis.call('EXISTS', P..'fence') == 1 then redis.call('SADD', P..'fence:have', gid) end
end

local EPS = 1e-9
local SCAN = 256  -- backfill looks this far down the order for a ticket that fits

-- The shares of the gateways whose heartbeat lapsed, summed: counted as in use, since such a
-- gateway may be cut off from Redis only and going on alone with its share (docs/CLUSTER.md
-- "Partitions"). Read once per script, again after ``lost`` changes (unreserve).
local RES = nil
local function reserved()
  if RES then return RES end
  RES = {r = {}, n = {}, c = 0}
  for _, gid in ipairs(redis.call('HKEYS', P..'lost')) do
    local raw = redis.call('GET', P..'gs:'..gid)
    if raw then
      local g = cjson.decode(raw)
      for route, n in pairs(g.r or {}) do RES.r[route] = (RES.r[route] or 0) + n end
      for node, n in pairs(g.n or {}) do RES.n[node] = (RES.n[node] or 0) + n end
      RES.c = RES.c + (tonumber(g.c) or 0)
    end
  end
  return RES
end

local function unreserve(gid)
  redis.call('HDEL', P..'lost', gid)
  RES = nil
end

local function drop_lease(lid)
  local l = redis.call('HMGET', P..'l:'..lid, 'route', 'node', 'gw', 'tid', 'k', 'd')
  if not l[1] then return false end
  if l[6] then  -- in doubt (a reaped lease): its slot is free now
    redis.call('ZREM', P..'d:'..l[2], lid)
    if redis.call('EXISTS', P..'d:'..l[2]) == 0 then redis.call('SREM', P..'dn', l[2]) end
  end
  -- What its grant added to each count goes (a count back at 0 goes too: no float drift).
  for _, k in ipairs(cjson.decode(l[5] or '[]')) do
    local left
    if k[4] == 1 then left = tonumber(redis.call('HINCRBYFLOAT', P..k[1], k[2], -k[3])) or 0
    else left = redis.call('HINCRBY', P..k[1], k[2], -k[3]) end
    if left <= EPS then redis.call('HDEL', P..k[1], k[2]) end
  end
  redis.call('DEL', P..'l:'..lid)
  redis.call('SREM', P..'gl:'..l[3], lid)
  if redis.call('HGET', P..'t:'..l[4], 'lease') == lid then
    redis.call('DEL', P..'t:'..l[4])
  end
  return true
end

local function unqueue(tid)
  local t = redis.call('HMGET', P..'t:'..tid, 'route', 'm', 'gw', 'state', 'ck')
  if not t[1] or t[4] ~= 'w' then return false end
  redis.call('ZREM', P..'o:'..t[1], t[2])
  redis.call('DECR', P..'n:'..t[1])
  redis.call('HINCRBY', P..'nk:'..t[1], t[5] or '', -1)
  redis.call('ZREM', P..'w:'..t[1], tid)
  redis.call('SREM', P..'gt:'..t[3], tid)
  redis.call('DEL', P..'t:'..tid)
  return true
end

-- A reaped lease's request may still run on its node (its gateway is frozen, not dead): the
-- lease is kept, counted as before, *in doubt* until the node shows the slot free (DOUBT) or the
-- route's request_timeout_sec since its grant has passed (reap). Its ticket goes: a job is
-- carried on elsewhere (cluster/jobs.py CLAIM), and waits for a slot like any other.
local function doubt(lid, now, gid, inst)
  local l = redis.call('HMGET', P..'l:'..lid, 'route', 'node', 'tid', 'at')
  if not l[1] then return end
  local v = redis.call('GET', P..'v:'..l[1])
  local tmo = (v and cjson.decode(v).t) or 600000
  redis.call('HSET', P..'l:'..lid, 'd', 1, 'gw', '', 'g', gid, 'i', inst)
  redis.call('ZADD', P..'d:'..l[2], (tonumber(l[4] or '') or now) + tmo, lid)
  redis.call('SADD', P..'dn', l[2])
  if redis.call('HGET', P..'t:'..l[3], 'lease') == lid then redis.call('DEL', P..'t:'..l[3]) end
end

local function undoubt_due(now)
  for _, node in ipairs(redis.call('SMEMBERS', P..'dn')) do
    for _, lid in ipairs(redis.call('ZRANGEBYSCORE', P..'d:'..node, '-inf', now)) do drop_lease(lid) end
    if redis.call('EXISTS', P..'d:'..node) == 0 then redis.call('SREM', P..'dn', node) end
  end
end

local function reap()
  local now = now_ms()
  undoubt_due(now)
  local last = tonumber(redis.call('GET', P..'last') or '0') or 0
  local ttl = tonumber(redis.call('GET', P..'ttl') or '0') or 0
  redis.call('SET', P..'last', now)
  if last > 0 and ttl > 0 and now - last > ttl / 2 then
    -- Nobody could call Redis for a while (every gateway beats every ttl/3): it was stalled
    -- (SIGSTOP, swap, a slow disk). The gateways could not renew meanwhile, so none is reaped for
    -- it (their expiries move by the gap), and those that went on alone must register first.
    local ids = {}
    for _, inst in ipairs(redis.call('ZRANGE', P..'gw', 0, -1)) do
      redis.call('ZINCRBY', P..'gw', now - last, inst)
      ids[#ids + 1] = redis.call('HGET', P..'gi:'..inst, 'id') or inst
    end
    if #ids > 0 then fence(now + ttl, ids) end
  end
  local dead = redis.call('ZRANGEBYSCORE', P..'gw', '-inf', now)
  local live_ids = nil
  for _, inst in ipairs(dead) do
    local gid = redis.call('HGET', P..'gi:'..inst, 'id') or ''
    if gid ~= '' and redis.call('EXISTS', P..'gs:'..gid) == 1 then
      -- Its share stays reserved, unless another instance of it is alive (it restarted).
      if not live_ids then
        live_ids = {}
        for _, other in ipairs(redis.call('ZRANGEBYSCORE', P..'gw', '('..now, '+inf')) do
          live_ids[redis.call('HGET', P..'gi:'..other, 'id') or ''] = true
        end
      end
      if not live_ids[gid] then
        redis.call('HSET', P..'lost', gid, now)
        RES = nil
      end
    end
    for _, lid in ipairs(redis.call('SMEMBERS', P..'gl:'..inst)) do doubt(lid, now, gid, inst) end
    for _, tid in ipairs(redis.call('SMEMBERS', P..'gt:'..inst)) do
      -- A waiting job keeps its place: the gateway that carries it on takes it over (cluster/jobs.py).
      local job = redis.call('HGET', P..'t:'..tid, 'job')
      if not job or redis.call('SISMEMBER', P..'jg:'..inst, job) == 0 then unqueue(tid) end
    end
    redis.call('DEL', P..'gl:'..inst, P..'gt:'..inst, P..'gi:'..inst)
    redis.call('ZREM', P..'gw', inst)
  end
  return #dead
end

-- ``place``: where it waits, as the gateway's order.place computed it (order.Place.wire:
-- {base, per arrival, fair key?}); the arrival and the key's fair round are filled in here
-- (order.Rounds: the counters, kept atomically). ``plan``: its candidates (rules.Plan.wire).
local function enqueue(route, place, ck, tid, gw, cost, plan)
  local seq = redis.call('INCR', P..'wseq')
  local o = cjson.decode(place)
  local rd = 0
  if o[3] then
    local cur = tonumber(redis.call('GET', P..'fc:'..route) or '0') or 0
    local last = tonumber(redis.call('HGET', P..'fr:'..route, o[3]) or '')
    rd = last and math.max(last + 1, cur) or cur  -- order.fair_round
    redis.call('HSET', P..'fr:'..route, o[3], rd)
  end
  local m = string.format('%015d', seq)..tid
  -- (formatted here: a Lua number is handed to Redis with 14 digits only)
  redis.call('ZADD', P..'o:'..route, string.format('%.17g', o[1] + o[2] * seq + rd), m)
  redis.call('INCR', P..'n:'..route)
  redis.call('HINCRBY', P..'nk:'..route, ck, 1)
  redis.call('SADD', P..'gt:'..gw, tid)
  redis.call('HSET', P..'t:'..tid, 'route', route, 'm', m, 'rd', rd, 'ck', ck, 'gw', gw, 'at', now_ms(),
             'cost', cost, 'plan', plan, 'state', 'w')
  redis.call('ZADD', P..'w:'..route, seq, tid)
end

local function count(h, f)
  return tonumber(redis.call('HGET', h, f) or '0') or 0
end

-- No policy below: the gateway's rules (kilolined/scheduling/rules.py) wrote each node's limits
-- into the route's view and each ticket's candidates with their rank columns into its plan;
-- this fills in the counts that only Redis holds atomically and picks.

-- A live count a limit or a column names (rules.IN, NIN, ...; SLOW: the view's flag).
local function counter(route, view, name, fld)
  if name == 'slow' then
    local nv = view.n[fld]
    return nv and nv.s or 0
  end
  if name == 'in' then return count(P..'in:'..route, fld) end
  return count(P..name, fld)
end

-- The lost gateways' shares a limit counts as in use (Limit.res).
local function reserve(lim)
  if lim[7] == '' then return 0 end
  local res = reserved()
  if lim[7] == 'c' then return res.c * lim[9] end
  local by = lim[7] == 'r' and res.r or res.n
  return (by[lim[8]] or 0) * lim[9]
end

-- rules.within: the one count-vs-cap rule.
local function within(lim, used, cost)
  if lim[3] < 0 then return true end
  local add = lim[4] + lim[5] * cost
  if used + add <= lim[3] + EPS then return true end
  return lim[6] >= 0 and used <= EPS and add <= lim[6] + EPS
end

local function feasible(route, view, node, cost)
  local nv = view.n[node]
  if not nv or nv.u ~= 1 then return false end
  for _, lim in ipairs(nv.l) do
    if not within(lim, counter(route, view, lim[1], lim[2]) + reserve(lim), cost) then return false end
  end
  return true
end

local function before(x, y)  -- lexicographic x < y
  for i = 1, #x do if x[i] ~= y[i] then return x[i] < y[i] end end
  return false
end

-- rules.value: a rank column filled in.
local function value(route, view, col, node, names)
  if type(col) == 'number' then return col end
  if col[1] == '+' then return col[2] + col[3] * counter(route, view, col[4], col[5]) end
  local total = 0
  for _, m in ipairs(names) do total = total + counter(route, view, 'in', m) end
  local bound = math.max(1, math.ceil(col[2] * (total + 1) / math.max(1, #names) - EPS))
  return (counter(route, view, 'in', node) + 1 > bound) and 1 or 0
end

local function best_of(route, view, free, names, held)
  local best, best_key = nil, nil
  for _, c in ipairs(free) do
    local cols = (#c[3] == 0 or held) and c[2] or c[3]
    local key = {}
    for i, col in ipairs(cols) do key[i] = value(route, view, col, c[1], names) end
    if best == nil or before(key, best_key) then best, best_key = c[1], key end
  end
  return best
end

-- rules.pick: the first tier with a feasible candidate gives its best; a tier with a node worth
-- waiting for that is up ends the search. ``blocked``: nodes held for a passed-over head.
local function pick(route, view, plan, cost, blocked)
  for _, tier in ipairs(plan.t) do
    local names, free, held = {}, {}, false
    for _, c in ipairs(tier.n) do
      if not blocked[c[1]] then
        names[#names + 1] = c[1]
        if feasible(route, view, c[1], cost) then
          free[#free + 1] = c
          held = held or c[4] == 1
        end
      end
    end
    local best = best_of(route, view, free, names, held)
    if best then return best end
    for _, n in ipairs(tier.w) do
      local nv = view.n[n]
      if nv and nv.u == 1 then return nil end
    end
  end
  return nil
end

-- The leases in doubt of gateway ``gid`` end: granted to an instance that never heard of them
-- (``inst``: that one's, on any node) or to an instance before it (on a node that cannot run
-- them without their connection: not in ``keep``, ",a,b,").
local function end_doubts(gid, inst, keep)
  local n = 0
  for _, node in ipairs(redis.call('SMEMBERS', P..'dn')) do
    local keeps = string.find(keep, ','..node..',', 1, true) ~= nil
    for _, lid in ipairs(redis.call('ZRANGE', P..'d:'..node, 0, -1)) do
      local l = redis.call('HMGET', P..'l:'..lid, 'g', 'i')
      if l[1] == gid and (l[2] == inst or not keeps) and drop_lease(lid) then n = n + 1 end
    end
  end
  return n
end

-- A lease: each count of its node's limits gets what one lease of ``cost`` adds to it, written down
-- with the lease so that drop_lease takes exactly that back (a reload may change the limits).
local function grant(route, tid, gw, node, cost, limits)
  local lid = tostring(redis.call('INCR', P..'seq'))
  local adds = {}
  for _, lim in ipairs(limits) do
    local amount = lim[4] + lim[5] * cost
    if amount ~= 0 then
      local h = lim[1] == 'in' and 'in:'..route or lim[1]
      if lim[5] ~= 0 then redis.call('HINCRBYFLOAT', P..h, lim[2], amount)
      else redis.call('HINCRBY', P..h, lim[2], amount) end
      adds[#adds + 1] = {h, lim[2], amount, lim[5] ~= 0 and 1 or 0}
    end
  end
  redis.call('HSET', P..'l:'..lid, 'route', route, 'node', node, 'gw', gw, 'tid', tid, 'cost', cost, 'at', now_ms(),
             'k', cjson.encode(adds))
  redis.call('SADD', P..'gl:'..gw, lid)
  redis.call('SREM', P..'gt:'..gw, tid)
  redis.call('ZREM', P..'w:'..route, tid)
  redis.call('HSET', P..'t:'..tid, 'state', 'l', 'lease', lid, 'node', node)
  local msg = tid..' '..lid..' '..node
  if gw == ME then grants[#grants + 1] = msg else redis.call('PUBLISH', P..'grant:'..gw, msg) end
  return lid
end

local function grant_on(route, view, tid, gw, node, cost)
  return grant(route, tid, gw, node, cost, view.n[node].l)
end

local function view_of(route)
  local v = redis.call('GET', P..'v:'..route)
  if not v then return nil end
  return cjson.decode(v)
end

-- Backfill (queue.Scheduler._pick): the head fits nowhere now, so the first later ticket that
-- fits goes first, on a node not held for a head passed over max_bypass times already (the
-- nodes its plan says could ever hold it).
local function backfill(route, view, head, plan, bypassed)
  local mb = tonumber(view.b) or 8
  local blocked = {}
  if bypassed >= mb then
    for _, n in ipairs(plan.h) do blocked[n] = true end
  end
  local open = false
  for node in pairs(view.n) do
    if not blocked[node] and feasible(route, view, node, 0) then open = true end
  end
  -- The scan is for cost only: when no open node has a free slot, nothing later fits either.
  if not open then return false end
  for _, m in ipairs(redis.call('ZRANGE', P..'o:'..route, 1, SCAN - 1)) do
    local tid = string.sub(m, 16)
    if tid ~= head then
      local t = redis.call('HMGET', P..'t:'..tid, 'gw', 'plan', 'ck', 'cost')
      local cost = tonumber(t[4] or '0') or 0
      local node = pick(route, view, cjson.decode(t[2]), cost, blocked)
      if node then
        redis.call('ZREM', P..'o:'..route, m)
        redis.call('DECR', P..'n:'..route)
        redis.call('HINCRBY', P..'nk:'..route, t[3] or '', -1)
        redis.call('HSET', P..'t:'..head, 'by', math.min(bypassed + 1, mb))
        grant_on(route, view, tid, t[1], node, cost)
        return true
      end
    end
  end
  return false
end

-- Free slots to waiting tickets, head of each route's order first (Scheduler.dispatch).
local function dispatch_route(route)
  local view = view_of(route)
  if not view then return end
  local o = P..'o:'..route
  while true do
    local m = redis.call('ZRANGE', o, 0, 0)[1]
    if not m then return end
    local tid = string.sub(m, 16)
    local t = redis.call('HMGET', P..'t:'..tid, 'gw', 'plan', 'ck', 'cost', 'by', 'rd')
    local cost = tonumber(t[4] or '0') or 0
    local plan = cjson.decode(t[2])
    local node = pick(route, view, plan, cost, {})
    if node then
      redis.call('ZREM', o, m)
      -- The head's fair round is being served (order.Rounds.served: the highest so far).
      local rd = tonumber(t[6] or '0') or 0
      if rd > (tonumber(redis.call('GET', P..'fc:'..route) or '0') or 0) then redis.call('SET', P..'fc:'..route, rd) end
      redis.call('DECR', P..'n:'..route)
      redis.call('HINCRBY', P..'nk:'..route, t[3] or '', -1)
      grant_on(route, view, tid, t[1], node, cost)
    elseif not view.c or not backfill(route, view, tid, plan, tonumber(t[5] or '0') or 0) then
      return
    end
  end
end

-- drop_oldest: the route's oldest waiting ticket, on whichever gateway, leaves for the new one.
local function drop_oldest(route)
  local tid = redis.call('ZRANGE', P..'w:'..route, 0, 0)[1]
  if not tid then return false end
  local gw = redis.call('HGET', P..'t:'..tid, 'gw')
  unqueue(tid)
  -- Kept a while as dropped, so the sweep of its gateway learns it if the message is lost.
  redis.call('HSET', P..'t:'..tid, 'state', 'x', 'gw', gw)
  redis.call('PEXPIRE', P..'t:'..tid, 600000)
  local msg = tid..' ! drop'
  if gw == ME then grants[#grants + 1] = msg else redis.call('PUBLISH', P..'grant:'..gw, msg) end
  return true
end

local function dispatch_all()
  if fenced() then return end
  for _, route in ipairs(redis.call('SMEMBERS', P..'routes')) do dispatch_route(route) end
end
"""

#: ARGV: P, ME, route, place (order.Place.wire, JSON), tid, plan (its candidates: rules.Plan.wire,
#: JSON), view, max_queue_depth, max_queued_per_key (-1: none), client key, drop_oldest (1|0), cost
#: -> {'ok'|'per_key'|'full', waiting, position (0: leased at once), grants...}
ADMIT = COMMON + r"""
local route, place, tid, plan, ck = ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[10]
local cost = tonumber(ARGV[12]) or 0
if stale() then return redis.error_reply('EPOCH Redis came back empty: register again') end
reap()
redis.call('SET', P..'v:'..route, ARGV[7])
redis.call('SADD', P..'routes', route)
local waiting = tonumber(redis.call('GET', P..'n:'..route) or '0')
local per_key = tonumber(ARGV[9])
if per_key >= 0 and count(P..'nk:'..route, ck) >= per_key then
  return {'per_key', count(P..'nk:'..route, ck)}
end
if waiting == 0 and not fenced() then
  local view = cjson.decode(ARGV[7])
  local node = pick(route, view, cjson.decode(plan), cost, {})
  if node then
    redis.call('HSET', P..'t:'..tid, 'route', route, 'ck', ck, 'gw', ME, 'cost', cost, 'plan', plan, 'state', 'w')
    grant_on(route, view, tid, ME, node, cost)
    local out = {'ok', 0, 0}
    for _, g in ipairs(grants) do out[#out + 1] = g end
    return out
  end
end
if waiting >= tonumber(ARGV[8]) then
  if ARGV[11] ~= '1' or not drop_oldest(route) then return {'full', waiting} end
  waiting = waiting - 1
end
enqueue(route, place, ck, tid, ME, cost, plan)
dispatch_all()
local pos = 0
local m = redis.call('HMGET', P..'t:'..tid, 'state', 'm')
if m[1] == 'w' then pos = redis.call('ZRANK', P..'o:'..route, m[2]) + 1 end
local out = {'ok', tonumber(redis.call('GET', P..'n:'..route) or '0'), pos}
for _, g in ipairs(grants) do out[#out + 1] = g end
return out
"""

#: ARGV: P, ME, lid -> {grants...}
RELEASE = COMMON + r"""
if stale() then return redis.error_reply('EPOCH Redis came back empty: register again') end
reap()
drop_lease(ARGV[3])
dispatch_all()
return grants
"""

#: ARGV: P, ME, lid, tid, route, place (order.Place.wire, JSON), client key, cost, plan -> {grants...}
REQUEUE = COMMON + r"""
if stale() then return redis.error_reply('EPOCH Redis came back empty: register again') end
reap()
drop_lease(ARGV[3])
redis.call('DEL', P..'t:'..ARGV[4])
enqueue(ARGV[5], ARGV[6], ARGV[7], ARGV[4], ME, tonumber(ARGV[8]) or 0, ARGV[9])
dispatch_all()
return grants
"""

#: ARGV: P, ME, route, node ("": the node is still used here) -> 1 forgotten | 0 still in use |
#: -1 not now (the fence stands, or the caller's epoch is stale: asked again at a later heartbeat).
#: A route made for a client-named target (/v1/proxy, kilolined/ops/adhoc.py) that this gateway
#: dropped: its keys go, unless a ticket waits or a lease runs on it (another gateway's, maybe).
#: Nothing is decided while the fence stands (leases not counted yet could be running on it).
FORGET = COMMON + r"""
if stale() or redis.call('EXISTS', P..'fence') == 1 then return -1 end
local route, node = ARGV[3], ARGV[4]
if (tonumber(redis.call('GET', P..'n:'..route) or '0') or 0) > 0 or redis.call('ZCARD', P..'o:'..route) > 0 then
  return 0
end
for _, c in ipairs(redis.call('HVALS', P..'in:'..route)) do
  if (tonumber(c) or 0) > 0 then return 0 end
end
redis.call('DEL', P..'v:'..route, P..'n:'..route, P..'nk:'..route, P..'in:'..route, P..'w:'..route, P..'o:'..route,
           P..'fr:'..route, P..'fc:'..route)
redis.call('SREM', P..'routes', route)
if node ~= '' and (tonumber(redis.call('HGET', P..'nin', node) or '0') or 0) <= 0 then
  redis.call('HDEL', P..'nin', node)
  redis.call('HDEL', P..'ncost', node)
end
return 1
"""

#: ARGV: P, ME, gateway id, keep (",a,b,", as REGISTER) -> {'forgotten'|'alive'|'unknown', leases ended, grants...}
#: An operator says a lost gateway is gone for good: its reserved share goes, and its leases in
#: doubt end except on the ``keep`` nodes, whose node check still asks.
FORGET_GATEWAY = COMMON + r"""
if stale() then return redis.error_reply('EPOCH Redis came back empty: register again') end
reap()
local gid, keep = ARGV[3], ARGV[4]
if redis.call('HEXISTS', P..'lost', gid) == 0 then
  for _, inst in ipairs(redis.call('ZRANGE', P..'gw', 0, -1)) do
    if redis.call('HGET', P..'gi:'..inst, 'id') == gid then return {'alive', 0} end
  end
  return {'unknown', 0}
end
unreserve(gid)
redis.call('DEL', P..'gs:'..gid)
local ended = end_doubts(gid, '', keep)
dispatch_all()
local out = {'forgotten', ended}
for _, g in ipairs(grants) do out[#out + 1] = g end
return out
"""

#: ARGV: P, ME, gateway id, keep (",a,b,", as REGISTER) -> {leases ended, grants...}
#: A gateway that woke from a freeze found at its heartbeat that it had been reaped, and stopped
#: the requests of its leases then (their connections closed): a heartbeat later its leases in
#: doubt end, as a restarted one's do, except on the ``keep`` nodes, whose node check still asks.
WOKE = COMMON + r"""
if stale() then return redis.error_reply('EPOCH Redis came back empty: register again') end
reap()
local ended = end_doubts(ARGV[3], '', ARGV[4])
dispatch_all()
local out = {ended}
for _, g in ipairs(grants) do out[#out + 1] = g end
return out
"""

#: ARGV: P, ME, tid -> {'cancelled'|'released'|'gone', grants...}
CANCEL = COMMON + r"""
if stale() then return redis.error_reply('EPOCH Redis came back empty: register again') end
local tid = ARGV[3]
local st = redis.call('HMGET', P..'t:'..tid, 'state', 'lease')
local out
if st[1] == 'w' then
  unqueue(tid)
  out = {'cancelled'}
elseif st[1] == 'l' then
  drop_lease(st[2])
  dispatch_all()
  out = {'released'}
else
  out = {'gone'}
end
for _, g in ipairs(grants) do out[#out + 1] = g end
return out
"""

#: ARGV: P, ME, ttl_ms, gateway_id, config_version, views (JSON {route: view}), counts (JSON {"r":
#: {route: max_concurrency}, "n": {node: max_concurrency}}: its full slot counts), tid... (tickets
#: this gateway has waited on a while: their grants are re-read, a lost wake-up replaced)
#: Its share of those counts among the gateways alive now (⌊n / k⌋, the remainder to the lowest
#: ids: what it runs alone if it loses Redis now, since it knows these peers from this answer on)
#: is kept as ``P gs:<gid>``, reserved once its heartbeat lapses.
#: -> {{grants...}, {lost tids...}, {inst, id, version, age_ms, ...}, reaped (1|0), {lids it holds here},
#:     {gateway id, ms since it was lost, its share, ...}: the gateways whose share is reserved}
BEAT = COMMON + r"""
if stale() then return redis.error_reply('EPOCH Redis came back empty: register again') end
redis.call('SET', P..'ttl', ARGV[3])
local now = now_ms()
-- Gone from the live gateways: another gateway's script reaped this one (it was frozen past the
-- TTL), and the slots of its leases may have been granted again.
local reaped = redis.call('ZSCORE', P..'gw', ME) == false
redis.call('ZADD', P..'gw', now + tonumber(ARGV[3]), ME)
counted(ARGV[4])
redis.call('HSET', P..'gi:'..ME, 'id', ARGV[4], 'version', ARGV[5], 'seen', now)
reap()
unreserve(ARGV[4])  -- it beats: not lost (a frozen one that woke)
for route, view in pairs(cjson.decode(ARGV[6])) do
  redis.call('SET', P..'v:'..route, cjson.encode(view))
  redis.call('SADD', P..'routes', route)
end
dispatch_all()
local lost = {}
for i = 8, #ARGV do
  local st = redis.call('HMGET', P..'t:'..ARGV[i], 'state', 'lease', 'node', 'gw')
  if st[1] == 'l' and st[4] == ME then
    grants[#grants + 1] = ARGV[i]..' '..st[2]..' '..st[3]
  elseif st[1] == 'x' then
    grants[#grants + 1] = ARGV[i]..' ! drop'
  elseif not st[1] then
    lost[#lost + 1] = ARGV[i]
  end
end
local peers = {}
local ids, seen_id = {}, {}
for _, inst in ipairs(redis.call('ZRANGE', P..'gw', 0, -1)) do
  local g = redis.call('HMGET', P..'gi:'..inst, 'id', 'version', 'seen')
  peers[#peers + 1] = inst
  peers[#peers + 1] = g[1] or ''
  peers[#peers + 1] = g[2] or ''
  peers[#peers + 1] = tostring(now - (tonumber(g[3] or now) or now))
  if g[1] and not seen_id[g[1]] then
    seen_id[g[1]] = true
    ids[#ids + 1] = g[1]
  end
end
table.sort(ids)
local k, rank = #ids, 0
for i, id in ipairs(ids) do if id == ARGV[4] then rank = i - 1 end end
local function part(n) return math.floor(n / k) + ((rank < n % k) and 1 or 0) end
local full = cjson.decode(ARGV[7])
local mine = {r = {}, n = {}, c = 1 / k}
for route, n in pairs(full.r or {}) do mine.r[route] = part(n) end
for node, n in pairs(full.n or {}) do mine.n[node] = part(n) end
redis.call('SET', P..'gs:'..ARGV[4], cjson.encode(mine))
local gone = {}
local lh = redis.call('HGETALL', P..'lost')
for i = 1, #lh, 2 do
  gone[#gone + 1] = lh[i]
  gone[#gone + 1] = tostring(now - (tonumber(lh[i + 1]) or now))
  gone[#gone + 1] = redis.call('GET', P..'gs:'..lh[i]) or '{}'
end
return {grants, lost, peers, reaped and 1 or 0, redis.call('SMEMBERS', P..'gl:'..ME), gone}
"""

#: ARGV: P, ME, ttl_ms, gateway id, peers (",a,b,": the gateways it saw alive before it lost Redis),
#: keep (",a,b,": the nodes where a request runs on without its connection: ComfyUI), n, n lease
#: ids it held before (dropped: they may still count here), then (tid, route, node, client key, cost) per
#: lease held now, and the limits it counts against (rules.Limit.wire, JSON) -> {epoch, lid...} in the same order.
#: Its reserved share (``P lost``) goes, and its leases in doubt end: those of this instance, which
#: it does not hold (granted while it was cut off, it never heard of them), and those of an
#: instance before it with the same id (a restart: their connections closed with that process)
#: except on the ``keep`` nodes, whose node check still asks.
#: A gateway's first call, and its first after it lost Redis: its leases count again, cluster-wide,
#: in one step (released and registered at once: no grant between the two). On a Redis with no
#: epoch (it came back empty, or the cluster's first start) a new epoch begins behind a fence.
REGISTER = COMMON + r"""
local ttl, gid, peers = tonumber(ARGV[3]), ARGV[4], ARGV[5]
local now = now_ms()
local e = redis.call('GET', P..'epoch')
if not e then
  e = tostring(now)..'/'..ME
  redis.call('SET', P..'epoch', e)
  fence(now + ttl, {})
end
redis.call('SET', P..'ttl', ttl)
if redis.call('EXISTS', P..'fence') == 1 then
  redis.call('SADD', P..'fence:want', gid)
  for id in string.gmatch(peers, '[^,]+') do redis.call('SADD', P..'fence:want', id) end
end
-- An instance before it with the same id (restarted within the TTL) is gone: reaped now.
for _, inst in ipairs(redis.call('ZRANGE', P..'gw', 0, -1)) do
  if inst ~= ME and redis.call('HGET', P..'gi:'..inst, 'id') == gid then redis.call('ZADD', P..'gw', 0, inst) end
end
reap()
-- Its waiting tickets are queued again by the gateway itself (at the back, as after a loss):
-- the copies Redis may still hold would be served twice.
for _, tid in ipairs(redis.call('SMEMBERS', P..'gt:'..ME)) do unqueue(tid) end
local keep = ARGV[6]
local n = tonumber(ARGV[7])
for i = 8, 7 + n do drop_lease(ARGV[i]) end
unreserve(gid)
end_doubts(gid, ME, keep)
redis.call('ZADD', P..'gw', now + ttl, ME)
redis.call('HSET', P..'gi:'..ME, 'id', gid, 'seen', now)
local out = {e}
for i = 8 + n, #ARGV, 6 do
  local tid, route, node, key = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local cost = tonumber(ARGV[i + 4]) or 0
  redis.call('HSET', P..'t:'..tid, 'route', route, 'ck', key, 'gw', ME, 'state', 'w')
  redis.call('SADD', P..'routes', route)
  out[#out + 1] = grant(route, tid, ME, node, cost, cjson.decode(ARGV[i + 5]))
end
grants = {}  -- grant() noted them as this gateway's new grants; they are leases it already runs
return out  -- its next BEAT says it is counted (a second REGISTER may follow: leases made meanwhile)
"""

#: ARGV: P, bucket key, tokens per ms, capacity -> {1|0, tokens left (string)}
BUCKET = r"""
local k = ARGV[1]..'b:'..ARGV[2]
local per_ms, cap = tonumber(ARGV[3]), tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local b = redis.call('HMGET', k, 'tokens', 'ts')
local tokens, ts = tonumber(b[1]) or cap, tonumber(b[2]) or now
if now > ts then tokens = math.min(cap, tokens + (now - ts) * per_ms); ts = now end
local ok = 0
if tokens >= 1 then tokens = tokens - 1; ok = 1 end
redis.call('HSET', k, 'tokens', tostring(tokens), 'ts', ts)
redis.call('PEXPIRE', k, math.ceil(cap / per_ms) + 60000)
return {ok, tostring(tokens)}
"""

#: Budgets, per key and window (a UTC day, or a UTC month for a key whose budget counts per
#: month; kept 40 days, past the longest window): ``P bu:<key>:<window>`` hash (requests, tokens, gpu: spent) and
#: ``P br:<key>`` hash (gateway instance -> tokens it holds reserved for its dispatched
#: requests; a dead gateway's entry no longer counts and is dropped by the next reservation).

#: ARGV: P, key id, window (UTC day or month), requests_per_day, tokens_per_day, gpu_seconds_per_day (-1: none)
#: -> {spent budget's name or '', requests, tokens, gpu} (checked and the request counted at once)
BUDGET_TAKE = r"""
local k = ARGV[1]..'bu:'..ARGV[2]..':'..ARGV[3]
local u = redis.call('HMGET', k, 'requests', 'tokens', 'gpu')
local req, tok, gpu = tonumber(u[1]) or 0, tonumber(u[2]) or 0, tonumber(u[3]) or 0
local lr, lt, lg = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local spent = ''
if lr >= 0 and req >= lr then spent = 'requests_per_day'
elseif lt >= 0 and tok >= lt then spent = 'tokens_per_day'
elseif lg >= 0 and gpu >= lg then spent = 'gpu_seconds_per_day' end
if spent == '' then
  req = redis.call('HINCRBY', k, 'requests', 1)
  redis.call('EXPIRE', k, 3456000)
end
return {spent, tostring(req), tostring(tok), tostring(gpu)}
"""

#: ARGV: P, ME (gateway instance), key id, window, tokens, tokens_per_day
#: -> {1 reserved | 0 does not fit, tokens spent, tokens reserved by the live gateways}
BUDGET_RESERVE = r"""
local P, ME, key = ARGV[1], ARGV[2], ARGV[3]
local n, limit = tonumber(ARGV[5]), tonumber(ARGV[6])
local spent = tonumber(redis.call('HGET', P..'bu:'..key..':'..ARGV[4], 'tokens') or '0') or 0
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rk = P..'br:'..key
local r = redis.call('HGETALL', rk)
local held = 0
for i = 1, #r, 2 do
  local live = r[i] == ME
  if not live then
    local exp = redis.call('ZSCORE', P..'gw', r[i])
    live = exp and tonumber(exp) > now
  end
  if live then held = held + tonumber(r[i + 1]) else redis.call('HDEL', rk, r[i]) end
end
if spent + held + n > limit then return {0, tostring(spent), tostring(held)} end
redis.call('HINCRBY', rk, ME, n)
return {1, tostring(spent), tostring(held + n)}
"""

#: ARGV: P, ME, then (key id, window, requests, tokens, gpu seconds, tokens unreserved) per key
#: -> {requests, tokens, gpu, ...} spent after, per key (usage counted and its reservation ended
#: in one step, so a budget never looks emptier than it is between the two)
BUDGET_SETTLE = r"""
local P, ME = ARGV[1], ARGV[2]
local out = {}
for i = 3, #ARGV, 6 do
  local key = ARGV[i]
  local k = P..'bu:'..key..':'..ARGV[i + 1]
  local req, tok, gpu, un = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]),
    tonumber(ARGV[i + 5])
  if req ~= 0 then
    local v = redis.call('HINCRBY', k, 'requests', req)
    if v < 0 then redis.call('HSET', k, 'requests', 0) end
  end
  if tok ~= 0 then redis.call('HINCRBY', k, 'tokens', tok) end
  if gpu ~= 0 then redis.call('HINCRBYFLOAT', k, 'gpu', ARGV[i + 4]) end
  if req ~= 0 or tok ~= 0 or gpu ~= 0 then redis.call('EXPIRE', k, 3456000) end
  if un > 0 then
    local rk = P..'br:'..key
    if redis.call('HINCRBY', rk, ME, -un) <= 0 then redis.call('HDEL', rk, ME) end
  end
  local u = redis.call('HMGET', k, 'requests', 'tokens', 'gpu')
  out[#out + 1] = u[1] or '0'
  out[#out + 1] = u[2] or '0'
  out[#out + 1] = u[3] or '0'
end
return out
"""

#: ARGV: P, ME, route... -> per route {waiting, {client key, waiting, ...}, {tid, position, ...}}
#: (positions of this gateway's waiting tickets in the cluster's order, for its views)
POSITIONS = COMMON + r"""
-- Each of its waiting tickets' rank in its route's order (ZRANK: the place is the order).
local ranks = {}
for _, tid in ipairs(redis.call('SMEMBERS', P..'gt:'..ME)) do
  local t = redis.call('HMGET', P..'t:'..tid, 'route', 'm', 'state')
  local rank = t[3] == 'w' and t[2] and redis.call('ZRANK', P..'o:'..t[1], t[2])
  if rank then
    local x = ranks[t[1]] or {}
    ranks[t[1]] = x
    x[#x + 1] = tid
    x[#x + 1] = rank + 1
  end
end
local out = {}
for i = 3, #ARGV do
  local route = ARGV[i]
  local by_key = {}
  local nk = redis.call('HGETALL', P..'nk:'..route)
  for j = 1, #nk, 2 do
    if tonumber(nk[j + 1]) > 0 then
      by_key[#by_key + 1] = nk[j]
      by_key[#by_key + 1] = nk[j + 1]
    end
  end
  out[#out + 1] = {tonumber(redis.call('GET', P..'n:'..route) or '0'), by_key, ranks[route] or {}}
end
return out
"""

#: ARGV: P, ME -> {node, leases in doubt, ...}: the nodes with leases in doubt, for the leader's
#: node check (those past their deadline are freed first, by reap; the next heartbeat's dispatch
#: hands their slots on)
DOUBTS = COMMON + r"""
if stale() then return redis.error_reply('EPOCH Redis came back empty: register again') end
reap()
local out = {}
for _, node in ipairs(redis.call('SMEMBERS', P..'dn')) do
  out[#out + 1] = node
  out[#out + 1] = redis.call('ZCARD', P..'d:'..node)
end
return out
"""

#: ARGV: P, ME, lease id: the gateway has written the lease's request to its node (the node
#: counts it from now on, kilolined/cluster/doubt.py). A lease already given back stays gone.
SENT = r"""
local k = ARGV[1]..'l:'..ARGV[3]
if redis.call('EXISTS', k) == 1 then redis.call('HSET', k, 's', 1) end
return {}
"""

#: ARGV: P, ME, node -> {{live lease, sent (1/0), ...}, {lease in doubt, ...}}: the leases on the
#: node held by live gateways, each with its sent mark, and those in doubt there (read only)
ON_NODE = COMMON + r"""
local node = ARGV[3]
local live = {}
for _, inst in ipairs(redis.call('ZRANGE', P..'gw', 0, -1)) do
  for _, lid in ipairs(redis.call('SMEMBERS', P..'gl:'..inst)) do
    local l = redis.call('HMGET', P..'l:'..lid, 'node', 's')
    if l[1] == node then
      live[#live + 1] = lid
      live[#live + 1] = l[2] and 1 or 0
    end
  end
end
return {live, redis.call('ZRANGE', P..'d:'..node, 0, -1)}
"""

#: ARGV: P, ME, node, keep (how many of the leases in doubt may still run there), lease in doubt,
#: ... (those the node check read before its probe) -> {freed, {grants...}}
#: Of the listed leases still in doubt, all but ``keep`` are freed (the earliest deadlines
#: first); kilolined/cluster/doubt.py says why that is safe.
DOUBT = COMMON + r"""
if stale() then return redis.error_reply('EPOCH Redis came back empty: register again') end
reap()
local node, keep = ARGV[3], tonumber(ARGV[4])
local held = {}
for i = 5, #ARGV do
  local at = redis.call('ZSCORE', P..'d:'..node, ARGV[i])
  if at then held[#held + 1] = {tonumber(at), ARGV[i]} end
end
table.sort(held, function(a, b) return a[1] < b[1] end)
local freed = 0
for i = 1, #held - keep do
  if drop_lease(held[i][2]) then freed = freed + 1 end
end
dispatch_all()
return {freed, grants}
"""
