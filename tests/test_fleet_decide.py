"""The fleet's policy (kilolined/fleet/decide.py) under drawn histories, with the clock in hand.

A model of the providers and the loop applies each decision: rents succeed at a drawn price or
fail, instances boot or hang, serving nodes are reclaimed or only lose the network. After every
step: the spend never passes the cap, no pool holds more than its size plus nothing rented
twice for one loss, a node that only lost the network is never destroyed, and failures back
off from the base doubling to an hour.
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kilolined.core.config import FleetOfferConfig
from kilolined.fleet.decide import (
    MAX_BACKOFF_SEC,
    AskStatus,
    Destroy,
    PoolRuntime,
    PoolSpec,
    Ready,
    Rent,
    RentRefused,
    Tracked,
    backoff_delay,
    choose_offer,
    decide,
    remember_lost,
    rent_failed,
    rent_ok,
    spend,
)
from kilolined.fleet.provider import Offer

BASE = 60.0

step = st.one_of(
    st.tuples(st.just("tick"), st.floats(0, 120)),
    st.tuples(st.just("reclaim"), st.integers(0, 5)),
    st.tuples(st.just("netloss"), st.integers(0, 5)),
    st.tuples(st.just("recover"), st.integers(0, 5)),
    st.tuples(st.just("rent_price"), st.floats(0.05, 1.0)),
    st.tuples(st.just("rent_fail"), st.just(0)),
    st.tuples(st.just("boot"), st.integers(0, 5)),
)


class Model:
    """The providers and the loop, as the decisions see them."""

    def __init__(self, sizes: list[int], cap: float):
        self.pools = {f"p{i}": PoolSpec.fixed(s, 300.0, 0.8) for i, s in enumerate(sizes)}
        self.state = {n: PoolRuntime() for n in self.pools}
        self.instances: dict[str, Tracked] = {}
        self.cap = cap
        self.now = 0.0
        self.pending: Rent | None = None  # a rent in flight
        self.netloss: set[str] = set()  # down but the provider says running
        self.reclaimed: set[str] = set()  # gone at the provider: it cannot lose only its network after
        self.seq = 0
        self.destroyed: list[Destroy] = []

    def apply(self, actions: list[object], rent_price: float | None, rent_fails: bool) -> None:
        for a in actions:
            if isinstance(a, Destroy):
                self.instances.pop(a.id)
                self.destroyed.append(a)
                ps = self.state.setdefault(a.pool, PoolRuntime())
                if a.reason == "boot_timeout":
                    rent_failed(ps, BASE, self.now)
            elif isinstance(a, Ready):
                t = self.instances[a.id]
                t.phase = "serving"
                rent_ok(self.state[t.pool])
            elif isinstance(a, AskStatus):
                t = self.instances[a.id]
                t.provider_running = a.id in self.netloss
            elif isinstance(a, RentRefused):
                rent_failed(self.state[a.pool], BASE, self.now)
            elif isinstance(a, Rent):
                assert self.pending is None, "a second rent while one is in flight"
                self.pending = a
                self.state[a.pool].renting = True

    def finish_rent(self, price: float | None) -> None:
        a = self.pending
        if a is None:
            return
        self.pending = None
        ps = self.state[a.pool]
        ps.renting = False
        if price is None or price > a.max_price:
            rent_failed(ps, BASE, self.now)  # no offer under the price asked: nothing created
            return
        self.seq += 1
        key = f"i{self.seq}"
        self.instances[key] = Tracked(key, a.pool, price, f"m{self.seq}", self.now)

    def pick(self, i: int, phase: str) -> Tracked | None:
        ts = [t for t in self.instances.values() if t.phase == phase]
        return ts[i % len(ts)] if ts else None


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(0, 3), min_size=1, max_size=3), cap=st.floats(0.1, 3.0),
       steps=st.lists(step, max_size=60))
# Reclaimed, then "netloss" drawn for it: the provider already said it is gone, so its destroy is
# right (the model once counted it as a node that only lost its network).
@example(sizes=[1], cap=1.0, steps=[("tick", 0.0), ("rent_price", 0.5), ("boot", 0), ("reclaim", 0), ("netloss", 0)])
def test_spend_size_and_one_rent_at_a_time(sizes: list[int], cap: float, steps: list[tuple[str, float]]) -> None:
    m = Model(sizes, cap)
    for kind, arg in steps:
        if kind == "tick":
            m.now += arg
        elif kind == "reclaim" and (t := m.pick(int(arg), "serving")) is not None:
            t.healthy = False
            m.netloss.discard(t.id)
            m.reclaimed.add(t.id)
        elif kind == "netloss" and (t := m.pick(int(arg), "serving")) is not None and t.id not in m.reclaimed:
            t.healthy = False
            m.netloss.add(t.id)
        elif kind == "recover" and (t := m.pick(int(arg), "serving")) is not None and t.id in m.netloss:
            t.healthy, t.provider_running = True, None
            m.netloss.discard(t.id)
        elif kind == "boot" and (t := m.pick(int(arg), "booting")) is not None:
            t.healthy = True
        elif kind == "rent_price":
            m.finish_rent(arg)
        elif kind == "rent_fail":
            m.finish_rent(None)
        before = set(m.instances)
        actions = decide(m.pools, m.state, m.instances, m.cap, m.now)
        m.apply(actions, None, False)
        assert spend(m.instances) <= m.cap + 1e-9
        for name, spec in m.pools.items():
            assert sum(t.pool == name for t in m.instances.values()) <= spec.max
        assert sum(isinstance(a, Rent) for a in actions) <= 1
        for d in m.destroyed:
            assert d.id not in m.netloss, "a node that only lost the network was destroyed"
        assert set(m.instances) <= before


@given(st.integers(0, 3))
def test_a_reclaim_is_answered_by_exactly_one_rent(extra: int) -> None:
    """A pool at size loses a node: destroyed once, one rent, and no second while it is in flight."""
    pools = {"p": PoolSpec.fixed(2, 300.0, 0.5)}
    state = {"p": PoolRuntime()}
    inst = {k: Tracked(k, "p", 0.3, f"m-{k}", 0.0, phase="serving", healthy=True) for k in ("a", "b")}
    assert decide(pools, state, inst, 2.0, 1.0) == []
    inst["a"].healthy = False
    assert decide(pools, state, inst, 2.0, 2.0) == [AskStatus("a")]
    inst["a"].provider_running = False
    acts = decide(pools, state, inst, 2.0, 3.0)
    assert acts[0] == Destroy("a", "p", "reclaimed")
    rents = [a for a in acts if isinstance(a, Rent)]
    assert rents == [Rent("p", 0.5, frozenset({"m-a"}))]  # never back on the machine just lost
    del inst["a"]
    remember_lost(state["p"], "m-a")
    state["p"].renting = True
    for i in range(extra + 1):
        assert not any(isinstance(a, Rent) for a in decide(pools, state, inst, 2.0, 4.0 + i))
    state["p"].renting = False
    assert decide(pools, state, inst, 2.0, 9.0) == [Rent("p", 0.5, frozenset({"m-a"}))]


def test_network_loss_is_not_a_reclaim() -> None:
    pools = {"p": PoolSpec.fixed(1, 300.0, 0.5)}
    t = Tracked("a", "p", 0.3, "m", 0.0, phase="serving", healthy=False, provider_running=True)
    assert decide(pools, {"p": PoolRuntime()}, {"a": t}, 2.0, 5.0) == []


def test_boot_timeout_destroys_and_a_removed_pool_loses_only_its_own() -> None:
    pools = {"p": PoolSpec.fixed(1, 10.0, 0.5)}
    inst = {"a": Tracked("a", "p", 0.3, "m", 0.0), "b": Tracked("b", "gone", 0.3, "m2", 0.0, phase="serving",
                                                                  healthy=True)}
    acts = decide(pools, {"p": PoolRuntime()}, inst, 2.0, 10.0)
    assert Destroy("a", "p", "boot_timeout") in acts and Destroy("b", "gone", "pool_removed") in acts


def test_budget_refuses_and_held_spend_counts() -> None:
    pools = {"p": PoolSpec.fixed(2, 300.0, 0.5)}
    inst = {"a": Tracked("a", "p", 0.6, "m", 0.0, phase="serving", healthy=True)}
    assert decide(pools, {"p": PoolRuntime()}, inst, 0.6, 1.0)[0] == RentRefused(
        "p", "max_spend_per_hour 0.6 reached (0.6 $/h live)")
    rent = decide(pools, {"p": PoolRuntime()}, inst, 1.0, 1.0, held=0.3)[0]
    assert isinstance(rent, Rent) and abs(rent.max_price - 0.1) < 1e-9


@given(st.floats(0.1, 600), st.integers(1, 40))
def test_backoff_doubles_to_an_hour(base: float, n: int) -> None:
    assert backoff_delay(base, 1) == base
    assert backoff_delay(base, n) == min(base * 2 ** (n - 1), MAX_BACKOFF_SEC)
    assert backoff_delay(base, n + 1) >= backoff_delay(base, n)
    ps = PoolRuntime()
    for _ in range(n):
        d = rent_failed(ps, base, 100.0, retry_after=None)
    assert d == backoff_delay(base, n) and ps.retry_at == 100.0 + d
    assert rent_failed(PoolRuntime(), 1.0, 0.0, retry_after=30.0) == 30.0  # a 429's Retry-After wins


offers = st.lists(st.builds(Offer, id=st.text("abc", min_size=1, max_size=3), machine=st.sampled_from(["1", "2", "3"]),
                            price=st.floats(0.01, 2.0), reliability=st.floats(0, 1),
                            gpu_name=st.sampled_from(["RTX 4090", "rtx 4090", "A100"]), num_gpus=st.integers(1, 2)),
                  max_size=12)


@given(offers, st.frozensets(st.sampled_from(["1", "2", "3"])), st.floats(0.01, 2.0))
def test_choose_offer_fits_and_is_cheapest(offs: list[Offer], exclude: frozenset[str], max_price: float) -> None:
    want = FleetOfferConfig(gpu_name="RTX 4090", num_gpus=1, max_dph=2.0, min_reliability=0.5)
    got = choose_offer(offs, want, exclude, max_price)
    fits = [o for o in offs if o.gpu_name.lower() == "rtx 4090" and o.num_gpus == 1 and o.reliability >= 0.5
            and o.price <= max_price and o.machine not in exclude]
    if not fits:
        assert got is None
    else:
        assert got is not None and got in fits and got.price == min(o.price for o in fits)


def test_a_price_that_is_not_a_number_never_lifts_the_cap() -> None:
    """One NaN in the spend made ``cap - spend`` NaN, which is not ``<= 0``: every rent passed."""
    pools = {"p": PoolSpec.fixed(5, 300.0, 2.0)}
    inst = {"a": Tracked("a", "p", float("nan"), "m", 0.0, phase="serving", healthy=True)}
    actions = decide(pools, {"p": PoolRuntime()}, inst, 1.0, 1.0)
    assert not any(isinstance(a, Rent) for a in actions)
    assert any(isinstance(a, RentRefused) for a in actions)


def test_a_retry_after_is_waited_at_most_the_backoff_ceiling() -> None:
    ps = PoolRuntime()
    assert rent_failed(ps, BASE, 0.0, 1e12) == MAX_BACKOFF_SEC
    assert ps.retry_at == MAX_BACKOFF_SEC
    assert rent_failed(PoolRuntime(), BASE, 0.0, 300.0) == 300.0  # a shorter one is still waited out
