"""Ad-hoc targets of ``/v1/proxy`` (docs/API.md#v1proxy): the routes and nodes made for them, bounded.

A key whose ``adhoc_targets`` glob matches an ``X-Target-Host`` gets a queue for that target.
Clients name targets freely, so what is kept for them must be bounded, like any cache:

- a route is made only for a request that is being admitted (one refused by auth, validation or
  limits never makes one), and is dropped at once if its first request was refused after all;
- one route per (key, target): ``X-Concurrency-Slot`` sets N for the key's own queue and can
  never change another key's; the node (breaker, keep-alive pool) is shared per target, and caps
  the target at ``ADHOC_MAX_SLOTS`` requests in flight whatever the keys ask for;
- a route with no request queued or running for ``idle_sec`` is dropped, with its node once no
  route uses it (queue, node state, upstream pool and session are freed);
- at most ``per_key`` routes per key and ``total`` in all: a new target over a cap takes the place
  of the least recently used idle route, else it is refused (429 for the key's own cap, 503 for
  the gateway's), so that refusals never drop a queued or running request.

Pure bookkeeping with ``now`` passed in; the Runtime sweeps from its pump and frees node I/O.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kilolined.core.config import NodeConfig, RouteConfig
from kilolined.scheduling.nodes import NodeState
from kilolined.scheduling.queue import LEASED, WAITING, Rejected, RouteQueue, Scheduler, Ticket

PREFIX = "adhoc:"
ADHOC_MAX_SLOTS = 8  # docs/API.md: X-Concurrency-Slot is 1–8; also a target's cap across keys
# Longer than the ad-hoc queue timeout and than a breaker may stay open (max_open_sec, 300 s by
# default): a target that is only resting between bursts keeps its queue, keep-alive sockets and
# breaker state; a target nobody uses any more is forgotten within minutes.
ADHOC_IDLE_SEC = 300.0
ADHOC_PER_KEY = 64  # targets one key may have at once (a key names GPUs it rents: a few, not thousands)
ADHOC_TOTAL = 1024  # targets in all: ~4 KB each, so a few MB at most
ADHOC_QUEUE_TIMEOUT_SEC = 120.0
ADHOC_QUEUE_DEPTH = 100
RETRY_AFTER_SEC = 5.0
_LIVE = (WAITING, LEASED)


def node_name(target: str) -> str:
    return PREFIX + target


def route_name(key: str, target: str) -> str:
    """One route per (key, target); ``#`` cannot appear in a target (targets.parse_target)."""
    return f"{PREFIX}{target}#{key}"


def is_adhoc(name: str) -> bool:
    return name.startswith(PREFIX)


@dataclass(eq=False, slots=True)
class AdhocRoute:
    name: str
    key: str
    node: str
    last_used: float  # when it was last seen busy or asked for
    holders: int = 0  # requests between the route's lookup and the end of their admission stage
    admitted: int = 0  # requests it ever admitted (a route that admitted none is dropped at once)
    tickets: set[Ticket] = field(default_factory=set)  # admitted, maybe still queued or running (jobs)


class AdhocTargets:
    def __init__(self, sched: Scheduler, forget_route: Callable[[str, str | None], None],
                 forget_node: Callable[[str], None], *, idle_sec: float = ADHOC_IDLE_SEC,
                 per_key: int = ADHOC_PER_KEY, total: int = ADHOC_TOTAL):
        self.sched = sched
        #: the lease store's LeaseStore.forget_route: the route's queue (and its node, when given)
        #: go from the scheduler, and in cluster mode from Redis
        self.forget_route = forget_route
        self.forget_node = forget_node  # frees what the Runtime holds for a node (pool, session)
        self.idle_sec = idle_sec
        self.per_key = per_key
        self.total = total
        self.routes: OrderedDict[str, AdhocRoute] = OrderedDict()  # least recently used first
        self.by_key: Counter[str] = Counter()
        self._node_users: Counter[str] = Counter()
        self._next_sweep = 0.0

    def __len__(self) -> int:
        return len(self.routes)

    def open(self, key: str, target: str, slots: int, now: float) -> AdhocRoute:
        """The key's route for ``target`` with ``slots`` slots, held until ``close``; raises Rejected
        when a cap is reached and every route under it has a request queued or running."""
        name = route_name(key, target)
        rec = self.routes.get(name)
        if rec is None:
            self._make_room(key, now)
            rec = self._make(name, key, target, now)
        else:
            self.routes.move_to_end(name)
        rq = self.sched.routes[name]
        if rq.cfg.max_concurrency != slots:
            rq.configure(_route_cfg(rec.node, slots), now)  # this key's queue only
        rec.holders += 1
        rec.last_used = now
        return rec

    def close(self, rec: AdhocRoute, ticket: Ticket | None, now: float) -> None:
        """The admission stage is over; ``ticket`` is what it admitted, if anything."""
        rec.holders -= 1
        rec.last_used = now
        if ticket is not None:
            rec.admitted += 1
            if ticket.state in _LIVE:
                rec.tickets.add(ticket)  # a job: it outlives the request that made it
        if rec.admitted == 0 and not self._busy(rec) and self.routes.get(rec.name) is rec:
            self._drop(rec)  # only refused requests came this way: nothing to keep

    def sweep(self, now: float) -> int:
        """Drop the routes idle for ``idle_sec``; returns how many. Cheap to call often."""
        if now < self._next_sweep:
            return 0
        self._next_sweep = now + min(1.0, self.idle_sec / 4)
        dropped = 0
        for rec in list(self.routes.values()):
            if self._busy(rec):
                rec.last_used = now
            elif now - rec.last_used >= self.idle_sec:
                self._drop(rec)
                dropped += 1
        return dropped

    # --- inside -------------------------------------------------------------------------
    def _busy(self, rec: AdhocRoute) -> bool:
        if rec.tickets:
            rec.tickets = {t for t in rec.tickets if t.state in _LIVE}
        if rec.holders or rec.tickets:
            return True
        rq = self.sched.routes.get(rec.name)
        return rq is not None and bool(rq.waiting or rq.inflight or self.sched.depth(rq))

    def _make_room(self, key: str, now: float) -> None:
        if self.by_key[key] >= self.per_key and not self._evict_idle(key):
            raise Rejected(429, "queue_full", f"key already has {self.by_key[key]} ad-hoc targets with requests "
                           f"queued or running (at most {self.per_key})", RETRY_AFTER_SEC)
        if len(self.routes) >= self.total and not self._evict_idle(None):
            raise Rejected(503, "queue_full", f"{len(self.routes)} ad-hoc targets have requests queued or running "
                           f"(the gateway's limit)", RETRY_AFTER_SEC)

    def _evict_idle(self, key: str | None) -> bool:
        """Drop the least recently used idle route (of ``key``, or of anyone)."""
        for rec in self.routes.values():
            if (key is None or rec.key == key) and not self._busy(rec):
                self._drop(rec)
                return True
        return False

    def _make(self, name: str, key: str, target: str, now: float) -> AdhocRoute:
        node = node_name(target)
        sched = self.sched
        if node not in sched.nodes:
            sched.nodes[node] = NodeState(node, NodeConfig(url=target, max_concurrency=ADHOC_MAX_SLOTS))
        sched.routes[name] = RouteQueue(name, _route_cfg(node, 1))
        rec = self.routes[name] = AdhocRoute(name, key, node, now)
        self.by_key[key] += 1
        self._node_users[node] += 1
        return rec

    def _drop(self, rec: AdhocRoute) -> None:
        del self.routes[rec.name]
        self.by_key[rec.key] -= 1
        if self.by_key[rec.key] <= 0:
            del self.by_key[rec.key]
        self._node_users[rec.node] -= 1
        node = None
        if self._node_users[rec.node] <= 0:
            del self._node_users[rec.node]
            if not self.sched.node_inflight.get(rec.node):
                node = rec.node
        self.forget_route(rec.name, node)
        if node is not None:
            self.forget_node(node)


def _route_cfg(node: str, slots: int) -> RouteConfig:
    return RouteConfig(path="/v1/proxy", nodes=[node], max_concurrency=slots,
                       queue_timeout_sec=ADHOC_QUEUE_TIMEOUT_SEC, max_queue_depth=ADHOC_QUEUE_DEPTH)
