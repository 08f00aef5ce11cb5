"""Node state shared by the gateways through Redis: health, breaker, slow start, drain and speed.

Design: each gateway keeps deciding with the pure ``NodeState`` (kilolined/scheduling/nodes.py) and
publishes the *transitions* it makes (a node marked down by the leader's health checks, a
breaker opened by the failures one gateway saw, a drain through one gateway's admin API); every
gateway applies them to its own ``NodeState``. The alternative, deciding every request's
success or failure in a Redis script, would add a round trip to each request; publishing only
transitions costs one script per state change and none on the request path. The one count that
must be the cluster's, the failures in a row that open a breaker, is a counter in Redis touched
only by failures (and by the first success after one), so a breaker opens on ``consecutive_failures``
seen on any gateways together.

Keys under the prefix P:
  P node:<name>  hash  gen, healthy, error, breaker, open_until_at (Redis ms), open_period,
                       ramp_at (Redis ms, -1 none), drained, slowed, slow, slow_until_at (Redis ms),
                       slow_period, slow_cause, slow_note, fails
Channel ``P nodes``: each change as JSON {node, from, gen?, fields…}. A lost message is made up
by the sweep every ``lease_ttl_sec / 3``, which reads every node's hash and applies the newer ones.
While Redis is unreachable nothing is published: each gateway goes on with its own view.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kilolined.cluster.nodestate import Snapshot, apply, changed_groups, export, snapshot
from kilolined.scheduling.nodes import CLOSED, NodeState
from kilolined.wire.tasks import cancel_all

log = logging.getLogger("kilolined")

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# ARGV: prefix, node, origin, fields (JSON). Relative times become Redis-clock times.
PUBLISH = _NOW + """
local P, node = ARGV[1], ARGV[2]
local f = cjson.decode(ARGV[4])
local key = P .. 'node:' .. node
local gen = redis.call('HINCRBY', key, 'gen', 1)
for k, v in pairs(f) do
  if k == 'open_left_ms' then
    redis.call('HSET', key, 'open_until_at', now + v)
  elseif k == 'slow_left_ms' then
    redis.call('HSET', key, 'slow_until_at', now + v)
  elseif k == 'ramp_ago_ms' then
    redis.call('HSET', key, 'ramp_at', v < 0 and -1 or now - v)
  else
    redis.call('HSET', key, k, v)
  end
end
if f['breaker'] ~= nil then redis.call('HSET', key, 'fails', 0) end
f['gen'] = gen
f['node'] = node
f['from'] = ARGV[3]
redis.call('PUBLISH', P .. 'nodes', cjson.encode(f))
return gen
"""
# ARGV: prefix, node, origin, "inc" | "reset": the cluster's failures in a row.
FAILS = """
local P, node = ARGV[1], ARGV[2]
local key = P .. 'node:' .. node
local n = 0
if ARGV[4] == 'inc' then n = redis.call('HINCRBY', key, 'fails', 1) else redis.call('HSET', key, 'fails', 0) end
redis.call('PUBLISH', P .. 'nodes', cjson.encode({node = node, from = ARGV[3], fails = n}))
return n
"""
# ARGV: prefix, node names…: {name: fields} of the nodes Redis knows, times relative again.
PULL = _NOW + """
local P = ARGV[1]
local out = {}
for i = 2, #ARGV do
  local h = redis.call('HGETALL', P .. 'node:' .. ARGV[i])
  if #h > 0 then
    local m = {}
    for j = 1, #h, 2 do m[h[j]] = h[j + 1] end
    local r = {gen = tonumber(m.gen or '0')}
    if m.healthy then r.healthy = tonumber(m.healthy) end
    if m.error then r.error = m.error end
    if m.breaker then
      r.breaker = m.breaker
      r.open_period = tonumber(m.open_period or '0')
      r.open_left_ms = math.max(0, tonumber(m.open_until_at or '0') - now)
    end
    if m.ramp_at then
      local a = tonumber(m.ramp_at)
      r.ramp_ago_ms = a < 0 and -1 or now - a
    end
    if m.drained then r.drained = tonumber(m.drained) end
    if m.slowed then r.slowed = tonumber(m.slowed) end
    if m.slow then
      r.slow = m.slow
      r.slow_left_ms = math.max(0, tonumber(m.slow_until_at or '0') - now)
      r.slow_period = tonumber(m.slow_period or '0')
      r.slow_cause = m.slow_cause or ''
      r.slow_note = m.slow_note or ''
    end
    if m.fails then r.fails = tonumber(m.fails) end
    out[ARGV[i]] = r
  end
end
return cjson.encode(out)
"""


class NodeSync:
    """Publishes this gateway's node transitions and applies the other gateways' ones."""

    def __init__(self, redis: aioredis.Redis, prefix: str, token: str, nodes: Callable[[], dict[str, NodeState]], *,
                 clock: Callable[[], float], redis_up: Callable[[], bool], leader: Callable[[], bool],
                 on_applied: Callable[[NodeState, list[str]], None], sweep_sec: float):
        self.redis = redis
        self.prefix = prefix
        self.token = token  # this process: its own messages come back on the channel
        self.nodes = nodes
        self.clock = clock
        self.redis_up = redis_up
        self.leader = leader
        self.on_applied = on_applied  # the runtime's node_events (or a wake-up when nothing is news)
        self.sweep_sec = sweep_sec
        self._publish = redis.register_script(PUBLISH)
        self._fails = redis.register_script(FAILS)
        self._pull = redis.register_script(PULL)
        self._gen: dict[str, int] = {}  # node -> newest change applied here
        self._known: dict[str, Snapshot] = {}  # node -> its state as the cluster last heard it
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        """Read the cluster's node state first: the server starts this before the lease store,
        whose first heartbeat writes this gateway's view of the nodes' slots into Redis (a fresh
        view would give a node the others hold ejected, open or drained its slots back)."""
        try:
            await self.pull()
        except (RedisError, OSError) as e:
            log.warning("⚠ cluster: node state not read at start (%s): this gateway's own view until then", e)
        self._spawn(self._listen())
        self._spawn(self._sweep_loop())

    async def stop(self) -> None:
        await cancel_all(self._tasks)

    # --- this gateway's changes ---------------------------------------------------------------
    def changed(self, ns: NodeState) -> None:
        """A node's state may have changed here (an event, a drain): publish what is news."""
        if not self._shared(ns):
            return
        snap = snapshot(ns)
        groups = changed_groups(self._known.get(ns.name), snap)
        if not groups:
            return
        self._known[ns.name] = snap
        fields = export(ns, self.clock(), groups)
        self._spawn(self._call(self._publish, ns.name, orjson.dumps(fields).decode()))

    def failed(self, ns: NodeState) -> None:
        """A request through this gateway failed on the node: count it for the cluster."""
        if self._shared(ns) and ns.breaker == CLOSED:
            self._spawn(self._count_failure(ns))

    def succeeded(self, ns: NodeState) -> None:
        """The first success after failures: the cluster's count starts again."""
        if self._shared(ns):
            self._spawn(self._call(self._fails, ns.name, "reset"))

    async def _count_failure(self, ns: NodeState) -> None:
        n = await self._call(self._fails, ns.name, "inc")
        if n is None or ns.retired:
            return
        events = ns.merge_failures(int(n), self.clock())
        if events:
            self.on_applied(ns, events)  # as a trip seen here: published by changed()

    # --- the others' changes ------------------------------------------------------------------
    def receive(self, data: bytes | str) -> None:
        m = orjson.loads(data)
        name, origin, gen = m.pop("node", None), m.pop("from", None), m.pop("gen", None)
        ns = self.nodes().get(name) if isinstance(name, str) else None
        if ns is None or ns.retired:
            return
        if gen is not None:
            if gen <= self._gen.get(name, 0):
                return
            self._gen[name] = gen
        if origin != self.token:  # our own change is applied here already
            self._apply(ns, m)

    async def pull(self) -> None:
        """The sweep: every node's hash; the ones newer than what was applied are applied. A node
        Redis does not know (it came back empty) is published by the leader."""
        # Not gated on redis_up: at start this runs before the lease store first reaches Redis.
        names = [n for n, ns in self.nodes().items() if self._cluster_node(ns)]
        if not names:
            return
        got = orjson.loads(await self._pull(args=[self.prefix, *names]))
        for name in names:
            ns = self.nodes().get(name)
            if ns is None:
                continue
            fields = got.get(name) if isinstance(got, dict) else None
            gen = int(fields.pop("gen", 0)) if fields else 0
            if gen == 0:
                if fields and "fails" in fields:
                    self._apply(ns, {"fails": fields["fails"]})
                if self.leader():
                    self._known.pop(name, None)
                    self.changed(ns)
                else:
                    self._known.setdefault(name, snapshot(ns))
            elif gen != self._gen.get(name, 0):
                # Newer; or older, from a Redis that restarted empty and counts from 1 again.
                self._gen[name] = gen
                self._apply(ns, fields or {})

    def republish(self) -> None:
        """Publish this gateway's whole view of every node: the first leader after a loss of
        Redis does, since the state Redis kept is older than what each gateway saw meanwhile."""
        for name, ns in list(self.nodes().items()):
            self._known.pop(name, None)
            self.changed(ns)

    def _apply(self, ns: NodeState, fields: dict[str, Any]) -> None:
        events = apply(ns, fields, self.clock())
        self._known[ns.name] = snapshot(ns)
        self.on_applied(ns, events)

    async def _listen(self) -> None:
        channel = self.prefix + "nodes"
        first = True
        while True:
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as ps:
                    await ps.subscribe(channel)
                    if not first:
                        # Subscribed again after a loss: catch up on what was missed. A Redis that
                        # kept its memory holds the numbers applied here (nothing older is taken);
                        # one back from a restart numbers from 1 again, which ``pull`` adopts.
                        await self.pull()
                    first = False
                    while True:
                        msg = await ps.get_message(timeout=None)
                        if msg is not None and msg.get("type") == "message":
                            self.receive(msg["data"])
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError):
                await asyncio.sleep(self.sweep_sec)  # the sweep makes up for what was missed
            except Exception:
                log.exception("cluster: node state listener")
                await asyncio.sleep(1.0)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_sec)
            if not self.redis_up():
                continue
            try:
                await self.pull()
            except (RedisError, OSError):
                pass  # the lease store notices a lost Redis and says so
            except Exception:
                log.exception("cluster: node state sweep")

    # --- helpers ----------------------------------------------------------------------------
    def _shared(self, ns: NodeState) -> bool:
        # While Redis is down every node is each gateway's own.
        return self.redis_up() and self._cluster_node(ns)

    @staticmethod
    def _cluster_node(ns: NodeState) -> bool:
        # Ad-hoc targets (/v1/proxy) are each gateway's own.
        return not ns.retired and not ns.name.startswith("adhoc:")

    async def _call(self, script: Any, node: str, arg: str) -> Any:
        try:
            return await script(args=[self.prefix, node, self.token, arg])
        except (RedisError, OSError) as e:
            log.debug("cluster: node state of %s not shared: %s", node, e)
            return None

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
