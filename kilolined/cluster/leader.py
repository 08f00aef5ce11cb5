"""One voice for the cluster: the leader, elected by a lease in Redis.

One gateway at a time holds the key ``P leader`` (``SET NX PX lease_ttl_sec``) and renews it
every ``lease_ttl_sec / 3`` with a compare-and-renew script, so a dead leader's lease lapses
after ``lease_ttl_sec`` and the next gateway to try takes it. The leader runs the active health
checks and sends the notifications; the others apply the node state it publishes
(kilolined/cluster/nodes.py) and stay silent.

``Leadership`` is the pure part (who leads, who speaks, who says ``cluster_degraded`` and
``cluster_restored``), driven by the results of the Redis calls and an explicit ``now``;
``LeaderLease`` makes those calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kilolined.cluster.view import ClusterView
from kilolined.core.config import ClusterConfig
from kilolined.wire.tasks import cancel_until_done

log = logging.getLogger("kilolined")

# Renew only if the key still holds our token: a lease that lapsed and went to another gateway
# must not be extended by its old holder (a plain PEXPIRE would).
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# A clean stop hands the lease on at once instead of after its TTL.
RESIGN = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
#: events about this gateway alone (its own config file), sent whoever leads
PER_GATEWAY = frozenset({"reload_failed"})


def holder_id(token: str) -> str:
    """The gateway_id of a lease token (``<gateway_id>#<instance>``)."""
    return token.rsplit("#", 1)[0]


@dataclass
class Leadership:
    """Who leads and who speaks, as this gateway knows it. Times are this gateway's clock."""

    me: str
    ttl_sec: float
    #: the gateway_id last seen holding the lease (None: nobody, or not known)
    leader: str | None = None
    #: this gateway leads while now < until; ``until`` is counted from *before* the call that
    #: took or renewed the lease, so it ends no later than the lease does in Redis
    until: float = -math.inf
    #: it led when Redis was lost: it speaks for the cluster until a leader is elected again
    voice_down: bool = False
    #: Redis is back and no leader round has run since: the first leader says cluster_restored
    restored_pending: bool = False

    def is_leader(self, now: float) -> bool:
        return now < self.until

    def held(self, sent_at: float) -> None:
        """The lease was taken or renewed by a call sent at ``sent_at``."""
        self.until = sent_at + self.ttl_sec
        self.leader = self.me

    def seen(self, holder: str | None) -> None:
        """Another gateway holds the lease (or nobody does): this one does not lead."""
        self.until = -math.inf
        self.leader = holder

    def unreachable(self) -> None:
        """A renewal failed: this gateway stops leading at once (another may take the lease once
        it lapses). ``leader`` keeps the last holder seen, for ``redis_lost``."""
        self.until = -math.inf

    def redis_lost(self) -> bool:
        """Redis is unreachable. True once, on the gateway that led: it sends ``cluster_degraded``
        and goes on speaking for the cluster while Redis is down."""
        self.until = -math.inf
        if self.leader == self.me and not self.voice_down:
            self.voice_down = True
            return True
        return False

    def redis_back(self) -> None:
        self.restored_pending = True

    def round_done(self, now: float) -> bool:
        """A leader round with Redis up finished. True once after Redis came back, on the gateway
        that leads then: it sends ``cluster_restored``."""
        if not self.restored_pending:
            return False
        self.restored_pending = False
        self.voice_down = False
        return self.is_leader(now)

    def speaks(self, now: float, redis_up: bool, event: str) -> bool:
        """Whether this gateway sends the alert ``event``."""
        if event in PER_GATEWAY:
            return True
        return self.is_leader(now) or (not redis_up and self.voice_down)

    def checks(self, now: float, redis_up: bool) -> bool:
        """Whether this gateway runs the active health checks: the leader, or every gateway while
        Redis is down (each goes on with its own view of the nodes)."""
        return self.is_leader(now) or not redis_up


class LeaderLease:
    """The Redis side of the election: one round every ``lease_ttl_sec / 3``."""

    def __init__(self, redis: aioredis.Redis, cfg: ClusterConfig, token: str, view: ClusterView,
                 leadership: Leadership, *, clock: Callable[[], float],
                 alert: Callable[[str, str, str | None], None], on_restored: Callable[[], None] = lambda: None):
        self.redis = redis
        self.cfg = cfg
        self.key = cfg.key_prefix + "leader"
        self.token = token  # this process's instance: a restarted gateway is a new candidate
        self.view = view
        self.state = leadership
        self.clock = clock
        self.alert = alert
        self.on_restored = on_restored  # the node state sync republishes this leader's view
        self._renew = redis.register_script(RENEW)
        self._resign = redis.register_script(RESIGN)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.round()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kiloline-leader")

    async def stop(self) -> None:
        await cancel_until_done(self._task)
        if self.state.is_leader(self.clock()):
            with contextlib.suppress(RedisError, OSError):
                await self._resign(keys=[self.key], args=[self.token])
        self.state.seen(None)
        self.view.leader = None

    def speaks(self, event: str) -> bool:
        return self.state.speaks(self.clock(), self.view.redis_up, event)

    def checks(self) -> bool:
        return self.state.checks(self.clock(), self.view.redis_up)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.lease_ttl_sec / 3)
            try:
                await self.round()
            except Exception:  # the loop must not die: it is what hands the voice on
                log.exception("cluster: leader election")

    async def round(self) -> None:
        st = self.state
        sent = self.clock()
        ttl_ms = int(self.cfg.lease_ttl_sec * 1000)
        was = st.is_leader(sent)
        try:
            # Renew ours; else take a free one; else see who holds it (it may still be ours, from
            # before a loss of Redis shorter than the TTL).
            mine = was and bool(await self._renew(keys=[self.key], args=[self.token, ttl_ms]))
            mine = mine or bool(await self.redis.set(self.key, self.token, nx=True, px=ttl_ms))
            cur: str | None = None
            if not mine:
                raw = await self.redis.get(self.key)
                cur = raw.decode() if isinstance(raw, bytes) else raw
                mine = cur == self.token and bool(await self._renew(keys=[self.key], args=[self.token, ttl_ms]))
            if mine:
                st.held(sent)
            else:
                st.seen(holder_id(cur) if cur else None)
        except (RedisError, OSError) as e:
            if was:
                log.warning("⚠ cluster: %s could not renew its leader lease (%s): no longer the leader", st.me, e)
            st.unreachable()
            self.view.leader = None
            return
        self.view.leader = st.leader
        now = self.clock()
        if st.is_leader(now) != was:
            log.info("cluster: %s is %s the leader", st.me, "no longer" if was else "now")
        if st.round_done(now):
            text = "✓ cluster: Redis is back, the gateways share their state again"
            log.warning("%s", text)
            self.alert("cluster_restored", text, None)
            self.on_restored()
