"""The fleet's policy as pure logic: given the pools, the instances known and the time, what to
rent, destroy and add. No I/O, no clock of its own (``now`` is passed in).

The rules (docs/FLEET.md):
- a serving node whose health is down is *reclaimed* only once the provider also says it is not
  running (a node that only lost the network is left alone); a reclaimed node is destroyed;
- a pool short of its size rents one instance at a time, so a loss is answered by exactly one
  replacement, and never while a backoff runs;
- a rent may cost at most what is left under ``max_spend_per_hour`` (the sum of the live
  instances' prices), and never more than the pool's ``max_dph``;
- a booting instance that is not healthy within ``boot_timeout_sec`` is destroyed and counts as
  a failed rent; failures back off from ``backoff_base_sec`` doubling to an hour;
- instances of a pool that is no longer configured, and a pool's instances past its size, are
  destroyed (only those the gateway rented: they carry its label).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kilolined.core.config import FleetOfferConfig
from kilolined.fleet.provider import Offer

MAX_BACKOFF_SEC = 3600.0
LOST_MACHINES_KEPT = 8  # machines a pool avoids after losing an instance on them
Phase = Literal["booting", "serving"]
DestroyReason = Literal["reclaimed", "boot_timeout", "pool_removed", "surplus"]


@dataclass(frozen=True, slots=True)
class PoolSpec:
    size: int
    boot_timeout_sec: float
    max_dph: float


@dataclass(slots=True)
class Tracked:
    """An instance the gateway rented (or found again with its label)."""

    id: str
    pool: str
    price: float
    machine: str | None
    created_at: float
    phase: Phase = "booting"
    provider: str = ""  # the fleet.providers entry it was rented through
    instance_id: str = ""  # the provider's own id (``id`` is unique across providers)
    url: str | None = None
    healthy: bool = False  # booting: its health probe passed; serving: the node's health state
    #: the provider's last answer while it mattered: True running, False not; None not asked yet
    provider_running: bool | None = None


@dataclass(slots=True)
class PoolRuntime:
    """What the loop keeps per pool between decisions."""

    failures: int = 0
    retry_at: float = 0.0
    renting: bool = False  # a rent is in flight
    lost_machines: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Rent:
    pool: str
    max_price: float
    exclude: frozenset[str]


@dataclass(frozen=True, slots=True)
class RentRefused:
    pool: str
    reason: str


@dataclass(frozen=True, slots=True)
class Destroy:
    id: str
    pool: str
    reason: DestroyReason


@dataclass(frozen=True, slots=True)
class Ready:
    id: str


@dataclass(frozen=True, slots=True)
class AskStatus:
    id: str


Action = Rent | RentRefused | Destroy | Ready | AskStatus


def backoff_delay(base: float, failures: int) -> float:
    """60 s, 120 s, 240 s … up to an hour (with base 60) after ``failures`` failures in a row."""
    if failures <= 0:
        return 0.0
    return min(base * 2.0 ** min(failures - 1, 30), MAX_BACKOFF_SEC)


def spend(instances: dict[str, Tracked]) -> float:
    """$/hour of every instance the gateway holds (booting ones are paid for too)."""
    return sum(t.price for t in instances.values())


def decide(pools: dict[str, PoolSpec], state: dict[str, PoolRuntime], instances: dict[str, Tracked],
           cap: float, now: float, held: float = 0.0) -> list[Action]:
    """Every action due now. Destroys come first; a rent is decided after them, on what is left.
    ``held``: $/hour of instances being destroyed, paid until the provider confirms."""
    actions: list[Action] = []
    gone: set[str] = set()
    lost_now: dict[str, set[str]] = {}  # machines reclaimed this round, per pool
    for t in instances.values():
        act = _instance_action(t, pools.get(t.pool), now)
        if act is not None:
            actions.append(act)
            if isinstance(act, Destroy):
                gone.add(t.id)
                if act.reason == "reclaimed" and t.machine is not None:
                    lost_now.setdefault(t.pool, set()).add(t.machine)
    live = {i: t for i, t in instances.items() if i not in gone}
    for name, spec in pools.items():
        mine = [t for t in live.values() if t.pool == name]
        if len(mine) > spec.size:
            for t in _surplus(mine, len(mine) - spec.size):
                actions.append(Destroy(t.id, name, "surplus"))
                del live[t.id]
    if any(ps.renting for ps in state.values()):
        return actions  # one rent in flight in all: its price is not in the spend yet
    for name, spec in pools.items():
        ps = state.get(name) or PoolRuntime()
        have = sum(1 for t in live.values() if t.pool == name)
        if have >= spec.size or now < ps.retry_at:
            continue
        paid = spend(live) + held
        room = cap - paid
        if not room > 0:  # NaN-safe: a spend that cannot be added up refuses, never rents
            actions.append(RentRefused(name, f"max_spend_per_hour {cap:g} reached ({paid:g} $/h live)"))
            continue
        exclude = frozenset(ps.lost_machines) | lost_now.get(name, set())
        actions.append(Rent(name, min(spec.max_dph, room), exclude))
        break  # the next pool decides on the spend this rent adds
    return actions


def _instance_action(t: Tracked, spec: PoolSpec | None, now: float) -> Action | None:
    if spec is None:
        return Destroy(t.id, t.pool, "pool_removed")
    if t.phase == "booting":
        if t.provider_running is False:
            return Destroy(t.id, t.pool, "reclaimed")
        if t.healthy:
            return Ready(t.id)
        if now - t.created_at >= spec.boot_timeout_sec:
            return Destroy(t.id, t.pool, "boot_timeout")
        return None
    if t.healthy:
        return None
    if t.provider_running is False:
        return Destroy(t.id, t.pool, "reclaimed")
    if t.provider_running is None:
        return AskStatus(t.id)
    return None  # down but running: the network, not a reclaim; asked again once it is back up


def _surplus(mine: list[Tracked], n: int) -> list[Tracked]:
    """Which ``n`` to let go: booting before serving, the newest first (the least invested)."""
    return sorted(mine, key=lambda t: (t.phase == "serving", -t.created_at))[:n]


def choose_offer(offers: list[Offer], want: FleetOfferConfig, exclude: frozenset[str],
                 max_price: float) -> Offer | None:
    """The best offer that fits: the GPU and count asked, reliable enough, within the price, not on
    a machine just lost; the cheapest, then the most reliable."""
    fits = [o for o in offers
            if o.gpu_name.lower() == want.gpu_name.lower() and o.num_gpus == want.num_gpus
            and o.reliability >= want.min_reliability and o.price <= max_price
            and (o.machine is None or o.machine not in exclude)]
    return min(fits, key=lambda o: (o.price, -o.reliability, o.id), default=None)


def remember_lost(ps: PoolRuntime, machine: str | None) -> None:
    if machine is not None:
        kept = [m for m in ps.lost_machines if m != machine][-(LOST_MACHINES_KEPT - 1):]
        ps.lost_machines = [*kept, machine]


def rent_failed(ps: PoolRuntime, base: float, now: float, retry_after: float | None = None) -> float:
    """Count a failure and set when the pool may rent again; returns the delay."""
    ps.failures += 1
    # A provider's Retry-After is waited out up to the backoff's own ceiling: 1e12 s would stop
    # the pool for good.
    delay = max(backoff_delay(base, ps.failures), min(retry_after or 0.0, MAX_BACKOFF_SEC))
    ps.retry_at = now + delay
    return delay


def rent_ok(ps: PoolRuntime) -> None:
    ps.failures = 0
    ps.retry_at = 0.0
