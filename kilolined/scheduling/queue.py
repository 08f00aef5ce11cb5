"""The lease queue: who waits, in what order, and who gets which slot on which node.

Pure, synchronous logic with ``now`` passed in, so that hypothesis can drive it with a fake
clock. The async layer (``runtime.py``) attaches a waker to each ticket and calls ``dispatch``
whenever something may have freed capacity.

Cost and capacity (docs/CONFIG.md, "Cost and capacity"): a ticket may carry a cost, and a node
with ``capacity`` takes it only while its leases' costs plus this one fit. When the head of a
route does not fit anywhere, a later ticket that fits goes first (backfill), at most
``max_bypass`` times per head; after that, the nodes that could hold the head wait for it.

Multi-model nodes (docs/CONFIG.md#multi-model-nodes): a ticket may name its model; only nodes
that serve it take it, one where it is warm first. When the head would make its node swap
models, a later ticket whose model is warm there goes first (collation), at most
``max_swap_bypass`` times per head and for at most ``queue_timeout_sec / 4`` after the first.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from kilolined.core.config import NodeConfig, RouteConfig
from kilolined.scheduling import affinity as aff
from kilolined.scheduling import order, rules
from kilolined.scheduling.affinity import Affinity, KeyMemo, PrefixIndex
from kilolined.scheduling.bodies import WaitingBodies
from kilolined.scheduling.cards import CardLoad
from kilolined.scheduling.nodes import NodeState
from kilolined.scheduling.share import WHOLE, Share

WAITING, LEASED, DONE, FAILED = "waiting", "leased", "done", "failed"
EPS = 1e-9  # costs are sums of floats: compare with a little slack


class Rejected(Exception):
    """Admission refused; ``type`` and ``status`` are those of docs/API.md#errors."""

    def __init__(self, status: int, type_: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.retry_after = retry_after


@dataclass(eq=False, slots=True)
class Ticket:
    seq: int
    route: str
    key: str
    priority: int
    enqueued_at: float
    pinned_node: str | None = None
    # Nodes that failed this request -> when they were lost (-inf: they answered, so are alive).
    avoid: dict[str, float] = field(default_factory=dict)
    requeues: int = 0
    state: str = WAITING
    lease: Lease | None = None
    error: Rejected | None = None
    on_wake: Callable[[Ticket], None] | None = None
    deadline: float = math.inf
    cost: float = 0.0  # what it holds of a node's capacity while leased
    bypassed: int = 0  # requests dispatched ahead of it while it was the head (backfill)
    model: str | None = None  # the model it asks for (OpenAI "model"); None: any node of the route
    usd: float | None = None  # what its answer cost on a node with price_per_mtok (the access log's usd=)
    swap_bypassed: int = 0  # requests collated ahead of it while it was the head
    swap_bypassed_at: float | None = None  # when it was first collated past
    affinity: Affinity | None = None  # its prefix keys or session key (routes with ``affinity``)
    cached: int | None = None  # prompt tokens its node reported reused (the access log's cached=)
    body: int = 0  # bytes of its request's body, held in memory while it waits (bodies.py)
    body_held: bool = False  # counted in Scheduler.bodies now
    named_model: str | None = None  # the model its body names, for the bill (``model`` is set where it routes)
    tokens: tuple[int, int] = (0, 0)  # (prompt, completion) tokens its node reported, for the bill
    continued: int = 0  # times its stream went on on another node after its node failed mid-answer

    def wake(self) -> None:
        if self.on_wake is not None:
            self.on_wake(self)


@dataclass(frozen=True, slots=True)
class Target:
    """Where a lease's request goes, resolved once at grant time: the route's and the node's
    config as they were then. A reload mid-request changes neither (docs/ARCHITECTURE.md)."""

    route: RouteConfig
    node: NodeConfig
    # What every attempt reads, copied once (a route reuses its Target from grant to grant):
    # plain attributes, not properties to call on each request.
    url: str = field(init=False)
    headers: dict[str, str] = field(init=False)
    request_timeout_sec: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.node.url)
        object.__setattr__(self, "headers", self.node.headers)
        object.__setattr__(self, "request_timeout_sec", self.route.request_timeout_sec)


@dataclass(eq=False, slots=True)
class Lease:
    ticket: Ticket
    route: str
    node: str
    started_at: float
    trial: bool
    target: Target
    released: bool = False
    cost: float = 0.0
    swap: bool | None = None  # the node had to load the model (None: the node has no model state)
    # Stops the request on this lease at once (its LeaseScope sets it): the cluster store calls it
    # when the lease was lost while this gateway could not reach Redis (docs/CLUSTER.md).
    revoke: Callable[[str], None] | None = None
    # Called once the attempt's request has been written to the node (then None): the cluster
    # store marks the lease sent, so its node check knows the node counts it (docs/CLUSTER.md).
    sent: Callable[[], None] | None = None


# --- the order in which waiting tickets get slots (order.py) -----------------------------------


class Waiting:
    """A route's waiting tickets by their places (order.py), the lowest first: the local store's
    twin of the cluster's ``P o:<route>`` ZSET."""

    def __init__(self, strategy: str, queue_timeout_sec: float) -> None:
        self.strategy = strategy
        self.step = order.age_step(queue_timeout_sec)
        self.rounds = order.Rounds()
        self._arrivals = itertools.count(1)
        self._sorted: list[tuple[float, int, Ticket]] = []  # (score, arrival, ticket): unique prefixes
        self._at: dict[int, tuple[float, int, int]] = {}  # ticket seq -> (score, arrival, round)

    def __len__(self) -> int:
        return len(self._sorted)

    def push(self, t: Ticket, front: bool = False) -> None:
        p = order.place(self.strategy, t.key, t.priority, t.enqueued_at, self.step, front)
        arrival = next(self._arrivals)
        rnd = self.rounds.assign(t.key) if p.fair is not None else 0
        score = p.score(arrival, rnd)
        self._at[t.seq] = (score, arrival, rnd)
        bisect.insort(self._sorted, (score, arrival, t))

    def remove(self, t: Ticket) -> bool:
        at = self._at.pop(t.seq, None)
        if at is None:
            return False
        del self._sorted[bisect.bisect_left(self._sorted, at[:2])]
        return True

    def take(self, t: Ticket, head: bool) -> None:
        """``t`` leaves for a slot. The head's fair round is the one being served now (a ticket
        backfilled or collated from a later round does not move the round newcomers join)."""
        rnd = self._at[t.seq][2]
        self.remove(t)
        if head:
            self.rounds.served(rnd)

    def rank(self, t: Ticket) -> int | None:
        """``t``'s position (1 = next), found by its place; None: not waiting here."""
        at = self._at.get(t.seq)
        return None if at is None else bisect.bisect_left(self._sorted, at[:2]) + 1

    def peek(self) -> Ticket | None:
        return self._sorted[0][2] if self._sorted else None

    def order(self) -> Iterator[Ticket]:
        return iter([x[2] for x in self._sorted])


# --- per-route state ---------------------------------------------------------------------------


class RouteQueue:
    def __init__(self, name: str, cfg: RouteConfig):
        self.name = name
        self.cfg = cfg
        self.waiting = Waiting(cfg.strategy, cfg.queue_timeout_sec)
        self.by_key: Counter[str] = Counter()
        self.inflight: Counter[str] = Counter()  # node -> leases of this route
        self.capacity_used = 0.0  # the costs of this route's leases
        self.retired = False
        self.mode = "primary"
        self.mean_service: float | None = cfg.expected_duration_sec
        self.samples = 0
        #: node -> the Target its last grant made: the next grant reuses it while both configs
        #: are still the very same objects (a reload replaces them), one frozen object less per grant
        self.targets: dict[str, Target] = {}
        #: whether the route or one of its nodes rewrites the model (edge/app.py): asked once per config
        self.renames: bool | None = None

    def target(self, node: str, cfg: NodeConfig) -> Target:
        """Where a grant on ``node`` (whose config is ``cfg``) sends its request: the route's and
        the node's config as they are now."""
        t = self.targets.get(node)
        if t is None or t.route is not self.cfg or t.node is not cfg:
            t = self.targets[node] = Target(self.cfg, cfg)
        return t

    def configure(self, cfg: RouteConfig, now: float) -> None:
        old = self.cfg
        self.cfg = cfg
        self.targets = {}  # nodes the route no longer has are not kept
        self.renames = None  # (every reload configures every route: a node's rewrite counts anew)
        if old.strategy != cfg.strategy or old.queue_timeout_sec != cfg.queue_timeout_sec:
            tickets = list(self.waiting.order())
            self.waiting = Waiting(cfg.strategy, cfg.queue_timeout_sec)
            for t in tickets:
                self.waiting.push(t)
        if self.samples == 0:
            self.mean_service = cfg.expected_duration_sec

    @property
    def all_nodes(self) -> list[str]:
        return list(self.cfg.nodes) + list(self.cfg.standby)

    def observe(self, seconds: float) -> None:
        """Service-time moving average (EWMA, alpha 0.2; the first sample replaces the seed)."""
        if self.samples == 0 or self.mean_service is None:
            self.mean_service = seconds
        else:
            self.mean_service += 0.2 * (seconds - self.mean_service)
        self.samples += 1


# --- the scheduler -----------------------------------------------------------------------------


class WaitingElsewhere(Protocol):
    """The waiting requests a shared lease store holds instead of this scheduler (cluster mode):
    their ranks and counts, for the views."""

    def position(self, t: Ticket) -> int | None: ...
    def positions(self, route: str) -> dict[int, int]: ...
    def depth(self, route: str) -> int: ...
    def by_key(self, route: str) -> dict[str, int]: ...


class Scheduler:
    """All routes' queues and all nodes' slots; the only place where leases are made."""

    def __init__(self) -> None:
        #: cluster mode: the waiting requests the cluster lease store holds (they count in the views)
        self.elsewhere: WaitingElsewhere | None = None
        self.routes: dict[str, RouteQueue] = {}
        self.nodes: dict[str, NodeState] = {}
        self.node_inflight: Counter[str] = Counter()
        self.capacity_used: dict[str, float] = {}  # node -> the costs of its leases
        #: the cards (GPUs shared by several nodes) and their leases (docs/CONFIG.md#cards)
        self.cards = CardLoad()
        self.swaps: Counter[str] = Counter()  # node -> dispatches that made it load a model
        self.indexes: dict[str, PrefixIndex] = {}  # node -> the prefix keys dispatched to it
        #: recent messages with their prefix keys: a prefix sent again is compared, not hashed again
        self.key_memo = KeyMemo()
        #: node -> the prefix requests in flight there (a few: a node runs N), to tell a busy match
        self.prefix_flight: dict[str, list[Affinity]] = {}
        #: (route, hit|miss|load) -> affinity decisions (kiloline_affinity_decisions_total)
        self.affinity_decisions: Counter[tuple[str, str]] = Counter()
        self._seq = itertools.count(1)
        self._deadlines: list[tuple[float, int, Ticket]] = []
        #: whether this gateway's own health checks run (cluster mode: only the leader's do)
        self.checks_here: Callable[[], bool] = lambda: True
        #: the bodies of waiting requests, per key and in total (server.max_queued_body_mb*)
        self.bodies = WaitingBodies()
        #: the part of every slot count this gateway may use (cluster mode, Redis down: its share)
        self.share: Share = WHOLE
        #: (route, node) -> its capped limits and what they were made of (a memo:
        #: remade when a config, the share or the node's slow verdict changes; never while ramping)
        self._limits: dict[tuple[str, str], tuple[tuple[object, ...], list[rules.Limit]]] = {}

    # -- capacity --------------------------------------------------------------------------
    def can_take(self, rq: RouteQueue, node: str, now: float, cost: float = 0.0) -> bool:
        ns = self.nodes.get(node)
        if ns is None or not ns.available(now):
            return False
        return all(rules.within(lim, self.count(rq, lim.counter, lim.field), cost) for lim in self.capped(rq, ns, now))

    def capped(self, rq: RouteQueue, ns: NodeState, now: float) -> list[rules.Limit]:
        """The node's limits on ``rq`` now that have a cap (rules.limits of ``caps``; the others
        are only counted)."""
        if ns.recovered_at is not None:  # slow start: they change with the clock
            return [lim for lim in rules.limits(self.caps(rq, ns, now)) if lim.cap >= 0]
        card = self.cards.cfg.get(ns.cfg.card) if ns.cfg.card is not None else None
        memo = self._limits.get((rq.name, ns.name))
        if memo is not None:  # compared by identity, field by field: this runs per node per choice
            m = memo[0]
            if m[0] is rq.cfg and m[1] is ns.cfg and m[2] is self.share and m[3] is card and m[4] is ns.slowed:
                return memo[1]
        lims = [lim for lim in rules.limits(self.caps(rq, ns, now)) if lim.cap >= 0]
        self._limits[(rq.name, ns.name)] = ((rq.cfg, ns.cfg, self.share, card, ns.slowed), lims)
        return lims

    def caps(self, rq: RouteQueue, ns: NodeState, now: float, share: Share | None = None) -> rules.NodeCaps:
        """What the node's limits on ``rq`` are made of now, as ``share`` (this store's) cuts them."""
        sh = self.share if share is None else share
        cfg = ns.cfg
        card = self.cards.cfg.get(cfg.card) if cfg.card is not None else None
        card_slots = None if card is None or card.max_concurrency is None else sh.slots(card.max_concurrency)
        return rules.NodeCaps(
            rq.name, ns.name, ns.effective(sh.slots(rq.cfg.max_concurrency), now),
            None if cfg.max_concurrency is None else ns.effective(sh.slots(cfg.max_concurrency), now),
            None if cfg.capacity is None else ramped_capacity(ns, now), cfg.capacity, sh.capacity(1.0),
            None if card is None else cfg.card, card_slots, None if card is None else card.capacity)

    def count(self, rq: RouteQueue, name: str, fld: str) -> float:
        """A live count the rules read (rules.IN ...), as this scheduler holds it."""
        if name == rules.IN:
            return rq.inflight[fld]
        if name == rules.NIN:
            return self.node_inflight[fld]
        if name == rules.NCOST:
            return self.capacity_used.get(fld, 0.0)
        if name == rules.CIN:
            return self.cards.inflight[fld]
        if name == rules.CCOST:
            return self.cards.used.get(fld, 0.0)
        ns = self.nodes.get(fld)
        return 1 if ns is not None and ns.slowed else 0  # rules.SLOW

    def hold_limit(self, ns: NodeState) -> float | None:
        """The most a node can hold at once: its capacity or its card's, the smaller (None: no limit)."""
        own = ns.cfg.capacity
        card = self.cards.capacity(ns.cfg.card) if ns.cfg.card is not None else None
        if card is None or own is None:
            return own if card is None else card
        return min(own, card)

    def could_hold(self, ns: NodeState | None, cost: float) -> bool:
        """The node could ever take a request of this cost (no capacity: always)."""
        if ns is None:
            return False
        cap = self.hold_limit(ns)
        return cap is None or cost <= cap + EPS

    def max_capacity(self, rq: RouteQueue, pinned_node: str | None = None) -> float | None:
        """The largest capacity of the route's nodes; None when one of them has none (no limit)."""
        caps = []
        for n in [pinned_node] if pinned_node is not None else rq.all_nodes:
            ns = self.nodes.get(n)
            if ns is None:
                continue
            cap = self.hold_limit(ns)
            if cap is None:
                return None
            caps.append(cap)
        return max(caps) if caps else None

    def costed(self, rq: RouteQueue) -> bool:
        """Whether costs can hold this route's tickets back (so backfill may be needed)."""
        return rq.cfg.cost is not None and any(
            n in self.nodes and self.hold_limit(self.nodes[n]) is not None for n in rq.all_nodes)

    def usable(self, rq: RouteQueue, now: float) -> list[str]:
        """Nodes the route would send new work to right now (primaries, else standbys)."""
        prim = [n for n in rq.cfg.nodes if n in self.nodes and self.nodes[n].available(now)]
        if prim:
            return prim
        return [n for n in rq.cfg.standby if n in self.nodes and self.nodes[n].available(now)]

    def answering(self, rq: RouteQueue, now: float) -> list[str]:
        """The nodes that may answer a request without a slot, in order: the usable ones (primaries
        first, else standbys), then the route's others — a dead primary counts as usable until a
        health check says so, and the standby is the next node its refused request goes to — and
        a node known lost after all of them (it may be back)."""
        usable = self.usable(rq, now)
        nodes = usable + [n for n in rq.all_nodes if n not in usable]
        return sorted(nodes, key=lambda n: self.nodes[n].known_lost())  # stable: the order otherwise kept

    def live_slots(self, rq: RouteQueue, now: float) -> int:
        per_card: Counter[str | None] = Counter()  # the nodes of one card share its slots
        for n in self.usable(rq, now):
            ns = self.nodes[n]
            s = ns.effective(self.share.slots(rq.cfg.max_concurrency), now)
            if ns.cfg.max_concurrency is not None:
                s = min(s, ns.effective(self.share.slots(ns.cfg.max_concurrency), now))
            per_card[ns.cfg.card] += s
        return sum(self.cards.slots(card, s) for card, s in per_card.items())

    def serves(self, node: str, model: str | None) -> bool:
        """The node may take a request for ``model`` (always, for a request naming none)."""
        ns = self.nodes.get(node)
        return ns is not None and (model is None or ns.models.serves(ns.cfg, model))

    def barred(self, t: Ticket, node: str, now: float) -> bool:
        """``node`` lost ``t`` and has not been seen alive since: it may not have it back.

        As HAProxy's redispatch: a request re-queued because its node stopped answering goes
        back there only after the node passed a health check or answered a request (its breaker
        closing through a trial is such an answer). A node nobody here probes (no ``health``, or
        another gateway leads the checks) is given the time in which a probe or a breaker would
        have judged it: ``breaker.open_sec``, or ``health.interval_sec × (fall + 1)``.
        """
        lost_at = t.avoid.get(node)
        if lost_at is None or lost_at == -math.inf:
            return False
        ns = self.nodes.get(node)
        if ns is None or ns.alive_at > lost_at:
            return False
        hc = ns.cfg.health
        if hc is not None and self.checks_here():
            return True
        wait = ns.cfg.breaker.open_sec if hc is None else hc.interval_sec * (hc.fall + 1)
        return now < lost_at + wait

    def plan(self, rq: RouteQueue, t: Ticket, now: float, hold: bool = False) -> rules.Plan:
        """The ticket's candidate nodes in tiers with their rank columns (rules.plan); ``hold``:
        with the nodes that could ever hold it (what a store that backfills alone needs)."""
        return rules.plan(_Board(self, now), t, (rq.cfg.nodes, rq.cfg.standby), rq.cfg.affinity, hold)

    def choose_node(self, rq: RouteQueue, t: Ticket, now: float,
                    blocked: frozenset[str] = frozenset(), position: int = 1) -> str | None:
        """Where ``t`` goes now, or None: the rules' plan picked with this scheduler's counts;
        ``blocked`` nodes are held for a head that was passed over. ``position``: its place in the
        queue, for the overflow tier's wait estimate."""
        free = self._feasible(rq, t, now, blocked)
        if free:
            p = self.plan(rq, t, now)
            got = rules.pick(p, _Local(self, rq, now, free), t.cost, blocked)
            if got.node is not None:
                self._affine_chosen(t, p.tiers[got.tier], got.node, blocked)
                return got.node
        if rq.cfg.overflow is None or t.pinned_node is not None:
            return None
        return self._overflow(rq, t, now, blocked, position if self._local_up(rq, t, now) else None)

    def _feasible(self, rq: RouteQueue, t: Ticket, now: float, blocked: frozenset[str]) -> frozenset[str]:
        """The nodes the plan could name that pass the live filters now (the pick reads them
        instead of asking each again). When none does, the pick names none whatever the plan says
        (every candidate must pass them): a full route, the most common case while requests
        wait, is answered without making the plan."""
        nodes = rq.all_nodes if t.pinned_node is None else [t.pinned_node]
        return frozenset([n for n in nodes if n not in blocked and self.can_take(rq, n, now, t.cost)])

    def _local_up(self, rq: RouteQueue, t: Ticket, now: float) -> bool:
        """Some primary or standby is up and could ever take ``t`` (one that lost it, once back)."""
        return any(n in self.nodes and self.nodes[n].available(now) and self.could_hold(self.nodes[n], t.cost)
                   and self.serves(n, t.model) and not self.barred(t, n, now) for n in rq.all_nodes)

    def _overflow(self, rq: RouteQueue, t: Ticket, now: float, blocked: frozenset[str],
                  position: int | None) -> str | None:
        """The overflow node ``t`` goes to now, or None (docs/CONFIG.md#overflow): the third tier,
        after primaries and standbys, taken when ``overflow_due`` says so for a request at
        ``position`` in the queue; at once when no primary or standby is up (``position`` None)."""
        ov = rq.cfg.overflow
        assert ov is not None
        if position is not None and not overflow_due(now - t.enqueued_at, self.est_wait(rq, position, now),
                                                     ov.when_wait_sec):
            return None
        board = _Board(self, now)
        names = rules.passing(rules.TIER_FILTERS, board, t, ov.nodes)
        tier = rules.Tier(rules.cands(rules.Ask(board, t), names, rules.LEAST_LOADED))
        return rules.pick(rules.Plan((tier,), ()), _Local(self, rq, now), t.cost, blocked).node

    def _overflow_later(self, rq: RouteQueue, head: Ticket, now: float) -> tuple[Ticket, str] | None:
        """A ticket behind the head that the overflow tier takes now: one that has waited
        ``when_wait_sec``, or whose place in the queue says it would. The estimate grows with the
        place, so the scan ends at the first place beyond ``when_wait_sec`` (or at the queue's end
        while nothing is measured)."""
        ov = rq.cfg.overflow
        assert ov is not None
        if not any(self.can_take(rq, n, now) for n in ov.nodes):
            return None
        for i, t in enumerate(rq.waiting.order(), 1):
            if t is head or t.pinned_node is not None:
                continue
            node = self._overflow(rq, t, now, frozenset(), i if self._local_up(rq, t, now) else None)
            if node is not None:
                return t, node
            est = self.est_wait(rq, i, now)
            if est is not None and est > ov.when_wait_sec:
                return None  # due by its place, yet no overflow node takes it now: the next pass looks again
        return None

    # -- affinity (docs/CONFIG.md#affinity) --------------------------------------------------------
    def _affine_chosen(self, t: Ticket, tier: rules.Tier, node: str, blocked: frozenset[str]) -> None:
        """Note what the affinity tier that chose ``node`` made of ``t``: hit (the session's first
        node, or the longest match there is); miss (no candidate holds any of it); load (one held
        more, or was the session's first, but the load rule chose another)."""
        a = t.affinity
        if tier.mode is None or a is None:
            return
        names = [c.node for c in tier.cands if c.node not in blocked]
        if tier.mode == aff.SESSION:
            a.node, a.match = node, 1
            a.outcome = aff.HIT if aff.rendezvous(a.keys[0], names)[:1] == [node] else aff.LOAD
            return
        got = self._match(node, a)
        best_any = max([got, *(self._match(n, a) for n in names)])
        a.node, a.match = node, got
        a.outcome = aff.MISS if best_any == 0 else aff.HIT if got >= best_any else aff.LOAD

    def _index(self, node: str) -> PrefixIndex | None:
        """The node's index, emptied first if the node's process restarted since it was filled, or
        a reload gave the name another URL (another server: nothing it holds is known)."""
        idx = self.indexes.get(node)
        ns = self.nodes.get(node)
        if idx is None or ns is None or (idx.url == ns.cfg.url and idx.started == ns.started):
            return idx
        # Not merely the first URL or start time heard of: another server, or a new process.
        if (idx.url is not None and idx.url != ns.cfg.url) or (idx.started is not None and idx.started != ns.started):
            idx.clear()
        idx.url, idx.started = ns.cfg.url, ns.started
        return idx

    def _match(self, node: str, a: Affinity) -> int:
        idx = self._index(node)
        return 0 if idx is None else idx.match(a.keys)

    def _affine_dispatch(self, rq: RouteQueue, t: Ticket, node: str) -> None:
        """Count the decision and record the request's keys on its node (at dispatch: a prefix
        still being prefilled there is already a hit for the next request)."""
        a = t.affinity
        assert a is not None
        if a.mode != rq.cfg.affinity:
            a.outcome = None
            return
        if a.node != node:  # pinned, or taken by the fallback rather than by the choice
            a.node, a.match = node, self._match(node, a) if a.mode == aff.PREFIX else 0
            a.outcome = aff.HIT if a.match else aff.MISS
        assert a.outcome is not None
        self.affinity_decisions[(rq.name, a.outcome)] += 1
        if a.mode == aff.PREFIX:
            flight = self.prefix_flight.get(node)
            if flight is None:
                flight = self.prefix_flight[node] = []
            busy, m = False, a.match
            if m > 0:
                # Another in flight there holds the first m keys (chained: key m-1 names them).
                k = a.keys[m - 1]
                for o in flight:
                    ok = o.keys
                    if len(ok) >= m and ok[m - 1] == k:
                        busy = True
                        break
            a.busy = busy
            flight.append(a)
            a.held = node
            idx = self.indexes.get(node)
            ns = self.nodes[node]
            if idx is not None and (idx.url != ns.cfg.url or idx.started != ns.started):
                idx = self._index(node)  # another process or address: emptied
            if idx is None:
                idx = self.indexes[node] = PrefixIndex(started=ns.started, url=ns.cfg.url)
            idx.record(a.keys)

    def _affine_release(self, a: Affinity, node: str) -> None:
        """The request's lease ended: it no longer computes its prefix on ``node``."""
        a.held = None
        flight = self.prefix_flight.get(node)
        if flight is None:
            return
        if flight[0] is a:  # the oldest in flight, most often: no search
            del flight[0]
        else:
            for i, o in enumerate(flight):
                if o is a:  # identity: two requests for one document carry equal Affinity values
                    del flight[i]
                    break
        if not flight:
            del self.prefix_flight[node]

    def affine_landed(self, rq: RouteQueue, t: Ticket, node: str) -> None:
        """A grant chosen elsewhere (the cluster's scripts, by the ticket's plan) lands here: what
        it was by this gateway's index now, as ``_affine_chosen`` would say it — hit; miss (no node it
        could have gone to holds any of it); load (one held more, or was the session's first, but
        the load rule chose another). Pinned, or a node that had failed it: hit if it holds any."""
        a = t.affinity
        if a is None or a.mode != rq.cfg.affinity:
            return
        group = rq.cfg.nodes if node in rq.cfg.nodes else rq.cfg.standby
        if t.pinned_node is not None or node in t.avoid or node not in group:
            a.match = self._match(node, a) if a.mode == aff.PREFIX else 0
            a.node, a.outcome = node, aff.HIT if a.match else aff.MISS
            return
        names = [n for n in group if n not in t.avoid and self.serves(n, t.model)]
        if a.mode == aff.SESSION:
            a.node, a.match = node, 1
            a.outcome = aff.HIT if aff.rendezvous(a.keys[0], names)[:1] == [node] else aff.LOAD
            return
        got = self._match(node, a)
        best_any = max([got, *(self._match(n, a) for n in names)])
        a.node, a.match = node, got
        a.outcome = aff.MISS if best_any == 0 else aff.HIT if got >= best_any else aff.LOAD

    def forget(self, node: str) -> None:
        """The node lost what it held (down, breaker open, restarted, swapped models)."""
        self.indexes.pop(node, None)

    def mispredicted(self, node: str, a: Affinity) -> None:
        """The node reported almost nothing reused where a hit was predicted: drop these keys there."""
        idx = self.indexes.get(node)
        if idx is not None:
            idx.drop(a.keys)

    def index_keys(self, node: str) -> int:
        idx = self._index(node)
        return 0 if idx is None else len(idx)

    # -- admission -------------------------------------------------------------------------
    def est_wait(self, rq: RouteQueue, position: int, now: float) -> float | None:
        """position × mean service time ÷ live slots (Gradio's rank_eta model); None if unknown."""
        if rq.mean_service is None:
            return None
        slots = self.live_slots(rq, now)
        if slots == 0:
            return None
        return round(position * rq.mean_service / slots, 2)

    def retry_after(self, rq: RouteQueue, now: float) -> float:
        est = self.est_wait(rq, len(rq.waiting) + 1, now)
        return max(1.0, math.ceil(est)) if est is not None else 1.0

    def check_servable(self, rq: RouteQueue, pinned_node: str | None, cost: float, model: str | None) -> None:
        """Refuse at once (Rejected) a request no node of the route could ever take: one that costs
        more than the largest capacity (422), or names a model none serves (404). Every lease store
        asks this before it queues anything (the cluster's too)."""
        limit = self.max_capacity(rq, pinned_node) if cost > 0 else None
        if limit is not None and cost > limit + EPS:
            raise Rejected(422, "exceeds_capacity",
                           f"request costs {cost:g}, more than the largest capacity of route {rq.name}'s nodes "
                           f"({limit:g})")
        nodes = [pinned_node] if pinned_node is not None else rq.all_nodes + rq.cfg.overflow_nodes
        # A route with no node at all (a fleet pool scaled to zero) waits for one: not refused.
        if model is not None and nodes and not any(self.serves(n, model) for n in nodes):
            raise Rejected(404, "model_not_found", f"no node of route {rq.name} serves model {model!r}")

    def admit(
        self,
        route: str,
        key: str,
        priority: int,
        now: float,
        *,
        pinned_node: str | None = None,
        on_wake: Callable[[Ticket], None] | None = None,
        cost: float = 0.0,
        model: str | None = None,
        affinity: Affinity | None = None,
        body: int = 0,
    ) -> Ticket:
        """Queue a request (raises Rejected); it may be leased at once by the dispatch inside.
        ``body``: the bytes of its body, held in memory while it waits (bodies.py)."""
        rq = self.routes[route]
        cfg = rq.cfg
        self.check_servable(rq, pinned_node, cost, model)
        if cfg.max_queued_per_key is not None and rq.by_key[key] >= cfg.max_queued_per_key:
            raise Rejected(
                429,
                "queue_full",
                f"key already has {rq.by_key[key]} requests waiting on route {route}",
                self.retry_after(rq, now),
            )
        t = Ticket(next(self._seq), route, key, priority, now, pinned_node=pinned_node, on_wake=on_wake, cost=cost,
                   model=model, affinity=affinity, body=body)
        # A free slot and nobody ahead: straight through, even when max_queue_depth is 0.
        if not rq.waiting:
            node = self.choose_node(rq, t, now)
            if node is not None:
                self.grant(rq, t, node, now)
                return t
        self.check_body(rq, t, now)
        if len(rq.waiting) >= cfg.max_queue_depth:
            if cfg.drop_policy == "drop_oldest" and rq.waiting:
                victim = min(rq.waiting.order(), key=lambda x: (x.enqueued_at, x.seq))
                self._fail(
                    victim,
                    Rejected(503, "queue_full", "dropped: queue full", self.retry_after(rq, now)),
                )
            else:
                status = 503 if cfg.drop_policy == "reject_with_503" else 429
                if cfg.drop_policy == "drop_oldest":
                    status = 503
                raise Rejected(
                    status,
                    "queue_full",
                    f"queue of route {route} is full ({cfg.max_queue_depth} waiting)",
                    self.retry_after(rq, now),
                )
        self.enqueue(rq, t, now, front=False)
        self.dispatch(now)
        return t

    def check_body(self, rq: RouteQueue, t: Ticket, now: float) -> None:
        """Refuse (Rejected) a request whose body may not wait: its key's waiting bodies, or all
        of them, would pass their bound (bodies.py)."""
        refused = self.bodies.refusal(t.key, t.body)
        if refused is not None:
            raise Rejected(refused[0], "queue_full", refused[1], self.retry_after(rq, now))

    def enqueue(self, rq: RouteQueue, t: Ticket, now: float, front: bool) -> None:
        t.state = WAITING
        t.lease = None
        t.deadline = now + rq.cfg.queue_timeout_sec
        rq.waiting.push(t, front=front)
        rq.by_key[t.key] += 1
        self.bodies.hold(t)
        heapq.heappush(self._deadlines, (t.deadline, t.seq, t))

    def _unqueue(self, rq: RouteQueue, t: Ticket) -> bool:
        if not rq.waiting.remove(t):
            return False
        self.bodies.release(t)
        rq.by_key[t.key] -= 1
        if rq.by_key[t.key] <= 0:
            del rq.by_key[t.key]
        return True

    def _fail(self, t: Ticket, err: Rejected) -> None:
        rq = self.routes[t.route]
        self._unqueue(rq, t)
        t.state = FAILED
        t.error = err
        t.wake()

    def cancel(self, t: Ticket) -> bool:
        """Take a waiting ticket out (client gone, job cancelled); False if it is not waiting."""
        if t.state != WAITING:
            return False
        self._unqueue(self.routes[t.route], t)
        t.state = DONE
        return True

    def requeue(self, lease: Lease, now: float, avoid_node: bool = True, lost: bool = False) -> Ticket:
        """Put a leased request back at the head of its queue (its node failed before any byte).

        ``lost``: the node stopped answering, and is barred for this request until seen alive."""
        t = lease.ticket
        self.release(lease, now, service_time=None)
        if avoid_node:
            avoided(t, lease.node, now, lost)
        t.requeues += 1
        rq = self.routes[t.route]
        self.enqueue(rq, t, now, front=True)
        return t

    def expire(self, now: float) -> list[Ticket]:
        """Fail every ticket whose queue_timeout_sec has passed (503 queue_timeout)."""
        out = []
        held = len(self._deadlines)
        if held > 256 and held > 2 * sum(len(rq.waiting) for rq in self.routes.values()):
            # Entries are deleted lazily; most tickets leave the queue long before their deadline.
            # Compact, or every ticket would be held for queue_timeout_sec after it was served.
            self._deadlines = [e for e in self._deadlines if e[2].state == WAITING and e[2].deadline == e[0]]
            heapq.heapify(self._deadlines)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, t = heapq.heappop(self._deadlines)
            if t.state != WAITING or t.deadline > now:
                continue
            rq = self.routes[t.route]
            self._fail(
                t,
                Rejected(
                    503,
                    "queue_timeout",
                    f"waited {rq.cfg.queue_timeout_sec:g}s in the queue of route {t.route}",
                    self.retry_after(rq, now),
                ),
            )
            out.append(t)
        return out

    def fail_all_waiting(self, err: Callable[[], Rejected]) -> list[Ticket]:
        out = []
        for rq in self.routes.values():
            for t in list(rq.waiting.order()):
                self._fail(t, err())
                out.append(t)
        return out

    # -- leases ----------------------------------------------------------------------------
    def grant(self, rq: RouteQueue, t: Ticket, node: str, now: float) -> Lease:
        """Lease ``node`` to ``t``: the one Python writer of the in-flight, capacity and swap counts
        (the cluster store calls it for a grant Redis made; its Lua twin is scripts.grant)."""
        ns = self.nodes[node]
        trial = ns.on_dispatch(now)
        swap = ns.models.dispatch(ns.cfg, t.model) if ns.cfg.models is not None else None
        if swap:
            self.swaps[node] += 1
            self.forget(node)  # loading another model threw the node's KV cache away (docs/CONFIG.md#affinity)
        if t.affinity is not None:
            self._affine_dispatch(rq, t, node)
        lease = Lease(t, rq.name, node, now, trial, rq.target(node, ns.cfg), cost=t.cost, swap=swap)
        self.bodies.release(t)  # leased: no longer waiting (a cluster grant too)
        rq.inflight[node] += 1
        self.node_inflight[node] += 1
        if t.cost:
            rq.capacity_used += t.cost
            self.capacity_used[node] = self.capacity_used.get(node, 0.0) + t.cost
        card = lease.target.node.card  # released under the same card (a reload may move the node)
        if card is not None:
            self.cards.inflight[card] += 1
            self.cards.used[card] = self.cards.used.get(card, 0.0) + t.cost
        t.state = LEASED
        t.lease = lease
        return lease

    def forget_route(self, route: str, node: str | None) -> None:
        """A route made for a client-named target is gone, and ``node`` with it if given (kilolined/ops/adhoc.py
        decides when: nothing queued or running on the route, nothing in flight on the node)."""
        self.routes.pop(route, None)
        self._limits = {k: v for k, v in self._limits.items() if k[0] != route}
        if node is not None:
            self.nodes.pop(node, None)
            self.swaps.pop(node, None)
            self.capacity_used.pop(node, None)

    def dispatch(self, now: float) -> list[Lease]:
        """Give free slots to waiting tickets: per route in strategy order, routes by oldest head."""
        made: list[Lease] = []
        active = [rq for rq in self.routes.values() if rq.waiting]
        while active:
            progress = False
            if len(active) > 1:
                active.sort(key=lambda r: (r.waiting.peek() or _NEVER).enqueued_at)
            for rq in active:
                picked = self._pick(rq, now)
                if picked is None:
                    continue
                t, node, head, collated = picked
                rq.waiting.take(t, head=t is head)
                if collated:
                    head.swap_bypassed += 1
                    if head.swap_bypassed_at is None:
                        head.swap_bypassed_at = now
                elif t is not head and node not in rq.cfg.overflow_nodes:
                    # (the overflow tier takes no slot the head waits for)
                    head.bypassed = min(head.bypassed + 1, rq.cfg.max_bypass)
                rq.by_key[t.key] -= 1
                if rq.by_key[t.key] <= 0:
                    del rq.by_key[t.key]
                made.append(self.grant(rq, t, node, now))
                t.wake()
                progress = True
                break
            if not progress:
                break
            active = [rq for rq in active if rq.waiting]
        return made

    def _pick(self, rq: RouteQueue, now: float) -> tuple[Ticket, str, Ticket, bool] | None:
        """The ticket that goes next and its node, with the head it was picked for, and whether
        it was collated ahead of the head.

        The head if it fits somewhere — unless it would make that node swap models and a later
        ticket is warm there (collation); else (backfill) the first later ticket in strategy order
        that fits, on a node not held for a head already passed over ``max_bypass`` times."""
        head = rq.waiting.peek()
        if head is None:
            return None
        node = self.choose_node(rq, head, now)
        if node is not None:
            if head.model is not None and self._may_collate(rq, head, node, now):
                t = self._warm_later(rq, head, node, now)
                if t is not None:
                    return t, node, head, True
            return head, node, head, False
        if rq.cfg.overflow is not None and (later := self._overflow_later(rq, head, now)) is not None:
            return later[0], later[1], head, False
        if not self.costed(rq):
            return None
        blocked: frozenset[str] = frozenset()
        if head.bypassed >= rq.cfg.max_bypass:
            blocked = frozenset(n for n in rq.all_nodes if self.could_hold(self.nodes.get(n), head.cost))
        # The scan is for cost only: when no open node has a free slot, nothing later fits either.
        if not any(n not in blocked and self.can_take(rq, n, now) for n in rq.all_nodes):
            return None
        for t in rq.waiting.order():
            if t is head:
                continue
            node = self.choose_node(rq, t, now, blocked)
            if node is not None:
                return t, node, head, False
        return None

    def _may_collate(self, rq: RouteQueue, head: Ticket, node: str, now: float) -> bool:
        """The head would make ``node`` swap models and has not been passed over enough yet."""
        ns = self.nodes[node]
        if not ns.models.would_swap(ns.cfg, head.model) or head.swap_bypassed >= rq.cfg.max_swap_bypass:
            return False
        since = head.swap_bypassed_at
        return since is None or now - since < rq.cfg.queue_timeout_sec / 4

    def _warm_later(self, rq: RouteQueue, head: Ticket, node: str, now: float) -> Ticket | None:
        """The first later ticket in strategy order whose model is warm on ``node`` and that
        ``node`` can take now."""
        models = self.nodes[node].models
        for t in rq.waiting.order():
            if t is head or not models.is_warm(t.model) or node in t.avoid:
                continue
            if t.pinned_node not in (None, node):
                continue
            if self.serves(node, t.model) and self.can_take(rq, node, now, t.cost):
                return t
        return None

    def release(self, lease: Lease, now: float, service_time: float | None) -> None:
        """Free the slot; idempotent so that every exit path may call it."""
        if lease.released:
            return
        lease.released = True
        rq = self.routes.get(lease.route)
        if rq is not None:
            rq.inflight[lease.node] -= 1
            if rq.inflight[lease.node] <= 0:
                del rq.inflight[lease.node]
            rq.capacity_used = rq.capacity_used - lease.cost if rq.inflight else 0.0  # 0 again: no float drift
            if service_time is not None and lease.node not in rq.cfg.overflow_nodes:
                rq.observe(service_time)  # the wait estimate is of the route's own nodes
        self.node_inflight[lease.node] -= 1
        if self.node_inflight[lease.node] <= 0:
            del self.node_inflight[lease.node]
            self.capacity_used.pop(lease.node, None)
        elif lease.cost:
            self.capacity_used[lease.node] -= lease.cost
        card = lease.target.node.card
        if card is not None:
            self.cards.inflight[card] -= 1
            if self.cards.inflight[card] <= 0:
                del self.cards.inflight[card]
                self.cards.used.pop(card, None)  # 0 again: no float drift
            else:
                self.cards.used[card] -= lease.cost
        ns = self.nodes.get(lease.node)
        if ns is not None and lease.trial and ns.trial_in_flight:
            # The trial ended without a verdict (e.g. cancelled): let another one run.
            ns.end_trial()
        t = lease.ticket
        if t.affinity is not None and t.affinity.held == lease.node:
            self._affine_release(t.affinity, lease.node)
        if t.lease is lease:
            t.lease = None  # Ticket ↔ Lease would be a reference cycle: only the collector could free them
        if t.state == LEASED:
            t.state = DONE

    # -- views -----------------------------------------------------------------------------
    def position(self, t: Ticket, now: float) -> int | None:
        if t.state != WAITING:
            return None
        if self.elsewhere is not None and (p := self.elsewhere.position(t)) is not None:
            return p
        return self.routes[t.route].waiting.rank(t)

    def positions(self, route: str, now: float) -> dict[int, int]:
        local = {t.seq: i for i, t in enumerate(self.routes[route].waiting.order(), 1)}
        return local if self.elsewhere is None else {**local, **self.elsewhere.positions(route)}

    def depth(self, rq: RouteQueue) -> int:
        """Waiting requests of the route: this scheduler's and (cluster mode) the cluster's."""
        return len(rq.waiting) + (self.elsewhere.depth(rq.name) if self.elsewhere is not None else 0)

    def waiting_by_key(self, rq: RouteQueue) -> dict[str, int]:
        if self.elsewhere is None:
            return dict(rq.by_key)
        return dict(rq.by_key + Counter(self.elsewhere.by_key(rq.name)))

    def update_modes(self, now: float) -> list[tuple[str, str, str]]:
        """Recompute each route's mode; returns (route, old, new) for every change."""
        changes = []
        for rq in self.routes.values():
            if rq.retired:
                continue
            if any(n in self.nodes and self.nodes[n].serving(now) for n in rq.cfg.nodes):
                mode = "primary"
            elif any(n in self.nodes and self.nodes[n].serving(now) for n in rq.cfg.standby):
                mode = "failover"
            else:
                mode = "down"
            if mode != rq.mode:
                changes.append((rq.name, rq.mode, mode))
                rq.mode = mode
        return changes


def overflow_due(waited: float, est_wait: float | None, when_wait_sec: float) -> bool:
    """The overflow tier may take a request a primary or standby will take in time: it has waited
    ``when_wait_sec``, or the wait estimate says it would (an unknown estimate says nothing)."""
    return waited >= when_wait_sec or (est_wait is not None and est_wait > when_wait_sec)


def avoided(t: Ticket, node: str, now: float, lost: bool) -> None:
    """Note that ``node`` failed ``t`` (at ``now`` if it was lost, else as merely avoided)."""
    t.avoid[node] = now if lost else -math.inf


def ramped_capacity(ns: NodeState, now: float) -> float:
    """The node's capacity now: during slow start it climbs linearly from 0, as the slots do."""
    full = ns.cfg.capacity
    assert full is not None
    ss = ns.breaker_cfg.slow_start_sec
    if ns.recovered_at is None or ss <= 0:
        return full
    return full * min(1.0, max(0.0, (now - ns.recovered_at) / ss))


class _Board:
    """The nodes as the rules read them (rules.Board), at ``now``."""

    __slots__ = ("now", "s")

    def __init__(self, s: Scheduler, now: float) -> None:
        self.s, self.now = s, now

    def serves(self, node: str, model: str | None) -> bool:
        return self.s.serves(node, model)

    def could_hold_node(self, node: str, cost: float) -> bool:
        return self.s.could_hold(self.s.nodes.get(node), cost)

    def is_barred(self, t: rules.Asking, node: str) -> bool:
        assert isinstance(t, Ticket)
        return self.s.barred(t, node, self.now)

    def is_cold(self, node: str, model: str | None) -> bool:
        return model is not None and not self.s.nodes[node].models.is_warm(model)

    def prefix_match(self, node: str, a: Affinity) -> int:
        return self.s._match(node, a)


class _Local:
    """This scheduler's live counts, as the rules' pick reads a store (rules.Counts)."""

    __slots__ = ("free", "now", "rq", "s")

    def __init__(self, s: Scheduler, rq: RouteQueue, now: float, free: frozenset[str] | None = None) -> None:
        #: ``free``: the nodes already found feasible for this ticket's cost at ``now`` (None: ask)
        self.s, self.rq, self.now, self.free = s, rq, now, free

    def count(self, name: str, fld: str) -> float:
        if name == rules.NIN:  # the load rank's, the most asked
            return self.s.node_inflight[fld]
        return self.s.count(self.rq, name, fld)

    def up(self, node: str) -> bool:
        ns = self.s.nodes.get(node)
        return ns is not None and ns.available(self.now)

    def feasible(self, node: str, cost: float) -> bool:
        if self.free is not None:
            return node in self.free
        return self.s.can_take(self.rq, node, self.now, cost)


_NEVER = Ticket(0, "", "", 0, math.inf)

