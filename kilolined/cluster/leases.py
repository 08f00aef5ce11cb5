"""The cluster lease store: the second ``LeaseStore``, its leases and queues in Redis.

Every decision is one Lua script (kilolined/cluster/scripts.py), so exactly N holds across all
gateways of one ``key_prefix``. This gateway keeps only the tickets of its own clients, the
waiters of the lease scope; a slot freed anywhere is handed to the head of the cluster-wide
fair order by the script that freed it, and a grant for a ticket of another gateway travels to
it by pub/sub. The heartbeat every ``lease_ttl_sec / 3`` renews this gateway's leases, reaps
the dead gateways' ones, and re-reads grants a lost message would have carried (the sweep): a
message is lost only while the subscriber is not subscribed, so the sweep reads the waiting
tickets once after each (re)subscription, and every beat while there is none — not every
waiting ticket at every beat, which at thousands waiting holds Redis for tens of milliseconds.

The local counters of ``queue.Scheduler`` mirror this gateway's cluster leases, so the views
(in-flight per node, /admin/state) and the drain at shutdown stay as they are. While Redis is
unreachable the scheduler takes over alone, with each slot count cut to this gateway's share
(kilolined/cluster/split.py); when Redis is back the leases held and the requests waiting are
registered there again.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kilolined.cluster import scripts
from kilolined.cluster.leader import Leadership
from kilolined.cluster.persistence import access_error, shown
from kilolined.cluster.split import alive
from kilolined.cluster.view import ClusterView, Lost, Peer
from kilolined.cluster.wire import Wire, subscribed
from kilolined.core.config import ClusterConfig, Config, ConfigError, RouteConfig, split_listen
from kilolined.scheduling import order, rules
from kilolined.scheduling.affinity import Affinity
from kilolined.scheduling.nodes import NodeState
from kilolined.scheduling.queue import (
    FAILED,
    LEASED,
    WAITING,
    Lease,
    Rejected,
    RouteQueue,
    Scheduler,
    Ticket,
    avoided,
)
from kilolined.scheduling.share import WHOLE, share_of
from kilolined.wire.tasks import cancel_all

log = logging.getLogger("kilolined")
WAITED_SEC = 1.0  # a ticket waiting this long has its grant re-read by the heartbeat (lost wake-up)
EXPIRE_SEC = 0.1  # how often queue timeouts are checked
CALL_TIMEOUT_SEC = 2.0  # a Redis that does not answer within this is down
POSITIONS_SEC = 1.0  # how often the cluster-wide positions and queue depths are re-read
POOL_SIZE = 32  # connections to Redis per gateway
# Ad-hoc routes dropped while Redis was out of reach, kept to be forgotten there: bounded, since
# clients name targets freely (kilolined/ops/adhoc.py); past it the oldest keep their keys in Redis.
FORGET_PENDING_MAX = 4096


def gateway_id(cfg: Config) -> str:
    """``cluster.gateway_id``, by default the host name and the configured listen port."""
    assert cfg.cluster is not None
    return cfg.cluster.gateway_id or f"{socket.gethostname()}:{split_listen(cfg.server.listen)[1]}"


class ClusterLeases:
    """``LeaseStore`` over Redis; ``settle`` must follow ``admit`` (the Redis verdict)."""

    def __init__(self, sched: Scheduler, cfg: ClusterConfig, gateway_id: str, *,
                 clock: Callable[[], float], version: Callable[[], str],
                 alert: Callable[[str, str, str | None], None], wall: Callable[[], float] = time.time,
                 speaks: Callable[[str], bool] = lambda event: True):
        self.sched = sched
        #: whether this gateway's alert of an event goes out (cluster mode: the leader's voice)
        self.speaks = speaks
        self.cfg = cfg
        self.prefix = cfg.key_prefix
        self.clock = clock
        #: the Unix time a ticket's place in the cluster's order is reckoned from (order.place)
        self.wall = wall
        self.version = version
        self.alert = alert
        #: this process: a restarted gateway with the same id must not renew its predecessor's leases
        self.inst = f"{gateway_id}#{os.urandom(4).hex()}"
        self.view = ClusterView(gateway_id)
        # Far above the scheduler's own numbers: a ticket it adopts (Redis down) keys its queues by seq.
        self._seq = itertools.count(1 << 48)
        self._tickets: dict[str, Ticket] = {}  # tid -> this gateway's tickets known to Redis
        self._tid: dict[Ticket, str] = {}
        self._lid: dict[Lease, str] = {}  # cluster leases held here -> their Redis id
        self._deadlines: list[tuple[float, int, Ticket]] = []
        self._local: set[Ticket] = set()  # tickets the scheduler holds alone (Redis down)
        self._orphans: set[str] = set()  # lease ids released while Redis was down
        self._epoch = ""  # the Redis epoch whose counts hold our leases ("": none yet; scripts.REGISTER)
        self._peers_at_loss: list[str] = []  # the gateways alive when Redis was lost: the fence waits for them
        #: waiting tickets whose plan may change -> the plan Redis has: those a lost node may not
        #: take yet (until it is seen alive), and every one after a reload (its nodes changed)
        self._replan: dict[Ticket, str] = {}
        self._entries = itertools.count()  # _track's ids
        self._alone_from = 0.0  # while Redis is down: when this gateway's share starts (_degrade)
        self._strays: set[str] = set()  # lease ids Redis counts for us that no request holds (one beat ago)
        self._restoring = False  # _restore is registering what we hold: nothing is dispatched alone meanwhile
        self._woke = False  # reaped at the last heartbeat (a freeze): its requests were stopped then
        #: when Redis last counted this gateway alive (the moment a call it answered was sent): a grant
        #: that arrives a TTL after it may be one Redis took back since (_granted)
        self._alive_at = -math.inf
        self._unsure: list[tuple[str, str, str]] = []  # grants held until the next heartbeat says
        self._forget: dict[str, str] = {}  # ad-hoc routes dropped here, not yet forgotten in Redis -> node ("")
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sub_at: float | None = None  # when the grant channel was last subscribed (None: it is not)
        self._swept_for: float | None = None  # the subscription since which no message could be missed
        self._to_sweep: set[str] = set()  # tickets whose grant may have gone to another channel (carried)
        self._resubscribe: Callable[[], None] = lambda: None  # ends the grant channel's subscription
        # A bounded pool that makes a burst wait for a connection instead of opening thousands.
        pool = aioredis.BlockingConnectionPool.from_url(
            cfg.redis_url, max_connections=POOL_SIZE, timeout=CALL_TIMEOUT_SEC,
            socket_timeout=CALL_TIMEOUT_SEC, socket_connect_timeout=CALL_TIMEOUT_SEC)
        #: connects on first use; the shared limits (kilolined/cluster/limits.py) use it too
        self.redis = aioredis.Redis(connection_pool=pool)
        self._redis: aioredis.Redis | None = self.redis
        # The lease scripts travel on one pipelined connection of their own (kilolined/cluster/wire.py):
        # a release is written in the releasing request's own turn and its answer, which carries this
        # gateway's grants, is handled as it arrives; the grants for this gateway that another one's
        # script decided arrive the same way, on a subscriber connection (_listen).
        self._wire = Wire(pool, CALL_TIMEOUT_SEC, scripts=[getattr(scripts, n) for n in (
            "ADMIT", "RELEASE", "REQUEUE", "CANCEL", "BEAT", "REGISTER", "POSITIONS", "DOUBTS", "ON_NODE", "DOUBT",
            "SENT",
            "FORGET_GATEWAY", "WOKE",
            "BUCKET", "BUDGET_TAKE", "BUDGET_RESERVE", "BUDGET_SETTLE")])
        #: the shared limits' scripts travel on it too (kilolined/cluster/limits.py)
        self.wire = self._wire
        #: who leads (kilolined/cluster/leader.py runs the election); it decides who says
        #: cluster_degraded and cluster_restored
        self.leadership = Leadership(gateway_id, cfg.lease_ttl_sec)
        self._seen: dict[str, float] = {}  # other gateway id -> when it was last seen alive (our clock)
        self._lost_known: set[str] = set()  # the lost gateways already alerted (cluster_gateway_lost)
        self.view.forget = self.forget_gateway
        # The cluster's queues as the views see them (queue.WaitingElsewhere), re-read every
        # POSITIONS_SEC: waiting per route, per client key, and our tickets' positions by tid.
        self._depth: dict[str, int] = {}
        self._by_key: dict[str, dict[str, int]] = {}
        self._pos: dict[str, int] = {}
        sched.elsewhere = self

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        assert self._redis is not None
        try:
            await self._register([])
            await self._beat()
            self.view.redis_up = True
        except (RedisError, OSError) as e:
            why = access_error(e)
            if why is not None:  # not an outage that passes: going on alone would take every slot
                self._wire.close()
                await self.redis.aclose()
                raise ConfigError([f"cluster.redis_url: Redis at {shown(self.cfg.redis_url)}: {why}"]) from None
            log.warning("⚠ cluster: Redis unreachable at start (%s): queuing until it answers", e)
            self._degrade(alert=False)
        self._spawn(self._beat_loop())
        self._spawn(self._expire_loop())
        self._spawn(self._listen())
        self._spawn(self._positions_loop())

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        if self._redis is not None:
            if self.view.redis_up:
                try:
                    # Leave at once: our leases and waiting tickets go back now, not after the TTL,
                    # and no share is reserved for us (we deregister: nothing runs here any more).
                    await self._redis.delete(self.prefix + "gs:" + self.view.gateway_id)
                    await self._redis.zadd(self.prefix + "gw", {self.inst: 0})
                    await self._call("RELEASE", "")
                except (RedisError, OSError):
                    pass
            self._wire.close()
            await self._redis.aclose()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _call(self, name: str, *args: str | int) -> asyncio.Future[Any]:
        """Run a lease script; written to Redis now (or as soon as the connection is made)."""
        # KEYS[1]: the epoch we know; a script refuses to decide for a gateway of another one.
        return self._wire.evalsha(getattr(scripts, name), [self._epoch], [self.prefix, self.inst, *args])

    async def _register(self, held: list[Ticket], old: Sequence[str] = ()) -> list[str]:
        """Count ``held`` (leased tickets) in Redis, dropping ``old`` lease ids in the same step;
        adopts Redis' epoch (a new one, behind the fence, when it came back empty). Returns the
        new lease ids in the order of ``held``."""
        args: list[str | int] = [int(self.cfg.lease_ttl_sec * 1000), self.view.gateway_id,
                                 "," + "".join(p + "," for p in self._peers_at_loss), self._keep(), len(old), *old]
        for t in held:
            assert t.lease is not None
            args += [self._track(t), t.route, t.lease.node, t.key, repr(t.cost), self._counts(t.lease)]
        sent = self.clock()
        res = await self._call("REGISTER", *args)
        self._alive_at = sent
        epoch = _s(res[0])
        if self._epoch and epoch != self._epoch:
            log.warning("⚠ cluster: Redis came back empty: leases are granted again once every gateway "
                        "has registered its own (at most %gs)", self.cfg.lease_ttl_sec)
        self._epoch = epoch
        self.view.reached = True
        return [_s(x) for x in res[1:]]

    # --- the LeaseStore calls ---------------------------------------------------------------
    def admit(self, route: str, key: str, priority: int, now: float, *, pinned_node: str | None = None,
              cost: float = 0.0, model: str | None = None, affinity: Affinity | None = None,
              body: int = 0) -> Ticket:
        # Which nodes serve the model holds in Redis too (the ticket's "only"), and so do warm and
        # prefix/session affinity (its "warm" and "aff"); collation is per gateway (docs/CLUSTER.md).
        if not self.view.redis_up:
            t = self.sched.admit(route, key, priority, now, pinned_node=pinned_node, cost=cost, model=model,
                                 affinity=affinity, body=body)
            self._local.add(t)
            return t
        rq = self.sched.routes[route]
        self.sched.check_servable(rq, pinned_node, cost, model)
        # Redis chooses the node here, by the rule this gateway's index feeds it (_affinity, at settle).
        t = Ticket(next(self._seq), route, key, priority, now, pinned_node=pinned_node, cost=cost, model=model,
                   affinity=affinity, body=body)
        # Whether it waits is Redis's answer: the bodies bound counts it as waiting from here (this
        # gateway holds the body) until it is granted or leaves (_untrack).
        self.sched.check_body(rq, t, now)
        self.sched.bodies.hold(t)
        t.deadline = now + rq.cfg.queue_timeout_sec
        return t

    async def settle(self, t: Ticket) -> Ticket:
        """The cluster's verdict on an admitted ticket: queued or leased; raises Rejected."""
        if t in self._local:
            return t
        rq = self.sched.routes[t.route]
        tid = self._track(t)
        front = t.requeues > 0  # re-queued (a job whose gateway was lost): the head, as after a node failure
        call = self._call(
            "ADMIT", t.route, self._place(t, front), tid, self._publish_plan(t), self._view_json(t.route),
            rq.cfg.max_queue_depth, -1 if rq.cfg.max_queued_per_key is None else rq.cfg.max_queued_per_key,
            t.key, 1 if rq.cfg.drop_policy == "drop_oldest" else 0, repr(t.cost))
        try:
            res = await asyncio.shield(call)
        except asyncio.CancelledError:
            # The client left while Redis decided: let the decision land, then undo it.
            self._untrack(t)
            t.state = "done"
            self._spawn(self._undo_admit(call, tid))
            raise
        except (RedisError, OSError) as e:
            self._untrack(t)
            self._lost(e)
            if t in self._local or t.state != WAITING:
                return t  # the loss of Redis adopted it already (_degrade)
            if self.view.redis_up:
                return await self.settle(t)  # Redis came back while this call failed: ask again
            self._adopt(t)
            return t
        verdict = _s(res[0])
        if verdict != "ok":
            self._untrack(t)
            waiting = int(res[1])
            est = self.sched.est_wait(rq, waiting + 1, self.clock())  # the cluster's queue, not ours
            ra = max(1.0, math.ceil(est)) if est is not None else 1.0
            if verdict == "per_key":
                raise Rejected(429, "queue_full", f"key already has {waiting} requests waiting on route {t.route}", ra)
            status = 503 if rq.cfg.drop_policy != "reject_with_429" else 429  # drop_oldest: nothing to drop
            raise Rejected(status, "queue_full", f"queue of route {t.route} is full ({waiting} waiting)", ra)
        heapq.heappush(self._deadlines, (t.deadline, t.seq, t))
        self._depth[t.route] = int(res[1])
        if int(res[2]):
            self._pos[tid] = int(res[2])
        if t.state == WAITING:  # (a re-admitted ticket's too; a grant below ends it)
            self.sched.bodies.hold(t)
        self._grants(res[3:])
        return t

    async def _undo_admit(self, call: asyncio.Future[Any], tid: str) -> None:
        """An admission whose requester is gone: a grant in its answer goes back (the ticket is no
        longer tracked, so _granted releases it), and a place it still holds in the queue is left."""
        try:
            res = await call
        except (RedisError, OSError):
            return
        if _s(res[0]) == "ok":
            self._grants(res[3:])
            if self.view.redis_up:
                self._remote("CANCEL", tid)

    def cancel(self, t: Ticket) -> bool:
        if t in self._local:
            self._local.discard(t)
            return self.sched.cancel(t)
        if t.state != WAITING:
            return False
        t.state = "done"
        tid = self._untrack(t)
        if tid is not None and self.view.redis_up:
            self._remote("CANCEL", tid)
        return True

    def requeue(self, lease: Lease, now: float, avoid_node: bool = True, lost: bool = False) -> Ticket:
        lid = self._lid.pop(lease, None)
        if lid is None or not self.view.redis_up:
            if lid is not None:
                self._orphans.add(lid)
                self._untrack(lease.ticket)
                self._local.add(lease.ticket)
            return self.sched.requeue(lease, now, avoid_node, lost)
        t = lease.ticket
        self.sched.release(lease, now, service_time=None)
        if avoid_node:
            avoided(t, lease.node, now, lost)
        t.requeues += 1
        t.state = WAITING
        t.lease = None
        self.sched.bodies.hold(t)  # waiting again, in Redis's queue, with its body here
        t.deadline = now + self.sched.routes[t.route].cfg.queue_timeout_sec
        heapq.heappush(self._deadlines, (t.deadline, t.seq, t))
        tid = self._tid[t]
        self._remote("REQUEUE", lid, tid, t.route, self._place(t, front=True), t.key, repr(t.cost),
                     self._publish_plan(t))
        return t

    def release(self, lease: Lease, now: float, service_time: float | None) -> None:
        if lease.released:
            return
        lid = self._lid.pop(lease, None)
        if lid is not None and self.view.redis_up:
            self._remote("RELEASE", lid)  # first: its answer starts the next request, wherever it waits
        elif lid is not None:
            self._orphans.add(lid)
        self.sched.release(lease, now, service_time)
        self._local.discard(lease.ticket)
        if lid is not None:
            self._untrack(lease.ticket)

    def forget_route(self, route: str, node: str | None) -> None:
        """An ad-hoc route this gateway dropped: gone from the scheduler now, and its keys from
        Redis (scripts.FORGET keeps them while any gateway queues or runs on it). While Redis is
        out of reach it is remembered, and forgotten there at the first heartbeat that reaches it."""
        self.sched.forget_route(route, node)
        self._forget[route] = node or ""
        while len(self._forget) > FORGET_PENDING_MAX:
            del self._forget[next(iter(self._forget))]  # the oldest: its few keys stay in Redis
        if self.view.redis_up:
            self._flush_forget()

    def _flush_forget(self) -> None:
        pending, self._forget = self._forget, {}
        for route, node in pending.items():
            self._call("FORGET", route, node).add_done_callback(partial(self._forgot, route, node))

    def _forgot(self, route: str, node: str, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        e = fut.exception()
        if isinstance(e, RedisError | OSError) or (e is None and fut.result() == -1):
            self._forget.setdefault(route, node)  # not now: the next heartbeat asks again
        elif e is not None:
            log.error("cluster: FORGET of %s failed", route, exc_info=e)

    def dispatch(self, now: float) -> list[Lease]:
        # With Redis, the script that frees a slot hands it on; alone, the scheduler does.
        return [] if self.view.redis_up or self._restoring else self.sched.dispatch(now)

    def fail_all_waiting(self, err: Callable[[], Rejected]) -> list[Ticket]:
        """Shutdown: every ticket of this gateway still waiting in Redis is answered."""
        out = []
        for t in list(self._tickets.values()):
            if t.state == WAITING and self.cancel(t):
                t.state, t.error = "failed", err()
                t.wake()
                out.append(t)
        return out

    # --- jobs carried on from a lost gateway (kilolined/cluster/jobs.py) ----------------------
    def carry(self, tid: str, route: str, key: str, priority: int, *, pinned_node: str | None, cost: float,
              deadline: float, model: str | None = None) -> Ticket:
        """A lost gateway's waiting ticket, which Redis now counts as this gateway's (same place)."""
        t = Ticket(next(self._seq), route, key, priority, self.clock(), pinned_node=pinned_node, cost=cost,
                   model=model)
        t.deadline = deadline
        self._tickets[tid] = t
        self._tid[t] = tid
        self._to_sweep.add(tid)  # a grant before it was carried went to the lost gateway's channel
        heapq.heappush(self._deadlines, (t.deadline, t.seq, t))
        return t

    def take_grants(self, grants: list[str]) -> None:
        """Grants ("tid lid node") for this gateway learnt outside the lease scripts' answers."""
        self._grants(grants)

    def tid_of(self, t: Ticket) -> str | None:
        """The Redis id of a ticket of this gateway (None: not in Redis)."""
        return self._tid.get(t)

    # --- slots in doubt (kilolined/cluster/doubt.py) ------------------------------------------
    async def in_doubt(self) -> list[str]:
        """The nodes with leases in doubt; those past their deadline are freed first."""
        out = await self._call("DOUBTS")
        return [_s(out[i]) for i in range(0, len(out), 2)]

    async def on_node(self, node: str) -> tuple[dict[str, bool], list[str]]:
        """({live lease on ``node``: its request was sent}, [its leases in doubt])."""
        live, held = await self._call("ON_NODE", node)
        return {_s(live[i]): live[i + 1] == 1 for i in range(0, len(live), 2)}, [_s(x) for x in held]

    async def free_doubt(self, node: str, keep: int, held: list[str]) -> int:
        """Of ``held`` (leases in doubt on ``node``), all but ``keep`` are freed. Returns how many."""
        freed, grants = await self._call("DOUBT", node, keep, *held)
        self._grants(grants)
        return int(freed)

    def _sent(self, lease: Lease) -> None:
        """The lease's request was written to its node: marked once, for the node check."""
        lease.sent = None
        lid = self._lid.get(lease)
        if lid is not None and self.view.redis_up:
            self._remote("SENT", lid)

    # --- grants ---------------------------------------------------------------------------
    def _grants(self, items: list[Any]) -> None:
        for g in items:
            tid, lid, node = _s(g).split(" ")
            self._granted(tid, lid, node)

    def _granted(self, tid: str, lid: str, node: str) -> None:
        if lid == "!":
            self._dropped(tid)
            return
        if self.clock() - self._alive_at >= self.cfg.lease_ttl_sec:
            # Not counted alive by Redis for a TTL (a freeze, a stalled loop): it may have been
            # reaped and this slot, in doubt, freed and granted again to another gateway. Its
            # next heartbeat says which: until then the request does not start.
            self._unsure.append((tid, lid, node))
            return
        t = self._tickets.get(tid)
        if t is not None and t.lease is not None and self._lid.get(t.lease) == lid:
            return  # the same grant twice (pub/sub and the sweep)
        rq = self.sched.routes.get(t.route) if t is not None else None
        ns = self.sched.nodes.get(node)
        if t is None or t.state != WAITING or rq is None or ns is None:
            # Nobody here wants it any more (the client left in the same moment): give it back.
            self._remote("RELEASE", lid)
            return
        self.sched.affine_landed(rq, t, node)  # hit, miss or load: by this gateway's index, now
        lease = self.sched.grant(rq, t, node, self.clock())
        self._lid[lease] = lid
        lease.sent = partial(self._sent, lease)
        t.wake()

    def _dropped(self, tid: str) -> None:
        """drop_oldest: this gateway's ticket was the cluster's oldest waiting when the queue was full."""
        t = self._tickets.get(tid)
        if t is None or t.state != WAITING:
            return
        self._untrack(t)
        rq = self.sched.routes[t.route]
        t.state = FAILED
        t.error = Rejected(503, "queue_full", "dropped: queue full", self.sched.retry_after(rq, self.clock()))
        t.wake()

    def _remote(self, name: str, *args: str) -> None:
        """A script whose answer is grants, sent now; no task waits for it: the grants are
        taken as the answer arrives (for a release, the next request starts from there)."""
        self._call(name, *args).add_done_callback(partial(self._answered, name, args[0]))

    def _answered(self, name: str, first: str, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        e = fut.exception()
        if e is not None:
            if not isinstance(e, RedisError | OSError):
                log.error("cluster: %s failed", name, exc_info=e)
                return
            if name in ("RELEASE", "REQUEUE"):
                self._orphans.add(first)  # given back in Redis once it answers again
            self._lost(e)
            return
        res = fut.result()
        self._grants(res[1:] if name == "CANCEL" else res)

    async def _listen(self) -> None:
        """Grants for this gateway's tickets, decided by a script another gateway ran: taken as
        the message arrives (the wire's data callback), no reader task in between."""
        channel = f"{self.prefix}grant:{self.inst}"
        while True:
            try:
                await subscribed(self._wire.pool, CALL_TIMEOUT_SEC, channel, self._pushed,
                                 ending=self._set_resubscribe, on_subscribed=self._now_subscribed)
            except (RedisError, OSError):
                pass
            finally:
                self._sub_at = None
            await asyncio.sleep(self.cfg.lease_ttl_sec / 3)  # the heartbeat notices and sweeps

    def _set_resubscribe(self, end: Callable[[], None]) -> None:
        self._resubscribe = end

    def _now_subscribed(self) -> None:
        self._sub_at = self.clock()

    def _pushed(self, msg: list[Any]) -> None:
        try:
            tid, lid, node = _s(msg[2]).split(" ")
            self._granted(tid, lid, node)  # or its drop (lid "!")
        except Exception:
            log.exception("cluster: grant listener")

    # --- the cluster's queues, for the views (queue.WaitingElsewhere) ------------------------
    def position(self, t: Ticket) -> int | None:
        tid = self._tid.get(t)
        return self._pos.get(tid) if tid is not None and self.view.redis_up else None

    def positions(self, route: str) -> dict[int, int]:
        out = {}
        for t, tid in self._tid.items():
            if t.route == route and (p := self._pos.get(tid)) is not None:
                out[t.seq] = p
        return out

    def depth(self, route: str) -> int:
        return self._depth.get(route, 0) if self.view.redis_up else 0

    def by_key(self, route: str) -> dict[str, int]:
        return self._by_key.get(route, {}) if self.view.redis_up else {}

    async def _positions_loop(self) -> None:
        while True:
            await asyncio.sleep(POSITIONS_SEC)
            if not self.view.redis_up:
                continue
            routes = [r for r, rq in self.sched.routes.items() if not rq.retired]
            try:
                res = await self._call("POSITIONS", *routes)
            except (RedisError, OSError):
                continue  # the heartbeat notices a lost Redis
            pos: dict[str, int] = {}
            for route, (waiting, by_key, ranks) in zip(routes, res, strict=True):
                self._depth[route] = int(waiting)
                self._by_key[route] = {_s(by_key[i]): int(by_key[i + 1]) for i in range(0, len(by_key), 2)}
                for i in range(0, len(ranks), 2):
                    pos[_s(ranks[i])] = int(ranks[i + 1])
            self._pos = pos

    # --- heartbeat, sweep and the loss of Redis ---------------------------------------------
    async def _beat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.lease_ttl_sec / 3)
            try:
                if not self.view.redis_up:
                    if not self.sched.share.part and self.view.reached and self.clock() >= self._alone_from:
                        self._cut(self.alive_peers())  # the first TTL of the outage is over: the share applies
                        self.sched.dispatch(self.clock())
                    assert self._redis is not None
                    # Pooled connections from before the loss would each fail once: start afresh.
                    await self._redis.connection_pool.disconnect()
                    await self._redis.ping()
                    await self._restore()
                else:
                    await self._beat()
            except (RedisError, OSError) as e:
                self._lost(e)
            except Exception:
                log.exception("cluster: heartbeat")

    async def _beat(self) -> None:
        if self._replan:
            await self._refresh()
        if self._woke:
            await self._end_own_doubts()
        now = self.clock()
        sub = self._sub_at
        # Every waiting ticket, until one sweep has run since the channel was subscribed (and
        # reached every ticket admitted before: those waiting WAITED_SEC); then only carried ones.
        full = sub is None or self._swept_for != sub
        stale = [tid for tid, t in self._tickets.items() if t.state == WAITING and now - t.enqueued_at > WAITED_SEC
                 and (full or tid in self._to_sweep)]
        views = {r: self._view(r) for r, rq in self.sched.routes.items() if not rq.retired}
        ttl_ms = int(self.cfg.lease_ttl_sec * 1000)
        grants, lost, peers, reaped, held, gone = await self._call(
            "BEAT", ttl_ms, self.view.gateway_id, self.version(), orjson.dumps(views).decode(), self._counts_json(),
            *stale)
        self._alive_at = now
        unsure, self._unsure = self._unsure, []
        if int(reaped) and self._lid:
            self._revoke_all()
        self._woke = bool(int(reaped))
        self._to_sweep.difference_update(stale)
        if full and sub is not None and now - sub > WAITED_SEC:
            self._swept_for = sub
        if int(reaped):
            self._swept_for = None  # reaped: our waiting tickets left Redis' queues; the next beat finds them
        self._grants(grants)
        if int(reaped):
            if unsure:
                log.warning("⚠ cluster: %d grant(s) that reached this gateway while it was reaped are not run",
                            len(unsure))
        else:
            for g in unsure:
                self._granted(*g)
        self._release_strays({_s(x) for x in held})
        for tid in lost:
            t = self._tickets.get(_s(tid))
            if t is not None and t.state == WAITING:
                self._spawn(self._readmit(t))
        out = []
        for i in range(0, len(peers), 4):
            inst, gid, ver, age = (_s(x) for x in peers[i:i + 4])
            if inst != self.inst:
                out.append(Peer(gid, int(age) / 1000, ver))
        self.view.peers = out
        for p in out:
            self._seen[p.id] = max(self._seen.get(p.id, -math.inf), now - p.last_seen_sec)
        self._gone([_s(x) for x in gone])
        if self._forget:
            self._flush_forget()

    def _counts_json(self) -> str:
        """Its full slot counts: the BEAT script keeps its share of them among the gateways alive
        (the same split _cut applies alone), reserved in Redis once its heartbeat lapses."""
        return orjson.dumps({
            "r": {r: rq.cfg.max_concurrency for r, rq in self.sched.routes.items() if not rq.retired},
            "n": {**{n: ns.cfg.max_concurrency for n, ns in self.sched.nodes.items()
                     if ns.cfg.max_concurrency is not None},
                  **{"card:" + c: cc.max_concurrency for c, cc in self.sched.cards.cfg.items()
                     if cc.max_concurrency is not None}},
        }).decode()

    def _keep(self) -> str:
        """The nodes where a request runs on without its connection (ComfyUI: its prompt stays
        queued): a lease in doubt there is ended only by the node check, ",a,b,"."""
        nodes = sorted({n for rq in self.sched.routes.values() if rq.cfg.kind == "comfyui" for n in rq.all_nodes})
        return "," + "".join(n + "," for n in nodes)

    def _gone(self, flat: list[str]) -> None:
        """The gateways whose share Redis reserves: shown, and each alerted once (the leader's voice)."""
        out = []
        for i in range(0, len(flat), 3):
            gid, age, raw = flat[i], int(flat[i + 1]) / 1000, orjson.loads(flat[i + 2])
            out.append(Lost(gid, age, {"routes": {r: n for r, n in raw.get("r", {}).items() if n},
                                       "nodes": {n: k for n, k in raw.get("n", {}).items() if k},
                                       "capacity": raw.get("c", 0)}))
        self.view.lost = out
        # Known once said: a gateway that is not the voice when it sees the loss (the lost one was
        # the leader, and the lease has not passed on yet) says it when it becomes the voice.
        said = {g.id for g in out if g.id in self._lost_known}
        for g in out:
            if g.id not in said and self.speaks("cluster_gateway_lost"):
                held = ", ".join([f"{r} {n}/node" for r, n in sorted(g.reserved["routes"].items())]
                                 + [f"node {n} {k}" for n, k in sorted(g.reserved["nodes"].items())]) or "nothing"
                self._notify("cluster_gateway_lost", f"⚠ cluster: gateway {g.id} lost (no heartbeat): its share stays "
                             f"reserved ({held}) until it comes back, or POST /admin/cluster/forget/{g.id}")
                said.add(g.id)
        self._lost_known = said

    async def forget_gateway(self, gid: str) -> str:
        """An operator says gateway ``gid`` is gone for good (POST /admin/cluster/forget/{id}):
        its reserved share goes, and its leases in doubt end where no prompt runs on without them.
        Returns "forgotten", "alive" (it beats: nothing to forget) or "unknown"."""
        res = await self._call("FORGET_GATEWAY", gid, self._keep())
        verdict = _s(res[0])
        self._grants(res[2:])
        if verdict == "forgotten":
            log.warning("⚠ cluster: gateway %s forgotten: its reserved share is free (%d leases in doubt ended)",
                        gid, int(res[1]))
            self.view.lost = [g for g in self.view.lost if g.id != gid]
        return verdict

    def _release_strays(self, held_here: set[str]) -> None:
        """Leases Redis counts for us that no request here holds: granted to a ticket whose grant
        never arrived (a pub/sub message lost while the connection was down, an ADMIT that ran
        after its call had timed out). Given back when a second heartbeat still finds them, so a
        grant on its way is not mistaken for one."""
        known = set(self._lid.values())
        strays = held_here - known
        for lid in strays & self._strays:
            self._remote("RELEASE", lid)
        self._strays = strays - self._strays

    async def _end_own_doubts(self) -> None:
        """A heartbeat after this gateway woke reaped: the requests it stopped then are gone from
        the nodes, so its leases in doubt end now, on a node that cannot tell too (not only after
        their request_timeout_sec), as a restarted gateway's do."""
        res = await self._call("WOKE", self.view.gateway_id, self._keep())
        self._woke = False
        if int(res[0]):
            log.warning("⚠ cluster: %d slot(s) this gateway held before its freeze are free again", int(res[0]))
        self._grants(res[1:])

    def _revoke_all(self) -> None:
        """This gateway was reaped while it could not beat (frozen past the TTL): the slots of its
        leases have been granted again, so the requests on them stop now (scope.revoke)."""
        log.error("✗ cluster: this gateway was cut off past lease_ttl_sec: its %d running requests stop",
                  len(self._lid))
        for lease in list(self._lid):
            del self._lid[lease]
            if lease.revoke is not None:
                lease.revoke("lease lost: this gateway was cut off from the cluster past lease_ttl_sec")

    async def _readmit(self, t: Ticket) -> None:
        """A ticket Redis no longer knows (it came back empty): queued again, at the back."""
        self._untrack(t)
        try:
            await self.settle(t)
        except Rejected as r:
            t.state, t.error = "failed", r
            t.wake()

    def _lost(self, e: BaseException) -> None:
        if not self.view.redis_up:
            return
        log.error("✗ cluster: Redis lost (%s): going on alone with a safe share of every slot", e)
        self._peers_at_loss = self.alive_peers()
        self._degrade(alert=True)

    def alive_peers(self) -> list[str]:
        """The other gateways seen within 3 × lease_ttl_sec: the k of every split while Redis is down."""
        now = self.clock()
        # Remembered here, not read from Redis: a Redis that came back empty forgot the peers.
        return alive(((pid, now - at) for pid, at in self._seen.items() if pid != self.view.gateway_id),
                     3 * self.cfg.lease_ttl_sec)

    def _degrade(self, alert: bool) -> None:
        self.view.redis_up = False
        self._swept_for = None
        # The channel may look subscribed over a connection that is gone (half open): subscribe
        # afresh, so that the sweep after it covers whatever was published meanwhile.
        self._resubscribe()
        self._depth, self._by_key, self._pos = {}, {}, {}
        now = self.clock()
        others = self.alive_peers()
        me = self.view.gateway_id
        # For one lease TTL nothing new starts here: by then every gateway has noticed the loss, and
        # a Redis that only blinked (restarted, stalled) is back first, so a blink never runs the
        # leases one gateway holds beside another's fresh share.
        self._alone_from = now + self.cfg.lease_ttl_sec
        self._cut(others)
        # The requests waiting in Redis wait here now, in their order.
        for t in sorted((t for t in self._tickets.values() if t.state == WAITING), key=lambda x: x.seq):
            self._untrack(t)
            self._adopt(t)
        if alert and self.leadership.redis_lost():
            self._notify("cluster_degraded", f"⚠ cluster: Redis unreachable — {me} goes on alone with "
                         f"a 1/{len(others) + 1} share of every slot")
        self.sched.dispatch(now)

    def _cut(self, others: list[str]) -> None:
        """This gateway's share of every slot count applies (Redis is down): an overlay the
        scheduler reads (scheduling/share.py), so the configs, reloaded or made meanwhile (an
        ad-hoc target), stay whole and hold again as they are once Redis is back."""
        # A gateway that never reached Redis knows no peer: a share of "all of it" would be a guess
        # that adds a whole N to whatever the others run. It queues until Redis answers. Nor does
        # anything start during the first TTL of an outage (_degrade).
        part = 1 if self.view.reached and self.clock() >= self._alone_from else 0
        self.sched.share = share_of(self.view.gateway_id, others, part)

    # --- reload (a runtime.Component) -------------------------------------------------------
    def prepare(self, cfg: Config) -> list[str]:
        """A changed ``cluster:`` section is refused: Redis, the gateway id and the TTL are bound
        at start (a restart applies them); saying nothing would leave the file and the gateway apart."""
        if cfg.cluster != self.cfg:
            return ["the cluster section changed: it needs a restart (nothing in this file was applied)"]
        return []

    def commit(self, cfg: Config) -> None:
        """A reload applied new route and node configs, whole. While Redis is down this
        gateway's share of those applies (the overlay reads them), and they hold once it is back."""
        if not self.view.redis_up:
            self.sched.dispatch(self.clock())
        for t in self._tickets.values():
            if t.state == WAITING:
                self._replan.setdefault(t, "")  # planned for the nodes of the old config

    def _adopt(self, t: Ticket) -> None:
        """The scheduler takes over a waiting ticket it did not make (Redis is down)."""
        if t in self._local:
            return
        deadline = t.deadline
        self.sched.enqueue(self.sched.routes[t.route], t, self.clock(), front=False)
        t.deadline = deadline  # the wait already spent counts
        self._local.add(t)
        self.sched.dispatch(self.clock())

    async def _restore(self) -> None:
        """Redis answers again: give back what was released meanwhile, register what is held and
        what waits, then the full slot counts apply again."""
        self._restoring = True  # a lease started alone from here on would not be in the count
        try:
            held = await self._register_held()
        finally:
            self._restoring = False
        self.sched.share = WHOLE
        self.view.redis_up = True
        waiting = sorted((t for t in self._local if t.state == WAITING), key=lambda x: x.seq)
        self._local.clear()
        log.info("✓ cluster: Redis is back: %d leases and %d waiting requests registered", held, len(waiting))
        for t in waiting:
            self.sched.cancel(t)
            t.state = WAITING
            self._spawn(self._readmit(t))
        self.leadership.redis_back()  # the first leader elected now says cluster_restored
        await self._beat()

    async def _register_held(self) -> int:
        """What Redis may still count for us (the orphans released meanwhile, the leases held when
        it went) goes, and what we hold now is counted, in one step: no grant between the two.
        Returns how many leases are held."""
        old = [*self._orphans, *self._lid.values()]
        for lease in list(self._lid):
            self._local.add(lease.ticket)
        self._lid.clear()
        counted: set[Lease] = set()
        first = True
        while True:
            # A request admitted while REGISTER was on its way may have been leased here alone:
            # it is counted by a second round, before this gateway says it is counted (BEAT).
            leases = [t.lease for t in self._local if t.state == LEASED and t.lease is not None
                      and not t.lease.released and t.lease not in counted]
            if not leases and not first:
                return len(counted)
            first = False
            lids = await self._register([lease.ticket for lease in leases], old)
            self._orphans.difference_update(old)
            old = []
            for lease, lid in zip(leases, lids, strict=True):
                counted.add(lease)
                if lease.released:  # it ended while Redis counted it: give it back there too
                    self._untrack(lease.ticket)
                    self._remote("RELEASE", lid)
                else:
                    self._lid[lease] = lid

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_SEC)
            now = self.clock()
            while self._deadlines and self._deadlines[0][0] <= now:
                _, _, t = heapq.heappop(self._deadlines)
                if t.state != WAITING or t.deadline > now or t not in self._tid:
                    continue
                rq = self.sched.routes[t.route]
                self.cancel(t)
                t.state = "failed"
                t.error = Rejected(503, "queue_timeout", f"waited {rq.cfg.queue_timeout_sec:g}s in the queue of route "
                                   f"{t.route}", self.sched.retry_after(rq, now))
                t.wake()

    # --- helpers --------------------------------------------------------------------------
    def _notify(self, event: str, text: str) -> None:
        log.warning("%s", text)
        self.alert(event, text, None)

    def _track(self, t: Ticket) -> str:
        # A new id for every time a ticket enters Redis: a copy an earlier attempt left there (an
        # ADMIT that ran after its call had timed out) can never be taken for this one.
        tid = f"{self.inst}:{t.seq}.{next(self._entries)}"
        self._tickets[tid] = t
        self._tid[t] = tid
        return tid

    def _untrack(self, t: Ticket) -> str | None:
        self.sched.bodies.release(t)
        tid = self._tid.pop(t, None)
        if tid is not None:
            self._tickets.pop(tid, None)
            self._to_sweep.discard(tid)
        return tid

    def _place(self, t: Ticket, front: bool = False) -> str:
        """Where the ticket waits in the cluster's order (order.place), its arrival reckoned on
        the Unix clock (one time for every gateway, up to their skew): a ticket admitted again
        (Redis came back) keeps the wait it already spent."""
        at = self.wall() - (self.clock() - t.enqueued_at)
        return place_json(self.sched.routes[t.route].cfg, t, at, front)

    def _view(self, route: str) -> dict[str, Any]:
        return route_view(self.sched, self.sched.routes[route], self.clock())

    def _plan(self, t: Ticket) -> str:
        return plan_json(self.sched, t, self.clock())

    def _counts(self, lease: Lease) -> str:
        """What a lease counts against in Redis (its node's limits on its route), for REGISTER."""
        rq = self.sched.routes.get(lease.route)
        ns = self.sched.nodes.get(lease.node)
        if rq is None or ns is None:
            return "[]"
        return orjson.dumps([lim.wire() for lim in rules.limits(self.sched.caps(rq, ns, self.clock(), WHOLE))]).decode()

    def _publish_plan(self, t: Ticket) -> str:
        """The plan as it goes to Redis with the ticket (ADMIT, REQUEUE). A bar in it holds only
        until the node is seen alive or its time is up (Scheduler.barred), which the scripts
        cannot see: the ticket is remembered until _refresh has written the lifted plan —
        whichever script wrote it, a re-queue's or the admission again of one Redis forgot."""
        plan = self._plan(t)
        if self._any_barred(t):
            self._replan[t] = plan
        else:
            self._replan.pop(t, None)
        return plan

    def _any_barred(self, t: Ticket) -> bool:
        now = self.clock()
        return any(self.sched.barred(t, n, now) for n in t.avoid)

    async def _refresh(self) -> None:
        """Plans that may have changed are written again: a node that lost a waiting ticket is
        alive again or its bar's time is up (the scripts may grant it there; the BEAT that follows
        dispatches), or a reload changed the route's nodes."""
        writes: list[asyncio.Future[Any]] = []
        for t, sent in list(self._replan.items()):
            tid = self._tid.get(t)
            if t.state != WAITING or tid is None or t.route not in self.sched.routes:
                del self._replan[t]
                continue
            plan = self._plan(t)
            if plan != sent:
                # On the scripts' own connection: after the REQUEUE or ADMIT that wrote ``sent``,
                # never overtaking it (a plan it then overwrote would bar the ticket for good).
                writes.append(self._wire.command("HSET", f"{self.prefix}t:{tid}", "plan", plan))
            if self._any_barred(t):
                self._replan[t] = plan
            else:
                del self._replan[t]
        if writes:
            await asyncio.gather(*writes)

    def _view_json(self, route: str) -> str:
        return orjson.dumps(self._view(route)).decode()


def route_view(sched: Scheduler, rq: RouteQueue, now: float) -> dict[str, Any]:
    """The route's nodes as the scripts read them (``P v:<route>``): per node up (1: it may take
    work), slowed (1: ranks last) and its limits (rules.Limit.wire, the full counts: a lost
    gateway's share is reserved in Redis); and whether backfill applies, with max_bypass."""

    def entry(ns: NodeState) -> dict[str, Any]:
        lims = rules.limits(sched.caps(rq, ns, now, WHOLE))
        return {"u": int(ns.available(now)), "s": int(ns.slowed), "l": [lim.wire() for lim in lims]}

    return {"n": {n: entry(ns) for n in rq.all_nodes if (ns := sched.nodes.get(n)) is not None},
            "c": sched.costed(rq), "b": rq.cfg.max_bypass, "t": int(rq.cfg.request_timeout_sec * 1000)}


def place_json(cfg: RouteConfig, t: Ticket, at: float, front: bool = False) -> str:
    """The ticket's place (order.Place.wire) as queued at ``at`` (Unix time), for ADMIT and REQUEUE."""
    p = order.place(cfg.strategy, t.key, t.priority, at, order.age_step(cfg.queue_timeout_sec), front)
    return orjson.dumps(p.wire()).decode()


def plan_json(sched: Scheduler, t: Ticket, now: float) -> str:
    """The ticket's candidates with their rank columns, by the rules (Scheduler.plan): written
    with the ticket, so the gateway whose release grants it picks by the same rule with Redis'
    own counts."""
    return orjson.dumps(sched.plan(sched.routes[t.route], t, now, hold=True).wire()).decode()


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)

