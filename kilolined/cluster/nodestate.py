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
others take it here and say the same event (``node_slow``, ``node_recovered``: nodes.speed_events,
one rule for both) in the decider's words, so the leader alerts it whoever saw it. A gateway with
``slow: off`` takes none of it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kilolined.scheduling.nodes import CHANGED, CLOSED, SPEED_OK, NodeState

GROUPS: dict[str, tuple[str, ...]] = {
    "health": ("healthy", "error", "ramp_ago_ms"),
    "breaker": ("breaker", "open_left_ms", "open_period", "error", "ramp_ago_ms"),
    "drain": ("drained",),
    "slow": ("slowed", "slow", "slow_left_ms", "slow_period", "slow_cause", "slow_note", "ramp_ago_ms"),
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
    same change made here would. The decoding is here; each change is one of the node's own
    methods. A quiet change (``CHANGED``) is no event here: the cluster has it already."""
    events: list[str] = []
    if fields.get("error"):
        ns.note_error(str(fields["error"]))
    if "healthy" in fields:
        events += ns.take_health(bool(int(fields["healthy"])), now)
    if "breaker" in fields:
        if fields["breaker"] == "closed":
            events += ns.take_breaker_closed()
        else:
            events += ns.take_breaker_open(now + float(fields["open_left_ms"]) / 1000, float(fields["open_period"]),
                                           now)
    if "ramp_ago_ms" in fields:
        ago = float(fields["ramp_ago_ms"])
        ns.take_ramp(None if ago < 0 else now - ago / 1000)
    if "drained" in fields:
        ns.take_drain(bool(int(fields["drained"])))
    if "slow" in fields and ns.cfg.slow is not None:
        events += ns.take_speed(str(fields["slow"]), bool(int(fields.get("slowed", 0))),
                                now + float(fields.get("slow_left_ms", 0)) / 1000, float(fields.get("slow_period", 0)),
                                str(fields.get("slow_cause", "")), str(fields.get("slow_note", "")))
    if "fails" in fields:
        ns.take_failures(int(fields["fails"]))
    return [e for e in events if e != CHANGED]
