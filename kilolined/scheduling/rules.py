"""Node choice as rules (docs/ARCHITECTURE.md "Node choice"): which nodes may take a
request, and in which order the rest rank, as ordered lists of small named functions.

Both lease stores decide with these: the local ``Scheduler`` and the cluster's scripts in Redis
(kilolined/cluster/scripts.py), which only count and pick. So a rule whose answer depends on live
counts is not decided here but *described*: a ``Limit`` (a count, a cap and what one lease adds
to it) or a rank column over counts (``c + f × count``), which the store fills in with the counts
it holds atomically. Everything else is decided here, once per ticket (``plan``), and written down
as data: the tiers of candidate nodes, each with its rank columns, and the nodes worth waiting for.

Two kinds of rule, in the order they apply:

- filters, ``(board, ticket, node) -> bool``: may this node take this ticket at all
  (``TIER_FILTERS``, ``FALLBACK_FILTERS``, ``PIN_FILTERS``, ``worth_waiting``), and at pick time
  the live ones: ``up`` (health, breaker, drain: the node's view), ``not_blocked`` (held for a
  head passed over ``max_bypass`` times) and every ``Limit`` of ``LIMITS``;
- ranks, ``(ask, node) -> Col``: the columns a candidate is ordered by, lowest first, the first
  of equals in candidate order (``LEAST_LOADED``, ``PREFIX``, ``PREFIX_NEW``, ``SESSION``).

Pure: no clock of its own, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from kilolined.scheduling import affinity as aff
from kilolined.scheduling.affinity import Affinity

EPS = 1e-9  # costs are sums of floats: compare with a little slack

#: the live counts a Limit or a rank column reads (a store keeps each per field):
IN = "in"  # leases of the route, per node
NIN = "nin"  # leases on the node, every route
NCOST = "ncost"  # the costs of the node's leases
CIN = "cin"  # leases on the nodes of a card
CCOST = "ccost"  # the costs of those leases
SLOW = "slow"  # 1 while the node is soft-ejected for being slow (its view's, not a count)

#: a rank column: a number the gateway knows, ("+", c, f, count, field): c + f × that count, or
#: (">", ratio): 1 when the node's route in-flight, counting this request, passes ``ratio`` × the
#: mean over the tier's candidates (rounded up, at least 1), else 0
Col = float | tuple[str, float, float, str, str] | tuple[str, float]


class Asking(Protocol):
    """What the rules read of a ticket."""

    pinned_node: str | None
    avoid: dict[str, float]
    model: str | None
    cost: float
    affinity: Affinity | None


class Board(Protocol):
    """What the rules read of the nodes (the Scheduler answers it)."""

    def serves(self, node: str, model: str | None) -> bool: ...
    def could_hold_node(self, node: str, cost: float) -> bool: ...
    def is_barred(self, t: Asking, node: str) -> bool: ...
    def is_cold(self, node: str, model: str | None) -> bool: ...
    def prefix_match(self, node: str, a: Affinity) -> int: ...


# --- limits: count vs cap, filled in by the store -----------------------------------------------


class Limit(NamedTuple):
    """A count a lease adds to (``per_lease`` + ``per_cost`` × its cost) and the cap it must stay
    within (-1: none, counted only). ``alone``: a count at 0 still takes one that fits this (a
    capacity ramping up takes one request). ``res``: which reserved share of a lost gateway
    counts as in use here (cluster: "r" per node of a route, "n" per node or card, "c" a part
    of a capacity), times ``scale``."""

    counter: str
    field: str
    cap: float
    per_lease: int = 1
    per_cost: int = 0
    alone: float = -1
    res: str = ""
    res_name: str = ""
    scale: float = 1

    def wire(self) -> list[object]:
        return list(self)


def within(lim: Limit, used: float, cost: float) -> bool:
    """The one count-vs-cap rule (its Lua twin: scripts.within)."""
    if lim.cap < 0:
        return True
    add = lim.per_lease + lim.per_cost * cost
    if used + add <= lim.cap + EPS:
        return True
    return lim.alone >= 0 and used <= EPS and add <= lim.alone + EPS


class NodeCaps(NamedTuple):
    """What the limits of one node of one route are made of, as the store's share has them."""

    route: str
    node: str
    route_slots: int  # the route's slots there now (slow start, share)
    node_slots: int | None  # the node's max_concurrency now
    capacity_now: float | None  # its capacity now (ramped)
    capacity: float | None  # its full capacity
    share_c: float  # the part of a capacity this store may use (1: all)
    card: str | None
    card_slots: int | None
    card_capacity: float | None


def route_slots(c: NodeCaps) -> Limit:
    return Limit(IN, c.node, c.route_slots, res="r", res_name=c.route)


def node_slots(c: NodeCaps) -> Limit:
    return Limit(NIN, c.node, -1 if c.node_slots is None else c.node_slots, res="n", res_name=c.node)


def node_capacity(c: NodeCaps) -> Limit:
    if c.capacity is None or c.capacity_now is None:
        return Limit(NCOST, c.node, -1, 0, 1)
    return Limit(NCOST, c.node, c.share_c * c.capacity_now, 0, 1, c.share_c * c.capacity, "c", "", c.capacity)


def card_slots(c: NodeCaps) -> Limit | None:
    if c.card is None:
        return None
    return Limit(CIN, c.card, -1 if c.card_slots is None else c.card_slots, res="n", res_name="card:" + c.card)


def card_capacity(c: NodeCaps) -> Limit | None:
    if c.card is None:
        return None
    cap = -1 if c.card_capacity is None else c.share_c * c.card_capacity
    return Limit(CCOST, c.card, cap, 0, 1, res="c", scale=c.card_capacity or 0)


#: the capacity rules, in order; a new one is one function here (and the count it adds)
LIMITS: tuple[Callable[[NodeCaps], Limit | None], ...] = (route_slots, node_slots, node_capacity, card_slots,
                                                           card_capacity)


def limits(c: NodeCaps) -> list[Limit]:
    return [lim for rule in LIMITS if (lim := rule(c)) is not None]


# --- filters: may this node take this ticket -----------------------------------------------------


def not_avoided(b: Board, t: Asking, n: str) -> bool:
    return n not in t.avoid


def avoided(b: Board, t: Asking, n: str) -> bool:
    """Only once every other node is gone: retrying where it failed beats failing outright."""
    return n in t.avoid


def serves_model(b: Board, t: Asking, n: str) -> bool:
    return b.serves(n, t.model)


def not_barred(b: Board, t: Asking, n: str) -> bool:
    """A node that lost the ticket gets it back only once seen alive (Scheduler.barred)."""
    return not b.is_barred(t, n)


def worth_waiting(b: Board, t: Asking, n: str) -> bool:
    """A node of a tier that could take the ticket later: while one is up (a live filter, at
    pick), the tier waits for it rather than spill onto the next (a full primary means wait, not
    standby)."""
    return n not in t.avoid and b.could_hold_node(n, t.cost) and b.serves(n, t.model)


Filter = Callable[[Board, Asking, str], bool]
TIER_FILTERS: tuple[Filter, ...] = (not_avoided, serves_model)
FALLBACK_FILTERS: tuple[Filter, ...] = (avoided, serves_model, not_barred)
PIN_FILTERS: tuple[Filter, ...] = (serves_model, not_barred)


def passing(filters: Sequence[Filter], b: Board, t: Asking, nodes: Iterable[str]) -> list[str]:
    out = []
    for n in nodes:
        for f in filters:
            if not f(b, t, n):
                break
        else:
            out.append(n)
    return out


# --- ranks: in which order the candidates go ---------------------------------------------------


@dataclass(slots=True)
class Ask:
    """One ticket's facts the ranks read, gathered once per plan."""

    board: Board
    t: Asking
    order: dict[str, int] = field(default_factory=dict)  # rendezvous place of the first key
    match: dict[str, int] = field(default_factory=dict)  # prefix keys each node holds


def slowed_last(q: Ask, n: str) -> Col:
    return ("+", 0, 1, SLOW, n)


def cold_last(q: Ask, n: str) -> Col:
    return 1 if q.board.is_cold(n, q.t.model) else 0


def least_loaded(q: Ask, n: str) -> Col:
    return ("+", 0, 1, NIN, n)


def uncached_by_load(q: Ask, n: str) -> Col:
    """Bytes still to prefill there × (its in-flight + 1): a longer match is worth a busier node, up to a point."""
    a = q.t.affinity
    assert a is not None
    u = a.uncached(q.match.get(n, 0))
    return ("+", u, u, NIN, n)


def longer_match(q: Ask, n: str) -> Col:
    return -q.match.get(n, 0)


def rendezvous_order(q: Ask, n: str) -> Col:
    """Gateways and restarts agree where a new prefix or session goes."""
    return q.order.get(n, len(q.order))


def within_bound(q: Ask, n: str) -> Col:
    """Consistent hashing with bounded load (affinity.bounded)."""
    return (">", aff.SESSION_LOAD_BOUND)


Rank = Callable[[Ask, str], Col]
LEAST_LOADED: tuple[Rank, ...] = (slowed_last, cold_last, least_loaded)
PREFIX: tuple[Rank, ...] = (slowed_last, cold_last, uncached_by_load, longer_match)
#: a prefix that no free candidate holds: least loaded, ties by rendezvous
PREFIX_NEW: tuple[Rank, ...] = (slowed_last, cold_last, least_loaded, rendezvous_order)
SESSION: tuple[Rank, ...] = (within_bound, slowed_last, cold_last, rendezvous_order)


# --- the plan: a ticket's tiers of candidates, as data -------------------------------------------


class Cand(NamedTuple):
    node: str
    cols: tuple[Col, ...]
    alt: tuple[Col, ...] | None = None  # the columns when no free candidate of its tier is ``held``
    held: bool = False


class Tier(NamedTuple):
    cands: tuple[Cand, ...]
    wait: tuple[str, ...] = ()  # while one of these is up, a later tier is not tried
    mode: str | None = None  # the affinity it ranks by (the outcome is counted for it)


class Plan(NamedTuple):
    tiers: tuple[Tier, ...]
    hold: tuple[str, ...]  # the nodes that could ever hold it (blocked while it is passed over): with_hold

    def wire(self) -> dict[str, object]:
        return {"t": [{"n": [[c.node, list(c.cols), list(c.alt or ()), int(c.held)]
                             for c in tier.cands], "w": list(tier.wait)} for tier in self.tiers],
                "h": list(self.hold)}


def cands(q: Ask, nodes: Sequence[str], ranks: Sequence[Rank], alt: Sequence[Rank] | None = None) -> tuple[Cand, ...]:
    return tuple([Cand(n, tuple([r(q, n) for r in ranks]), None if alt is None else tuple([r(q, n) for r in alt]),
                       q.match.get(n, 0) > 0) for n in nodes])


def tier(b: Board, t: Asking, q: Ask, group: Sequence[str], a: Affinity | None) -> Tier:
    names = passing(TIER_FILTERS, b, t, group)
    wait = tuple(n for n in group if worth_waiting(b, t, n))
    if a is None:
        return Tier(cands(q, names, LEAST_LOADED), wait)
    if a.mode == aff.SESSION:
        return Tier(cands(q, names, SESSION), wait, a.mode)
    return Tier(cands(q, names, PREFIX, PREFIX_NEW), wait, a.mode)


def ask(b: Board, t: Asking, every: Sequence[str], a: Affinity | None) -> Ask:
    """What the ranks read of the ticket: with affinity, the rendezvous order of its first key
    and, for a prefix, each node's match."""
    q = Ask(b, t)
    if a is not None:
        q.order = {n: i for i, n in enumerate(aff.rendezvous(a.keys[0], every))}
        if a.mode == aff.PREFIX:
            q.match = {n: b.prefix_match(n, a) for n in every}
    return q


def holding(b: Board, t: Asking, nodes: Sequence[str]) -> tuple[str, ...]:
    """The nodes that could ever hold the ticket (its cost within their capacity and card's)."""
    return tuple([n for n in nodes if b.could_hold_node(n, t.cost)])


def plan(b: Board, t: Asking, groups: Sequence[Sequence[str]], affinity_mode: str | None,
         with_hold: bool = False) -> Plan:
    """The ticket's tiers: its pinned node alone; else each group (primaries, standbys) ranked by
    load or affinity, then the nodes that failed it, least loaded first. ``with_hold``: with the
    nodes that could ever hold it (the cluster's backfill blocks them for a passed-over head)."""
    every = [n for g in groups for n in g]
    hold = holding(b, t, every) if with_hold else ()
    if t.pinned_node is not None:
        return Plan((Tier(tuple([Cand(n, (0,)) for n in passing(PIN_FILTERS, b, t, [t.pinned_node])])),), hold)
    a = t.affinity if t.affinity is not None and t.affinity.mode == affinity_mode else None
    q = ask(b, t, every, a)
    tiers = [tier(b, t, q, g, a) for g in groups]
    last = cands(Ask(b, t), passing(FALLBACK_FILTERS, b, t, every), LEAST_LOADED)
    return Plan((*tiers, Tier(last)), hold)


# --- the pick: filled in with a store's counts (its Lua twin: scripts.pick) ----------------------


class Counts(Protocol):
    """A store's live counts and node views."""

    def count(self, name: str, field: str) -> float: ...
    def up(self, node: str) -> bool: ...
    def feasible(self, node: str, cost: float) -> bool: ...  # up, and every limit within its cap


def value(col: Col, s: Counts, n: str, names: Sequence[str]) -> float:
    if not isinstance(col, tuple):
        return col
    if len(col) == 5:  # ("+", c, f, count, field)
        return col[1] + col[2] * s.count(col[3], col[4])
    ratio = col[1]
    total = sum(s.count(IN, m) for m in names)
    bound = max(1, math.ceil(ratio * (total + 1) / max(1, len(names)) - EPS))
    return 1 if s.count(IN, n) + 1 > bound else 0


class Picked(NamedTuple):
    node: str | None
    tier: int  # the tier it came from (or that stopped the search: -1 none)


def feasible(tr: Tier, s: Counts, cost: float, blocked: frozenset[str]) -> list[Cand]:
    """The live filters: not held for a passed-over head, up, every limit within its cap."""
    return [c for c in tr.cands if c.node not in blocked and s.feasible(c.node, cost)]


def best(tr: Tier, s: Counts, cost: float, blocked: frozenset[str]) -> str | None:
    """The tier's feasible candidate with the lowest columns, the first of equals; the ``alt``
    columns when no feasible one is ``held``."""
    free = feasible(tr, s, cost, blocked)
    if len(free) < 2:  # the lowest of one is that one: no columns to fill in (the common case)
        return free[0].node if free else None
    names = [c.node for c in tr.cands if c.node not in blocked]
    held = any(c.held for c in free)
    top: tuple[float, ...] | None = None
    node = None
    for c in free:
        cols = c.cols if c.alt is None or held else c.alt
        key = tuple(value(x, s, c.node, names) for x in cols)
        if top is None or key < top:
            top, node = key, c.node
    return node


def pick(p: Plan, s: Counts, cost: float, blocked: frozenset[str] = frozenset()) -> Picked:
    """The first tier with a feasible candidate gives its best; a tier with a node worth waiting
    for that is up ends the search."""
    for i, tr in enumerate(p.tiers):
        node = best(tr, s, cost, blocked)
        if node is not None:
            return Picked(node, i)
        if any(s.up(n) for n in tr.wait):
            return Picked(None, i)
    return Picked(None, -1)
