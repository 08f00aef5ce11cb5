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
  slow     slowed (0/1), slow (the speed verdict: ok|slow|hard|trial|stalled), slow_left_ms (how
           long until its trial), slow_period, slow_cause, slow_note (the alert's words), ramp_ago_ms
and ``fails``, the failures seen in a row on every gateway (kilolined/cluster/nodes.py counts them).

The speed verdict (ops/speedwatch.py) is decided by whichever gateway's requests showed it; the
others take it here and say the same event (``node_slow``, ``node_recovered``) in the decider's
words, so the leader alerts it whoever saw it. A gateway with ``slow: off`` takes none of it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kilolined.scheduling.nodes import (
    CLOSED,
    OPEN,
    SPEED_HARD,
    SPEED_OK,
    SPEED_SLOW,
    SPEED_STALLED,
    SPEED_TRIAL,
    NodeState,
)

GROUPS: dict[str, tuple[str, ...]] = {
    "health": ("healthy", "error", "ramp_ago_ms"),
    "breaker": ("breaker", "open_left_ms", "open_period", "error", "ramp_ago_ms"),
    "drain": ("drained",),
    "slow": ("slowed", "slow", "slow_left_ms", "slow_period", "slow_cause", "slow_note", "ramp_ago_ms"),
}
_EJECTED = (SPEED_SLOW, SPEED_HARD, SPEED_STALLED)


class Snapshot(NamedTuple):
    """What a publish is decided on: a change of any of these is news for the other gateways.
    Half-open counts as open (each gateway's clock turns open into half-open by itself)."""

    healthy: bool
    closed: bool
    open_until: float
    open_period: float
    drained: bool
    slowed: bool = False
    slow: str = SPEED_OK
    slow_until: float = 0.0
    slow_period: float = 0.0


def snapshot(ns: NodeState) -> Snapshot:
    closed = ns.breaker == CLOSED
    return Snapshot(ns.healthy, closed, 0.0 if closed else ns.open_until, 0.0 if closed else ns.open_period,
                    ns.drained, ns.slowed, ns.slow_state, ns.slow_until, ns.slow_period)


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
    if (old.slowed, old.slow, old.slow_until, old.slow_period) != (new.slowed, new.slow, new.slow_until,
                                                                    new.slow_period):
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
        "slow": ns.slow_state,
        "slow_left_ms": int(max(0.0, ns.slow_until - now) * 1000),
        "slow_period": ns.slow_period,
        "slow_cause": ns.slow_cause,
        "slow_note": ns.slow_note,
    }
    return {f: every[f] for g in groups for f in GROUPS[g]}


def apply(ns: NodeState, fields: dict[str, Any], now: float) -> list[str]:
    """Take the fields another gateway published; returns the events the change is (``node_down``,
    ``node_up``, ``breaker_open``, ``breaker_closed``, ``node_slow``, ``node_recovered``), as the
    same change made here would."""
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
    if "slow" in fields and ns.cfg.slow is not None:
        events += _apply_slow(ns, fields, now)
    if "fails" in fields and ns.breaker == CLOSED:
        ns.failures = int(fields["fails"])
    return events


def _apply_slow(ns: NodeState, fields: dict[str, Any], now: float) -> list[str]:
    """The speed verdict another gateway reached. Its events are the ones that gateway alerted:
    an eject (again after a trial, or harder) is ``node_slow``, the end of one ``node_recovered``
    (a stall ends quietly, as here, and so does a lift by ``slow: off``)."""
    old, new = ns.slow_state, str(fields["slow"])
    ns.slow_state = new
    ns.slowed = bool(int(fields.get("slowed", 0)))
    ns.slow_until = now + float(fields.get("slow_left_ms", 0)) / 1000
    ns.slow_period = float(fields.get("slow_period", 0))
    ns.slow_cause = str(fields.get("slow_cause", ""))
    ns.slow_note = str(fields.get("slow_note", ""))
    if new == old:
        return []
    if new in _EJECTED:
        return ["node_slow"]
    if new == SPEED_OK and old in (SPEED_SLOW, SPEED_HARD, SPEED_TRIAL) and ns.slow_note:
        return ["node_recovered"]  # (without words it was lifted by `slow: off`: quiet)
    return []


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
