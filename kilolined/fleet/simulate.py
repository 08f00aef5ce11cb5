"""What the fleet's policy does to a day of traffic, on a simulated clock (docs/FLEET.md
"What scaling costs"): the pure ``decide`` against a simulated queue and a simulated market whose
instances boot in ``boot_sec`` and resume in ``resume_sec``. No I/O and no wall clock, so a day
runs in a second; scripts/bench_fleet_scale.py prints it and a test holds it to docs/FLEET.md's targets.

The loop is modelled as the real one runs it: once a tick, the queue is measured (``Demand``),
``decide`` runs, and its actions land at once (a rent or resume answers within the tick; the
instance serves ``boot_sec`` or ``resume_sec`` later). Requests are served first in first out,
``slots`` at a time per serving instance; one waiting past ``queue_timeout_sec`` is lost.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from kilolined.fleet.decide import (
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
    rent_failed,
    rent_ok,
    spend,
)

POOL = "pool"

#: (hour of the day, requests per hour from then on): a quiet night, a morning ramp, bursts at
#: 10:00 and 20:00, a lunch dip
DAY_SHAPE: tuple[tuple[float, float], ...] = (
    (0, 2), (7, 20), (8, 60), (9, 120), (10, 240), (10.5, 150), (12, 60), (13, 120), (17, 80),
    (19, 40), (20, 220), (21, 60), (22, 10), (23, 3),
)


@dataclass(frozen=True, slots=True)
class Market:
    price: float = 0.40  # $/hour of an instance
    boot_sec: float = 300.0  # a fresh instance: image and model download
    resume_sec: float = 30.0  # a stopped one: its disk still holds them


@dataclass(frozen=True, slots=True)
class Request:
    at: float
    service_sec: float


@dataclass
class Result:
    gpu_hours: float = 0.0
    cost: float = 0.0
    waits: list[float] = field(default_factory=list)
    lost: int = 0
    max_spend: float = 0.0
    rents: int = 0
    resumes: int = 0
    stops: int = 0
    max_instances: int = 0

    def p(self, q: float) -> float:
        """The q-quantile of the waits (nearest rank)."""
        if not self.waits:
            return 0.0
        w = sorted(self.waits)
        return w[min(len(w) - 1, max(0, math.ceil(q * len(w)) - 1))]


def day_trace(seed: int = 1, hours: float = 24.0, service_sec: float = 20.0,
              shape: tuple[tuple[float, float], ...] = DAY_SHAPE) -> list[Request]:
    """Poisson arrivals at the rate of ``shape`` (per hour, by hour of the day), each taking
    ``service_sec`` ± 25 %; seeded, so a run is repeatable."""
    rng = random.Random(seed)
    out: list[Request] = []
    t = 0.0
    end = hours * 3600.0
    while True:
        rate = _rate(shape, t) / 3600.0
        t += rng.expovariate(rate) if rate > 0 else 60.0
        if t >= end:
            return out
        if rng.random() * _peak(shape) / 3600.0 <= rate:  # thinning: the rate may have changed
            out.append(Request(t, service_sec * rng.uniform(0.75, 1.25)))


def _rate(shape: tuple[tuple[float, float], ...], t: float) -> float:
    hour = (t / 3600.0) % 24.0
    return next((r for h, r in reversed(shape) if hour >= h), shape[0][1])


def _peak(shape: tuple[tuple[float, float], ...]) -> float:
    return max(r for _, r in shape)


@dataclass
class _Node:
    t: Tracked
    ready_at: float
    running: list[float] = field(default_factory=list)  # when each running request ends


def simulate(trace: list[Request], spec: PoolSpec, market: Market, *, cap: float = 10.0, slots: int = 1,
             tick_sec: float = 1.0, queue_timeout_sec: float = 600.0, warm: int = 0, stopped: int = 0,
             backoff_base_sec: float = 60.0) -> Result:
    """Run ``trace`` through a pool of ``spec``. ``warm`` instances serve from the start (a fixed
    pool), ``stopped`` ones wait stopped (a pool as a previous day left it)."""
    res = Result()
    nodes: dict[str, _Node] = {}
    tracked: dict[str, Tracked] = {}
    state = {POOL: PoolRuntime()}
    queue: deque[Request] = deque()
    pending = deque(sorted(trace, key=lambda r: r.at))
    end = (pending[-1].at if pending else 0.0) + queue_timeout_sec
    end = max(end, math.ceil(end / 86400.0) * 86400.0) if trace else 0.0
    seq = 0

    def add(phase: str, now: float) -> _Node:
        nonlocal seq
        seq += 1
        t = Tracked(f"i{seq}", POOL, market.price, None, now, phase="booting")
        if phase == "serving":
            t.phase, t.healthy, t.idle_since = "serving", True, now
        elif phase == "stopped":
            t.phase = "stopped"
        tracked[t.id] = t
        nodes[t.id] = _Node(t, now)
        return nodes[t.id]

    for _ in range(warm):
        add("serving", 0.0)
    for _ in range(stopped):
        add("stopped", 0.0)
    now = 0.0
    while now < end or queue:
        while pending and pending[0].at <= now:
            queue.append(pending.popleft())
        for n in nodes.values():
            n.running = [e for e in n.running if e > now]
            if n.t.phase == "booting" and now >= n.ready_at:
                n.t.healthy = True
        _serve(nodes, queue, now, slots, res)
        while queue and now - queue[0].at > queue_timeout_sec:
            queue.popleft()
            res.lost += 1
        for n in nodes.values():
            if n.t.phase == "serving" and (n.running or queue):
                n.t.idle_since = now
        demand = {POOL: _demand(queue, nodes, now, slots)}
        for a in decide({POOL: spec}, state, tracked, cap, now, 0.0, demand):
            if isinstance(a, Ready):
                n = nodes[a.id]
                n.t.phase, n.t.since, n.t.idle_since = "serving", now, now
                rent_ok(state[POOL])
            elif isinstance(a, Rent):
                if market.price > a.max_price:
                    rent_failed(state[POOL], backoff_base_sec, now)
                    continue
                n = add("booting", now)
                n.ready_at = now + market.boot_sec
                res.rents += 1
            elif isinstance(a, Resume):
                n = nodes[a.id]
                n.t.phase, n.t.since, n.t.healthy, n.ready_at = "booting", now, False, now + market.resume_sec
                res.resumes += 1
            elif isinstance(a, Stop):
                n = nodes[a.id]
                n.t.phase, n.t.since, n.t.healthy = "stopped", now, False
                res.stops += 1
            elif isinstance(a, Destroy):
                del nodes[a.id], tracked[a.id]
            elif isinstance(a, RentRefused):
                rent_failed(state[POOL], backoff_base_sec, now)
        paid = spend(tracked)
        res.max_spend = max(res.max_spend, paid)
        billed = sum(1 for t in tracked.values() if t.phase != "stopped")
        res.max_instances = max(res.max_instances, billed)
        res.gpu_hours += billed * tick_sec / 3600.0
        res.cost += paid * tick_sec / 3600.0
        now += tick_sec
    return res


def _serve(nodes: dict[str, _Node], queue: deque[Request], now: float, slots: int, res: Result) -> None:
    for n in sorted(nodes.values(), key=lambda n: n.t.id):
        if n.t.phase != "serving":
            continue
        while queue and len(n.running) < slots:
            r = queue.popleft()
            res.waits.append(now - r.at)
            n.running.append(now + r.service_sec)


def _demand(queue: deque[Request], nodes: dict[str, _Node], now: float, slots: int) -> Demand:
    if not queue:
        return Demand()
    live = slots * sum(1 for n in nodes.values() if n.t.phase == "serving")
    mean = sum(r.service_sec for r in queue) / len(queue)
    est = None if live == 0 else (len(queue) + 1) * mean / live
    return Demand(len(queue), now - queue[0].at, est)
