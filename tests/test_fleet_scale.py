"""The fleet following the queue (kilolined/fleet/decide.py, docs/FLEET.md "Scaling"): pools
between ``min`` and ``max`` under drawn histories with the clock in hand.

A model of the provider and the loop applies each decision: requests arrive and are served,
rents and resumes land or fail, instances boot, idle ones are stopped, and the gateway restarts
at any point — a new loop rebuilt from nothing but the provider's list of instances. After every
step: never over ``max`` nor the spend cap, a stopped instance is resumed before anything is
rented, one rent or resume in flight, never below ``min`` serving by a stop, and a restart
mid-scale rents nothing twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kilolined.fleet.decide import (
    AskStatus,
    Demand,
    Destroy,
    PoolRuntime,
    PoolSpec,
    Ready,
    Rent,
    RentRefused,
    Resume,
    Stop,
    Tracked,
    decide,
    offer_failed,
    rent_failed,
    rent_ok,
    retry_in,
    spend,
    wants_more,
)

BASE = 30.0
SPEC = PoolSpec(0, 3, 300.0, (0.5, 0.8), scale_up_wait_sec=20.0, idle_stop_sec=600.0, stopped_destroy_sec=3600.0)


@dataclass
class Machine:
    """An instance as the provider holds it."""

    pool: str
    price: float
    status: str  # booting | running | stopped


class World:
    """The provider, the queue and the loop, as the decisions see them."""

    def __init__(self, specs: dict[str, PoolSpec], cap: float):
        self.specs = specs
        self.cap = cap
        self.now = 0.0
        self.provider: dict[str, Machine] = {}
        self.waiting: dict[str, list[float]] = {p: [] for p in specs}  # enqueue times
        self.seq = 0
        self.restart()

    def restart(self) -> None:
        """A new loop: no memory but what the provider lists (labels name the pool)."""
        self.state = {n: PoolRuntime() for n in self.specs}
        self.pending: Rent | Resume | None = None
        self.tracked: dict[str, Tracked] = {}
        for key, m in self.provider.items():
            self.tracked[key] = Tracked(key, m.pool, m.price, None, self.now,
                                        phase="stopped" if m.status == "stopped" else "booting")

    def demand(self) -> dict[str, Demand]:
        out = {}
        for p, q in self.waiting.items():
            serving = any(t.pool == p and t.phase == "serving" for t in self.tracked.values())
            out[p] = Demand(len(q), self.now - min(q) if q else 0.0, 0.0 if serving else None)
        return out

    def step(self) -> list[object]:
        before = {p: [t.id for t in self.tracked.values() if t.pool == p and t.phase == "stopped"
                      and self.now >= t.retry_at] for p in self.specs}
        acts = decide(self.specs, self.state, self.tracked, self.cap, self.now, 0.0, self.demand())
        ids = [a.id for a in acts if isinstance(a, Destroy | Stop | Resume)]
        assert len(ids) == len(set(ids)), f"two actions for one instance: {acts}"
        for p in self.specs:
            assert sum(isinstance(a, Rent | Resume) and a.pool == p for a in acts) <= 1
            if any(isinstance(a, Rent) and a.pool == p for a in acts):
                assert not before[p], "rented while a stopped instance could be resumed"
        self.apply(acts)
        return acts

    def apply(self, acts: list[object]) -> None:
        for a in acts:
            if isinstance(a, Destroy):
                self.tracked.pop(a.id)
                self.provider.pop(a.id, None)
                if a.reason == "boot_timeout":
                    rent_failed(self.state[a.pool], BASE, self.now)
            elif isinstance(a, Stop):
                t = self.tracked[a.id]
                serving = sum(x.pool == t.pool and x.phase == "serving" for x in self.tracked.values())
                assert serving - 1 >= self.specs[t.pool].min, "stopped below min serving"
                assert not self.waiting[t.pool], "stopped while requests wait"
                t.phase, t.since = "stopped", self.now
                self.provider[a.id].status = "stopped"
            elif isinstance(a, Ready):
                t = self.tracked[a.id]
                t.phase, t.since, t.idle_since = "serving", self.now, self.now
                rent_ok(self.state[t.pool])
            elif isinstance(a, AskStatus):
                self.tracked[a.id].provider_running = a.id in self.provider
            elif isinstance(a, RentRefused):
                rent_failed(self.state[a.pool], BASE, self.now)
            elif isinstance(a, Rent | Resume):
                assert self.pending is None, "a second rent or resume while one is in flight"
                assert not any(ps.renting for ps in self.state.values())
                self.pending = a
                self.state[a.pool].renting = True

    def land(self, ok: bool, price: float) -> None:
        """The call in flight answers: created (or resumed), or failed."""
        a, self.pending = self.pending, None
        if a is None:
            return
        ps = self.state[a.pool]
        ps.renting = False
        if isinstance(a, Resume):
            t = self.tracked.get(a.id)
            if t is None:
                return
            if ok:
                t.phase, t.since, t.resuming, t.healthy = "booting", self.now, True, False
                self.provider[a.id].status = "booting"
            else:
                t.retry_at = self.now + BASE
            return
        if not ok or price > a.max_price:
            offer_failed(ps, a.offer, BASE, self.now)
            return
        self.create(a.pool, price, a.offer)

    def create(self, pool: str, price: float, offer: int = 0) -> str:
        self.seq += 1
        key = f"i{self.seq}"
        self.provider[key] = Machine(pool, price, "booting")
        self.tracked[key] = Tracked(key, pool, price, None, self.now, offer=offer)
        return key

    def check(self) -> None:
        billed = sum(m.price for m in self.provider.values() if m.status != "stopped")
        assert billed <= self.cap + 1e-9, "over max_spend_per_hour"
        assert abs(billed - spend(self.tracked)) < 1e-9  # the loop's view of the bill is the provider's
        for p, spec in self.specs.items():
            mine = [m for m in self.provider.values() if m.pool == p]
            assert sum(m.status != "stopped" for m in mine) <= spec.max, "over max"
            assert len(mine) <= spec.max, "more instances than max (a rent twice)"


step = st.one_of(
    st.tuples(st.just("tick"), st.sampled_from([0.5, 20.0, 600.0, 3600.0]) | st.floats(0, 900)),
    st.tuples(st.just("arrive"), st.integers(1, 4)),
    st.tuples(st.just("serve"), st.integers(1, 4)),
    st.tuples(st.just("land"), st.floats(0.1, 1.0)),
    st.tuples(st.just("fail"), st.just(0)),
    st.tuples(st.just("boot"), st.integers(0, 5)),
    st.tuples(st.just("boot_all"), st.just(0)),
    st.tuples(st.just("cycle"), st.integers(1, 6)),
    st.tuples(st.just("reload"), st.integers(0, 3)),
    st.tuples(st.just("restart"), st.booleans()),
)


@settings(max_examples=300, deadline=None)
@given(bounds=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), min_size=1, max_size=2),
       cap=st.floats(0.3, 3.0), steps=st.lists(step, max_size=80))
def test_scaling_never_passes_max_or_the_cap_resumes_first_and_a_restart_rents_nothing_twice(
        bounds: list[tuple[int, int]], cap: float, steps: list[tuple[str, float]]) -> None:
    specs = {f"p{i}": PoolSpec(lo, max(lo, hi), 300.0, (0.5, 0.8), 20.0, 600.0, 3600.0)
             for i, (lo, hi) in enumerate(bounds)}
    w = World(specs, cap)
    for kind, arg in steps:
        pool = f"p{int(arg) % len(specs)}" if kind in ("arrive", "serve", "cycle") else "p0"
        if kind == "tick":
            w.now += arg
        elif kind == "arrive":
            w.waiting[pool] += [w.now] * int(arg)
        elif kind == "serve" and any(t.pool == pool and t.phase == "serving" for t in w.tracked.values()):
            del w.waiting[pool][:int(arg)]
            for t in w.tracked.values():
                if t.pool == pool and t.phase == "serving":
                    t.idle_since = w.now
        elif kind == "land":
            w.land(True, arg)
        elif kind == "fail":
            w.land(False, 0.0)
        elif kind == "boot":
            booting = [t for t in w.tracked.values() if t.phase == "booting"]
            if booting:
                t = booting[int(arg) % len(booting)]
                t.healthy = True
                w.provider[t.id].status = "running"
        elif kind == "cycle":  # a burst served to the end, then a quiet spell: what a day is made of
            w.waiting[pool] += [w.now] * int(arg)
            for _ in range(int(arg) + 2):
                w.land(True, 0.4)
                boot_all(w)
                w.now += 5
                w.step()
                w.check()
            w.waiting = {p: [] for p in specs}
            for t in w.tracked.values():
                t.idle_since = w.now if t.phase == "serving" else t.idle_since
            w.now += 600
        elif kind == "reload":  # max changed in the file (min follows it down)
            old = w.specs["p0"]
            w.specs["p0"] = PoolSpec(min(old.min, int(arg)), int(arg), 300.0, old.max_dph, 20.0, 600.0, 3600.0)
        elif kind == "boot_all":
            boot_all(w)
        elif kind == "restart":
            if arg and isinstance(w.pending, Rent):  # the create reached the provider; its answer was lost
                w.provider[f"lost{w.seq}"] = Machine(w.pending.pool, w.pending.max_price, "booting")
                w.seq += 1
            elif arg and isinstance(w.pending, Resume) and w.pending.id in w.provider:
                w.provider[w.pending.id].status = "booting"
            w.restart()
        w.step()
        w.check()


def boot_all(w: World) -> None:
    for t in w.tracked.values():
        if t.phase == "booting":
            t.healthy = True
            w.provider[t.id].status = "running"


def test_a_restart_mid_rent_finds_the_instance_and_rents_nothing_more() -> None:
    w = World({"p": SPEC}, 2.0)
    w.waiting["p"] = [0.0]
    acts = w.step()
    assert acts == [Rent("p", 0.5, frozenset(), 0)]
    w.provider["x"] = Machine("p", 0.4, "booting")  # created; the gateway died before the answer
    w.restart()
    for _ in range(5):
        w.now += 10
        assert not [a for a in w.step() if isinstance(a, Rent | Resume)]
    assert list(w.provider) == ["x"]


def test_a_stopped_instance_is_resumed_before_any_rent_and_restart_mid_stop_keeps_it() -> None:
    w = World({"p": SPEC}, 2.0)
    key = w.create("p", 0.4)
    w.tracked[key].healthy = True
    w.provider[key].status = "running"
    assert w.step() == [Ready(key)]
    w.now += 600
    assert w.step() == [Stop(key, "p")]  # idle 600 s, min 0: stopped, not destroyed
    w.restart()  # the stop answered; the new loop sees it stopped at the provider
    assert w.tracked[key].phase == "stopped" and spend(w.tracked) == 0
    w.waiting["p"] = [w.now]
    assert w.step() == [Resume(key, "p")]
    w.land(False, 0.0)  # the resume fails: that instance waits out its own backoff, a rent goes on
    acts = w.step()
    assert acts == [Rent("p", 0.5, frozenset(), 0)]


def test_scale_up_waits_for_scale_up_wait_sec_unless_nothing_serves() -> None:
    spec = SPEC
    assert not wants_more(spec, Demand(0, 0.0, None))
    assert wants_more(spec, Demand(1, 0.0, None))  # no slot at all: at once
    assert not wants_more(spec, Demand(3, 5.0, 10.0))
    assert wants_more(spec, Demand(3, 20.0, 10.0))  # the oldest waited scale_up_wait_sec
    assert wants_more(spec, Demand(3, 1.0, 25.0))  # the estimate says it will
    w = World({"p": spec}, 2.0)
    key = w.create("p", 0.4)
    w.tracked[key].healthy = True
    w.step()
    w.waiting["p"] = [w.now] * 3
    w.now += 19
    assert w.step() == []
    w.now += 1
    assert w.step() == [Rent("p", 0.5, frozenset(), 0)]


def test_no_spot_offer_falls_back_to_the_next_entry_within_one_backoff() -> None:
    w = World({"p": PoolSpec(1, 1, 300.0, (0.3, 0.8))}, 2.0)
    assert w.step() == [Rent("p", 0.3, frozenset(), 0)]
    w.land(False, 0.0)  # no spot capacity
    assert w.step() == [Rent("p", 0.8, frozenset(), 1)]  # the on-demand entry, at once
    w.land(False, 0.0)
    assert w.step() == [] and retry_in(w.state["p"], 2, w.now) == BASE  # both back off
    w.now += BASE
    assert w.step() == [Rent("p", 0.3, frozenset(), 0)]  # the preferred entry first again


def test_never_below_min_and_stopped_ones_are_destroyed_after_stopped_destroy_sec() -> None:
    spec = PoolSpec(1, 3, 300.0, (0.5,), 20.0, 600.0, 3600.0)
    w = World({"p": spec}, 2.0)
    keys = [w.create("p", 0.4) for _ in range(2)]
    for k in keys:
        w.tracked[k].healthy = True
    w.step()
    w.now += 600
    stops = [a for a in w.step() if isinstance(a, Stop)]
    assert len(stops) == 1  # one keeps serving: min 1
    w.now += 3600
    assert w.step() == [Destroy(stops[0].id, "p", "stopped_expired")]
    w.now += 10_000
    assert w.step() == []  # the last serving one stays, however idle


def test_an_instance_let_go_as_surplus_is_not_also_stopped() -> None:
    """max lowered while every instance is idle: the surplus one is destroyed, another stopped,
    never both for one."""
    w = World({"p": SPEC}, 2.0)
    keys = [w.create("p", 0.4) for _ in range(2)]
    for k in keys:
        w.tracked[k].healthy = True
    w.step()
    w.now += 600
    w.specs["p"] = PoolSpec(0, 1, 300.0, (0.5,), 20.0, 600.0, 3600.0)
    acts = w.step()
    assert sorted(type(a).__name__ for a in acts) == ["Destroy", "Stop"]
    assert len({a.id for a in acts if isinstance(a, Destroy | Stop)}) == 2
