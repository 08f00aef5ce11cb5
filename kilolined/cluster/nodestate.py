"""The shared part of a node's state, as plain fields: what a gateway publishes and how another
applies it. Pure: no I/O, every function takes ``now`` (this gateway's monotonic seconds).

Times travel relative (``open_left_ms``: how long the breaker stays open; ``ramp_ago_ms``: how
long ago the slow start began, -1 for none), since the gateways' monotonic clocks differ; Redis
stores them against its own clock (kilolined/cluster/nodes.py).

Fields come in groups that change apart, so two gateways changing different things at once
(one drains a node while the leader marks it down) do not overwrite each other:
  health   healthy (0/1), error, ramp_ago_ms
  breaker  breaker ("closed"|"open"), open_left_ms, open_period, error, ramp_ago_ms
  drain    drained (0/1)
  slow     slowed (0/1): soft-ejected for being slow (kilolined/scheduling/speed.py; the gateway whose
           requests showed it decides, the others follow)
and ``fails``, the failures seen in a row on every gateway (kilolined/cluster/nodes.py counts them).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kilolined.scheduling.nodes import CLOSED, OPEN, NodeState

GROUPS: dict[str, tuple[str, ...]] = {
    "health": ("healthy", "error", "ramp_ago_ms"),
    "breaker": ("breaker", "open_left_ms", "open_period", "error", "ramp_ago_ms"),
    "drain": ("drained",),
    "slow": ("slowed",),
}


class Snapshot(NamedTuple):
    """What a publish is decided on: a change of any of these is news for the other gateways.
    Half-open counts as open (each gateway's clock turns open into half-open by itself)."""

    healthy: bool
    closed: bool
    open_until: float
    open_period: float
    drained: bool
    slowed: bool = False


def snapshot(ns: NodeState) -> Snapshot:
    closed = ns.breaker == CLOSED
    return Snapshot(ns.healthy, closed, 0.0 if closed else ns.open_until, 0.0 if closed else ns.open_period,
                    ns.drained, ns.slowed)


def changed_groups(old: Snapshot | None, new: Snapshot) -> list[str]:
    if old is None:
        return list(GROUPS)
    out = []
    if old.healthy != new.healthy:
        out.append("health")
    if (old.closed, old.open_until, old.open_period) != (new.closed, new.open_until, new.open_period):
        out.append("breaker")
    if old.drained != new.drained:
        out.append("drain")
    if old.slowed != new.slowed:
        out.append("slow")
    return out


def export(ns: NodeState, now: float, groups: list[str]) -> dict[str, Any]:
    """The fields of ``groups``, ready to publish."""
    closed = ns.breaker == CLOSED
    every = {
        "healthy": int(ns.healthy),
        "error": ns.last_error or "",
        "ramp_ago_ms": -1 if ns.recovered_at is None else int(max(0.0, now - ns.recovered_at) * 1000),
        "breaker": "closed" if closed else "open",
        "open_left_ms": 0 if closed else int(max(0.0, ns.open_until - now) * 1000),
        "open_period": ns.open_period,
        "drained": int(ns.drained),
        "slowed": int(ns.slowed),
    }
    return {f: every[f] for g in groups for f in GROUPS[g]}


def apply(ns: NodeState, fields: dict[str, Any], now: float) -> list[str]:
    """Take the fields another gateway published; returns the events the change is (``node_down``,
    ``node_up``, ``breaker_open``, ``breaker_closed``), as the same change made here would."""
    events: list[str] = []
    if fields.get("error"):
        ns.last_error = str(fields["error"])
    if "healthy" in fields:
        up = bool(int(fields["healthy"]))
        if up != ns.healthy:
            ns.healthy = up
            ns.check_fails = ns.check_oks = 0
            if up:
                ns.alive_at = now  # the leader's checks passed: as one passing here
            events.append("node_up" if up else "node_down")
    if "breaker" in fields:
        events += _apply_breaker(ns, fields, now)
    if "ramp_ago_ms" in fields:
        ago = float(fields["ramp_ago_ms"])
        ns.recovered_at = None if ago < 0 else now - ago / 1000
    if "drained" in fields:
        ns.drained = bool(int(fields["drained"]))
    if "slowed" in fields:
        ns.slowed = bool(int(fields["slowed"]))  # no event: the deciding gateway alerted
    if "fails" in fields and ns.breaker == CLOSED:
        ns.failures = int(fields["fails"])
    return events


def _apply_breaker(ns: NodeState, fields: dict[str, Any], now: float) -> list[str]:
    was_closed = ns.breaker == CLOSED
    if fields["breaker"] == "closed":
        if was_closed:
            return []
        ns.breaker = CLOSED
        ns.open_period = 0.0
        ns.trial_in_flight = False
        ns.failures = 0
        return ["breaker_closed"]
    until = now + float(fields["open_left_ms"]) / 1000
    period = float(fields["open_period"])
    # A re-trip (half-open trial failed) moves the end by at least a whole period; the same trip
    # read again (the sweep) moves it by the time it travelled, a few milliseconds.
    news = was_closed or until > ns.open_until + period / 2
    if not news:
        return []
    ns.breaker = OPEN
    ns.open_until = until
    ns.open_period = period
    ns.trial_in_flight = False
    ns.failures = 0
    ns.tick(now)
    return ["breaker_open"]
