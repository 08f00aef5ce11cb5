"""The speed watch's live half: feeds speed.py from finished requests and acts on its verdicts.

``measured`` is called once per request the node answered in full (lease.py's release, the one
place the scope judges and ends a node's answer); ``tick`` runs with the pump and gives an
ejected node its trial when its period is over. Acting means: a soft eject sets
``NodeState.slowed`` (one slot, ranked last — queue.py reads it through ``effective``, so the
slot counters stay the scheduler's alone); a hard eject opens the node's breaker; both and the
recovery are alerted (``node_slow``, ``node_recovered``; ``node_drifting`` for a lone node).

The verdict lives on ``NodeState`` (``slow_state``, ``slow_until``, …), not in the book: in cluster
mode it is node state the gateways share (cluster/nodestate.py), so the eject another gateway
decided holds here too, its trial comes at the same moment, and the recovery this gateway's
requests show ends it for all. Before the book judges or ticks, ``_follow`` copies the verdict
into it; each gateway keeps only its own samples.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Protocol

from kilolined.scheduling.nodes import (
    SPEED_HARD,
    SPEED_OK,
    SPEED_SLOW,
    SPEED_STALLED,
    SPEED_TRIAL,
    NodeState,
)
from kilolined.scheduling.queue import Scheduler
from kilolined.scheduling.speed import (
    HARD,
    MS_REQUEST,
    MS_UNIT,
    OK,
    SLOW,
    STALLED,
    NodeSpeed,
    Sample,
    SpeedBook,
    Verdict,
    client_model,
    ejectable,
    shown_model,
)
from kilolined.wire.upstream import STALLED as STALLED_REASON

log = logging.getLogger("kilolined")


class Host(Protocol):
    """What the watch uses of the runtime (which owns it)."""

    scheduler: Scheduler
    clock: Callable[[], float]

    def node_events(self, ns: NodeState, events: list[str], texts: dict[str, str] | None = None) -> None: ...

    def wake(self) -> None: ...


class SpeedWatch:
    def __init__(self, rt: Host) -> None:
        self.rt = rt
        self.book = SpeedBook()

    # --- samples ------------------------------------------------------------------------
    def measured(self, node: str, route: str, model: str | None, held: float, cost: float,
                 samples: list[Sample] | None, key: str = "") -> None:
        """One request ``node`` served in full in ``held`` seconds for the client ``key``:
        ``samples`` as the adapter read them (LLM tokens), else per cost unit (``cost``), else per
        request, in the client's own series (speed.client_model)."""
        ns = self.rt.scheduler.nodes.get(node)
        if ns is None or ns.cfg.slow is None or route.startswith("adhoc:"):
            return
        now = self.rt.clock()
        book = self.book
        if ns.slow_state != SPEED_OK or ns.name in book.nodes:  # _follow's own shortcut, without its call
            self._follow(ns)
        if node in book.nodes and book.unstall(node):  # (a node never ejected has no entry)
            log.info("✓ [%s] answering in full again after a stall", node)
            self.rt.node_events(ns, self._decide(ns, SPEED_OK, self.book.node(node), ""))  # quiet, here and elsewhere
        cfg, model_ = ns.cfg.slow, model or ""

        def ejectable() -> int:
            return self._ejectable(route, node, now)

        if not samples:
            # Per cost unit, else per request: one value, recorded without a Sample made for it.
            if cost > 0:
                v = book.record_value(node, route, model_, MS_UNIT, held * 1000 / cost, now, cfg, ejectable)
            else:
                # The size is unknown: the client's own series, judged against its own history
                # only when the node is alone on the route (else its peers say more).
                v = book.record_value(node, route, client_model(model_, key), MS_REQUEST, held * 1000, now, cfg,
                                      ejectable, may_drift=self._alone(route))
            if v is not None:
                self._act(ns, v, now)
            return
        for sample in samples:
            v = book.record_value(node, route, model_, sample.unit, sample.value, now, cfg, ejectable)
            if v is not None:
                self._act(ns, v, now)

    def _alone(self, route: str) -> bool:
        rq = self.rt.scheduler.routes.get(route)
        return rq is None or len(rq.cfg.nodes) + len(rq.cfg.standby) <= 1

    def _route_nodes(self, route: str) -> list[str]:
        rq = self.rt.scheduler.routes.get(route)
        return list(rq.all_nodes) if rq is not None else []

    def _ejectable(self, route: str, node: str, now: float) -> int:
        """How many more of the route's nodes may be ejected besides ``node`` (out already or
        not): max(1, 10 %) at once, and never the last one that can take work."""
        sched = self.rt.scheduler
        names = [n for n in self._route_nodes(route) if n in sched.nodes and not sched.nodes[n].retired]
        # the cluster's verdicts, not only this gateway's: the cap holds for the route
        out = sum(1 for n in names
                  if n != node and sched.nodes[n].slow_state in (SPEED_SLOW, SPEED_HARD, SPEED_STALLED))
        others = [n for n in names if n != node and sched.nodes[n].serving(now) and not sched.nodes[n].slowed]
        return ejectable(len(names), out, len(others))

    # --- acting ---------------------------------------------------------------------------
    def _act(self, ns: NodeState, v: Verdict, now: float) -> None:
        rt = self.rt
        if v.action in ("soft", "hard"):
            cfg = ns.breaker_cfg
            st = self.book.node(ns.name)
            self.book.eject_period(ns.name, now, cfg.open_sec, cfg.max_open_sec)
            text = self.slow_text(ns, v)
            events = self._decide(ns, SPEED_HARD if v.action == "hard" else SPEED_SLOW, st, text)
            texts = {"node_slow": text}
            if v.action == "hard":
                ns.note_error("slow")
                events += ns.trip(now)
                texts["breaker_open"] = f"⚡ {_who(ns)} breaker OPEN for being slow, retry in {ns.open_period:g}s"
            rt.node_events(ns, events, texts)  # one publish carries the eject and the breaker
        elif v.action == "recovered":
            text = f"✓ {_who(ns)} back to speed: {_n(v.level)} {v.unit} vs {_n(v.peers)} {v.unit} on its peers"
            rt.node_events(ns, self._decide(ns, SPEED_OK, self.book.node(ns.name), text), {"node_recovered": text})
        elif v.action == "drifting":
            ratio = v.level / v.peers if v.peers else math.inf
            rt.node_events(ns, ["node_drifting"], {"node_drifting": (
                f"🐢 {_who(ns)} drifting: {_n(v.level)} {v.unit} vs {_n(v.peers)} {v.unit} "
                f"at its best ({ratio:.1f}×) — alone on its route, so still serving")})
        rt.wake()

    @staticmethod
    def _decide(ns: NodeState, state: str, st: NodeSpeed, note: str) -> list[str]:
        """This gateway's book reached a verdict: it becomes the node's (and, through node_events,
        the cluster's); returns its events (NodeState.judge_speed)."""
        return ns.judge_speed(state, st.until, st.period, "\t".join(st.cause) if st.cause is not None else "", note)

    def _follow(self, ns: NodeState) -> None:
        """Copy the node's verdict into the book, wherever it was reached: the book's next
        judgement starts from it (a node ejected elsewhere is not ejected again here; one
        recovered elsewhere is judged afresh; one tried elsewhere is on trial here too)."""
        state = ns.slow_state
        if state == SPEED_OK and ns.name not in self.book.nodes:
            return  # nothing to copy, and no entry made for a node never measured
        st = self.book.node(ns.name)
        if state == SPEED_OK:
            if st.state in (SLOW, STALLED):
                st.state, st.cause, st.ejected, st.hard, st.until, st.period = OK, None, False, False, 0.0, 0.0
            return
        if state == SPEED_STALLED:
            st.state, st.ejected, st.hard = STALLED, True, True
            return
        parts = tuple(ns.slow_cause.split("\t"))
        if len(parts) == 3:
            st.cause = (parts[0], parts[1], parts[2])
        st.state, st.period = SLOW, ns.slow_period
        if state == SPEED_TRIAL:
            if st.ejected:
                self.book.trial(ns.name, math.inf)  # on trial here too: judged from its next request
            st.ejected = st.hard = False
            st.until = 0.0
            return
        st.ejected, st.hard, st.until = True, state == SPEED_HARD, ns.slow_until

    def slow_text(self, ns: NodeState, v: Verdict) -> str:
        ratio = v.level / v.peers if v.peers else math.inf
        what = ("its breaker is open until a trial" if v.action == "hard" or ratio >= HARD
                else "1 slot until it recovers")
        return (f"🐢 {_who(ns)} slow: {_n(v.level)} {v.unit} vs {_n(v.peers)} {v.unit} on its peers "
                f"({ratio:.1f}×) — {what}")

    def tick(self, now: float) -> None:
        """An ejected node's period is over: its trial — slots back through slow start, and the
        requests are judged from the first, on the EWMA it kept (recovered, or ejected again for
        longer after ``evaluations`` slow ones)."""
        for name, ns in self.rt.scheduler.nodes.items():
            if ns.cfg.slow is None:
                self._lift(name, ns)  # a verdict another gateway published meanwhile
                continue
            self._follow(ns)
            if self.book.trial(name, now):
                log.info("~ [%s] trying again after being slow (slots ramp up)", name)
                self.rt.node_events(ns, ns.speed_trial(now))  # shared with the cluster, and a wake-up

    def lift_unwatched(self) -> None:
        """``slow: off``: whatever the watch decided is lifted, at the reload that turns it off (and
        at every tick after, by ``tick``)."""
        for name, ns in self.rt.scheduler.nodes.items():
            if ns.cfg.slow is None:
                self._lift(name, ns)

    def _lift(self, name: str, ns: NodeState) -> None:
        # Quietly for the cluster (no words: not a recovery), so Redis keeps no verdict for a
        # gateway that turns it on again.
        self.rt.node_events(ns, ns.clear_slow())
        if name in self.book.nodes:
            self.book.forget(name)  # its numbers too: judged afresh if it is turned on again

    def stall(self, node: str, route: str, reason: str, again: bool) -> bool:
        """No byte from the node for ``stall_sec`` in a running request of ``route``: out at once
        (a hard eject), under the caps a slow verdict obeys — never the last node of the route
        that can take work, never more than max(1, 10 %) of its nodes at once. ``again``: the
        request stalled on another node before, so it is the request's doing (a prefill longer
        than stall_sec), not this node's: no eject. False: the node is not watched (``slow: off``)."""
        ns = self.rt.scheduler.nodes.get(node)
        if ns is None or ns.cfg.slow is None:
            return False
        now = self.rt.clock()
        self._follow(ns)
        why_not = ("it stalled on another node too: the request's doing" if again else
                   "never more than max(1, 10 %) of a route's nodes at once, nor its last"
                   if self._ejectable(route, node, now) <= 0 else "")
        if why_not:
            ns.note_error(reason)
            log.warning("✗ [%s] %s — not ejected (%s)", node, reason, why_not)
            return True
        if not self.book.stalled(node):
            return True
        st = self.book.node(node)
        self.book.eject_period(node, now, ns.breaker_cfg.open_sec, ns.breaker_cfg.max_open_sec)
        ns.note_error(reason)
        what = reason.removeprefix(STALLED_REASON + ": ")  # the words say "stalled: …" for the client
        text = f"🐢 {_who(ns)} stalled: {what} — breaker open"
        events = self._decide(ns, SPEED_STALLED, st, text)
        self.rt.node_events(ns, [*events, *ns.trip(now)], {"node_slow": text, "breaker_open": (
            f"⚡ {_who(ns)} breaker OPEN after a stall, retry in {ns.open_period:g}s")})
        return True

    # --- views ------------------------------------------------------------------------------
    def view(self, node: str) -> dict[str, object] | None:
        ns = self.rt.scheduler.nodes.get(node)
        if ns is None or ns.cfg.slow is None:
            return None  # `slow: off`: not watched
        self._follow(ns)
        out = self.book.view(node)
        if out is None and ns.slow_state != SPEED_OK:
            # Ejected by another gateway before this one measured it: the verdict, without numbers.
            route, model, unit = [*ns.slow_cause.split("\t"), "", "", ""][:3]
            state = STALLED if ns.slow_state == SPEED_STALLED else SLOW
            out = {"unit": unit or None, "ewma": None, "peers_median": None, "state": state, "route": route or None,
                   "model": shown_model(model)}
        return out

    def forget(self, node: str) -> None:
        self.book.forget(node)

    def is_slow(self, node: str) -> bool:
        ns = self.rt.scheduler.nodes.get(node)
        if ns is not None and ns.cfg.slow is not None:
            self._follow(ns)
        return self.book.node(node).state == SLOW or self.book.node(node).ejected


def _who(ns: NodeState) -> str:
    return f"{ns.name} ({ns.label})" if ns.label != ns.name else ns.name


def _n(v: float | None) -> str:
    if v is None:
        return "?"
    return f"{v:.0f}" if v >= 10 else f"{v:.2g}"
