"""The fleet's policy as pure logic: given the pools, the instances known, the queue and the
time, what to rent, resume, stop, destroy and add. No I/O, no clock of its own (``now`` is passed in).

The rules (docs/FLEET.md):
- a serving node whose health is down is *reclaimed* only once the provider also says it is not
  running (a node that only lost the network is left alone); a reclaimed node is destroyed;
- a pool below its ``min`` rents (or resumes) one instance at a time; above it, one more is
  added only when the queue asks (a request of its routes has waited ``scale_up_wait_sec``
  with no slot, or the estimate says it will) and nothing of the pool is already booting — never
  past ``max``, never while a backoff runs;
- a stopped instance of the pool is resumed before anything new is rented (its disk holds the
  model); the ``offers`` are tried in order, an entry that failed backing off on its own so that
  the next one is tried at once;
- a rent or resume may cost at most what is left under ``max_spend_per_hour`` (the sum of the
  billed instances' prices; a stopped one is not billed), and never more than the entry's
  ``max_dph``;
- a serving instance with nothing queued or running for ``idle_stop_sec`` is stopped while the
  pool keeps ``min`` serving; a stopped one is destroyed after ``stopped_destroy_sec``;
- a booting instance that is not healthy within ``boot_timeout_sec`` is destroyed and counts as
  a failed rent; failures back off from ``backoff_base_sec`` doubling to an hour;
- instances of a pool that is no longer configured, and a pool's instances past its ``max``,
  are destroyed (only those the gateway rented: they carry its label).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kilolined.core.config import FleetOfferConfig
from kilolined.fleet.provider import Offer

MAX_BACKOFF_SEC = 3600.0
LOST_MACHINES_KEPT = 8  # machines a pool avoids after losing an instance on them
#: booting: rented or resumed, not yet healthy; stopping: the stop is asked, not yet confirmed
Phase = Literal["booting", "serving", "stopping", "stopped"]
DestroyReason = Literal["reclaimed", "boot_timeout", "pool_removed", "surplus", "stopped_expired", "stop_failed"]
BILLED: tuple[Phase, ...] = ("booting", "serving", "stopping")  # a stopped instance pays no GPU


@dataclass(frozen=True, slots=True)
class PoolSpec:
    min: int
    max: int
    boot_timeout_sec: float
    max_dph: tuple[float, ...]  # one per ``offers`` entry, in order of preference
    scale_up_wait_sec: float = 20.0
    idle_stop_sec: float = 600.0  # 0: never stopped for idleness
    stopped_destroy_sec: float = 86400.0  # 0: a stopped instance is kept

    @classmethod
    def fixed(cls, size: int, boot_timeout_sec: float, max_dph: float) -> PoolSpec:
        """A pool of ``size: N`` (min = max = N) with one offer."""
        return cls(size, size, boot_timeout_sec, (max_dph,))


@dataclass(frozen=True, slots=True)
class Demand:
    """What the queue of a pool's routes asks for, as the loop measured it now."""

    waiting: int = 0  # requests waiting on the pool's routes
    oldest_wait_sec: float = 0.0  # how long the oldest of them has waited
    #: the queue's estimate for a request arriving now; None: no slot at all on the routes
    est_wait_sec: float | None = None


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
    offer: int = 0  # the ``offers`` entry it was rented from
    since: float | None = None  # when its current phase began (created_at until it changes)
    idle_since: float | None = None  # serving: since when nothing ran on it or waited for its routes
    resuming: bool = False  # booting again from stopped (the provider may still say stopped a while)
    retry_at: float = 0.0  # stopped: a failed resume is not tried again before this
    rented_here: bool = False  # rented or resumed by this gateway (its boot time is a measure)

    def phase_start(self) -> float:
        return self.created_at if self.since is None else self.since


@dataclass(slots=True)
class PoolRuntime:
    """What the loop keeps per pool between decisions."""

    failures: int = 0
    retry_at: float = 0.0
    renting: bool = False  # a rent or a resume is in flight
    lost_machines: list[str] = field(default_factory=list)
    #: per ``offers`` entry: failures in a row and when it may be tried again
    offer_failures: dict[int, int] = field(default_factory=dict)
    offer_retry_at: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Rent:
    pool: str
    max_price: float
    exclude: frozenset[str]
    offer: int = 0  # the ``offers`` entry to rent from


@dataclass(frozen=True, slots=True)
class Resume:
    id: str
    pool: str


@dataclass(frozen=True, slots=True)
class Stop:
    id: str
    pool: str


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


Action = Rent | Resume | Stop | RentRefused | Destroy | Ready | AskStatus


def backoff_delay(base: float, failures: int) -> float:
    """60 s, 120 s, 240 s … up to an hour (with base 60) after ``failures`` failures in a row."""
    if failures <= 0:
        return 0.0
    return min(base * 2.0 ** min(failures - 1, 30), MAX_BACKOFF_SEC)


def spend(instances: dict[str, Tracked]) -> float:
    """$/hour of every instance the gateway pays a GPU for (booting ones too; not stopped ones)."""
    return sum(t.price for t in instances.values() if t.phase in BILLED)


def active(ts: list[Tracked]) -> list[Tracked]:
    """The instances that serve or will: booting and serving (not stopping or stopped)."""
    return [t for t in ts if t.phase in ("booting", "serving")]


def wants_more(spec: PoolSpec, d: Demand) -> bool:
    """The queue asks for another instance: a request waited ``scale_up_wait_sec``, or one
    arriving now would (no slot at all counts as forever)."""
    if d.waiting <= 0:
        return False
    if d.oldest_wait_sec >= spec.scale_up_wait_sec:
        return True
    return d.est_wait_sec is None or d.est_wait_sec > spec.scale_up_wait_sec


def decide(pools: dict[str, PoolSpec], state: dict[str, PoolRuntime], instances: dict[str, Tracked],
           cap: float, now: float, held: float = 0.0, demand: dict[str, Demand] | None = None) -> list[Action]:
    """Every action due now. Destroys and stops come first; a rent or resume is decided after
    them, on what is left. ``held``: $/hour of instances being destroyed, paid until the
    provider confirms. ``demand``: per pool, what its routes' queue asks (none: nothing waits)."""
    demand = demand or {}
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
        for t in _surplus(mine, spec.max):
            actions.append(Destroy(t.id, name, "surplus"))
            del live[t.id]
        mine = [t for t in mine if t.id in live]
        for t in _idle(mine, spec, demand.get(name, Demand()), now):
            actions.append(Stop(t.id, name))
    if any(ps.renting for ps in state.values()):
        return actions  # one rent in flight in all: its price is not in the spend yet
    for name, spec in pools.items():
        ps = state.get(name) or PoolRuntime()
        mine = [t for t in live.values() if t.pool == name]
        if now < ps.retry_at or not _short(spec, mine, demand.get(name, Demand())):
            continue
        paid = spend(live) + held
        refused = RentRefused(name, f"max_spend_per_hour {cap:g} reached ({paid:g} $/h live)")
        act = _grow(name, spec, ps, mine, cap - paid, now, lost_now.get(name, set()), refused)
        if act is None:
            continue
        actions.append(act)
        if not isinstance(act, RentRefused):
            break  # the next pool decides on the spend this one adds
    return actions


def _short(spec: PoolSpec, mine: list[Tracked], d: Demand) -> bool:
    """The pool needs one more instance: below ``min``, or the queue asks and there is room
    under ``max`` and nothing of the pool still boots (its capacity is on its way)."""
    act = active(mine)
    if len(act) < spec.min:
        return True
    if len(act) >= spec.max or any(t.phase == "booting" for t in act):
        return False
    return wants_more(spec, d)


def _grow(name: str, spec: PoolSpec, ps: PoolRuntime, mine: list[Tracked], room: float, now: float,
          lost_now: set[str], refused: RentRefused) -> Rent | Resume | RentRefused | None:
    """Resume a stopped instance (the cheapest, then the last stopped) before renting; rent from
    the first ``offers`` entry not backing off. None: every entry backs off."""
    stopped = [t for t in mine if t.phase == "stopped" and now >= t.retry_at]
    if stopped:
        t = min(stopped, key=lambda t: (t.price, -t.phase_start()))
        # NaN-safe comparisons: a spend that cannot be added up refuses, never rents or resumes
        return Resume(t.id, name) if t.price <= room else refused
    if not room > 0:
        return refused
    entry = next((i for i in range(len(spec.max_dph)) if now >= ps.offer_retry_at.get(i, 0.0)), None)
    if entry is None:
        return None
    exclude = frozenset(ps.lost_machines) | lost_now
    return Rent(name, min(spec.max_dph[entry], room), exclude, entry)


def _instance_action(t: Tracked, spec: PoolSpec | None, now: float) -> Action | None:
    if spec is None:
        return Destroy(t.id, t.pool, "pool_removed")
    if t.phase == "stopping":
        return None  # the stop is in flight
    if t.phase == "stopped":
        if spec.stopped_destroy_sec > 0 and now - t.phase_start() >= spec.stopped_destroy_sec:
            return Destroy(t.id, t.pool, "stopped_expired")
        return None
    if t.phase == "booting":
        if t.provider_running is False:
            return Destroy(t.id, t.pool, "reclaimed")
        if t.healthy:
            return Ready(t.id)
        if now - t.phase_start() >= spec.boot_timeout_sec:
            return Destroy(t.id, t.pool, "boot_timeout")
        return None
    if t.healthy:
        return None
    if t.provider_running is False:
        return Destroy(t.id, t.pool, "reclaimed")
    if t.provider_running is None:
        return AskStatus(t.id)
    return None  # down but running: the network, not a reclaim; asked again once it is back up


def _surplus(mine: list[Tracked], limit: int) -> list[Tracked]:
    """What a pool holds past ``max``: stopped ones first (they serve nothing), then booting
    before serving, the newest first (the least invested). Stopping ones are let finish."""
    order = {"stopped": 0, "booting": 1, "serving": 2}
    kept = [t for t in mine if t.phase in order]
    n = len(kept) + sum(t.phase == "stopping" for t in mine) - limit
    if n <= 0:
        return []
    return sorted(kept, key=lambda t: (order[t.phase], -t.created_at))[:n]


def _idle(mine: list[Tracked], spec: PoolSpec, d: Demand, now: float) -> list[Tracked]:
    """Serving instances idle for ``idle_stop_sec`` that may stop: the longest idle first, while
    ``min`` stay serving; none while anything waits for the pool's routes."""
    if spec.idle_stop_sec <= 0 or d.waiting > 0:
        return []
    serving = [t for t in mine if t.phase == "serving"]
    idle = sorted((t for t in serving if t.healthy and t.idle_since is not None
                   and now - t.idle_since >= spec.idle_stop_sec), key=lambda t: t.idle_since or 0.0)
    return idle[:max(0, len(serving) - spec.min)]


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
    """Count a failure of the pool (the budget, a listing, a rate limit) and set when it may rent
    again; returns the delay."""
    ps.failures += 1
    # A provider's Retry-After is waited out up to the backoff's own ceiling: 1e12 s would stop
    # the pool for good.
    delay = max(backoff_delay(base, ps.failures), min(retry_after or 0.0, MAX_BACKOFF_SEC))
    ps.retry_at = now + delay
    return delay


def offer_failed(ps: PoolRuntime, entry: int, base: float, now: float) -> float:
    """Count a failure of one ``offers`` entry (no capacity, refused, never healthy): it backs off
    on its own, and the next entry may be tried at once; returns its delay."""
    n = ps.offer_failures[entry] = ps.offer_failures.get(entry, 0) + 1
    delay = backoff_delay(base, n)
    ps.offer_retry_at[entry] = now + delay
    ps.failures = max(ps.failures, n)
    return delay


def rent_ok(ps: PoolRuntime) -> None:
    ps.failures = 0
    ps.retry_at = 0.0
    ps.offer_failures.clear()
    ps.offer_retry_at.clear()


def retry_in(ps: PoolRuntime, entries: int, now: float) -> float | None:
    """Seconds until the pool may rent again (None: it may now): its own backoff, or the soonest
    of its entries' when every one backs off."""
    waits = [ps.retry_at - now]
    offers = [ps.offer_retry_at.get(i, 0.0) - now for i in range(entries)]
    if offers and min(offers) > 0:
        waits.append(min(offers))
    wait = max(waits)
    return wait if wait > 0 else None
