"""The speed watch's live half: feeds speed.py from finished requests and acts on its verdicts.

``measured`` is called once per request the node answered in full (lease.py's release, the one
place the scope judges and ends a node's answer); ``tick`` runs with the pump and gives an
ejected node its trial when its period is over. Acting means: a soft eject sets
``NodeState.slowed`` (one slot, ranked last — queue.py reads it through ``effective``, so the
slot counters stay the scheduler's alone); a hard eject opens the node's breaker; both and the
recovery are alerted (``node_slow``, ``node_recovered``; ``node_drifting`` for a lone node).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Protocol

from kilolined.cluster.nodes import NodeSync
from kilolined.scheduling.nodes import NodeState
from kilolined.scheduling.queue import Scheduler
from kilolined.scheduling.speed import HARD, MS_REQUEST, MS_UNIT, SLOW, Sample, SpeedBook, Verdict, ejectable
from kilolined.wire.upstream import STALLED

log = logging.getLogger("kilolined")


class Host(Protocol):
    """What the watch uses of the runtime (which owns it)."""

    scheduler: Scheduler
    clock: Callable[[], float]
    node_sync: NodeSync | None

    def node_events(self, ns: NodeState, events: list[str], texts: dict[str, str] | None = None) -> None: ...

    def wake(self) -> None: ...


class SpeedWatch:
    def __init__(self, rt: Host) -> None:
        self.rt = rt
        self.book = SpeedBook()

    # --- samples ------------------------------------------------------------------------
    def measured(self, node: str, route: str, model: str | None, held: float, cost: float,
                 samples: list[Sample] | None) -> None:
        """One request ``node`` served in full in ``held`` seconds: ``samples`` as the adapter
        read them (LLM tokens), else per cost unit (``cost``), else per request."""
        ns = self.rt.scheduler.nodes.get(node)
        if ns is None or ns.cfg.slow is None or route.startswith("adhoc:"):
            return
        if not samples:
            samples = [Sample(MS_UNIT, held * 1000 / cost) if cost > 0 else Sample(MS_REQUEST, held * 1000)]
        now = self.rt.clock()
        if self.book.unstall(node):
            log.info("✓ [%s] answering in full again after a stall", node)
        for sample in samples:
            v = self.book.record(node, route, model or "", sample, now, ns.cfg.slow,
                                 lambda: self._ejectable(route, node, now))
            if v is not None:
                self._act(ns, v, now)

    def _route_nodes(self, route: str) -> list[str]:
        rq = self.rt.scheduler.routes.get(route)
        return list(rq.all_nodes) if rq is not None else []

    def _ejectable(self, route: str, node: str, now: float) -> int:
        """How many more of the route's nodes may be ejected: max(1, 10 %) at once, and never
        the last one that can take work."""
        sched = self.rt.scheduler
        names = [n for n in self._route_nodes(route) if n in sched.nodes and not sched.nodes[n].retired]
        out = sum(1 for n in names if self.book.node(n).ejected)
        others = [n for n in names if n != node and sched.nodes[n].serving(now) and not sched.nodes[n].slowed]
        return ejectable(len(names), out, len(others))

    # --- acting ---------------------------------------------------------------------------
    def _act(self, ns: NodeState, v: Verdict, now: float) -> None:
        rt = self.rt
        if v.action in ("soft", "hard"):
            cfg = ns.breaker_cfg
            self.book.eject_period(ns.name, now, cfg.open_sec, cfg.max_open_sec)
            ns.slowed = True
            text = self.slow_text(ns, v)
            rt.node_events(ns, ["node_slow"], {"node_slow": text})
            if v.action == "hard":
                ns.last_error = "slow"
                rt.node_events(ns, ns.trip(now), {"breaker_open": (
                    f"⚡ {_who(ns)} breaker OPEN for being slow, retry in {ns.open_period:g}s")})
        elif v.action == "recovered":
            ns.slowed = False
            rt.node_events(ns, ["node_recovered"], {"node_recovered": (
                f"✓ {_who(ns)} back to speed: {_n(v.level)} {v.unit} vs {_n(v.peers)} {v.unit} on its peers")})
        elif v.action == "drifting":
            ratio = v.level / v.peers if v.peers else math.inf
            rt.node_events(ns, ["node_drifting"], {"node_drifting": (
                f"🐢 {_who(ns)} drifting: {_n(v.level)} {v.unit} over the last hour vs {_n(v.peers)} {v.unit} "
                f"at its best ({ratio:.1f}×) — alone on its route, so still serving")})
        rt.wake()

    def slow_text(self, ns: NodeState, v: Verdict) -> str:
        ratio = v.level / v.peers if v.peers else math.inf
        what = ("its breaker is open until a trial" if v.action == "hard" or ratio >= HARD
                else "1 slot until it recovers")
        return (f"🐢 {_who(ns)} slow: {_n(v.level)} {v.unit} vs {_n(v.peers)} {v.unit} on its peers "
                f"({ratio:.1f}×) — {what}")

    def tick(self, now: float) -> None:
        """An ejected node's period is over: its trial — slots back through slow start, and the
        next ``samples`` requests judge it afresh (recovered, or ejected again for longer)."""
        for name, ns in self.rt.scheduler.nodes.items():
            if self.book.trial(name, now):
                ns.slowed = False
                ns.recovered_at = now
                log.info("~ [%s] trying again after being slow (slots ramp up)", name)
                if self.rt.node_sync is not None:
                    self.rt.node_sync.changed(ns)
                self.rt.wake()

    def stall(self, node: str, reason: str) -> None:
        """No byte from the node for ``stall_sec`` in a running request: out at once."""
        ns = self.rt.scheduler.nodes.get(node)
        if ns is None or ns.cfg.slow is None or not self.book.stalled(node):
            return
        now = self.rt.clock()
        self.book.eject_period(node, now, ns.breaker_cfg.open_sec, ns.breaker_cfg.max_open_sec)
        ns.last_error = reason
        what = reason.removeprefix(STALLED + ": ")  # the reason says "stalled: …" for the scope's verdict
        self.rt.node_events(ns, ["node_slow"], {"node_slow": f"🐢 {_who(ns)} stalled: {what} — breaker open"})
        self.rt.node_events(ns, ns.trip(now), {"breaker_open": (
            f"⚡ {_who(ns)} breaker OPEN after a stall, retry in {ns.open_period:g}s")})

    # --- views ------------------------------------------------------------------------------
    def view(self, node: str) -> dict[str, object] | None:
        return self.book.view(node)

    def forget(self, node: str) -> None:
        self.book.forget(node)

    def is_slow(self, node: str) -> bool:
        return self.book.node(node).state == SLOW or self.book.node(node).ejected


def _who(ns: NodeState) -> str:
    return f"{ns.name} ({ns.label})" if ns.label != ns.name else ns.name


def _n(v: float | None) -> str:
    if v is None:
        return "?"
    return f"{v:.0f}" if v >= 10 else f"{v:.2g}"
